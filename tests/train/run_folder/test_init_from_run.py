"""--init-from through a real recipe run: a tiny trained Llama folder starts debug_dense at its own loss (transformers'
loss on the same first batch), far below a random init's ln(vocab), and trains on; with --resume the checkpoint's
weights win (one warning line); bad --init-from input is one line and exit 2."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch

from adaptive.models import AdaptiveForCausalLM
from adaptive.plan.architecture.hf_config import spec_from_hf_config
from adaptive.train.run_folder.init_from import target_config
from tests.train._launch import REPO, accelerate_launch, launch_env, records, tail

DRIVER = REPO / "tests" / "train" / "_init_from_driver.py"
VOCAB = 2048  # the built-in tokenizer's


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory, tokenizer):
    """A 2-layer Llama trained 60 steps on the shipped corpus, saved with the built-in tokenizer."""
    import transformers

    from adaptive.train.data.tokenizer import DEFAULT_CORPUS

    ids = torch.tensor(tokenizer(DEFAULT_CORPUS.read_text(encoding="utf-8"))["input_ids"])
    blocks = ids[: len(ids) // 65 * 65].view(-1, 65)
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    model = transformers.LlamaForCausalLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    generator = torch.Generator().manual_seed(0)
    for _ in range(60):
        batch = blocks[torch.randint(0, len(blocks), (8,), generator=generator)]
        model(input_ids=batch, labels=batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    folder = tmp_path_factory.mktemp("tiny-llama")
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def _run(folder, out, home, *flags):
    args = ["--init-from", str(folder), "--seq-len", "64", "--lr", "2e-3", "--output-dir", str(out), "--log-every", "1",
            "--checkpoint-every", "0", "--no-progress", *flags]
    return accelerate_launch(DRIVER, ["debug", "dense", str(out / "reference.json"), "--", *args], home=home,
                             ADAPTIVE_CACHE=str(home / "cache"))


@pytest.mark.slow
def test_a_recipe_starts_from_a_llama_folder_at_its_loss_and_resume_wins(tiny_llama, tmp_path):
    out = tmp_path / "run"
    done = _run(tiny_llama, out, tmp_path, "--max-steps", "16")
    assert done.returncode == 0, tail(done)
    start = records(out, "start")[0]
    assert start["init_from"] == str(tiny_llama)
    losses = [r["loss"] for r in records(out, "train")]
    first = json.loads((out / "reference.json").read_text())
    # the loaded model is transformers' model: the same loss on the same batch
    assert first["ours"] == pytest.approx(first["reference"], abs=1e-4)
    assert losses[0] == pytest.approx(first["ours"], abs=1e-6)
    assert losses[0] < math.log(VOCAB) - 1.0  # a random init starts at ln(vocab)
    assert sum(losses[-4:]) / 4 < sum(losses[:4]) / 4 - 0.05  # and it trains on (each step sees other text)
    exported = json.loads((out / "hf" / "config.json").read_text())
    assert exported["model_type"] == "llama" and exported["rms_norm_eps"] == 1e-6  # the checkpoint's numerics

    again = _run(tiny_llama, out, tmp_path, "--max-steps", "18", "--resume")
    assert again.returncode == 0, tail(again)
    warning = [line for line in again.stderr.splitlines() if "--init-from" in line and "ignored" in line]
    assert len(warning) == 1 and "the checkpoint resumed holds the trained weights" in warning[0]
    resumed = records(out, "start")[-1]
    assert resumed["step"] == 16 and resumed["resumed_from"]
    assert [r["step"] for r in records(out, "train")] == list(range(1, 19))


def _dry_run(*flags, home):
    return subprocess.run([sys.executable, str(REPO / "recipes" / "debug_dense.py"), "--dry-run", "--gpu", "a100-80gb",
                           *flags], env=launch_env(home), capture_output=True, text=True, timeout=60)


def test_dry_run_plans_the_checkpoints_shape(tiny_llama, tmp_path):
    done = _dry_run("--init-from", str(tiny_llama), "--arch", "moe", home=tmp_path)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert out["run"]["init_from"] == str(tiny_llama)
    plan = out["plan"]
    assert (plan["arch"], plan["model_source"]) == ("moe", "hf:llama")
    # the parameters of the upcycled model (8 experts as wide as the Llama's FFN), not the debug preset's
    upcycled = AdaptiveForCausalLM(target_config(str(tiny_llama), spec_from_hf_config(tiny_llama, "moe")))
    assert plan["params_total"] == sum(p.numel() for p in upcycled.parameters())


@pytest.mark.parametrize(("make", "flags", "message"), [
    (None, [], "is not a folder"),
    ("empty", [], "has no config.json"),
    ("gpt2", [], "model_type 'gpt2' is not supported"),
    ("llama", ["--model", "debug"], "give --model or --init-from, not both"),
])
def test_bad_init_from_is_one_line_and_exit_2(tiny_llama, tmp_path, make, flags, message):
    path = tmp_path / "ckpt"
    if make == "empty":
        path.mkdir()
    elif make == "gpt2":
        path.mkdir()
        (path / "config.json").write_text('{"model_type": "gpt2"}')
    elif make == "llama":
        path = tiny_llama
    done = _dry_run("--init-from", str(path), *flags, home=tmp_path)
    assert done.returncode == 2, done.stderr
    assert message in done.stderr and done.stderr.count("\n") == 1 and "Traceback" not in done.stderr


def test_a_tokenizer_larger_than_the_checkpoints_vocab_is_refused(tiny_llama, tmp_path):
    from adaptive.errors import AdaptiveError
    from adaptive.train.run_folder.init_from import tokenizer_folder
    from adaptive.train.data.tokenizer import load_tokenizer, require_fits_vocab

    assert tokenizer_folder(str(tiny_llama)) == str(tiny_llama)
    tokenizer = load_tokenizer(tokenizer_folder(str(tiny_llama)))  # what a run loads from the folder
    with pytest.raises(AdaptiveError, match=f"the tokenizer has {len(tokenizer)} tokens but the model's vocab_size is "
                                            "1024"):
        require_fits_vocab(tokenizer, 1024)


ZERO3 = r"""
import sys, torch, deepspeed
from adaptive.models import AdaptiveForCausalLM
from adaptive.models.moe_deepspeed import ensure_distributed
from adaptive.plan.architecture.hf_config import spec_from_hf_config
from adaptive.train.run_folder.init_from import load_init_weights, target_config
from transformers import AutoModelForCausalLM

