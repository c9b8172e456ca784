"""A recipe with test callbacks, run by the tests under `accelerate launch` like a real recipe:

    accelerate launch --use_deepspeed --num_processes 1 tests/train/_driver.py PRESET ARCH SPEC -- FLAGS

SPEC is JSON: {"kill_after_checkpoint": 10, "record": "DIR", "skip_at": 3, "oom_at": 5, "halve_on_oom": true,
"rollback_at": 8, "lr_scale_at": [6, 0.5], "touch_at": {"2": "EXPORT"}, "sigterm_at": 5, "nan_weights_at": 3}
(each optional). Steps are 1-based optimizer steps.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import sys
from pathlib import Path

import torch

from adaptive.train.run.callbacks import Callback
from adaptive.recipe import main


class KillAfterCheckpoint(Callback):
    """SIGKILL this process right after checkpoint `step` is complete: a crash, nothing flushed."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_checkpoint(self, state, control, *, path):
        if state.step == self.step:
            os.kill(os.getpid(), signal.SIGKILL)


class Recorder(Callback):
    """Every event in order, with the step, micro-step and what a test needs to check; one JSON per rank."""

    def __init__(self, out_dir: str) -> None:
        self.out_dir = Path(out_dir)
        self.events: list[dict] = []

    def _add(self, state, event, **extra):
        self.events.append({"event": event, "step": state.step, "micro_step": state.micro_step,
                            "attempt": state.attempt, **extra})

    def on_train_start(self, state, control):
        self._add(state, "on_train_start", max_steps=state.max_steps, knobs=state.knobs.as_dict(),
                  has=[name for name in ("model", "optimizer", "scheduler", "accelerator", "plan")
                       if getattr(state, name) is not None])

    def on_step_start(self, state, control):
        self._add(state, "on_step_start", samples_seen=state.samples_seen)

    def on_backward_end(self, state, control, *, outputs, loss, batch):
        rows = [hashlib.sha1(r.cpu().numpy().tobytes()).hexdigest()[:12] for r in batch["input_ids"]]
        self._add(state, "on_backward_end", loss=float(loss), rows=rows,
                  router_stats=outputs.router_stats is not None)

    def on_optimizer_step(self, state, control):
        self._add(state, "on_optimizer_step", params_sum=_param_sum(state))

    def on_step_end(self, state, control, *, metrics):
        self._add(state, "on_step_end", logged=metrics is not None, lr=state.scheduler.get_last_lr()[0],
                  param_lr=state.optimizer.param_groups[0]["lr"], params_sum=_param_sum(state),
                  skipped=state.skipped_steps, samples_seen=state.samples_seen, knobs=state.knobs.as_dict())

    def on_eval(self, state, control, *, metrics):
        self._add(state, "on_eval", eval_loss=metrics["eval_loss"])

    def on_checkpoint(self, state, control, *, path):
        self._add(state, "on_checkpoint", path=str(path))

    def on_oom(self, state, control, *, error):
        self._add(state, "on_oom", error=type(error).__name__)

    def on_train_end(self, state, control):
        self._add(state, "on_train_end")
        rank = state.accelerator.process_index
        self.out_dir.mkdir(parents=True, exist_ok=True)
        (self.out_dir / f"events_rank{rank}.json").write_text(json.dumps(self.events))


def _param_sum(state) -> float:
    return float(sum(p.detach().double().sum() for p in state.model.module.parameters()))


class SkipAt(Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_backward_end(self, state, control, *, outputs, loss, batch):
        if state.step + 1 == self.step:
            control.skip_step = True


class InjectOOM(Callback):
    """Raise torch.OutOfMemoryError after micro-batch 1 of step `step`, on its first try only."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_backward_end(self, state, control, *, outputs, loss, batch):
        if state.step + 1 == self.step and state.micro_step == 1 and state.attempt == 0:
            raise torch.OutOfMemoryError("injected by the test")


class HalveOnOOM(Callback):
    """The OOM playbook's first rung: half the micro-batch, twice the accumulation, same step."""

    def on_oom(self, state, control, *, error):
        k = state.knobs
        control.change_knobs = {"micro_batch_size": k.micro_batch_size // 2,
                                "gradient_accumulation_steps": k.gradient_accumulation_steps * 2}
        control.retry_step = True


class RollbackAt(Callback):
    def __init__(self, step: int) -> None:
        self.step, self.done = step, False

    def on_step_end(self, state, control, *, metrics):
        if state.step == self.step and not self.done:
            self.done = True
            control.rollback_to_checkpoint = True


class LrScaleAt(Callback):
    def __init__(self, step: int, scale: float) -> None:
        self.step, self.scale = step, scale

    def on_step_end(self, state, control, *, metrics):
        if state.step == self.step:
            control.lr_scale = self.scale


class TouchAt(Callback):
    """Create <output-dir>/NAME after step `step`, as a user would with `touch`."""

    def __init__(self, step: int, name: str) -> None:
        self.step, self.name = step, name

    def on_step_end(self, state, control, *, metrics):
        if state.step == self.step and state.is_main_process:
            (state.output_dir / self.name).touch()


class SigtermAt(Callback):
    """SIGTERM this process after step `step`, as a scheduler does before preemption."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, state, control, *, metrics):
        if state.step == self.step:
            os.kill(os.getpid(), signal.SIGTERM)


class NanWeightsAt(Callback):
    """After the update of step `step`, one weight becomes NaN (what a diverged update leaves)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_optimizer_step(self, state, control):
        if state.step + 1 == self.step:
            with torch.no_grad():
                next(state.model.module.parameters()).view(-1)[0] = float("nan")


def callbacks_from(spec: dict) -> list[Callback]:
    out: list[Callback] = []
    if "record" in spec:
        out.append(Recorder(spec["record"]))
    if "skip_at" in spec:
        out.append(SkipAt(spec["skip_at"]))
    if "oom_at" in spec:
        out.append(InjectOOM(spec["oom_at"]))
    if spec.get("halve_on_oom"):
        out.append(HalveOnOOM())
    if "rollback_at" in spec:
        out.append(RollbackAt(spec["rollback_at"]))
    if "lr_scale_at" in spec:
        out.append(LrScaleAt(*spec["lr_scale_at"]))
    for step, name in spec.get("touch_at", {}).items():
        out.append(TouchAt(int(step), name))
    if "sigterm_at" in spec:
        out.append(SigtermAt(spec["sigterm_at"]))
    if "nan_weights_at" in spec:
        out.append(NanWeightsAt(spec["nan_weights_at"]))
    if "kill_after_checkpoint" in spec:
        out.append(KillAfterCheckpoint(spec["kill_after_checkpoint"]))
    return out


if __name__ == "__main__":
    preset, arch, spec = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    flags = sys.argv[5:] if len(sys.argv) > 4 and sys.argv[4] == "--" else sys.argv[4:]
    raise SystemExit(main(preset, arch, flags, callbacks=callbacks_from(spec)))
