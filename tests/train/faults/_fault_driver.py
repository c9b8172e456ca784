"""The debug recipe with one fault on one rank, on the first start only (a restarted worker runs clean):

    torchrun --nproc_per_node 2 tests/train/faults/_fault_driver.py PRESET ARCH SPEC -- FLAGS

SPEC is JSON {"rank": 1, "step": 3, "fault": F}, F one of:
- "sigkill": SIGKILL to itself after the backward of step `step` (mid-step: before the optimizer);
- "sigstop": SIGSTOP to itself there (a hang: the process is alive and silent);
- "unreadable": step `step`'s data read fails the way an unreadable file does (PermissionError), before the step
  (a test-only trigger: the shipped corpus is tokenized once up front, so no file is read while training);
- "sigkill_in_checkpoint": SIGKILL as soon as this rank has written its own files of checkpoint `step` (the model
  and optimizer shards and data_state_<rank>.json), before the main process could mark it complete.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import sys

from adaptive.recipe import main
from adaptive.train.run.callbacks import Callback
from adaptive.train.run.restart import restart_count


class Fault(Callback):
    def __init__(self, spec: dict) -> None:
        self.step, self.fault = spec["step"], spec["fault"]

    def on_step_start(self, state, control):
        if self.fault == "unreadable" and state.step + 1 == self.step:
            raise PermissionError(errno.EACCES, "Permission denied", "shard-00001.jsonl")

    def on_backward_end(self, state, control, *, outputs, loss, batch):
        if state.step + 1 == self.step and self.fault in ("sigkill", "sigstop"):
            os.kill(os.getpid(), signal.SIGKILL if self.fault == "sigkill" else signal.SIGSTOP)


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


if __name__ == "__main__":
    preset, arch, spec = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    callbacks = []
    if restart_count() == 0 and int(os.environ.get("RANK", "0")) == spec["rank"]:
        if spec["fault"] == "sigkill_in_checkpoint":
            kill_inside_checkpoint(spec["step"], spec["rank"])
        else:
            callbacks.append(Fault(spec))
    raise SystemExit(main(preset, arch, sys.argv[5:], callbacks))