folder = sys.argv[1]
ensure_distributed(torch.device("cpu"))  # a one-process group, as a recipe run has
reference = AutoModelForCausalLM.from_pretrained(folder).state_dict()
for arch in ("dense", "mod"):
    with deepspeed.zero.Init(config_dict_or_path={"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}}):
        model = AdaptiveForCausalLM(target_config(folder, spec_from_hf_config(folder, arch)))
    assert all(p.numel() == 0 for p in model.parameters())  # partitioned: nothing held outside the gather
    load_init_weights(model, folder)
    with deepspeed.zero.GatheredParameters(list(model.parameters())):
        ours = {k: v.clone() for k, v in model.state_dict().items()}
    wrong = [k for k, v in reference.items() if not torch.equal(ours[k], v)]
    print(arch, "WRONG", wrong)
"""


@pytest.mark.slow
def test_zero3_partitioned_models_load_every_weight(tiny_llama, tmp_path):
    """Under ZeRO-3 the model is built partitioned (zero.Init): each weight is gathered, written and partitioned."""
    done = subprocess.run([sys.executable, "-c", ZERO3, str(tiny_llama)], env=launch_env(tmp_path), capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, tail(done)
    assert "dense WRONG []" in done.stdout and "mod WRONG []" in done.stdout, tail(done)


def test_launch_plans_the_checkpoints_shape_and_hands_init_from_to_the_recipe(tiny_llama, tmp_path):
    from adaptive.config.run import RunConfig
    from adaptive.launch import LaunchRequest, plan_launch

    config = RunConfig.from_options({"init_from": str(tiny_llama), "gpu": "a100-80gb", "output_dir": str(tmp_path)})
    launch = plan_launch(LaunchRequest(recipe=str(REPO / "recipes" / "debug_moe.py"), config=config))
    assert launch.plan.request.spec.source == "hf:llama" and launch.plan.request.spec.num_hidden_layers == 2
    command = launch.this_node
    assert command[command.index("--init-from") + 1] == str(tiny_llama)
