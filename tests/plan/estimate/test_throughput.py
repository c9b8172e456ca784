"""Training FLOPs per token against PyTorch's FLOP counter on a real transformers Llama."""

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from adaptive.plan.architecture.presets import Shape, spec_from_shape
from adaptive.plan.estimate.throughput import hardware_flops_per_token, model_flops_per_token


def test_dense_flops_per_token_match_torch_flop_counter():
    from transformers import LlamaConfig, LlamaForCausalLM

    shape = Shape("t", 0, vocab_size=512, hidden_size=128, intermediate_size=352, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2)
    seq, batch = 256, 2
    cfg = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=352, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, attn_implementation="eager")
    model = LlamaForCausalLM(cfg)
    ids = torch.randint(0, 512, (batch, seq))
    with FlopCounterMode(display=False) as counter:
        model(input_ids=ids, labels=ids).loss.backward()
    measured = counter.get_total_flops() / (batch * seq)
    # Eager attention so the counter sees the score and mixing matmuls (it skips CPU SDPA kernels).
    assert model_flops_per_token(spec_from_shape(shape), seq) == pytest.approx(measured, rel=0.01)


def test_mod_cuts_flops_and_checkpointing_adds_a_forward():
    shape = Shape("t", 0, vocab_size=512, hidden_size=256, intermediate_size=704, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2)
    dense = model_flops_per_token(spec_from_shape(shape, "dense"), 1024)
    mod = model_flops_per_token(spec_from_shape(shape, "mod", mod_capacity=0.125), 1024)
    assert 0.5 < mod / dense < 0.65  # half the blocks run on 1/8 of the tokens; LM head unchanged
    spec = spec_from_shape(shape)
    head = 6 * 512 * 256
    assert hardware_flops_per_token(spec, 1024, True, 1.0) - dense == pytest.approx((dense - head) / 3)


def test_expert_parallel_all_to_all_stays_inside_a_node_while_the_group_fits():
    from dataclasses import replace

    from adaptive.plan.hardware.gpus import get_gpu
    from adaptive.plan.estimate.memory import TrainSetup
    from adaptive.plan.architecture.presets import preset_spec
    from adaptive.plan.estimate.throughput import estimate_throughput

    gpu = get_gpu("h100")
    one_node = TrainSetup(preset_spec("b1", "moe"), 2048, 1, 2, False, False, True, ep_size=8, gpus_per_node=8)
    two_nodes = replace(one_node, num_nodes=2)
    spans = replace(two_nodes, gpus_per_node=4)  # 8 experts' ranks over 2 nodes of 4
    t1, t2, t3 = (estimate_throughput(s, gpu, 4).alltoall_seconds for s in (one_node, two_nodes, spans))
    assert t1 > 0 and t2 == pytest.approx(t1)  # DeepSpeed's EP groups are consecutive ranks: one node
    assert t3 > 2 * t1  # across nodes: the inter-node link
