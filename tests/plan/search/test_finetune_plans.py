"""Fine-tune plans (--finetune full|lora|qlora, 8-bit optimizers, NVMe offload) as `fit` answers them."""

from dataclasses import replace

import pytest

from adaptive.errors import AdaptiveError
from adaptive.plan import fit, make_request
from adaptive.plan.architecture.params import count_params
from adaptive.plan.estimate.memory import TrainSetup, estimate_memory
from adaptive.plan.estimate.optimizers import EIGHT_BIT_STATE_BYTES
from adaptive.plan.finetune.method import Finetune
from adaptive.plan.finetune.roles import nf4_packed_bytes, nf4_state_bytes, param_roles
from tests.conftest import REPO_ROOT

LLAMA3_8B = str(REPO_ROOT / "tests" / "plan" / "data" / "llama-3.1-8b" / "config.json")
GiB = 2**30


def plan(**kw):
    return fit(make_request(model=LLAMA3_8B, **kw))


def test_llama3_8b_on_a_4090_full_does_not_fit_and_offers_lora_and_qlora_with_their_peaks():
    # at headroom 0 the closest configuration is ZeRO-2 + offload optimizer, whose playbook keeps every method rung
    # (the default headroom moves it to ZeRO-3 + offload all, below which QLoRA's rung, without offload, is no lower)
    p = plan(gpu="rtx4090", finetune="full", headroom="0")
    assert not p.fits
    offers = {s.split(":")[0]: s for s in p.suggestions}
    lora = next(v for k, v in offers.items() if k.startswith("LoRA"))
    qlora = next(v for k, v in offers.items() if k.startswith("QLoRA"))
    for line in (lora, qlora):
        assert "peak" in line and "tokens/s" in line and "$" in line
    # the playbook gains the method rungs, each lower than the one before it
    changes = [s.change for s in p.ladder]
    assert any(c.startswith("+ LoRA") for c in changes) and any(c.startswith("+ QLoRA") for c in changes)
    peaks = [s.peak_gpu_bytes for s in p.ladder]
    assert peaks == sorted(peaks, reverse=True)


@pytest.mark.parametrize("method", ["lora", "qlora"])
def test_an_offered_rung_is_the_plan_fit_gives_that_method(method):
    """What would fit offers each method as `fit --finetune <method>` itself plans it: peak and speed alike."""
    offered = next(s for s in plan(gpu="rtx4090", finetune="full").suggestions
                   if s.startswith(("LoRA" if method == "lora" else "QLoRA") + " ("))
    own = plan(gpu="rtx4090", finetune=method).shown
    assert f"peak {own.memory.peak_gpu_bytes / GiB:.2f} GiB" in offered
    assert f"{own.throughput.tokens_per_second:,.0f} tokens/s" in offered


def test_qlora_fits_a_4090_with_its_frozen_nf4_base_counted():
    p = plan(gpu="rtx4090", finetune="qlora")
    assert p.fits
    roles = p.roles
    frozen = p.shown.memory.parts["frozen_params"]
    # every linear of the decoder in NF4, the embedding and the untied head in 16 bits
    h, v = 4096, 128256
    assert roles.frozen_16bit == count_params(p.request.spec).total - roles.frozen_4bit
    assert roles.frozen_16bit == 2 * v * h + 32 * 2 * h + h  # embeddings, head, 65 norms
    assert frozen == 2 * roles.frozen_16bit + roles.nf4_packed_bytes + roles.nf4_state_bytes
    assert p.shown.memory.parts["dequantized_weight"] == 2 * 14336 * 4096 + 4 * 14336 * 4096 // 64


def test_lora_at_2048_with_checkpointing_gets_a_definite_answer():
    p = plan(gpu="rtx4090", finetune="lora", seq_len=2048, checkpointing=True)
    assert p.shown.setup.gradient_checkpointing and p.shown.setup.seq_len == 2048
    assert p.fits == (p.shown.memory.peak_gpu_bytes <= p.request.gpu.memory_bytes)


