"""The slice of accelerate's Accelerator that the checkpoint protocol calls, without DeepSpeed: one
process whose save_state writes two files like accelerate would, or dies halfway (a crash, or an OSError
such as a full disk)."""

from __future__ import annotations

import os


class FakeAccelerator:
    is_main_process = is_local_main_process = True
    num_processes = 1

    def __init__(self, crash_after_first_file: bool = False, error: OSError | None = None) -> None:
        self.crash, self.error = crash_after_first_file, error

    def wait_for_everyone(self) -> None:
        pass

    def save_state(self, path: str) -> None:
        os.makedirs(os.path.join(path, "pytorch_model"), exist_ok=True)
        with open(os.path.join(path, "pytorch_model", "mp_rank_00_model_states.pt"), "wb") as f:
            f.write(b"weights" * 100)
        if self.crash:
            raise KeyboardInterrupt("killed while saving")
        if self.error:
            raise self.error
        with open(os.path.join(path, "scheduler.bin"), "wb") as f:
            f.write(b"schedule")
