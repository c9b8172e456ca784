"""Monitors: the signals the policies read, kept on the device and summarised every N steps.

Per micro-batch (`on_backward_end`) the monitor adds the model's `router_stats` into one flat
float64 tensor on the device (`add_`, no host sync): per-layer expert token counts (before
dropping, DeepSpeed's `exp_counts`), dropped fraction, MoD skip rate and causal-router agreement,
and the loss (non-finite losses count as 0 and are counted apart). At the step's end the step's
sums join the window's (one `add_`); a failed try (OOM) is dropped. Every `every` steps (by
default the loop's log steps, when it syncs anyway) the window is summed over ranks (one
all-reduce) and read to the host once, giving `Signals`:

    expert_counts    [layer][expert] tokens routed in the window, all ranks
    max_vio          per layer, (max load - mean load) / mean load (DeepSeek-V3's MaxVio)
    dropped_fraction per layer, mean fraction of routes dropped by capacity
    dead_experts     per layer, experts that got no token in the whole window
    router_entropy   per layer, the mean over tokens of each token's gate entropy
                     H(softmax(router logits)) divided by log(E): 1.0 is a router that cannot tell
                     experts apart, 0 a router certain of one expert per token (the model computes
                     it on the device in each forward, `router_stats.router_entropy`)
    load_entropy     per layer, entropy of the window's load distribution over experts divided by
                     log(E): 1.0 is perfectly even, 0 is one expert
    mod_skip_rate    per MoD layer, fraction of tokens that skipped the block
    mod_router_agreement  per MoD layer, fraction where the causal router agrees with top-k
    loss             mean finite micro-batch loss in the window (None if none was finite)
    non_finite       micro-batches whose loss was not finite
    step_seconds     mean wall time per step on this rank (host clock, no device sync)
    grad_norm        the last step's gradient norm as the loop computed it (log steps), or None
    memory_peak_bytes  the loop's CUDA peak for the interval when it reported one (the largest over
                     ranks), else None

`step_counts` (the current step's [layer, expert] counts, on the device) is what the balancing
policy updates its biases from after each optimizer step.
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch only where a policy runs: its config stays importable without it
    import torch

from adaptive.orchestrator.registry import require
from adaptive.orchestrator.contract import Control, TrainerState


def world_size() -> int:
    import torch
    dist = torch.distributed
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    """Sum over every rank, in place (a no-op for one process)."""
    import torch
    if world_size() > 1:
        torch.distributed.all_reduce(tensor, op=torch.distributed.ReduceOp.SUM)
    return tensor


HISTORY = 100  # summaries kept in memory


@dataclass(frozen=True)
class MonitorConfig:
    every: int = 0  # summarise every N optimizer steps; 0: on the loop's log steps (--log-every)

    def __post_init__(self) -> None:
        require(self.every >= 0, f"every must be >= 0, got {self.every}")


@dataclass(frozen=True)
class Signals:
    step: int
    steps: int  # optimizer steps in the window
    micro_batches: int  # summed over ranks
    expert_counts: list[list[int]] | None = None
    max_vio: list[float | None] | None = None
    dropped_fraction: list[float] | None = None
    dead_experts: list[int] | None = None
    router_entropy: list[float] | None = None
    load_entropy: list[float | None] | None = None
    mod_skip_rate: list[float] | None = None
    mod_router_agreement: list[float] | None = None
    loss: float | None = None
    non_finite: int = 0
    step_seconds: float | None = None
    memory_peak_bytes: int | None = None
    grad_norm: float | None = None

    @property
    def max_vio_max(self) -> float | None:
        values = [v for v in (self.max_vio or []) if v is not None]
        return max(values) if values else None

    @property
    def dropped_max(self) -> float | None:
        return max(self.dropped_fraction) if self.dropped_fraction else None

    def brief(self) -> dict[str, Any]:
        """The scalar signals an event records."""
        out: dict[str, Any] = {"loss": self.loss, "max_vio_max": self.max_vio_max, "dropped_max": self.dropped_max}
        if self.dead_experts is not None:
            out["dead_experts"] = sum(self.dead_experts)
        if self.router_entropy is not None:
            out["router_entropy_min"] = min(self.router_entropy) if self.router_entropy else None
        if self.load_entropy is not None:
            values = [v for v in self.load_entropy if v is not None]
            out["load_entropy_min"] = min(values) if values else None
        if self.mod_skip_rate:
            out["mod_skip_rate_mean"] = sum(self.mod_skip_rate) / len(self.mod_skip_rate)
        if self.memory_peak_bytes is not None:
            out["memory_peak_bytes"] = self.memory_peak_bytes
        if self.grad_norm is not None:
            out["grad_norm"] = self.grad_norm
        return out


def max_vio(load: list[float]) -> float | None:
    mean = sum(load) / len(load) if load else 0.0
    return (max(load) - mean) / mean if mean > 0 else None


def load_entropy(load: list[float]) -> float | None:
    """Entropy of the load distribution over experts, divided by log(E) (1.0: perfectly even)."""
    total = sum(load)
    if total <= 0 or len(load) < 2:
        return None
    return -sum(c / total * math.log(c / total) for c in load if c > 0) / math.log(len(load))


class _Layout:
    """Offsets of each signal inside the flat accumulator."""

    def __init__(self, moe_layers: int, experts: int, mod_layers: int) -> None:
        self.moe_layers, self.experts, self.mod_layers = moe_layers, experts, mod_layers
        sizes = [("counts", moe_layers * experts), ("dropped", moe_layers), ("entropy", moe_layers),
                 ("skip", mod_layers),
                 ("agree", mod_layers), ("loss", 1), ("finite", 1), ("micro", 1)]
        self.slices: dict[str, slice] = {}
        offset = 0
        for name, size in sizes:
            self.slices[name] = slice(offset, offset + size)
            offset += size
        self.size = offset


class Monitor:
    """Accumulates router and loss signals on the device; `latest` holds the last summary."""

    name = "monitor"

    def __init__(self, config: MonitorConfig | None = None) -> None:
        self.config = config or MonitorConfig()
        self.latest: Signals | None = None
        self.first: Signals | None = None
        self.history: deque[Signals] = deque(maxlen=HISTORY)  # the recent summaries
        self._layout: _Layout | None = None
        self._step: torch.Tensor | None = None  # this step's sums
        self._window: torch.Tensor | None = None  # the window's sums
        self._views: dict[str, torch.Tensor] = {}
        self._window_steps = 0
        self._window_seconds = 0.0
        self._started = 0.0

    # --- what policies read ---------------------------------------------------------------

    @property
    def step_counts(self) -> torch.Tensor | None:
        """[moe_layers, experts] tokens routed in the current step's micro-batches (this rank)."""
        return self._views.get("counts")

    def fresh(self, state: TrainerState) -> Signals | None:
        """The summary made at this step, if one was."""
        return self.latest if self.latest is not None and self.latest.step == state.step else None

    # --- events ---------------------------------------------------------------------------

    def on_step_start(self, state: TrainerState, control: Control) -> None:
        if self._step is not None:
            self._step.zero_()
        self._started = time.perf_counter()

    def on_oom(self, state: TrainerState, control: Control, *, error: BaseException) -> None:
        if self._step is not None:  # the failed try's micro-batches are redone
            self._step.zero_()

    def on_backward_end(self, state: TrainerState, control: Control, *, outputs: Any, loss: Any,
                        batch: dict[str, Any]) -> None:
        import torch
        stats = getattr(outputs, "router_stats", None)
        if self._step is None:
            self._allocate(stats, loss.device)
        v = self._views
        if "counts" in v and stats is not None and stats.expert_counts is not None:
            v["counts"].add_(stats.expert_counts)
            v["dropped"].add_(stats.dropped_fraction)
            entropy = getattr(stats, "router_entropy", None)
            if entropy is not None:
                v["entropy"].add_(entropy)
        if "skip" in v and stats is not None and stats.mod_skip_rate is not None:
            v["skip"].add_(stats.mod_skip_rate)
            v["agree"].add_(stats.mod_router_agreement)
        finite = torch.isfinite(loss)
        v["loss"].add_(torch.where(finite, loss, 0.0))
        v["finite"].add_(finite)
        v["micro"].add_(1.0)

    def on_step_end(self, state: TrainerState, control: Control, *, metrics: dict[str, Any] | None) -> None:
        if self._step is None:
            return
        self._window.add_(self._step)
        self._window_steps += 1
        self._window_seconds += time.perf_counter() - self._started
        every = self.config.every
        due = metrics is not None if every <= 0 else state.step % every == 0
        if due:
            self.latest = self.summarise(state.step, metrics, state.last_grad_norm)
            self.history.append(self.latest)
            if self.first is None:
                self.first = self.latest

    # --- internals ------------------------------------------------------------------------

    def _allocate(self, stats: Any, device: torch.device) -> None:
        import torch
        counts = getattr(stats, "expert_counts", None)
        skip = getattr(stats, "mod_skip_rate", None)
        layers, experts = tuple(counts.shape) if counts is not None else (0, 0)
        mod = skip.numel() if skip is not None else 0
        self._layout = _Layout(layers, experts, mod)
        self._step = torch.zeros(self._layout.size, dtype=torch.float64, device=device)
        self._window = torch.zeros_like(self._step)
        self._views = {}
        for name, where in self._layout.slices.items():
            if where.stop > where.start:
                view = self._step[where]
                self._views[name] = view.view(layers, experts) if name == "counts" else view
        if not layers:
            self._views.pop("dropped", None)
            self._views.pop("entropy", None)

    def summarise(self, step: int, metrics: dict[str, Any] | None = None, grad_norm: float | None = None) -> Signals:
        """Sum the window over ranks (one all-reduce), read it once, start a new window."""
        packed = all_reduce_sum(self._window.clone())
        values = packed.tolist()
        self._window.zero_()
        steps, seconds = self._window_steps, self._window_seconds
        self._window_steps, self._window_seconds = 0, 0.0
        lay = self._layout

        def part(name: str) -> list[float]:
            return values[lay.slices[name]]

        micro = part("micro")[0]
        finite = part("finite")[0]
        kwargs: dict[str, Any] = {}
        if lay.moe_layers:
            flat = part("counts")
            counts = [[int(round(c)) for c in flat[i * lay.experts:(i + 1) * lay.experts]]
                      for i in range(lay.moe_layers)]
            kwargs.update(expert_counts=counts, max_vio=[max_vio([float(c) for c in row]) for row in counts],
                          dropped_fraction=[d / micro for d in part("dropped")] if micro else None,
                          dead_experts=[sum(1 for c in row if c == 0) for row in counts],
                          router_entropy=[e / micro for e in part("entropy")] if micro else None,
                          load_entropy=[load_entropy([float(c) for c in row]) for row in counts])
        if lay.mod_layers:
            kwargs.update(mod_skip_rate=[s / micro for s in part("skip")] if micro else None,
                          mod_router_agreement=[a / micro for a in part("agree")] if micro else None)
        return Signals(step=step, steps=steps, micro_batches=int(micro),
                       loss=part("loss")[0] / finite if finite else None, non_finite=int(micro - finite),
                       step_seconds=seconds / steps if steps else None,
                       memory_peak_bytes=self._memory_peak(metrics), grad_norm=grad_norm, **kwargs)

    def _memory_peak(self, metrics: dict[str, Any] | None) -> int | None:
        """The loop's CUDA peak of this interval, the largest over ranks (so every rank decides alike)."""
        import torch
        memory = (metrics or {}).get("memory") or None
        if not memory:
            return None
        peak = memory.get("peak_allocated_bytes")
        if world_size() > 1:
            value = torch.tensor([float(peak)], dtype=torch.float64, device=self._window.device)
            torch.distributed.all_reduce(value, op=torch.distributed.ReduceOp.MAX)
            peak = int(value.item())
        return peak

    def summary(self) -> dict[str, Any]:
        if self.latest is None:
            return {}
        first, last = self.first, self.latest
        return {"first": {"step": first.step, **first.brief()},
                "last": {"step": last.step, **last.brief()}}


__all__ = ["Monitor", "MonitorConfig", "Signals", "all_reduce_sum", "load_entropy", "max_vio", "world_size"]
