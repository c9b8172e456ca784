"""A fine-tune's parameter split against the models PEFT and bitsandbytes build: the trainable count equals PEFT's
`get_nb_trainable_parameters()`, and the frozen base's bytes equal what the built model holds (its parameters and
bitsandbytes' quantization states, byte for byte)."""

import json

import pytest
import torch

from adaptive.plan.architecture.hf_config import spec_from_hf_config
from adaptive.plan.finetune.method import make_finetune
from adaptive.plan.finetune.roles import param_roles
from tests.plan.architecture.test_families import CONFIGS


def _write(tmp_path, cfg) -> str:
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return str(tmp_path / "config.json")


def _peft(model, targets, rank):
    from peft import LoraConfig, get_peft_model

    target = targets if targets == "all-linear" else None
    if targets == "attention":
        from adaptive.plan.architecture.families import resolve_targets

        target = sorted({m.leaf for m in resolve_targets(_peft.spec, "attention")})
    elif target is None:
        target = [t.strip() for t in targets.split(",")]
    return get_peft_model(model, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=target))


@pytest.mark.parametrize("model_type", sorted(CONFIGS))
@pytest.mark.parametrize("targets, rank", [("all-linear", 8), ("attention", 4)])
def test_trainable_params_equal_peft_s_count(tmp_path, model_type, targets, rank):
    from transformers import AutoConfig, AutoModelForCausalLM

    path = _write(tmp_path, CONFIGS[model_type])
    spec = spec_from_hf_config(path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tmp_path))
    _peft.spec = spec
    peft_model = _peft(model, targets, rank)
    trainable, total = peft_model.get_nb_trainable_parameters()
    roles = param_roles(spec, make_finetune("lora", lora_rank=rank, lora_targets=targets))
    assert (roles.trainable, roles.total) == (trainable, total)


def test_a_name_list_targets_what_peft_targets(tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM

    path = _write(tmp_path, CONFIGS["qwen2_moe"])
    spec = spec_from_hf_config(path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tmp_path))
    peft_model = _peft(model, "q_proj,down_proj", 8)  # down_proj: the shared expert's (the experts are 3D)
    roles = param_roles(spec, make_finetune("lora", lora_rank=8, lora_targets="q_proj,down_proj"))
    assert roles.trainable == peft_model.get_nb_trainable_parameters()[0]


def _held_bytes(model) -> int:
    """Unique storages of the model's parameters and of bitsandbytes' quantization states (not its buffers: RoPE's
    inverse frequencies, a few hundred bytes, are no parameter)."""
    import bitsandbytes as bnb

    storages = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in model.parameters()}
    for module in model.modules():
        if isinstance(module, bnb.nn.Linear4bit):
            qs = module.weight.quant_state
            for t in (qs.absmax, qs.code, qs.offset, qs.state2.absmax, qs.state2.code):
                storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(storages.values())


@pytest.mark.parametrize("model_type", ["llama", "qwen3", "phi3", "mixtral"])
def test_qlora_base_bytes_equal_what_bitsandbytes_builds(tmp_path, model_type):
    """transformers' 4-bit loading with double quantization: every nn.Linear but the LM head in NF4 (blocks of 64 and
    their quantized absmaxes), the rest (embeddings, norms, Mixtral's 3D experts) in bf16."""
    from transformers import AutoConfig, AutoModelForCausalLM, BitsAndBytesConfig

    path = _write(tmp_path, CONFIGS[model_type])
    spec = spec_from_hf_config(path)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tmp_path)).to(torch.bfloat16).save_pretrained(
        tmp_path / "ckpt")
    quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                               bnb_4bit_compute_dtype=torch.bfloat16)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt", quantization_config=quant, dtype=torch.bfloat16,
                                                 device_map="cpu")
    roles = param_roles(spec, make_finetune("qlora", lora_rank=8))
    assert _held_bytes(model) == roles.frozen_bytes


def test_lora_base_bytes_equal_the_16_bit_model(tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM

    path = _write(tmp_path, CONFIGS["gemma2"])
    spec = spec_from_hf_config(path)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tmp_path)).to(torch.bfloat16)
    held = sum(p.numel() * p.element_size() for p in model.parameters())
    roles = param_roles(spec, make_finetune("lora"))
    assert roles.frozen_bytes == held and roles.frozen_4bit == 0


def test_the_qlora_run_holds_its_base_as_planned(tmp_path):
    """The run's own model (load_pretrained + apply_method, as recipes/finetune.py builds it) holds the frozen base in
    the planned bytes: no fp32 copy of the modules bitsandbytes leaves in 16 bits (PEFT's kbit preparation makes one)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from adaptive.models.finetune import apply_method, load_pretrained

    path = _write(tmp_path, CONFIGS["llama"])
    spec = spec_from_hf_config(path)
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tmp_path)).to(torch.bfloat16).save_pretrained(
        tmp_path / "ckpt")
    finetune = make_finetune("qlora", lora_rank=8)
    model = apply_method(load_pretrained(tmp_path / "ckpt", finetune, "bf16", 2, "sdpa", torch.device("cpu")), spec,
                         finetune, "off")
    adapters = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    roles = param_roles(spec, finetune)
    assert _held_bytes(model) - adapters == roles.frozen_bytes
    assert sum(p.numel() for p in model.parameters() if p.requires_grad) == roles.trainable