def test_lora_trains_peft_s_adapter_count_and_only_it_gets_optimizer_states():
    p = plan(gpu="a100-80gb", finetune="lora", lora_rank=16)
    # PEFT's own count for Llama-3-8B, r=16, all-linear: 41,943,040 (trainable of 8,072,204,288)
    assert p.roles.trainable == 41_943_040 and p.roles.total == 8_072_204_288
    s = p.shown.setup
    parts = p.shown.memory.parts
    local = p.roles.trainable
    assert parts["params"] == 2 * local and parts["frozen_params"] == 2 * count_params(s.spec).total
    if s.zero_stage == 0:
        assert parts["optimizer"] == 12 * local


def test_full_finetune_is_the_pretraining_arithmetic_byte_for_byte():
    """No adapter: every part equals the estimate without a fine-tune (the roles split changes nothing)."""
    spec = make_request(model=LLAMA3_8B, gpu="a100-80gb").spec
    for zero, off_opt, off_par in ((0, False, False), (1, False, False), (2, True, False), (3, True, True)):
        base = TrainSetup(spec=spec, seq_len=2048, micro_batch_size=2, zero_stage=zero, offload_optimizer=off_opt,
                          offload_params=off_par, gradient_checkpointing=True, gpus_per_node=8,
                          gradient_accumulation_steps=4, kernels="plain")
        assert estimate_memory(replace(base, finetune=Finetune("full"))) == estimate_memory(base)


def test_eight_bit_optimizer_states_are_two_bytes_and_their_absmaxes():
    base = plan(gpu="a100-80gb", gpus=8, finetune="full", zero=2, offload="none", micro_batch=1,
                checkpointing=True)
    eight = plan(gpu="a100-80gb", gpus=8, finetune="full", zero=2, offload="none", micro_batch=1,
                 checkpointing=True, optimizer="adamw_8bit")
    partition = count_params(base.request.spec).total / 8
    assert base.shown.memory.parts["optimizer"] == int(12 * partition)
    assert eight.shown.memory.parts["optimizer"] == int((4 + 2 + 8 / 256) * partition)
    assert EIGHT_BIT_STATE_BYTES == 2 + 8 / 256


def test_paged_optimizer_states_live_outside_the_peak():
    kw = dict(gpu="a100-80gb", gpus=8, finetune="full", zero=2, offload="none", micro_batch=1, checkpointing=True)
    paged = plan(optimizer="paged_adamw_8bit", **kw).shown.memory
    eight = plan(optimizer="adamw_8bit", **kw).shown.memory
    assert paged.parts["paged_optimizer_states"] > 0
    assert eight.peak_gpu_bytes - paged.peak_gpu_bytes >= paged.parts["paged_optimizer_states"]


def test_nf4_storage_is_bitsandbytes_blocks_and_double_quant_constants():
    # a 4096 x 14336 weight: 2 codes a byte, one 8-bit absmax per 64, one fp32 per 256 of those, 1,092 bytes of codes
    n = 4096 * 14336
    assert nf4_packed_bytes(n) == n // 2
    assert nf4_state_bytes(n) == n // 64 + 4 * (n // 64 // 256) + 1092


def test_zero3_partitions_the_frozen_base_and_zero2_does_not():
    z2 = plan(gpu="a100-40gb", gpus=2, finetune="lora", zero=2).shown.memory.parts["frozen_params"]
    z3 = plan(gpu="a100-40gb", gpus=2, finetune="lora", zero=3).shown.memory.parts["frozen_params"]
    assert z2 == 2 * z3


def test_qlora_under_zero3_stores_its_codes_in_the_compute_dtype():
    from adaptive.plan.ds_config.emit import plan_dict

    d = plan_dict(plan(gpu="a100-40gb", gpus=2, finetune="qlora", zero=3))
    assert d["finetune"]["bnb_4bit_quant_storage"] == "bfloat16"
    assert plan_dict(plan(gpu="t4", finetune="qlora", zero=0))["finetune"]["bnb_4bit_quant_storage"] == "uint8"


