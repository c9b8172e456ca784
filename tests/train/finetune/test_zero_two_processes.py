"""LoRA under ZeRO-2 and ZeRO-3, and QLoRA under ZeRO-3, on two processes (torchrun, gloo) train as one process
does: the same global batch of 8 examples a step, the same per-step losses, the same adapter.

The global batch is split so that nothing but the order of sums differs: one example per micro-batch (the step's loss
is the mean over all its trained tokens however it is grouped, test_step_loss.py; one example each keeps the sums'
order closest), one process accumulating 8 of them, two processes 4 each. Rank r's sample i is global sample 2i + r
(adaptive/train/data/order.py), so a step's 8 examples are the same on one process and on two. What differs is
the order in which fp32 gradients are summed (accumulation, then gloo's all-reduce or reduce-scatter over the
ranks) and the loss is averaged: rounding of ~1e-7 relative, which Adam's steps carry into the weights.

The tolerances (measured on this CPU in brackets): LoRA losses within 1e-6 relative (<= 2e-8), QLoRA's within 1e-4
(3e-6): its base computes in bf16, where a weight that differs in its last fp32 bits can round an activation the
other way (2^-8). A one-example change of the batch moves the loss by ~1e-2, far outside either. Each adapter
matrix within 1e-4 of its norm for LoRA (3e-6), 1e-2 for QLoRA (8e-4): Adam divides each element's step by that
element's own gradient scale, so an element whose gradient is near zero moves by up to the LR on rounding alone.
"""

from __future__ import annotations

import math

import pytest
import torch
from safetensors.torch import load_file

from tests.train._launch import tail
from tests.train.finetune._run import LORA_FLAGS, finetune, losses, recorded

pytestmark = pytest.mark.slow  # torchrun runs of two processes

STEPS = ["--micro-batch", "1", "--max-steps", "4"]


def one_and_two_processes(root, name, flags, zeros):
    """The one-process run (ZeRO-0) and a two-process run per ZeRO stage, each recorded."""
    single = finetune(root / f"{name}-1", [*flags, *STEPS, "--grad-accum", "8"])
    assert single.returncode == 0, tail(single)
    runs = {}
    for zero in zeros:
        out = root / f"{name}-2-zero{zero}"
        done = finetune(out, [*flags, *STEPS, "--grad-accum", "4", "--zero", str(zero)],
                        {"record": str(root / f"record-{name}-{zero}")}, launcher="torchrun", nproc=2)
        assert done.returncode == 0, tail(done)
        runs[zero] = out
    return root / f"{name}-1", runs


def assert_same_adapter(single, double, rel):
    ours, theirs = (load_file(out / "adapter" / "adapter_model.safetensors") for out in (single, double))
    assert ours.keys() == theirs.keys()
    worst = max(float((theirs[k] - ours[k]).norm() / ours[k].norm()) for k in ours)
    print(f"{double.name}: adapter matrices within {worst:.1e} of their norm")
    assert worst <= rel


def assert_same_losses(single, double, rel):
    ours, theirs = losses(single), losses(double)
    assert ours.keys() == theirs.keys() == {1, 2, 3, 4}
    worst = max(abs(ours[s] - theirs[s]) / ours[s] for s in ours)
    print(f"{double.name}: losses {[round(theirs[s], 6) for s in sorted(theirs)]}, worst relative gap {worst:.1e}")
    assert all(math.isclose(ours[s], theirs[s], rel_tol=rel) for s in ours), (ours, theirs)


def test_lora_under_zero_2_and_3_on_two_processes_trains_as_one_process(tmp_path, tiny_llama, chat_jsonl):
    flags = [*LORA_FLAGS, "--init-from", str(tiny_llama), "--dataset", str(chat_jsonl)]
    single, runs = one_and_two_processes(tmp_path, "lora", flags, (2, 3))
    for zero, out in runs.items():
        assert_same_losses(single, out, 1e-6)
        assert_same_adapter(single, out, 1e-4)  # under ZeRO-3 the export gathered each one from its partitions
        assert recorded(tmp_path / f"record-lora-{zero}")["trainable"] == 17920  # the whole adapters, either stage
        assert (out / "hf" / "model.safetensors").is_file()


def test_qlora_under_zero_3_on_two_processes_trains_as_one_process(tmp_path, tiny_llama, chat_jsonl):
    from transformers import AutoModelForCausalLM

    flags = [*LORA_FLAGS, "--init-from", str(tiny_llama), "--dataset", str(chat_jsonl), "--finetune", "qlora"]
    single, runs = one_and_two_processes(tmp_path, "qlora", flags, (3,))
    assert_same_losses(single, runs[3], 1e-4)
    got = recorded(tmp_path / "record-qlora-3")
    # every linear of the base in NF4, its packed codes stored as bf16 (the compute dtype: what ZeRO-3 partitions)
    assert got["linear4bit"] == {"torch.bfloat16": 14}, got
    assert_same_adapter(single, runs[3], 1e-2)
    merged = AutoModelForCausalLM.from_pretrained(runs[3] / "hf")  # merged into the 16-bit base
    assert merged.dtype == torch.float32 and type(merged).__name__ == "LlamaForCausalLM"
