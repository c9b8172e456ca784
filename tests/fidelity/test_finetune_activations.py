"""The planner's activation counts for fine-tuning against the real classes: transformers' decoder of every family
(tests/plan/architecture/test_families.py's CONFIGS), frozen and wrapped in real PEFT LoRA, or loaded as NF4 by real
bitsandbytes for QLoRA, with and without checkpointing. Saved bytes are counted with saved_tensors_hooks and the
backward peak with a storage-lifetime counter (adaptive/fidelity/measure.py), independently of the formula
(adaptive/plan/estimate/hf_blocks.py, activations.py).

Like with like: the planner plans GPUs, and two things differ on this CPU. LoRA's dropout runs as CUDA's fused
native_dropout (a bool mask; the CPU's nn.Dropout keeps one in the input's dtype, `test_dropout_runs_as_on_a_gpu`),
and PEFT's router adapter computes B·A in fp32 on the CPU only (a few kB a layer, inside the tolerance).
"""

import json

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from adaptive.fidelity.measure import (NativeDropout, count_saved_bytes, finetune_model_on_meta, materialize,
                                       qlora_model, run_phases)
from adaptive.plan.architecture.hf_config import spec_from_hf_config
from adaptive.plan.estimate.activations import (activation_bytes, backward_peak_bytes, dense_layer_bytes,
                                                eager_backward_extra_bytes, eager_extra_bytes)
from adaptive.plan.estimate.hf_blocks import layer_flow, peft_targets
from adaptive.plan.finetune.method import make_finetune
from tests.plan.architecture.test_families import CONFIGS

TOLERANCE = 0.03  # saved bytes: the bound
BACKWARD_TOLERANCE = 0.08  # backward peaks: the CPU's kernels' temporaries, fitted (hf_blocks.py NORM_BACKWARD)
NAMES = {"phi3": "o_proj,gate_up_proj", "mixtral": "q_proj,w2", "qwen3_moe": "k_proj,gate_proj,up_proj"}
# Shapes where a layer's backward, not the loss's, sets the peak (small vocabulary, realistic h : f)
WIDE = dict(vocab_size=256, hidden_size=512, intermediate_size=1408, num_attention_heads=8, num_key_value_heads=4)
WIDE_MOE = {"mixtral": dict(WIDE, intermediate_size=704),
            "qwen3_moe": dict(WIDE, moe_intermediate_size=352, head_dim=64, mlp_only_layers=[]),
            "qwen2_moe": dict(WIDE, moe_intermediate_size=352, shared_expert_intermediate_size=1408)}


def spec_and_config(tmp_path, model_type, **overrides):
    config = dict(CONFIGS[model_type], **overrides)
    path = tmp_path / f"{model_type}.json"
    path.write_text(json.dumps(config))
    return spec_from_hf_config(path), config


def lora(targets="all-linear", rank=8, dropout=None, method="lora"):
    return make_finetune(method, rank, None, targets, dropout)


def measured_and_predicted(tmp_path, model_type, finetune, checkpointing, seq=128, micro_batch=1, **overrides):
    """(measured phases, predicted saved bytes, predicted backward peak) of one cell. Gemma 2 runs eager attention
    (transformers refuses SDPA for it): its score tensors are the eager extras, kept and in backward."""
    spec, config = spec_and_config(tmp_path, model_type, **overrides)
    eager = model_type == "gemma2"
    phases = run_phases(spec, seq, micro_batch, checkpointing, zero_stage=2, bucket_elements=1, hf_config=config,
                        kernels="plain", finetune=finetune, attn_implementation="eager" if eager else "sdpa")
    saved = activation_bytes(spec, seq, micro_batch, checkpointing, 1.0, "plain", finetune)
    backward = backward_peak_bytes(spec, seq, micro_batch, checkpointing, 1.0, "plain", finetune)
    if eager:
        extra = eager_extra_bytes(spec, seq, micro_batch, checkpointing, "plain", finetune)
        saved += extra
        backward += extra + eager_backward_extra_bytes(spec, seq, micro_batch, checkpointing, "plain", finetune)
    return phases, saved, backward


def check_saved(record_error, tmp_path, model_type, finetune, checkpointing, **kw):
    phases, saved, backward = measured_and_predicted(tmp_path, model_type, finetune, checkpointing, **kw)
    error = saved / phases.activations - 1
    record_error(error, f"{model_type} {finetune} ckpt={checkpointing}: saved")
    assert abs(error) <= TOLERANCE, (model_type, finetune, checkpointing, phases.activations, saved)
    return phases, saved, backward


