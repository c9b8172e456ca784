"""LoRA and QLoRA fine-tunes of transformers' own Llama and Qwen3, with real PEFT, bitsandbytes and DeepSpeed.

Each run is one epoch (16 steps) of `tests/train/finetune/_checkpoints.py`'s sums, recorded by `_ft_driver.py`: the
trained model's logits on a few probe examples (in the run, after its export) and the probes' loss before the first
step and after the last. The checks then go through the run's files only, the way a user would: PEFT reloads
RUN/adapter onto a base built from the checkpoint (for QLoRA quantized as PEFT's QLoRA recipe does), and
AutoModelForCausalLM loads the merged RUN/hf with its tokenizer. The Llama LoRA run is also the uninterrupted
baseline a SIGKILLed and resumed run must equal bitwise.

Quick: Llama LoRA on chats (launched with `accelerate launch`, as the README's command) and Qwen3 QLoRA on
prompt/completion rows (plain python, one process); the other two pairings are slow.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from tests.train._launch import tail
from tests.train.finetune._checkpoints import CHAT_TEMPLATE
from tests.train.finetune._run import LORA_FLAGS, finetune, losses, recorded

# name: (checkpoint fixture, method, data fixture, launcher)
RUNS = {
    "llama-lora": ("tiny_llama", "lora", "chat_jsonl", "accelerate"),
    "qwen3-qlora": ("tiny_qwen3", "qlora", "prompt_completion_jsonl", "python"),
    "llama-qlora": ("tiny_llama", "qlora", "chat_jsonl", "python"),
    "qwen3-lora": ("tiny_qwen3", "lora", "prompt_completion_jsonl", "python"),
}
QUICK = ("llama-lora", "qwen3-qlora")
PARAMS = [pytest.param(name, marks=() if name in QUICK else pytest.mark.slow) for name in RUNS]
PROMPT = [{"role": "user", "content": "What is 3 plus 4?"}]


def probes(tokenizer, data: str) -> tuple[list[list[int]], list[int]]:
    """Three examples the way the run renders them (chats with the template, prompt + completion + EOS), and where
    each one's answer (the tokens the run trains) starts."""
    sums = [(3, 4), (6, 2), (0, 1)]
    if data == "chat_jsonl":
        chats = [[{"role": "user", "content": f"What is {a} plus {b}?"},
                  {"role": "assistant", "content": f"{a} plus {b} is {a + b}."}] for a, b in sums]
        ids = [list(tokenizer.apply_chat_template(c, tokenize=True, return_dict=False)) for c in chats]
        answers = [len(tokenizer.apply_chat_template(c[:1], tokenize=True, return_dict=False,
                                                     add_generation_prompt=True)) for c in chats]
        return ids, answers
    prompts = [tokenizer(f"Q: {a} plus {b}?\nA:")["input_ids"] for a, b in sums]
    ids = [p + tokenizer(f" {a + b}", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
           for p, (a, b) in zip(prompts, sums)]
    return ids, [len(p) for p in prompts]


class Runs:
    """Each run once per module, when a test first asks for it (a deselected slow run never starts)."""

    def __init__(self, request, root: Path) -> None:
        self.request, self.root, self.done = request, root, {}

    def get(self, name: str) -> SimpleNamespace:
        if name not in self.done:
            from transformers import AutoTokenizer

            checkpoint_fixture, method, data_fixture, launcher = RUNS[name]
            checkpoint = self.request.getfixturevalue(checkpoint_fixture)
            data = self.request.getfixturevalue(data_fixture)
            ids, answers = probes(AutoTokenizer.from_pretrained(checkpoint), data_fixture)
            out, record = self.root / name, self.root / f"record-{name}"
            flags = [*LORA_FLAGS, "--init-from", str(checkpoint), "--finetune", method, "--dataset", str(data)]
            done = finetune(out, flags, {"record": str(record), "probes": ids, "answers": answers}, launcher=launcher)
            assert done.returncode == 0, tail(done)
            self.done[name] = SimpleNamespace(name=name, out=out, record=record, checkpoint=checkpoint, method=method,
                                              probes=ids, flags=flags, launcher=launcher)
        return self.done[name]


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory):
    return Runs(request, tmp_path_factory.mktemp("lora-runs"))


