"""Model-state memory (params + grads + optimizer) agrees with DeepSpeed's own estimators.

Under their assumptions: every parameter is partitioned alike (dense models, ep_size 1), and the
ZeRO-3 "largest layer" is the largest module's own parameters.
"""

import pytest
from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

from adaptive.plan import count_params, preset_spec
from adaptive.plan.estimate.memory import TrainSetup, host_bytes_per_node, model_state_bytes

CASES = [("debug_200m", 1, 1), ("b1", 1, 1), ("b7", 8, 1), ("b7", 4, 2), ("b70", 8, 4)]


def setup_for(name, stage, gpus, nodes, offload_opt=False, offload_params=False):
    return TrainSetup(preset_spec(name), seq_len=2048, micro_batch_size=1, zero_stage=stage,
                      offload_optimizer=offload_opt, offload_params=offload_params,
                      gradient_checkpointing=False, gpus_per_node=gpus, num_nodes=nodes)


def states(setup):
    parts = model_state_bytes(setup)
    return parts["params"] + parts["grads"] + parts["optimizer"] + parts["zero3_live_params"]


@pytest.mark.parametrize("name,gpus,nodes", CASES)
@pytest.mark.parametrize("offload", [False, True])
def test_zero2_matches_deepspeed(name, gpus, nodes, offload):
    p = count_params(preset_spec(name)).total
    ds_cpu, ds_gpu = estimate_zero2_model_states_mem_needs(p, gpus, nodes, cpu_offload=offload)
    setup = setup_for(name, 2, gpus, nodes, offload_opt=offload)
    assert states(setup) == pytest.approx(ds_gpu, rel=0.01)
    if offload and nodes == 1:
        assert host_bytes_per_node(setup) == pytest.approx(ds_cpu, rel=0.01)


@pytest.mark.parametrize("name,gpus,nodes", CASES)
@pytest.mark.parametrize("offload_opt,offload_params", [(False, False), (True, False), (True, True)])
def test_zero3_matches_deepspeed(name, gpus, nodes, offload_opt, offload_params):
    c = count_params(preset_spec(name))
    ds_cpu, ds_gpu, _ = estimate_zero3_model_states_mem_needs(
        c.total, c.largest_layer, gpus, nodes, cpu_offload=offload_opt, cpu_offload_params=offload_params,
        zero_init=True)
    setup = setup_for(name, 3, gpus, nodes, offload_opt, offload_params)
    assert states(setup) == pytest.approx(ds_gpu, rel=0.01)
    if offload_opt:
        assert host_bytes_per_node(setup) == pytest.approx(ds_cpu, rel=0.01)


def test_largest_layer_is_what_deepspeed_would_find_on_the_real_module_tree():
    """DeepSpeed's `model_to_params` takes the largest module's own params; for our presets that is
    the embedding (vocab x hidden), which a transformers Llama on the meta device confirms."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    s = preset_spec("b7")
    cfg = LlamaConfig(vocab_size=s.vocab_size, hidden_size=s.hidden_size, intermediate_size=s.intermediate_size,
                      num_hidden_layers=2, num_attention_heads=s.num_attention_heads,
                      num_key_value_heads=s.num_key_value_heads)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    largest = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())
    assert count_params(s).largest_layer == largest


def test_expert_parallelism_shrinks_only_the_16bit_expert_copies():
    spec = preset_spec("b1", "moe")
    c = count_params(spec)
    one = model_state_bytes(TrainSetup(spec, 2048, 1, 2, False, False, False, gpus_per_node=8, ep_size=1))
    eight = model_state_bytes(TrainSetup(spec, 2048, 1, 2, False, False, False, gpus_per_node=8, ep_size=8))
    assert one["params"] - eight["params"] == pytest.approx(2 * c.expert * (1 - 1 / 8), rel=1e-6)
    assert one["optimizer"] == eight["optimizer"]  # partitioned over 8 ranks either way
