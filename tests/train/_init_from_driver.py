"""A recipe run that also records transformers' own loss on its first batch (the reference for --init-from):

    accelerate launch --use_deepspeed --num_processes 1 tests/train/_init_from_driver.py PRESET ARCH OUT -- FLAGS

Writes OUT: {"ours": the run's first micro-batch loss, "reference": AutoModelForCausalLM.from_pretrained(--init-from)'s
loss on that batch}. Without --init-from in FLAGS, records nothing.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from adaptive.recipe import main
from adaptive.train.run.callbacks import Callback


class ReferenceLoss(Callback):
    def __init__(self, init_from: str, out: str) -> None:
        self.init_from, self.out = init_from, Path(out)

    def on_backward_end(self, state, control, *, outputs, loss, batch):
        if state.step or state.micro_step or self.out.exists():
            return
        from transformers import AutoModelForCausalLM

        reference = AutoModelForCausalLM.from_pretrained(self.init_from, dtype=torch.float32).eval()
        inputs = {k: v.cpu() for k, v in batch.items() if k in ("input_ids", "labels", "attention_mask")}
        with torch.no_grad():
            expected = reference(**inputs).loss.item()
        self.out.write_text(json.dumps({"ours": float(loss), "reference": expected}))


if __name__ == "__main__":
    preset, arch, out = sys.argv[1:4]
    flags = sys.argv[5:]
    init_from = flags[flags.index("--init-from") + 1] if "--init-from" in flags else None
    callbacks = [ReferenceLoss(init_from, out)] if init_from else []
    raise SystemExit(main(preset, arch, flags, callbacks=callbacks))