@pytest.fixture(scope="module", params=PARAMS)
def run(request, runs):
    return runs.get(request.param)


def reference_base(run: SimpleNamespace):
    """The base a user loads the adapter onto: the checkpoint in fp32 (LoRA: the run trains an fp32 copy on the
    CPU), or (QLoRA) NF4 with double quantization and bf16 compute, the modules bitsandbytes leaves in 16 bits kept
    in bf16 as the run keeps them (no fp32 upcast: adaptive/models/finetune.py apply_method), on bitsandbytes'
    training kernel (see keep_training_kernel there: its CPU inference repacking refuses in_features 160 and rounds
    the scales to bf16)."""
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    if run.method == "lora":
        return AutoModelForCausalLM.from_pretrained(run.checkpoint, dtype=torch.float32).eval()
    import bitsandbytes as bnb

    nf4 = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                             bnb_4bit_compute_dtype=torch.bfloat16)
    base = AutoModelForCausalLM.from_pretrained(run.checkpoint, quantization_config=nf4, dtype=torch.bfloat16,
                                                device_map="cpu")
    for module in base.modules():
        if isinstance(module, bnb.nn.Linear4bit):
            module.support_avx512bf16_for_cpu = False
    return base.eval()


def logits_of(model, ids: list[list[int]]) -> list[torch.Tensor]:
    with torch.no_grad():
        return [model(input_ids=torch.tensor([x])).logits[0].float() for x in ids]


def test_the_loss_falls(run):
    train = losses(run.out)
    steps = sorted(train)
    first, last = (sum(train[s] for s in part) / len(part) for part in (steps[:4], steps[-4:]))
    got = recorded(run.record)
    print(f"{run.name}: {len(steps)} steps, train loss {first:.3f} -> {last:.3f}; probes {got['loss_before']:.3f} -> "
          f"{got['loss_after']:.3f}; {got['trainable']} trained, {got['frozen']} frozen")
    assert len(steps) == 16  # one epoch of 61 rows at micro-batch 4
    # measured falls: 0.6-0.8 nats on the train loss, the same on the probes (seeded: no run-to-run noise)
    assert last < first - 0.3
    assert got["loss_after"] < got["loss_before"] - 0.3  # the same examples' answers before and after
    assert 0 < got["trainable"] < got["frozen"] / 10  # the adapters train, the base is frozen
    if run.method == "qlora":  # every linear of the base in NF4 (7 per layer)
        assert sum(got["linear4bit"].values()) == 14, got


def test_peft_reloads_the_adapter_to_the_logits_the_run_computed(run):
    from peft import PeftConfig, PeftModel

    config = PeftConfig.from_pretrained(run.out / "adapter")
    assert (config.peft_type, config.r, config.lora_alpha) == ("LORA", 8, 16)
    base = reference_base(run)
    before = logits_of(base, run.probes)
    reloaded = logits_of(PeftModel.from_pretrained(base, run.out / "adapter").eval(), run.probes)
    ran = torch.load(run.record / "logits.pt")
    for got, expected, untrained in zip(reloaded, ran, before):
        scale = expected.abs().max()
        # the same class, weights and kernels as in the run: only a thread split of a reduction could differ
        # (measured: bitwise equal)
        assert (got - expected).abs().max() <= 1e-5 * scale
        assert (untrained - expected).abs().max() > 0.1 * scale  # the adapter is not a no-op


