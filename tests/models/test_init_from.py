"""--init-from's mapping: transformers' Llama, Mistral, Qwen2 and Mixtral load into our classes with their logits,
our exports load back exactly, a dense checkpoint upcycles into MoE (experts = the FFN, same logits at step 0), and
bad checkpoints are one-line errors."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from _model_helpers import tiny_model

from adaptive.errors import AdaptiveError
from adaptive.models import AdaptiveForCausalLM
from adaptive.models.export import export_pretrained
from adaptive.plan.architecture.hf_config import spec_from_hf_config
from adaptive.train.run_folder.init_from import check_source, load_init_weights, target_config

SHAPE = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-6)
IDS = torch.randint(0, 96, (2, 11), generator=torch.Generator().manual_seed(3))


def perturbed(model):
    """HF init leaves norms at 1 and biases at 0; noise on every tensor makes a mis-mapped one show."""
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=generator) * 0.05)
    return model.eval()


def hf_model(kind: str, **extra):
    torch.manual_seed(0)
    config = {
        "llama": lambda: transformers.LlamaConfig(**SHAPE, rope_theta=50000.0, **extra),
        "mistral": lambda: transformers.MistralConfig(**SHAPE, sliding_window=None, **extra),
        "qwen2": lambda: transformers.Qwen2Config(**SHAPE, tie_word_embeddings=True, **extra),
        "mixtral": lambda: transformers.MixtralConfig(**{**SHAPE, "intermediate_size": 24, "num_local_experts": 4,
                                                         "num_experts_per_tok": 2, **extra}),
    }[kind]()
    return perturbed(transformers.AutoModelForCausalLM.from_config(config))


def load(path, arch: str, **overrides):
    """What a run does with --init-from: check, plan the shape, build our model, load (fp32, eval)."""
    check_source(path, arch)
    model = AdaptiveForCausalLM(target_config(path, spec_from_hf_config(path, arch), **overrides))
    load_init_weights(model, str(path))
    return model.eval()


def logits(model, ids=IDS):
    with torch.no_grad():
        return model(ids).logits


@pytest.mark.parametrize("kind", ["llama", "mistral", "qwen2"])
def test_dense_transformers_checkpoints_give_their_logits(tmp_path, kind):
    theirs = hf_model(kind)
    theirs.save_pretrained(tmp_path)
    ours = load(tmp_path, "dense")
    assert ours.config.rms_norm_eps == 1e-6 and ours.config.qkv_bias == (kind == "qwen2")
    torch.testing.assert_close(logits(ours), logits(theirs), rtol=0, atol=1e-5)


def test_mixtral_loads_into_our_moe_with_its_logits(tmp_path):
    theirs = hf_model("mixtral")
    theirs.save_pretrained(tmp_path)  # transformers writes per-expert w1/w2/w3 names
    ours = load(tmp_path, "moe")
    assert ours.config.moe_layers == [0, 1, 2] and ours.config.num_local_experts == 4
    torch.testing.assert_close(logits(ours), logits(theirs), rtol=0, atol=1e-5)


@pytest.mark.parametrize("layout", ["sharded safetensors", "sharded pytorch_model.bin"])
def test_sharded_checkpoints_load_the_same(tmp_path, layout):
    theirs = hf_model("llama")
    theirs.save_pretrained(tmp_path, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    if layout.endswith(".bin"):  # the older format, as torch.save shards with an index
        state = theirs.state_dict()
        keys = sorted(state)
        shards = {"pytorch_model-00001-of-00002.bin": keys[::2], "pytorch_model-00002-of-00002.bin": keys[1::2]}
        for name, part in shards.items():
            torch.save({k: state[k] for k in part}, tmp_path / name)
        index = {"weight_map": {k: name for name, part in shards.items() for k in part}}
        (tmp_path / "pytorch_model.bin.index.json").write_text(json.dumps(index))
        for file in tmp_path.glob("model*.safetensors*"):
            file.unlink()
    torch.testing.assert_close(logits(load(tmp_path, "dense")), logits(theirs), rtol=0, atol=1e-5)


@pytest.mark.parametrize(("arch", "fmt", "blocks"), [
    ("dense", "llama", None), ("dense", "adaptive", None), ("moe", "mixtral", ["moe"] * 5),
    ("moe", "adaptive", None), ("mod", "adaptive", None), ("hybrid", "adaptive", None),
])
def test_our_exports_load_back_exactly(tmp_path, arch, fmt, blocks):
    ours = tiny_model(arch, **({"block_types": blocks} if blocks else {})).eval()
    perturbed(ours)
    assert export_pretrained(ours, tmp_path, fmt).format == fmt
    back = load(tmp_path, arch)
    assert back.config.block_types == ours.config.block_types
    for key, value in ours.state_dict().items():
        assert torch.equal(back.state_dict()[key], value), key
    torch.testing.assert_close(logits(back, IDS % 128), logits(ours, IDS % 128), rtol=0, atol=0)


def _dense_and_upcycled(tmp_path, arch: str, **overrides):
    dense = hf_model("llama")
    dense.save_pretrained(tmp_path)
    return dense, load(tmp_path, arch, **overrides)


def test_upcycled_experts_are_copies_of_the_dense_ffn(tmp_path):
    dense, moe = _dense_and_upcycled(tmp_path, "moe")
    assert moe.config.num_local_experts == 8 and moe.config.moe_intermediate_size == 48
    for i, layer in enumerate(moe.model.layers):
        mlp = dense.model.layers[i].mlp
        gate_up = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight])
        for e in range(8):
            assert torch.equal(layer.mlp.experts.gate_up_proj[e], gate_up)
            assert torch.equal(layer.mlp.experts.down_proj[e], mlp.down_proj.weight)
        # the router is fresh: our init (normal, std initializer_range), not zeros and not shared between layers
        assert 0.01 < layer.mlp.gate.weight.std() < 0.03


@pytest.mark.parametrize("mode", ["eval", "train, unbounded capacity"])
def test_upcycled_moe_computes_the_dense_model_at_step_0(tmp_path, mode):
    # top-2 combine weights are renormalised to sum to 1 and the experts are equal: the MoE layer is the FFN
    dense, moe = _dense_and_upcycled(tmp_path, "moe", drop_tokens=mode == "eval")
    moe.train(mode != "eval")
    torch.testing.assert_close(logits(moe), logits(dense), rtol=0, atol=1e-5)


@pytest.mark.parametrize("kind", ["mixtral", "llama"])
def test_deepspeed_moe_loads_what_the_native_block_loads(tmp_path, kind):
    """The recipes' MoE blocks are DeepSpeed's (its per-expert names): the same checkpoint gives the same logits."""
    hf_model(kind).save_pretrained(tmp_path)
    native = load(tmp_path, "moe")
    check_source(tmp_path, "moe")
    deepspeed = AdaptiveForCausalLM(target_config(tmp_path, spec_from_hf_config(tmp_path, "moe"),
                                                  moe_implementation="deepspeed"))
    deepspeed.setup_expert_parallel()  # process groups before the first forward (one process here)
    load_init_weights(deepspeed, str(tmp_path))
    torch.testing.assert_close(logits(deepspeed.eval()), logits(native), rtol=0, atol=1e-6)


def test_upcycled_moe_drops_tokens_over_capacity_in_training(tmp_path):
    """What the step-0 equality needs: with the training capacity (factor 1), a dropped token gets no FFN."""
    dense, moe = _dense_and_upcycled(tmp_path, "moe")
    moe.train()
    assert not torch.allclose(logits(moe), logits(dense), atol=1e-3)


def test_dense_into_hybrid_upcycles_moe_layers_and_copies_mod_blocks(tmp_path):
    dense, hybrid = _dense_and_upcycled(tmp_path, "hybrid")
    assert hybrid.config.mod_layers and hybrid.config.moe_layers
    for i, layer in enumerate(hybrid.model.layers):
        source = dense.model.layers[i]
        assert torch.equal(layer.self_attn.q_proj.weight, source.self_attn.q_proj.weight)
        assert torch.equal(layer.mlp.experts.down_proj[3], source.mlp.down_proj.weight)
        assert (layer.mod is not None) == (i in hybrid.config.mod_layers)


def test_a_dense_adaptive_export_upcycles_too(tmp_path):
    ours = perturbed(tiny_model("dense"))
    export_pretrained(ours, tmp_path, "adaptive")
    moe = load(tmp_path, "moe")
    assert torch.equal(moe.model.layers[1].mlp.experts.down_proj[5], ours.model.layers[1].mlp.down_proj.weight)


def _edit_config(path, **changes):
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, **changes}))


@pytest.mark.parametrize(("setup", "arch", "message"), [
    (lambda p: None, "dense", "is not a folder"),
    (lambda p: p.mkdir(), "dense", "has no config.json"),
    (lambda p: (p.mkdir(), (p / "config.json").write_text('{"model_type": "gpt2"}')), "dense",
     "model_type 'gpt2' is not supported; start from one of llama, mistral, qwen2, mixtral, adaptive"),
    (lambda p: (p.mkdir(), (p / "config.json").write_text('{"model_type": "qwen2_moe"}')), "moe",
     "Qwen2-MoE's shared expert"),
    (lambda p: hf_model("mixtral").save_pretrained(p), "dense", "holds a moe model, which starts only a moe one"),
    (lambda p: hf_model("mixtral", num_experts_per_tok=1).save_pretrained(p), "moe", "top-1 routing"),
    (lambda p: (hf_model("llama").save_pretrained(p), (p / "model.safetensors").unlink()), "dense", "holds no weights"),
], ids=["missing", "no config.json", "gpt2", "qwen2_moe", "mixtral as dense", "top-1 mixtral", "no weights"])
def test_bad_checkpoint_folders_are_one_line_errors(tmp_path, setup, arch, message):
    path = tmp_path / "ckpt"
    setup(path)
    with pytest.raises(AdaptiveError) as err:
        check_source(path, arch)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_weights_that_do_not_match_config_json_are_refused(tmp_path):
    hf_model("llama").save_pretrained(tmp_path)
    _edit_config(tmp_path, intermediate_size=64)
    with pytest.raises(AdaptiveError, match=r"mlp.down_proj.weight is \[32, 48\] in the weights but \[32, 64\] by its "
                                            r"config.json \(shape mismatch\)"):
        load(tmp_path, "dense")


def test_non_finite_weights_are_refused(tmp_path):
    model = hf_model("llama")
    with torch.no_grad():
        model.model.layers[1].self_attn.k_proj.weight[0, 0] = float("nan")
    model.save_pretrained(tmp_path)
    with pytest.raises(AdaptiveError, match="model.layers.1.self_attn.k_proj.weight holds non-finite values"):
        load(tmp_path, "dense")