def check_backward(record_error, tmp_path, model_type, finetune, checkpointing, **kw):
    phases, _, backward = measured_and_predicted(tmp_path, model_type, finetune, checkpointing, **kw)
    error = backward / phases.backward - 1
    record_error(error, f"{model_type} {finetune} ckpt={checkpointing}: backward")
    assert abs(error) <= BACKWARD_TOLERANCE, (model_type, finetune, checkpointing, phases.backward, backward)


# --- the measurement itself

def test_frozen_weights_are_not_activations_and_a_leaf_activation_is():
    """A LoRA-like step: a frozen embedding whose output is made to require grad (a leaf, as
    `enable_input_require_grads` does), a frozen base linear (it saves its weight, for the input's gradient) and a
    trained adapter (it saves its input). Told by storage, the activation is the input; told by requires_grad
    (without the model), it was the frozen weight."""
    torch.manual_seed(0)
    embed, base, adapter = torch.nn.Embedding(50, 16), torch.nn.Linear(16, 32), torch.nn.Linear(16, 32)
    model = torch.nn.ModuleList([embed, base, adapter])
    embed.requires_grad_(False)
    base.requires_grad_(False)
    ids = torch.randint(0, 50, (2, 8))

    def counted(with_model: bool) -> int:
        result: dict = {}
        with count_saved_bytes(result, model if with_model else None):
            x = embed(ids).requires_grad_(True)
            out = base(x) + adapter(x)
        out.sum().backward()
        return result["bytes"]

    assert counted(True) == 2 * 8 * 16 * 4  # the adapter's input
    assert counted(False) == 32 * 16 * 4  # the frozen weight, and not the leaf input
    model.requires_grad_(True)  # full training: the same count either way (ids and the linears' input)
    assert counted(True) == counted(False) == 2 * 8 * 8 + 2 * 8 * 16 * 4


def test_dropout_runs_as_on_a_gpu():
    """CUDA's nn.Dropout is aten native_dropout, keeping a bool mask; the CPU's keeps one in the input's dtype. The
    measurement runs the GPU's, so a 16-bit input's mask is 1 byte an element, as the planner counts it."""
    x = torch.randn(4, 64, dtype=torch.bfloat16, requires_grad=True)
    for module, mask_bytes in ((NativeDropout(0.1), 1), (torch.nn.Dropout(0.1), 2)):
        result: dict = {}
        with count_saved_bytes(result):
            out = module.train()(x)
        out.sum().backward()
        assert result["bytes"] == x.numel() * mask_bytes, module


def test_fake_tensors_count_what_real_ones_keep(tmp_path):
    """LoRA is measured on fake tensors (a meta model given fake storage): the same bytes as real tensors keep."""
    spec, config = spec_and_config(tmp_path, "qwen3", num_hidden_layers=2)
    finetune = lora("q_proj,v_proj", dropout=0.1)
    counts = []
    for fake in (True, False):
        meta = finetune_model_on_meta(spec, config, torch.bfloat16, False, finetune)
        with FakeTensorMode(allow_non_fake_inputs=True) if fake else torch.device("cpu"):
            model = materialize(meta)
            if not fake:
                for p in model.parameters():
                    torch.nn.init.normal_(p.data, std=0.02)
            ids = torch.randint(0, spec.vocab_size, (1, 32))
            result: dict = {}
            with count_saved_bytes(result, model):
                out = model(input_ids=ids, labels=ids)
            out.loss.backward()
        counts.append(result["bytes"])
    assert counts[0] == counts[1]


def test_qlora_loads_a_4bit_base_and_keeps_what_lora_keeps(record_error, tmp_path):
    """bitsandbytes' Linear4bit (MatMul4Bit keeps only the packed weight) saves what a frozen 16-bit linear does."""
    import bitsandbytes as bnb

    spec, config = spec_and_config(tmp_path, "llama", num_hidden_layers=2)
    model = qlora_model(spec, config, torch.bfloat16, False, lora(method="qlora"))
    assert sum(type(m) is bnb.nn.Linear4bit for m in model.modules()) == 7 * 2
    qlora_phases, saved, _ = check_saved(record_error, tmp_path, "llama", lora(method="qlora"), False,
                                         num_hidden_layers=2)
    lora_phases = run_phases(spec, 128, 1, False, zero_stage=2, bucket_elements=1, hf_config=config, kernels="plain",
                             finetune=lora())
    assert qlora_phases.activations == lora_phases.activations


