"""Aux-loss-free expert balancing (DeepSeek-V3), on the native and the DeepSpeed MoE alike.

Every MoE gate has a bias `e_score_correction_bias` [E] that is added to the softmax scores for
top-k *selection only* (combine weights and l_aux use the unbiased scores; see
`adaptive.models.moe.route`). DeepSpeed's own `TopKGate` has no such bias; our `DeepSpeedGate`
routes with the same `route()`, so the bias works on `deepspeed.moe.layer.MoE` and with
`ep_size > 1`: each rank holds E/ep experts but the gate, and its bias, is replicated.

After each applied optimizer step:

    load_i  = tokens routed to expert i in this step's micro-batches, summed over every rank
    bias_i += u * sign(mean(load) - load_i)

The load is all-reduced over the whole world (one [layers, E] all-reduce of exact integer counts
in float64), so every rank applies the same update and the biases stay bitwise identical. All of it
stays on the device: no host sync. Under bf16/fp16 the bias buffer is 16-bit; the update goes into
an fp32 master copy that is then copied into the buffer, so steps of u = 1e-3 are not rounded away.
The biases are persistent buffers, so every checkpoint holds them; the fp32 masters and the update
count go into the checkpoint too (the policy's `state_dict`). After a resume or a rollback the
masters come back from the checkpoint (from the restored buffers if it has none).

u defaults to DeepSeek-V3's 1e-3 (for runs of many thousands of steps). The router scores are
probabilities (sum 1 over E), so a bias must reach the gap between a favoured expert's score and
the others' to move tokens: with u = 1e-3 that takes hundreds of steps. The CPU tests use larger
rates for runs of tens of steps, and say so.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch only where a policy runs: its config stays importable without it
    import torch

from adaptive.orchestrator.registry import Policy, require
from adaptive.orchestrator.contract import Control, TrainerState
from adaptive.orchestrator.events import EventLog
from adaptive.orchestrator.monitor import Monitor, all_reduce_sum, world_size


@dataclass(frozen=True)
class BalanceConfig:
    rate: float = 1e-3  # u: bias step per optimizer step

    def __post_init__(self) -> None:
        require(0 < self.rate < 1, f"rate must be in (0, 1), got {self.rate}")


def moe_gates(model: Any) -> list[Any]:
    """Every MoE gate with a selection bias, in module order (works through DeepSpeed/DDP wrappers)."""
    if model is None:
        return []
    return [m for m in model.modules() if hasattr(m, "e_score_correction_bias") and hasattr(m, "capacity_factor")]


def gate_rows(model: Any, biases: list[Any]) -> tuple[list[int], int, int, bool]:
    """(each local gate's MoE layer row, the model's MoE layers, experts, whether this rank is its replica's first).
    A pipeline stage (adaptive/models/pipeline.py) holds some of the layers: its `local_moe_rows` says which, and
    each stage's first data-parallel rank speaks for it; otherwise every layer, and rank 0."""
    module = getattr(model, "module", model)
    local_rows = getattr(module, "local_moe_rows", None)
    if local_rows is None:
        import torch
        first = not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0
        return list(range(len(biases))), len(biases), biases[0].numel() if biases else 0, first
    config = module.config
    return (local_rows(), len(config.moe_layers), config.num_local_experts,
            model.grid.get_data_parallel_rank() == 0)


class BalancePolicy:
    name = "balance"

    def __init__(self, monitor: Monitor, events: EventLog, config: BalanceConfig | None = None) -> None:
        self.config = config or BalanceConfig()
        self.monitor = monitor
        self.events = events
        self.gates: list[Any] = []
        self.rows: list[int] = []  # each gate's row in the model's [moe_layers, E] counts
        self.layers = 0  # the model's MoE layers (a pipeline stage holds some of them)
        self._experts, self._first, self._device = 0, True, None
        self.biases: list[torch.Tensor] = []
        self.masters: list[torch.Tensor] | None = None  # fp32 copies when the buffers are 16-bit
        self.updates = 0
        self._last_step = -1
        self._reported: list[torch.Tensor] = []  # device copies of the biases at the last report (no sync)
        self._loaded: dict[str, Any] | None = None  # from the checkpoint being loaded

    def on_train_start(self, state: TrainerState, control: Control) -> None:
        self.gates = moe_gates(state.model)
        self.biases = [g.e_score_correction_bias for g in self.gates]
        self.rows, self.layers, self._experts, self._first = gate_rows(state.model, self.biases)
        if self.layers:
            self._device = next(iter(state.model.parameters())).device
        if world_size() > 1 and self.layers:  # start from the first replica's biases; identical updates keep them equal
            full = self._first_replica(self.biases)
            for row, bias in zip(self.rows, self.biases):
                bias.copy_(full[row])
        self._sync_masters()
        self._last_step = state.step
        self._reported = self._bias_copies()

    def _first_replica(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        """[layers, E]: every MoE layer's row of `tensors` (this rank's gates' biases or masters) as the first replica
        holds it: one all-reduce, the first replica's ranks (rank 0 without a pipeline; each stage's first one with)
        adding theirs, the others zeros. A collective: every rank calls it."""
        import torch
        full = torch.zeros(self.layers, self._experts, dtype=torch.float32, device=self._device)
        if self._first:
            for row, tensor in zip(self.rows, tensors):
                full[row] = tensor.float()
        return all_reduce_sum(full)

    def _layer_rows(self, tensors: list[torch.Tensor]) -> list[list[float]]:
        """Every MoE layer's row of `tensors`, for the records: a pipeline stage holds some layers, so the stages'
        rows are gathered (a collective on every rank); otherwise this rank's own."""
        if self.rows == list(range(self.layers)):
            return [t.tolist() for t in tensors]
        return self._first_replica(tensors).tolist()

    def _sync_masters(self) -> None:
        import torch
        low = any(b.dtype != torch.float32 for b in self.biases)
        self.masters = [b.detach().float().clone() for b in self.biases] if low else None
        saved, self._loaded = self._loaded, None
        if saved is not None:
            self.updates = saved.get("updates", self.updates)
            rows = saved.get("masters")
            same_layers = saved.get("rows", list(range(len(rows or [])))) == self.rows  # a pipeline stage's own
            if self.masters is not None and rows is not None and len(rows) == len(self.masters) and same_layers:
                for bias, master, row in zip(self.biases, self.masters, rows):
                    master.copy_(torch.tensor(row, dtype=torch.float32))
                    bias.copy_(master)

    def on_step_start(self, state: TrainerState, control: Control) -> None:
        if state.step < self._last_step or self._loaded is not None:  # rolled back: buffers restored
            self._sync_masters()
        self._last_step = state.step

    def state_dict(self) -> dict[str, Any] | None:
        if not self.biases:
            return None
        return {"updates": self.updates, "masters": [m.tolist() for m in self.masters] if self.masters else None,
                "rows": self.rows}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Taken in at the next on_train_start (--resume) or on_step_start (a rollback)."""
        self._loaded = dict(state_dict)

    def on_optimizer_step(self, state: TrainerState, control: Control) -> None:
        import torch
        counts = self.monitor.step_counts
        if not self.layers or counts is None:  # every rank joins the all-reduce, a pipeline stage without gates too
            return
        load = counts.clone() if world_size() > 1 else counts
        all_reduce_sum(load)
        if not self.biases:
            return
        delta = (load.mean(dim=1, keepdim=True) - load).sign_().mul_(self.config.rate).float()
        rows = [delta[row] for row in self.rows]  # this rank's gates' layers (a pipeline stage holds some)
        if self.masters is None:
            torch._foreach_add_(self.biases, rows)
        else:
            torch._foreach_add_(self.masters, rows)
            for bias, master in zip(self.biases, self.masters):
                bias.copy_(master)
        self.updates += 1

    def on_step_end(self, state: TrainerState, control: Control, *, metrics: dict[str, Any] | None) -> None:
        self._last_step = state.step
        signals = self.monitor.fresh(state)
        if signals is None or not self.layers:  # every rank goes on: a pipeline's stages gather their rows
            return
        before = self._layer_rows(self._reported)  # read on the summary step, when the monitor reads too
        self._reported = self._bias_copies()
        self.events.record(
            state.step, self.name, "bias_update", f"{self.updates} updates of u={self.config.rate:g} so far",
            signals={"max_vio": signals.max_vio, "dropped_fraction": signals.dropped_fraction,
                     "dead_experts": signals.dead_experts, "router_entropy": signals.router_entropy,
                     "load_entropy": signals.load_entropy},
            before={"bias_range": _ranges(before)}, after={"bias_range": _ranges(self._layer_rows(self._source()))})

    def _source(self) -> list[torch.Tensor]:
        return self.masters if self.masters is not None else self.biases

    def _bias_copies(self) -> list[torch.Tensor]:
        return [b.detach().clone() for b in self._source()]

    def summary(self) -> dict[str, Any]:
        """Called on every rank at the end (a collective under a pipeline)."""
        rows = self._layer_rows(self._source()) if self.layers else []
        return {"layers": self.layers, "rate": self.config.rate, "updates": self.updates, "bias": rows}


def _ranges(rows: list[list[float]] | None) -> list[list[float]] | None:
    """[min, max] of each layer's bias, to 7 significant digits (the fp32 values print long)."""
    return [[float(f"{min(r):.7g}"), float(f"{max(r):.7g}")] for r in rows] if rows else None



POLICY = Policy(name="balance", config=BalanceConfig, build=BalancePolicy)

__all__ = ["BalanceConfig", "BalancePolicy", "moe_gates"]