def test_a_finetune_has_no_loss_prediction_and_the_recipes_batch():
    p = plan(gpu="a100-80gb", finetune="qlora", dataset_tokens=2e7, epochs=3)
    assert p.quality is None and "no loss is predicted" in p.quality_note
    assert p.train_tokens == 6e7
    assert p.global_batch_tokens == 16 * 2048 and p.hyperparams.lr == 2e-4


def test_nvme_offload_plans_host_buffers_files_and_traffic(tmp_path):
    p = plan(gpu="rtx4090", finetune="full", nvme_path=str(tmp_path), offload="nvme")
    m = p.shown.memory
    assert p.shown.setup.zero_stage == 3 and p.shown.setup.offload_device == "nvme"
    assert m.parts["params"] == 0 and m.parts["optimizer"] == 0
    assert m.nvme_bytes_per_node > 16 * count_params(p.request.spec).total * 0.9
    assert 0 < m.host_bytes_per_node < 48 * GiB
    assert p.shown.throughput.offload_seconds > 0


@pytest.mark.parametrize("kw, message", [
    (dict(finetune="lora", lora_targets="c_attn"), "'c_attn' matches no linear layer"),
    (dict(finetune="qlora", offload="optimizer"), "--finetune qlora cannot take --offload optimizer"),
    (dict(finetune="lora", model="b7"), "preset b7 has no weights"),
    (dict(finetune="full", offload="nvme"), "needs --nvme-path"),
    (dict(finetune="full", offload="nvme", zero=2, nvme_path="/tmp"), "needs ZeRO-3"),
    (dict(lora_rank=8), "--lora-rank applies to a fine-tune"),
    (dict(finetune="full", lora_rank=8), "apply to --finetune lora or qlora"),
    (dict(finetune="lora", tp_size=2, gpus=2), "--tp-size 2 does not apply"),
    (dict(finetune="full", optimizer="paged_adamw_8bit", offload="optimizer", zero=2), "pages GPU states"),
    (dict(finetune="lora", nvme_path="/no/such/dir"), "is not a folder"),
])
def test_bad_finetune_requests_are_refused_in_one_line(kw, message):
    kw = {"model": LLAMA3_8B, "gpu": "a100-80gb", **kw}
    with pytest.raises(AdaptiveError, match=message) as err:
        fit(make_request(**kw))
    assert "\n" not in str(err.value)


def test_lora_rank_zero_is_refused():
    from adaptive.plan.finetune.method import make_finetune

    with pytest.raises(AdaptiveError, match="--lora-rank must be a positive integer"):
        make_finetune("lora", lora_rank=0)


@pytest.mark.parametrize("targets", ["", " , "])
def test_empty_lora_targets_are_refused_not_read_as_the_default(targets):
    from adaptive.plan.finetune.method import make_finetune

    with pytest.raises(AdaptiveError, match="--lora-targets names no module"):
        make_finetune("lora", lora_targets=targets)


def test_qlora_trainable_and_frozen_split_per_family():
    """Mixtral under transformers 5 keeps its 3D experts in 16 bits: bitsandbytes quantizes nn.Linear only."""
    import json
    import tempfile
    from pathlib import Path

    from adaptive.plan.architecture.hf_config import spec_from_hf_config

    cfg = dict(model_type="mixtral", vocab_size=32000, hidden_size=4096, intermediate_size=14336,
               num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, num_local_experts=8,
               num_experts_per_tok=2)
    folder = Path(tempfile.mkdtemp())
    (folder / "config.json").write_text(json.dumps(cfg))
    spec = spec_from_hf_config(folder / "config.json")
    roles = param_roles(spec, Finetune("qlora"))
    attention = 32 * (2 * 4096 * 4096 + 2 * 4096 * 1024)
    assert roles.frozen_4bit == attention
    assert roles.frozen_16bit > 45e9  # the experts, the router, embeddings, head
