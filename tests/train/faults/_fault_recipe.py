"""The debug dense recipe with one fault on one rank, on the first start only (a restarted worker runs clean):

    FAULT='{"rank": 1, "step": 5, "fault": "sigkill"}' torchrun --nproc_per_node 2 tests/train/faults/_fault_recipe.py FLAGS
    FAULT=... adaptive launch tests/train/faults/_fault_recipe.py --gpus 2 --max-restarts 1 FLAGS

FAULT (the environment: `adaptive launch` hands the recipe its own flags only) is JSON
{"rank": 1, "step": 3, "fault": F, "mark": PATH}, F one of:
- "sigkill": SIGKILL to itself after the backward of step `step` (mid-step: before the optimizer);
- "sigstop": SIGSTOP to itself there (a hang: the process is alive and silent);
- "unreadable": step `step`'s data read fails the way an unreadable file does (PermissionError), before the step
  (a test-only trigger: the shipped corpus is tokenized once up front, so no file is read while training);
- "sigkill_in_checkpoint": SIGKILL as soon as this rank has written its own files of checkpoint `step` (the model
  and optimizer shards and data_state_<rank>.json), before the main process could mark it complete.
"mark" (optional): a file the time of the fault is written to, just before it.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import time
from pathlib import Path

from adaptive.recipe import Recipe
from adaptive.train.run.callbacks import Callback
from adaptive.train.run.restart import restart_count


recipe = Recipe(model="debug", arch="dense")


class Fault(Callback):
    def __init__(self, spec: dict) -> None:
        self.step, self.fault, self.mark = spec["step"], spec["fault"], spec.get("mark")

    def on_step_start(self, state, control):
        if self.fault == "unreadable" and state.step + 1 == self.step:
            _mark(self.mark)
            raise PermissionError(errno.EACCES, "Permission denied", "shard-00001.jsonl")

    def on_backward_end(self, state, control, *, outputs, loss, batch):
        if state.step + 1 == self.step and self.fault in ("sigkill", "sigstop"):
            _mark(self.mark)
            os.kill(os.getpid(), signal.SIGKILL if self.fault == "sigkill" else signal.SIGSTOP)


def _mark(path: str | None) -> None:
    if path:
        Path(path).write_text(repr(time.time()))


def kill_inside_checkpoint(step: int, rank: int) -> None:
    """SIGKILL right after this rank writes data_state_<rank>.json into checkpoint `step`'s temporary folder."""
    from adaptive.train.run_folder import checkpoint

    write = checkpoint.atomic_write_text
    target = (f".tmp-{checkpoint.checkpoint_name(step)}", checkpoint.data_state_file(rank))

    def writing(path, text):
        write(path, text)
        if (path.parent.name, path.name) == target:
            os.kill(os.getpid(), signal.SIGKILL)

    checkpoint.atomic_write_text = writing


def main_with_fault(declared: Recipe) -> int:
    """Run `declared` with the FAULT of the environment armed on its rank, on the first start only."""
    spec = json.loads(os.environ.get("FAULT", "null"))
    callbacks = []
    if spec and restart_count() == 0 and int(os.environ.get("RANK", "0")) == spec["rank"]:
        if spec["fault"] == "sigkill_in_checkpoint":
            kill_inside_checkpoint(spec["step"], spec["rank"])
        else:
            callbacks.append(Fault(spec))
    return declared.main(callbacks=callbacks)


if __name__ == "__main__":
    raise SystemExit(main_with_fault(recipe))
