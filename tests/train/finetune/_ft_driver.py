"""recipes/finetune.py with test callbacks, run as a user runs it (python, accelerate launch or torchrun):

    python tests/train/finetune/_ft_driver.py SPEC -- FLAGS

SPEC is JSON {"record": DIR, "probes": [[token ids], ...], "answers": [index, ...], "kill_after_checkpoint": N}
(each optional; "answers": where each probe's answer starts, the tokens the loss is on). With
"record", the main process writes DIR/run.json at the end of the run (after its final checkpoint, eval and export):
the optimizer classes from DeepSpeed's engine inwards, the dtypes of the optimizer's state tensors with their
counts, and the trainable / frozen parameter counts. With "probes" too, it writes DIR/logits.pt (each probe's logits
from the trained model, in eval mode without grad, as the run computes its eval: the model the engine holds, LoRA
unmerged) and the mean next-token loss over the probes' answers before the first step and after the last (one process only:
under ZeRO-3 a forward on one rank alone would wait for the others).
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path

import torch

from adaptive.recipe import Recipe
from adaptive.train.run.callbacks import Callback
from tests.train._driver import KillAfterCheckpoint

recipe = Recipe(finetune="lora")


class RecordTrained(Callback):
    def __init__(self, out_dir: str, probes: list[list[int]] | None, answers: list[int] | None) -> None:
        self.out_dir, self.probes, self.answers = Path(out_dir), probes, answers or [1] * len(probes or [])
        self.loss_before: float | None = None

    def _logits(self, state) -> list[torch.Tensor]:
        model = state.accelerator.unwrap_model(state.model)
        model.eval()
        with torch.no_grad():
            logits = [model(input_ids=torch.tensor([ids])).logits[0].float() for ids in self.probes]
        model.train()
        return logits

    def _loss(self, logits: list[torch.Tensor]) -> float:
        # position i predicts token i + 1: the answer's tokens k.. are predicted from k - 1 on
        return float(torch.stack([torch.nn.functional.cross_entropy(out[k - 1:-1], torch.tensor(ids[k:]))
                                  for out, ids, k in zip(logits, self.probes, self.answers)]).mean())

    def on_train_start(self, state, control):
        if self.probes and state.is_main_process:
            self.loss_before = self._loss(self._logits(state))

    def on_train_end(self, state, control):
        if not state.is_main_process:
            return
        self.out_dir.mkdir(parents=True, exist_ok=True)
        record = {}
        if self.probes:
            logits = self._logits(state)
            torch.save(logits, self.out_dir / "logits.pt")
            record.update(loss_before=self.loss_before, loss_after=self._loss(logits))
        chain, optimizer = [], state.model.optimizer
        while optimizer is not None:  # DeepSpeed's ZeRO optimizer (if any), then the client optimizer it steps
            chain.append(f"{type(optimizer).__module__}.{type(optimizer).__qualname__}")
            inner, optimizer = optimizer, getattr(optimizer, "optimizer", None)
        dtypes = Counter(str(v.dtype) for s in inner.state.values() for v in s.values()
                         if torch.is_tensor(v) and v.numel() > 1)  # the moments, not the step counters
        params = list(state.accelerator.unwrap_model(state.model).parameters())
        numel = [(getattr(p, "ds_numel", p.numel()), p.requires_grad) for p in params]  # ZeRO-3: the whole size
        import bitsandbytes as bnb

        model = state.accelerator.unwrap_model(state.model)
        nf4 = Counter(str(m.weight.dtype) for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)
                      and m.weight.quant_state is not None)  # the 4-bit base: its packed codes' storage dtype
        record.update(optimizer=chain, state_dtypes=dict(dtypes), trainable=sum(n for n, grad in numel if grad),
                      frozen=sum(n for n, grad in numel if not grad), linear4bit=dict(nf4))
        (self.out_dir / "run.json").write_text(json.dumps(record))


if __name__ == "__main__":
    spec = json.loads(sys.argv[1])
    flags = sys.argv[3:] if sys.argv[2:3] == ["--"] else sys.argv[2:]
    callbacks = []
    if "record" in spec:
        callbacks.append(RecordTrained(spec["record"], spec.get("probes"), spec.get("answers")))
    if "kill_after_checkpoint" in spec:
        callbacks.append(KillAfterCheckpoint(spec["kill_after_checkpoint"]))
    raise SystemExit(recipe.main(flags, callbacks=callbacks))
