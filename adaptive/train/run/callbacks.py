"""The training loop's contract: the callback events, the state callbacks read, the requests they make.

The loop owns this contract; the orchestrator's policies (`adaptive.orchestrator`) are plugins that
implement, by name, the events they need, and import nothing from `adaptive.train`. A callback may
subclass `Callback` (no-op events) or implement only some events: `CallbackList` calls what exists.

The loop (`adaptive.train.run.loop.train`) calls these events, in this order:

    on_train_start
    for each optimizer step:
        on_step_start
        for each micro-batch:  forward, backward, on_backward_end(outputs, loss, batch)
        on_optimizer_step                (only when the optimizer step was applied)
        on_step_end(metrics)             (metrics: the logged dict on log steps, else None)
        on_eval(metrics)                 (when this step evaluated)
        on_checkpoint(path)              (when this step wrote a checkpoint)
    on_train_end

    on_oom(error)   when a step raises an out-of-memory error (CUDA's, or any
                    torch.OutOfMemoryError). Set control.retry_step, usually with change_knobs
                    {"micro_batch_size": m // 2, "gradient_accumulation_steps": 2 * a} (or a seq_len
                    that cuts each block into more pieces, with the accumulation to match), and the
                    loop frees memory, discards the step's partial gradients and redoes the same
                    optimizer step on the same samples (blocks); otherwise the error propagates.

Callbacks read `TrainerState` (declared up front; the loop owns it) and ask for actions through
`Control`; they never call into the loop. `state.log(values, step)` hands scalars to the run's
experiment trackers (`--report-to`; nothing without any). Every callback sees the same objects, in list order.
Requests are honoured at fixed points:

    skip_step               after the step's last micro-batch: the step's gradients are discarded
                            (its samples stay consumed, the step counts, the LR schedule advances);
                            the loop also skips any step whose loss is not finite
                            (`state.last_skip` then says "discarded")
    retry_step              in on_oom only: redo the step in progress (see above)
    change_knobs            before the next step, or before the retry; runtime knobs only
                            (`Knobs.RUNTIME`); the loop writes the knobs in force back to the run's
                            plan.json and ds_config.json
    rollback_to_checkpoint  after on_step_end: reload the newest complete checkpoint and continue
    lr_scale                after on_step_end (and after a rollback the same step asked for): the
                            scheduled LR times this factor, from then on
    should_evaluate / should_checkpoint / should_export / should_stop   after on_step_end

State that must survive a resume or a rollback goes into the checkpoint: the loop stores each
callback's `state_dict()` (JSON-safe, or None for nothing) under its `name` in the checkpoint's
trainer_state.json, and gives it back with `load_state_dict` when it loads that checkpoint (on
`--resume`, before on_train_start; on a rollback, right after the weights are restored).

Under several processes every rank runs its callbacks; the loop combines the flags of all ranks
(any rank asking is enough) so that all ranks act together. `change_knobs` and `lr_scale` must be
set identically on every rank (policies see the same reduced metrics).

This module imports nothing heavy; `TrainerState` holds the torch objects as `Any`.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from adaptive.errors import AdaptiveError
from adaptive.plan.estimate.activations import parse_checkpoint_policy

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Knobs:
    """The training settings in force. Only `RUNTIME` ones may change while training runs.

    The data are blocks of `block_len` tokens (the run's --seq-len; fixed for the whole run, and a
    resume must keep it). `seq_len` is the sequence the model sees: it divides `block_len`, and each
    block is cut into `pieces_per_block` consecutive pieces of `seq_len` tokens. Micro-batches count
    pieces, so an optimizer step takes `samples_per_step` blocks from the data and runs
    `sequences_per_step` pieces; its tokens do not depend on how the blocks are cut.
    """

    micro_batch_size: int
    gradient_accumulation_steps: int
    seq_len: int
    gradient_checkpointing: bool
    zero_stage: int
    offload_optimizer: bool
    offload_params: bool
    ep_size: int
    block_len: int = 0  # 0: seq_len (a run that never cut its blocks; checkpoints written before the field)
    sp_size: int = 1  # Ulysses sequence parallelism: each rank holds 1/sp of every sequence (plan/estimate/parallel.py)
    tp_size: int = 1  # AutoTP tensor parallelism: each rank holds 1/tp of the attention and MLP weights
    pp_size: int = 1  # DeepSpeed's pipeline engine: the layers split into pp stages (adaptive/models/pipeline.py)
    # the activation checkpointing in force: off | every:N | mlp | full (adaptive/models/checkpointing.py);
    # "": gradient_checkpointing's (full or off). gradient_checkpointing stays True exactly when it is "full".
    checkpoint_policy: str = ""

    RUNTIME = ("micro_batch_size", "gradient_accumulation_steps", "gradient_checkpointing", "checkpoint_policy",
               "seq_len")

    def __post_init__(self) -> None:
        if not self.block_len:
            object.__setattr__(self, "block_len", self.seq_len)
        policy = self.checkpoint_policy or ("full" if self.gradient_checkpointing else "off")
        try:
            kind, _ = parse_checkpoint_policy(policy)
        except ValueError as e:
            raise AdaptiveError(str(e)) from None
        policy = "full" if kind == "full" else policy  # every:1 is full
        object.__setattr__(self, "checkpoint_policy", policy)
        object.__setattr__(self, "gradient_checkpointing", policy == "full")

    @property
    def pieces_per_block(self) -> int:
        return self.block_len // self.seq_len

    @property
    def sequences_per_step(self) -> int:
        """This rank's sequences (pieces) per optimizer step: micro-batch x accumulation."""
        return self.micro_batch_size * self.gradient_accumulation_steps

    @property
    def samples_per_step(self) -> int:
        """This rank's samples (data blocks) per optimizer step."""
        return self.sequences_per_step // self.pieces_per_block

    @property
    def tokens_per_step(self) -> int:
        """This rank's tokens per optimizer step."""
        return self.sequences_per_step * self.seq_len

    def changed(self, changes: dict[str, Any]) -> Knobs:
        """A copy with runtime knobs changed; AdaptiveError for unknown or fixed ones, a sequence that
        does not divide the block, or a step that would not hold whole blocks."""
        for key, value in changes.items():
            if key not in self.RUNTIME:
                raise AdaptiveError(
                    f"knob {key!r} cannot change while training; runtime knobs: {', '.join(self.RUNTIME)}"
                )
            if key not in ("gradient_checkpointing", "checkpoint_policy") and (not isinstance(value, int) or value < 1):
                raise AdaptiveError(f"knob {key} must be a positive integer, got {value!r}")
        if "checkpoint_policy" not in changes and "gradient_checkpointing" in changes:  # on/off: full or off
            changes = {**changes, "checkpoint_policy": "full" if changes["gradient_checkpointing"] else "off"}
        new = replace(self, **changes)
        if new.block_len % new.seq_len:
            divisors = [d for d in range(1, new.block_len + 1) if new.block_len % d == 0]
            nearest = min(divisors, key=lambda d: abs(d - new.seq_len))
            raise AdaptiveError(f"seq_len ({new.seq_len}) must divide the block length ({new.block_len}); "
                                f"nearest: {nearest}")
        if new.sequences_per_step % new.pieces_per_block:
            raise AdaptiveError(
                f"micro_batch_size x gradient_accumulation_steps ({new.sequences_per_step}) must be a multiple of "
                f"the pieces per block ({new.pieces_per_block} at seq_len {new.seq_len}, block {new.block_len})"
            )
        return new

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class TrainerState:
    """Everything a callback may read. The loop updates it; callbacks treat it as read-only."""

    # the run
    max_steps: int
    knobs: Knobs
    output_dir: Path
    plan: Any = None  # adaptive.plan.Plan the run was sized with
    orchestrator: bool = False  # --orchestrator resolved (on, or auto and recommended)
    # the objects (after accelerator.prepare)
    accelerator: Any = None
    model: Any = None  # the DeepSpeed engine; accelerator.unwrap_model(model) is the HF model
    optimizer: Any = None
    scheduler: Any = None
    # progress, committed when an optimizer step completes (and restored on resume/rollback)
    step: int = 0  # optimizer steps done (global batches consumed, skipped ones included)
    tokens_seen: int = 0  # global tokens consumed by those steps
    samples_seen: int = 0  # this rank's data position in blocks (SampleIterator.position)
    skipped_steps: int = 0
    last_skip: str | None = None  # why the last step's update was not applied: "discarded" (a non-finite
    # loss or a callback's skip_step), "overflow" (DeepSpeed's fp16 loss scaler); None when it was applied
    lr_scale: float = 1.0
    last_grad_norm: float | None = None  # of the last applied step, when it was computed (log steps)
    # inside the current step
    micro_step: int = 0  # index of the micro-batch being run
    attempt: int = 0  # 0 on the first try of a step, n after n OOM retries
    # bookkeeping
    last_checkpoint: Path | None = None  # the checkpoint this run wrote or resumed from last
    last_checkpoint_step: int | None = None  # the step it holds
    resumed_from: Path | None = None
    world_size: int = 1
    trackers: Any = None  # the experiment trackers' sink (adaptive.train.reporting.trackers.TrackerSink; None: --report-to none)

    def log(self, values: dict[str, float], step: int | None = None) -> None:
        """Hand scalars to the run's experiment trackers (--report-to) at `step` (default: the steps done);
        nothing without any. Only the main process's values are logged."""
        if self.trackers is not None:
            self.trackers.log(values, self.step if step is None else step)

    @property
    def is_main_process(self) -> bool:
        return self.accelerator is None or self.accelerator.is_main_process

    @property
    def tokens_per_step(self) -> int:
        """Global tokens per optimizer step (the same whatever seq_len cuts the blocks into)."""
        # a TP group, and a pipeline's stages, share their data
        return self.knobs.tokens_per_step * (self.world_size // (self.knobs.tp_size * self.knobs.pp_size))


@dataclass
class Control:
    """Requests from callbacks to the loop. One-shot flags are cleared once acted on."""

    skip_step: bool = False
    retry_step: bool = False
    rollback_to_checkpoint: bool = False
    should_evaluate: bool = False
    should_checkpoint: bool = False
    should_export: bool = False
    should_stop: bool = False
    lr_scale: float | None = None
    change_knobs: dict[str, Any] = field(default_factory=dict)

    FLAGS = ("skip_step", "rollback_to_checkpoint", "should_evaluate", "should_checkpoint", "should_export",
             "should_stop")


class Callback:
    """No-op base: subclass and override the events you need. Each gets the state and the control."""

    def on_train_start(self, state: TrainerState, control: Control) -> None:
        pass

    def on_step_start(self, state: TrainerState, control: Control) -> None:
        pass

    def on_backward_end(self, state: TrainerState, control: Control, *, outputs: Any, loss: Any,
                        batch: dict[str, Any]) -> None:
        """After each micro-batch's backward. `outputs` is the model output (with `router_stats`),
        `loss` the micro-batch's loss tensor (LM + aux, before accumulation scaling; no host sync
        was made for it), `batch` the micro-batch on the device."""

    def on_optimizer_step(self, state: TrainerState, control: Control) -> None:
        """Right after an applied optimizer step (where an expert-bias update goes)."""

    def on_step_end(self, state: TrainerState, control: Control, *, metrics: dict[str, Any] | None) -> None:
        """After the step is committed; `metrics` is the metrics.jsonl record on log steps."""

    def on_eval(self, state: TrainerState, control: Control, *, metrics: dict[str, Any]) -> None:
        pass

    def on_checkpoint(self, state: TrainerState, control: Control, *, path: Path) -> None:
        """After a checkpoint is complete on disk (atomically renamed, `latest` updated)."""

    def on_oom(self, state: TrainerState, control: Control, *, error: BaseException) -> None:
        pass

    def on_train_end(self, state: TrainerState, control: Control) -> None:
        pass

    def state_dict(self) -> dict[str, Any] | None:
        """What a checkpoint keeps of this callback (JSON-safe); None: nothing."""
        return None

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Take back what `state_dict` returned when the checkpoint being loaded was written."""


def callback_key(callback: Any) -> str:
    return getattr(callback, "name", None) or type(callback).__name__


class CallbackList(Callback):
    """Calls every callback for every event, in list order."""

    def __init__(self, callbacks: list[Callback] | None = None) -> None:
        self.callbacks: list[Callback] = list(callbacks or [])

    def add(self, callback: Callback) -> None:
        self.callbacks.append(callback)

    def __len__(self) -> int:
        return len(self.callbacks)

    def _call(self, event: str, state: TrainerState, control: Control, **kwargs: Any) -> None:
        for callback in self.callbacks:
            handler = getattr(callback, event, None)  # plugins implement only the events they need
            if handler is not None:
                handler(state, control, **kwargs)

    def on_train_start(self, state, control):
        self._call("on_train_start", state, control)

    def on_step_start(self, state, control):
        self._call("on_step_start", state, control)

    def on_backward_end(self, state, control, *, outputs, loss, batch):
        self._call("on_backward_end", state, control, outputs=outputs, loss=loss, batch=batch)

    def on_optimizer_step(self, state, control):
        self._call("on_optimizer_step", state, control)

    def on_step_end(self, state, control, *, metrics):
        self._call("on_step_end", state, control, metrics=metrics)

    def on_eval(self, state, control, *, metrics):
        self._call("on_eval", state, control, metrics=metrics)

    def on_checkpoint(self, state, control, *, path):
        self._call("on_checkpoint", state, control, path=path)

    def on_oom(self, state, control, *, error):
        self._call("on_oom", state, control, error=error)

    def on_train_end(self, state, control):
        self._call("on_train_end", state, control)

    def state_dict(self) -> dict[str, Any]:
        out = {}
        for callback in self.callbacks:
            saved = callback.state_dict() if hasattr(callback, "state_dict") else None
            if saved is not None:
                out[callback_key(callback)] = saved
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for callback in self.callbacks:
            key = callback_key(callback)
            if key in state_dict and hasattr(callback, "load_state_dict"):
                callback.load_state_dict(state_dict[key])


__all__ = ["Callback", "CallbackList", "Control", "Knobs", "TrainerState", "callback_key"]