def test_the_merged_model_is_base_plus_adapter_and_generates(run):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    merged = AutoModelForCausalLM.from_pretrained(run.out / "hf").eval()
    saved = AutoModelForCausalLM.from_pretrained(run.checkpoint).dtype
    assert merged.dtype == saved  # fp32 Llama, bf16 Qwen3: the checkpoint's own dtype
    fp32_base = AutoModelForCausalLM.from_pretrained(run.checkpoint, dtype=torch.float32)
    exact = PeftModel.from_pretrained(fp32_base, run.out / "adapter").merge_and_unload().eval()
    weights, expected = merged.state_dict(), exact.state_dict()
    assert weights.keys() == expected.keys()
    eps = torch.finfo(saved).eps  # one rounding to the export's dtype: bf16 2^-7, fp32 2^-23, relative
    for name, value in expected.items():
        assert ((weights[name].float() - value).abs() <= eps * value.abs()).all(), name
    # the logits of the merged weights (computed in fp32) against base + adapter: bf16 rounding of the weights moves
    # them by ~0.5% of their range (measured 5e-3 relative, the same as a plain bf16 cast of the exact merge)
    tolerance = 2e-2 if saved == torch.bfloat16 else 1e-5
    for got, want in zip(logits_of(merged.float(), run.probes), logits_of(exact, run.probes)):
        assert (got - want).abs().max() <= tolerance * want.abs().max()

    merged = AutoModelForCausalLM.from_pretrained(run.out / "hf").eval()  # as saved
    tokenizer = AutoTokenizer.from_pretrained(run.out / "hf")
    assert tokenizer.chat_template == CHAT_TEMPLATE
    prompt = tokenizer.apply_chat_template(PROMPT, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = merged.generate(**prompt, max_new_tokens=8, do_sample=False)
    new = out[0, prompt["input_ids"].shape[1]:]
    print(f"{run.name}: {tokenizer.decode(new)!r}")
    assert 1 <= len(new) <= 8 and isinstance(tokenizer.decode(new, skip_special_tokens=True), str)
    if saved == torch.float32:  # the same weights to the last bit: the same greedy tokens as PEFT's model
        assert torch.equal(out, exact.generate(**prompt, max_new_tokens=8, do_sample=False))


@pytest.mark.slow
def test_a_lora_run_sigkilled_after_a_checkpoint_resumes_to_the_uninterrupted_losses(runs, tmp_path):
    baseline = runs.get("llama-lora")
    out = tmp_path / "killed"
    killed = finetune(out, baseline.flags, {"kill_after_checkpoint": 8}, launcher=baseline.launcher)
    assert killed.returncode != 0
    checkpoint = out / "checkpoints" / "step_00000008"
    assert (checkpoint / "COMPLETE.json").is_file() and not (out / "checkpoints" / "step_00000012").exists()
    # the checkpoint holds the adapters (and their optimizer states), not the frozen base
    [states] = checkpoint.glob("*/mp_rank_00_model_states.pt")
    module = torch.load(states, map_location="cpu", weights_only=False)["module"]
    assert module and all(".lora_A." in k or ".lora_B." in k for k in module), sorted(module)[:4]
    assert losses(out) == {s: v for s, v in losses(baseline.out).items() if s <= 8}

    resumed = finetune(out, [*baseline.flags, "--resume"], launcher=baseline.launcher)
    assert resumed.returncode == 0, tail(resumed)
    log = resumed.stdout + resumed.stderr
    assert "resumed from" in log and "ignored: the checkpoint resumed" not in log  # the base is --init-from's
    assert losses(out) == losses(baseline.out)  # bitwise: == on the floats metrics.jsonl holds
    # the end-of-run summary counts this launch's wall time and speed, and says so; the first launch's steps count too
    end = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
    assert end["kind"] == "end" and (end["launches"], end["first_step"], end["train_steps"]) == (2, 8, end["step"] - 8)
    assert end["train_seconds_total"] > end["train_seconds"] > 0 and end["tokens_per_s"] > 0
    assert (end["adapter"], end["finetune"]) == (str(out / "adapter"), "lora")
    for line in ("(this launch; resumed at step 8)", f"adapter     {out / 'adapter'}", f"HF model    {out / 'hf'}",
                 "'content': 'Hello!'}], max_new_tokens=20)[0]['generated_text'][-1]['content']"):
        assert line in log, log[-3000:]
    ours, theirs = (load_file(run / "adapter" / "adapter_model.safetensors") for run in (out, baseline.out))
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
