"""A fine-tune's step loss is the mean over the step's answer tokens, however the step is split into micro-batches
(transformers' Trainer's `num_items_in_batch`): one micro-batch of 4 chats and 4 accumulated micro-batches of one
chat each give the same losses. The chats' answers differ in length, so the mean of each micro-batch's own mean
(what a pretraining step takes, its blocks holding equal counts) differs by ~1e-4 (measured 1.4e-4, against 1.3e-7
with the step's token mean)."""

from __future__ import annotations

import pytest

from tests.train._launch import tail
from tests.train.finetune._run import LORA_FLAGS, finetune, losses

pytestmark = pytest.mark.slow  # two fine-tunes


def test_one_micro_batch_of_four_and_four_of_one_train_alike(tiny_llama, chat_jsonl, tmp_path):
    flags = [*LORA_FLAGS, "--init-from", str(tiny_llama), "--dataset", str(chat_jsonl), "--max-steps", "3"]
    whole, split = tmp_path / "mb4x1", tmp_path / "mb1x4"
    for out, micro, accum in ((whole, "4", "1"), (split, "1", "4")):
        done = finetune(out, [*flags, "--micro-batch", micro, "--grad-accum", accum])
        assert done.returncode == 0, tail(done)
    ours, theirs = losses(whole), losses(split)
    assert ours.keys() == theirs.keys() == {1, 2, 3}
    worst = max(abs(ours[s] - theirs[s]) / ours[s] for s in ours)
    print(f"losses {ours} vs {theirs}: worst relative gap {worst:.1e}")
    assert worst <= 1e-5
