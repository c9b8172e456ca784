"""The fine-tune recipe with test callbacks, run under `accelerate launch` like recipes/finetune.py:

    accelerate launch --use_deepspeed --num_processes 1 tests/train/finetune_extras/_driver.py SPEC -- FLAGS

FLAGS are recipes/finetune.py's (--init-from, --finetune, ...). SPEC is JSON, each key optional:
- "record": DIR, every callback event with the step, a hash of the trainable parameters and the checkpointing policy
  in force (tests/orchestrator/_driver.py's recorder, for transformers' classes under PEFT);
- "oom_at": [steps], "nan_at": [steps]: tests/orchestrator/_driver.py's fault injectors (an OOM after micro-batch 1
  on a step's first try; NaN logits from the LM head, once per step);
- "swap_files": DIR, the NVMe folder whose files (DeepSpeed's swap files) are listed with their sizes at every step
  end, written to RECORD/swap_files.json (they are gone once the engine is freed).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

from adaptive.models.checkpointing import checkpointing_policy
from adaptive.recipe import Recipe
from adaptive.train.run.callbacks import Callback
from tests.orchestrator._driver import InjectOOMAt, PoisonLoss
from tests.train._driver import Recorder


def trainable_hash(state) -> str:
    """A hash of the trained parameters (under ZeRO-3 each is gathered: `ds_tensor` is this rank's partition)."""
    digest = hashlib.sha1()
    for name, p in state.model.module.named_parameters():
        if p.requires_grad:
            tensor = p.ds_tensor if hasattr(p, "ds_tensor") else p
            digest.update(name.encode() + tensor.detach().float().cpu().numpy().tobytes())
    return digest.hexdigest()[:16]


class FinetuneRecorder(Recorder):
    def on_backward_end(self, state, control, *, outputs, loss, batch):  # transformers' output: no router_stats
        self._add(state, "on_backward_end", loss=float(loss), shape=list(batch["input_ids"].shape),
                  tokens=batch["input_ids"].flatten().tolist())

    def on_step_start(self, state, control):
        self._add(state, "on_step_start", samples_seen=state.samples_seen, params=trainable_hash(state),
                  param_lr=state.optimizer.param_groups[0]["lr"], scheduled_lr=state.scheduler.get_last_lr()[0],
                  knobs=state.knobs.as_dict())

    def on_checkpoint(self, state, control, *, path):
        self._add(state, "on_checkpoint", path=str(path), params=trainable_hash(state))

    def on_step_end(self, state, control, *, metrics):
        super().on_step_end(state, control, metrics=metrics)
        self.events[-1].update(params=trainable_hash(state), last_skip=state.last_skip,
                               policy_in_model=checkpointing_policy(state.accelerator.unwrap_model(state.model)))


class SwapFiles(Callback):
    """The files under the NVMe folder (kind: the folder under zero_stage_3, e.g. float32params, optimizer) at each
    step end."""

    def __init__(self, root: str, out_dir: str) -> None:
        self.root, self.out_dir, self.seen = Path(root), Path(out_dir), []

    def on_step_end(self, state, control, *, metrics):
        files = {}
        for dirpath, _, names in os.walk(self.root):
            for name in names:
                path = Path(dirpath) / name
                files[str(path.relative_to(self.root))] = path.stat().st_size
        self.seen.append({"step": state.step, "files": files})

    def on_train_end(self, state, control):
        self.out_dir.mkdir(parents=True, exist_ok=True)
        (self.out_dir / "swap_files.json").write_text(json.dumps(self.seen))


def callbacks_from(spec: dict) -> list[Callback]:
    out: list[Callback] = []
    if "record" in spec:
        out.append(FinetuneRecorder(spec["record"]))
    if "oom_at" in spec:
        out.append(InjectOOMAt(spec["oom_at"]))
    if "nan_at" in spec:
        out.append(PoisonLoss(spec["nan_at"]))
    if "swap_files" in spec:
        out.append(SwapFiles(spec["swap_files"], spec.get("record", spec["swap_files"])))
    return out


if __name__ == "__main__":
    spec = json.loads(sys.argv[1])
    flags = sys.argv[3:] if len(sys.argv) > 2 and sys.argv[2] == "--" else sys.argv[2:]
    raise SystemExit(Recipe(finetune="lora").main(flags, callbacks=callbacks_from(spec)))
