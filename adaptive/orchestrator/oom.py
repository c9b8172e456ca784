"""The runtime OOM ladder: the planner's playbook, one rung per out-of-memory error.

On an out-of-memory error in a step (CUDA's, or any `torch.OutOfMemoryError`), `on_oom` picks the
next rung and asks the loop to redo the step (`control.retry_step`). The loop frees memory
(garbage collection, `torch.cuda.empty_cache`), discards the step's partial gradients and reruns
the same optimizer step on the same samples, so no sample is lost or repeated:

    1. micro-batch > 1: halve it (the largest divisor <= half) and raise gradient accumulation by the
       same factor: micro-batch x accumulation, hence the global batch, is unchanged;
    2. micro-batch 1: turn on activation checkpointing;
    3. checkpointing already on: a shorter sequence. The loop cannot change the sequence while
       training (the data are blocks of seq_len tokens, and tokens per step would change), so this
       rung is a restart: when `min_seq_len` allows a shorter sequence (3/4 of it, then 1/2, never
       below min_seq_len) the policy writes it into the run's plan.json under
       "orchestrator_restart" and lets the error end the run; restart with that --seq-len. That
       restart begins at step 0: `--resume` refuses a checkpoint of another seq_len (the data blocks
       and the tokens per step would change), and the recipes do not read the key themselves. Without
       `min_seq_len` the ladder ends at rung 2 and the error propagates.

The loop writes the knobs in force to plan.json and ds_config.json after each change; with
`checkpoint_after_change` the policy also asks for a checkpoint once the retried step completes,
so `--resume` starts from the working settings. A multi-process retry needs every rank to run out
of memory at the same micro-batch (see adaptive/train/loop.py); the change is the same on every
rank because it follows from the knobs alone.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from adaptive.orchestrator.callbacks import Callback, Control, Knobs, TrainerState
from adaptive.orchestrator.events import EventLog

RESTART_KEY = "orchestrator_restart"


@dataclass(frozen=True)
class OOMConfig:
    checkpointing: bool = True  # rung 2 allowed
    min_seq_len: int | None = None  # rung 3 (a restart) allowed down to this sequence length
    checkpoint_after_change: bool = True
    max_retries: int = 4  # per step


def next_rung(knobs: Knobs, config: OOMConfig) -> tuple[str, dict[str, Any]] | None:
    """(action, runtime knob changes) of the next live rung, or None when none is left."""
    micro = knobs.micro_batch_size
    if micro > 1:
        smaller = max(d for d in range(1, micro // 2 + 1) if micro % d == 0)
        accum = knobs.gradient_accumulation_steps * (micro // smaller)
        return "halve_micro_batch", {"micro_batch_size": smaller, "gradient_accumulation_steps": accum}
    if config.checkpointing and not knobs.gradient_checkpointing:
        return "enable_checkpointing", {"gradient_checkpointing": True}
    return None


def shorter_seq_len(seq_len: int, min_seq_len: int | None) -> int | None:
    """3/4 of the sequence, then 1/2 (the planner's ladder), never below min_seq_len."""
    if min_seq_len is None:
        return None
    for fraction in (0.75, 0.5):
        candidate = max(int(seq_len * fraction), min_seq_len)
        if candidate < seq_len:
            return candidate
    return None


class OOMPolicy(Callback):
    name = "oom"

    def __init__(self, events: EventLog, config: OOMConfig | None = None) -> None:
        self.config = config or OOMConfig()
        self.events = events
        self.changes: list[dict[str, Any]] = []
        self._checkpoint_next = False

    def on_oom(self, state: TrainerState, control: Control, *, error: BaseException) -> None:
        knobs = state.knobs
        signals = {"error": f"{type(error).__name__}: {str(error)[:200]}", "micro_step": state.micro_step,
                   "attempt": state.attempt}
        before = {k: getattr(knobs, k) for k in Knobs.RUNTIME}
        if state.attempt >= self.config.max_retries:
            self.events.record(state.step + 1, self.name, "give_up", f"{state.attempt} retries of this step",
                               signals=signals, before=before, after=before)
            return
        rung = next_rung(knobs, self.config)
        if rung is not None:
            action, changes = rung
            control.change_knobs = dict(changes)
            control.retry_step = True
            after = {**before, **changes}
            self.changes.append({"step": state.step + 1, "action": action, "after": after})
            self.events.record(state.step + 1, self.name, action, "out of memory; redoing the step on the same "
                               "samples", signals=signals, before=before, after=after)
            self._checkpoint_next = self.config.checkpoint_after_change
            return
        seq = shorter_seq_len(knobs.seq_len, self.config.min_seq_len)
        if seq is None:
            self.events.record(state.step + 1, self.name, "exhausted", "out of memory at micro-batch 1 with "
                               "checkpointing; no shorter sequence allowed (min_seq_len)", signals=signals,
                               before=before, after=before)
            return
        self._write_restart(state, seq, signals)
        self.events.record(state.step + 1, self.name, "restart_shorter_seq", "out of memory at micro-batch 1 with "
                           "checkpointing; the sequence cannot change while training: restart with the new "
                           "seq_len", signals=signals, before={**before, "seq_len": knobs.seq_len},
                           after={**before, "seq_len": seq})

    def on_step_end(self, state: TrainerState, control: Control, *, metrics: dict[str, Any] | None) -> None:
        if self._checkpoint_next:  # the retried step completed with the new knobs
            self._checkpoint_next = False
            control.should_checkpoint = True

    def _write_restart(self, state: TrainerState, seq_len: int, signals: dict[str, Any]) -> None:
        if not state.is_main_process or state.output_dir is None:
            return
        path = state.output_dir / "plan.json"
        plan = json.loads(path.read_text(encoding="utf-8")) if path.exists() else {}
        plan[RESTART_KEY] = {"seq_len": seq_len, "knobs": state.knobs.as_dict(), "step": state.step,
                             "reason": signals["error"]}
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(plan, indent=2) + "\n", encoding="utf-8")
        tmp.replace(path)

    def summary(self) -> dict[str, Any]:
        return {"changes": self.changes}


__all__ = ["OOMConfig", "OOMPolicy", "RESTART_KEY", "next_rung", "shorter_seq_len"]