@pytest.mark.parametrize("model_type", ["mixtral", "qwen3_moe", "qwen2_moe", "phi3"])
def test_targets_are_what_peft_adapts(tmp_path, model_type):
    """PEFT 0.21 on transformers 5 adapts Mixtral's and Qwen3-MoE's router and 3D experts under "all-linear" (and
    leaves Qwen3-MoE's dense layers' MLP frozen), Qwen2-MoE's shared expert but not its experts."""
    import peft
    from peft.tuners.lora import Linear as LoraLinear
    from peft.tuners.lora.layer import ParamWrapper
    from transformers import AutoConfig, AutoModelForCausalLM

    spec, config = spec_and_config(tmp_path, model_type)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config))
    model.requires_grad_(False)
    model = peft.get_peft_model(model, peft.LoraConfig(r=8, target_modules="all-linear"))
    modules, experts = set(), set()
    for name, module in model.named_modules():
        parts = name.split(".layers.", 1)[-1].split(".", 1)
        if ".layers." not in name or len(parts) < 2:
            continue
        inside = parts[1]  # the name inside a layer
        if isinstance(module, ParamWrapper):
            experts.add({"weight": "router", "gate_up_proj": "gate_up", "down_proj": "down"}[module.parameter_name])
        elif isinstance(module, LoraLinear):
            modules.add(inside)
    assert peft_targets(spec, "all-linear") == (modules, experts)


# --- saved bytes, every family

@pytest.mark.parametrize("model_type", sorted(CONFIGS))
def test_every_family_full_and_lora(record_error, tmp_path, model_type):
    check_saved(record_error, tmp_path, model_type, None, False)
    check_saved(record_error, tmp_path, model_type, lora(), False)


def test_checkpointing_dropout_rank_and_a_bigger_batch(record_error, tmp_path):
    check_saved(record_error, tmp_path, "qwen3_moe", lora("attention", rank=64), True)
    check_saved(record_error, tmp_path, "llama", lora("q_proj,v_proj", dropout=0.1), False, seq=256, micro_batch=2)
    check_saved(record_error, tmp_path, "gemma3_text", lora(dropout=0.1), "every:2", num_hidden_layers=4)


@pytest.mark.parametrize("model_type", ["llama", "mistral", "qwen2"])
def test_dense_families_count_the_formula_exactly(tmp_path, model_type):
    """With every weight trained, the dataflow of a Llama-style layer is `dense_layer_bytes` (plain), byte for byte:
    two counts written independently agree."""
    spec, _ = spec_and_config(tmp_path, model_type)
    per_token, fixed, _, _ = layer_flow(spec, "dense", None, True)
    assert (per_token, fixed) == (dense_layer_bytes(spec, "plain"), 0)


# --- backward peaks

@pytest.mark.parametrize("model_type,checkpointing", [("llama", True), ("qwen3", "every:2"), ("gemma3_text", True),
                                                      ("gemma2", True)])
def test_lora_backward_peak(record_error, tmp_path, model_type, checkpointing):
    extra = dict(head_dim=64) if CONFIGS[model_type].get("head_dim") else {}
    check_backward(record_error, tmp_path, model_type, lora(), checkpointing, seq=512, num_hidden_layers=2,
                   **WIDE, **extra)


# --- the whole matrix (slow)

@pytest.mark.slow
@pytest.mark.parametrize("model_type", sorted(CONFIGS))
@pytest.mark.parametrize("checkpointing", [False, True, "every:2"])
def test_every_family_every_method(record_error, tmp_path, model_type, checkpointing):
    moe = CONFIGS[model_type].get("num_experts") or CONFIGS[model_type].get("num_local_experts")
    names = NAMES.get(model_type, "q_proj,v_proj")
    for finetune in (None, lora(), lora("attention", rank=64, dropout=0.1),
                     lora(names, dropout=None if model_type in ("mixtral", "qwen3_moe") else 0.1),
                     lora("all-linear", rank=64, dropout=None if moe else 0.1)):
        check_saved(record_error, tmp_path, model_type, finetune, checkpointing, seq=256, micro_batch=2)


@pytest.mark.slow
@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
@pytest.mark.parametrize("checkpointing", [False, True, "every:2"])
def test_qlora(record_error, tmp_path, model_type, checkpointing):
    for finetune in (lora(method="qlora"), lora("q_proj,v_proj", rank=64, dropout=0.1, method="qlora")):
        check_saved(record_error, tmp_path, model_type, finetune, checkpointing, seq=256, num_hidden_layers=2)


@pytest.mark.slow
@pytest.mark.parametrize("model_type", sorted(CONFIGS))
@pytest.mark.parametrize("checkpointing", [False, True, "every:2"])
def test_backward_peaks(record_error, tmp_path, model_type, checkpointing):
    shape = dict(WIDE_MOE.get(model_type, WIDE), num_hidden_layers=4 if checkpointing == "every:2" else 2)
    if CONFIGS[model_type].get("head_dim") and model_type not in WIDE_MOE:
        shape["head_dim"] = 64
    for finetune in (lora(), lora("attention")):
        check_backward(record_error, tmp_path, model_type, finetune, checkpointing, seq=512, **shape)
