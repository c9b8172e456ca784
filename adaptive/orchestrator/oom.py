"""The runtime OOM ladder: the planner's playbook, one rung per out-of-memory error.

On an out-of-memory error in a step (CUDA's, or any `torch.OutOfMemoryError`), `on_oom` picks the
next rung and asks the loop to redo the step (`control.retry_step`). The loop frees memory
(garbage collection, `torch.cuda.empty_cache`), discards the step's partial gradients and reruns
the same optimizer step on the same samples, so no sample is lost or repeated:

    1. micro-batch > 1: halve it (the largest divisor <= half) and raise gradient accumulation by the
       same factor: micro-batch x accumulation, hence the global batch, is unchanged;
    2. micro-batch 1: checkpoint more activations, one policy of `checkpoint_ladder` per OOM, as
       the planner orders them (least recompute first): every:4 (every 4th block recomputes), every:2,
       mlp (each block recomputes its MLP half), full. A run that starts on a policy moves to the next
       one after it (a policy not in the ladder, e.g. a pinned every:3, to full). A policy the model
       class cannot run is passed over: transformers' classes (a fine-tune) have no mlp;
    3. full checkpointing already on: halve the sequence, when `min_seq_len` allows it (half >= min_seq_len,
       and half divides the block length), and double the accumulation. The data stay blocks of the
       run's --seq-len (the block length); the loop cuts each of the step's blocks into consecutive
       pieces of the new seq_len and runs the micro-batches over the pieces, so the step takes the same
       blocks and the same tokens as before. Not for a fine-tune (`shorter_seq_blocked`): a piece of an
       instruction example is an answer without its prompt. Each piece is a sequence of its own: its first token has
       no context, and a block of B tokens cut into k pieces yields B - k predicted tokens instead of
       B - 1. The rung repeats (1/4, 1/8, ...) while min_seq_len allows. Without `min_seq_len` the
       ladder ends at full checkpointing: the policy records "exhausted" and the error propagates.

The loop writes the knobs in force (seq_len included) to plan.json and ds_config.json after each
change; with `checkpoint_after_change` the policy also asks for a checkpoint once the retried step
completes, so `--resume` (with the run's original --seq-len, the block length) starts from the
working settings: the checkpoint's knobs are put back in force (a fresh start from the run's files,
`--ds-config ds_config.json --seq-len <plan.json's seq_len>`, has the same tokens per step, but
begins at step 0). A multi-process retry needs every
rank to run out of memory at the same micro-batch (see adaptive/train/run/loop.py); the change is the
same on every rank because it follows from the knobs alone.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from adaptive.orchestrator.registry import Policy, require
from adaptive.orchestrator.contract import Control, Knobs, TrainerState
from adaptive.orchestrator.events import EventLog
from adaptive.plan.estimate.activations import SELECTIVE_POLICIES, parse_checkpoint_policy


@dataclass(frozen=True)
class OOMConfig:
    checkpointing: bool = True  # rung 2 allowed
    checkpoint_ladder: tuple[str, ...] = (*SELECTIVE_POLICIES, "full")  # rung 2's policies, in order
    min_seq_len: int | None = None  # rung 3 (halve the sequence) allowed down to this length; None: never
    checkpoint_after_change: bool = True
    max_retries: int = 8  # per step: enough for micro-batch 8 down to 1 and the whole checkpointing ladder

    def __post_init__(self) -> None:
        require(self.min_seq_len is None or self.min_seq_len >= 1, f"min_seq_len must be >= 1, got {self.min_seq_len}")
        require(self.max_retries >= 0, f"max_retries must be >= 0, got {self.max_retries}")
        object.__setattr__(self, "checkpoint_ladder", tuple(self.checkpoint_ladder))  # JSON gives a list
        for policy in self.checkpoint_ladder:
            try:
                parse_checkpoint_policy(policy)
            except ValueError as e:
                require(False, f"checkpoint_ladder: {e}")
        require(self.checkpoint_ladder[-1:] == ("full",), f"checkpoint_ladder must end with full, got "
                f"{list(self.checkpoint_ladder)}")


def next_rung(knobs: Knobs, config: OOMConfig, skip: frozenset[str] = frozenset()) -> tuple[str, dict[str, Any]] | None:
    """(action, runtime knob changes) of the next rung, or None when none is left. `skip`: checkpointing policies
    the model class does not run (transformers' classes of a fine-tune have no "mlp"; `unsupported_policies`)."""
    micro = knobs.micro_batch_size
    if micro > 1:
        smaller = max(d for d in range(1, micro // 2 + 1) if micro % d == 0)
        accum = knobs.gradient_accumulation_steps * (micro // smaller)
        return "halve_micro_batch", {"micro_batch_size": smaller, "gradient_accumulation_steps": accum}
    policy = next_checkpoint_policy(knobs.checkpoint_policy, config, skip) if config.checkpointing else None
    if policy is not None:
        action = "enable_checkpointing" if knobs.checkpoint_policy == "off" else "raise_checkpointing"
        return action, {"checkpoint_policy": policy}
    seq = shorter_seq_len(knobs, config.min_seq_len)
    if seq is not None:
        accum = knobs.gradient_accumulation_steps * (knobs.seq_len // seq)
        return "halve_seq_len", {"seq_len": seq, "gradient_accumulation_steps": accum}
    return None


def next_checkpoint_policy(current: str, config: OOMConfig, skip: frozenset[str] = frozenset()) -> str | None:
    """The ladder's policy after `current` (its first from off, full from one not in it), passing over those in
    `skip`; None at full."""
    ladder = config.checkpoint_ladder
    if current == "full":
        return None
    after = ladder if current == "off" else ladder[ladder.index(current) + 1:] if current in ladder else ("full",)
    return next(p for p in after if p not in skip or p == "full")


def unsupported_policies(plan: Any) -> frozenset[str]:
    """The ladder's selective policies the run's model class cannot run: the planner's own rule (planner.py
    `selective_policies`: transformers' classes, a fine-tune's, checkpoint whole layers, so no "mlp")."""
    request = getattr(plan, "request", None)
    if request is None:
        return frozenset()
    from adaptive.plan.search.planner import selective_policies

    return frozenset(SELECTIVE_POLICIES) - frozenset(selective_policies(request))


def shorter_seq_len(knobs: Knobs, min_seq_len: int | None) -> int | None:
    """Half the sequence in force, when it is >= min_seq_len and divides the block length; else None."""
    if min_seq_len is None or knobs.seq_len % 2:
        return None
    half = knobs.seq_len // 2
    if half < max(min_seq_len, 2) or knobs.block_len % half:
        return None
    return half


def shorter_seq_blocked(plan: Any) -> str | None:
    """Why rung 3 (halve the sequence) is not taken for this run; None when it may be. A fine-tune's block is one
    example (or whole examples, packed): a piece of a cut block is an answer without the prompt it answers, or a
    prompt without its answer, which trains something else than the data says. A fine-tune's ladder ends at full
    checkpointing; the planner's --seq-len is the one to lower."""
    request = getattr(plan, "request", None)
    if getattr(request, "finetune", None) is None:
        return None
    return ("no shorter sequence for a fine-tune: a piece of a cut example is an answer without its prompt; "
            "lower --seq-len instead")


class OOMPolicy:
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
        before = {k: getattr(knobs, k) for k in knobs.RUNTIME}
        if state.attempt >= self.config.max_retries:
            self.events.record(state.step + 1, self.name, "give_up", f"{state.attempt} retries of this step",
                               signals=signals, before=before, after=before)
            return
        blocked = shorter_seq_blocked(state.plan)
        config = replace(self.config, min_seq_len=None) if blocked else self.config
        rung = next_rung(knobs, config, unsupported_policies(state.plan))
        if rung is None:
            why = blocked or (f"no shorter sequence allowed (seq_len {knobs.seq_len}, block {knobs.block_len}, "
                              f"min_seq_len {self.config.min_seq_len})")
            self.events.record(state.step + 1, self.name, "exhausted", "out of memory at micro-batch 1 with "
                               f"checkpointing {knobs.checkpoint_policy}"
                               f"{'' if knobs.gradient_checkpointing else ' (no more allowed)'}; {why}",
                               signals=signals, before=before, after=before)
            return
        action, changes = rung
        control.change_knobs = dict(changes)
        control.retry_step = True
        after = {**before, **changes}
        self.changes.append({"step": state.step + 1, "action": action, "after": after})
        self.events.record(state.step + 1, self.name, action, "out of memory; redoing the step on the same "
                           "samples", signals=signals, before=before, after=after)
        self._checkpoint_next = self.config.checkpoint_after_change

    def on_step_end(self, state: TrainerState, control: Control, *, metrics: dict[str, Any] | None) -> None:
        if self._checkpoint_next:  # the retried step completed with the new knobs
            self._checkpoint_next = False
            control.should_checkpoint = True

    def summary(self) -> dict[str, Any]:
        return {"changes": self.changes}



POLICY = Policy(name="oom", config=OOMConfig, build=lambda monitor, events, config: OOMPolicy(events, config))

__all__ = ["OOMConfig", "OOMPolicy", "next_checkpoint_policy", "next_rung", "shorter_seq_blocked", "shorter_seq_len",
           "unsupported_policies"]
