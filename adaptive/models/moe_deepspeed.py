"""The MoE block on `deepspeed.moe.layer.MoE` (imported only when `moe_implementation="deepspeed"`).

DeepSpeed's module names (`deepspeed_moe.gate.wg`, `deepspeed_moe.experts.deepspeed_experts.{i}`) live only here:
a load pre-hook converts our native (Mixtral) layout to them, and `save_pretrained` writes the native layout
(`moe.from_deepspeed_layout`), so one checkpoint loads into either block.

DeepSpeed's `MOELayer` does the dispatch, the expert all-to-all (`ep_size > 1`) and the combine; its
gate is replaced by `DeepSpeedGate`, which routes with the same `route()` as the native block (so the
two agree, and the selection bias works on DeepSpeed too).

Expert parallelism: with `ep_size = P`, rank r of an expert-parallel group holds global experts
`r * E/P ... (r+1) * E/P - 1` as local experts `0 ... E/P - 1` (DeepSpeed's layout). A global
(HF) checkpoint maps onto it with `localize_expert_state_dict`; `AdaptivePreTrainedModel.
load_global_state_dict` and `from_pretrained` do that for you.

Expert tensor parallelism: under AutoTP (`tensor_parallel.autotp_size`) the experts are sharded like the dense
MLP (the config's tp_plan names their projections) and DeepSpeed builds the expert groups inside AutoTP's
(data, tensor) mesh (`enable_expert_tensor_parallelism`); each TP rank sends 1/tp of every expert's slots through
the all-to-all, and the slots are gathered back over the TP group before the sharded experts run.

Process groups. One process without torch.distributed, at ep_size 1, needs none: the layer uses its group
only for the all-to-all (ep_size > 1) and the gate only for a capacity all-reduce over more than one rank, so
`Model(config)`, `from_config` and `from_pretrained` forward as they are (`groups_missing`). Nothing is created
there: DeepSpeed's groups need torch.distributed's default group, process-wide state that a later real
`init_process_group` in the same process could not replace. Under torch.distributed, `deepspeed.initialize` or
`ensure_expert_parallel(model)` (model.setup_expert_parallel()) creates them; a forward under several processes
never does, because creating a group is a collective that every rank must join. The explicit call in a process
without torch.distributed initialises a single-process group, logs that, and creates the groups.
"""

from __future__ import annotations

import logging
import os
import re

import torch
import torch.distributed as dist
from deepspeed.moe.layer import MoE
from deepspeed.moe.sharded_moe import TopKGate
from torch import nn

from adaptive.engine import (expert_group_line, expert_parallel_rank, gather_tokens_for_gloo, prints_held,
                             tensor_parallel_size, use_tensor_parallel_mesh)
from adaptive.errors import AdaptiveError
from adaptive.models.moe import MoEStats, _init_gate_state, convert_on_load, gate_routes

logger = logging.getLogger(__name__)

_EXPERT_KEY = re.compile(r"^(.*\.deepspeed_moe\.experts\.deepspeed_experts\.)(\d+)(\..*)$")


class DeepSpeedGate(TopKGate):
    """DeepSpeed's TopKGate with our routing (selection bias, DeepSpeed-identical math otherwise)."""

    def __init__(self, hidden_size: int, num_experts: int, k: int, capacity_factor: float,
                 eval_capacity_factor: float | None, min_capacity: int, drop_tokens: bool,
                 noisy_gate_policy: str | None, top2_2nd_expert_sampling: bool):
        super().__init__(hidden_size, num_experts, k, capacity_factor, eval_capacity_factor or 1.0, min_capacity,
                         noisy_gate_policy, drop_tokens, False, None, top2_2nd_expert_sampling)
        _init_gate_state(self, num_experts, k, capacity_factor, eval_capacity_factor, min_capacity, drop_tokens,
                         noisy_gate_policy, top2_2nd_expert_sampling)
        self.last_stats: MoEStats | None = None

    def forward(self, input, used_token=None, sparse_routes=False, use_tutel=False):  # noqa: A002 (DS's name)
        assert sparse_routes and not use_tutel, "DeepSpeedGate serves MOELayer's sparse dispatch only"
        routes = gate_routes(self, input, self.ep_group, used_token)
        self.last_stats = routes.stats
        # Under tensor parallelism MOELayer splits each expert's buffer over the TP ranks (drop_tokens), so the
        # buffer's capacity must divide by tp: pad it with empty slots; which tokens are kept does not change
        tp = tensor_parallel_size()
        capacity = routes.capacity if tp == 1 else (routes.capacity + tp - 1) // tp * tp
        return (routes.stats.l_aux, capacity, self.num_experts, routes.experts.int(),
                routes.locations.int(), routes.weights, routes.stats.expert_counts)


class DeepSpeedMoE(MoE):
    """deepspeed.moe.layer.MoE with our gate. forward(x) -> (y, MoEStats), like `NativeMoE`."""

    def __init__(self, hidden_size: int, expert: nn.Module, num_experts: int, k: int, ep_size: int,
                 capacity_factor: float, eval_capacity_factor: float | None, min_capacity: int, drop_tokens: bool,
                 noisy_gate_policy: str | None, top2_2nd_expert_sampling: bool):
        super().__init__(hidden_size, expert, num_experts=num_experts, ep_size=ep_size, k=k,
                         capacity_factor=capacity_factor, eval_capacity_factor=eval_capacity_factor or 1.0,
                         min_capacity=min_capacity, use_residual=False, noisy_gate_policy=noisy_gate_policy,
                         drop_tokens=drop_tokens, use_rts=False, enable_expert_tensor_parallelism=True,
                         top2_2nd_expert_sampling=top2_2nd_expert_sampling)
        self.deepspeed_moe.gate = DeepSpeedGate(hidden_size, num_experts, k, capacity_factor, eval_capacity_factor,
                                                min_capacity, drop_tokens, noisy_gate_policy,
                                                top2_2nd_expert_sampling)
        convert_on_load(self, to_deepspeed=True)  # checkpoints in our native (Mixtral) layout load as well

    @property
    def gate(self) -> DeepSpeedGate:
        return self.deepspeed_moe.gate

    @property
    def expert_parallel_ready(self) -> bool:
        return self.deepspeed_moe.ep_group is not None

    def set_deepspeed_parallelism(self, use_data_before_expert_parallel_: bool = False) -> None:
        # Idempotent: deepspeed.initialize calls this again after ensure_expert_parallel may have.
        if not self.expert_parallel_ready:
            gather_tokens_for_gloo()  # CPU runs: DeepSpeed's tensor-parallel token gather fails under gloo
            with prints_held(expert_group_line):  # DeepSpeed prints each group it creates: no news to the user
                super().set_deepspeed_parallelism(use_data_before_expert_parallel_)

    def forward(self, hidden_states: torch.Tensor, used: torch.Tensor | None = None) -> tuple[torch.Tensor, MoEStats]:
        if not self.expert_parallel_ready:
            missing = groups_missing(self.ep_size)
            if missing:
                raise AdaptiveError(missing)
            if dist.is_initialized():  # one rank (groups_missing refuses more): no other rank to wait for
                ensure_distributed(hidden_states.device)
                self.set_deepspeed_parallelism()
        output, _, _ = super().forward(hidden_states, None if used is None else used.reshape(-1))
        return output, self.gate.last_stats


def groups_missing(ep_size: int) -> str | None:
    """Why a DeepSpeed MoE forward cannot run before its expert groups exist, or None where it can: in one
    process (with or without torch.distributed) at ep_size 1."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        return ("DeepSpeed MoE under several processes needs its process groups before the first forward: call "
                "model.setup_expert_parallel() on every rank (from_pretrained, deepspeed.initialize and the recipes do)")
    if ep_size > 1:
        return (f"ep_size ({ep_size}) needs {ep_size} processes and this is one: launch with torchrun "
                f"--nproc_per_node {ep_size} or set ep_size=1")
    return None


def ensure_distributed(device: torch.device | None = None) -> None:
    """Initialise torch.distributed for DeepSpeed MoE if nothing has; never fails for one process."""
    import deepspeed
    import deepspeed.comm

    if dist.is_initialized():
        if not deepspeed.comm.is_initialized():  # initialised by torch alone: DeepSpeed's groups need its wrapper
            deepspeed.init_distributed(dist_backend=dist.get_backend(), auto_mpi_discovery=False)
        return

    launched = "WORLD_SIZE" in os.environ and "RANK" in os.environ
    backend = "gloo" if device is None or device.type == "cpu" else None
    logger.warning(
        "DeepSpeed MoE needs torch.distributed and nothing initialised it: initialising %s (backend=%s)",
        "from the launcher's environment" if launched else "a single-process group", backend or "default",
    )
    if not launched:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
        # one process needs no rendezvous: an in-memory store (no TCP port to lose, no file left behind)
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False)  # wraps an existing group


def ensure_expert_parallel(model: nn.Module, tp_size: int = 1) -> None:
    """Create DeepSpeed's expert/data-parallel groups for every DeepSpeed MoE block (inside AutoTP's mesh when
    `tp_size` > 1, the experts then sharded over it too). Idempotent."""
    blocks = [m for m in model.modules() if isinstance(m, DeepSpeedMoE)]
    if not blocks or all(b.expert_parallel_ready for b in blocks):
        return
    device = next(model.parameters()).device
    ensure_distributed(device)
    if tp_size > 1:
        use_tensor_parallel_mesh(tp_size)
    ep_size = blocks[0].ep_size
    if dist.get_world_size() % ep_size:
        raise AdaptiveError(
            f"ep_size ({ep_size}) must divide the world size ({dist.get_world_size()}); "
            f"launch with torchrun --nproc_per_node {ep_size} or set ep_size=1"
        )
    for block in blocks:
        block.set_deepspeed_parallelism()


def localize_expert_state_dict(state_dict: dict, num_experts: int, ep_size: int, ep_rank: int) -> dict:
    """A global state dict (experts 0..E-1) -> this rank's view (its E/ep_size experts, renumbered)."""
    local = num_experts // ep_size
    first = ep_rank * local
    out = {}
    for key, value in state_dict.items():
        match = _EXPERT_KEY.match(key)
        if match is None:
            out[key] = value
            continue
        expert = int(match.group(2))
        if first <= expert < first + local:
            out[f"{match.group(1)}{expert - first}{match.group(3)}"] = value
    return out


def globalize_expert_state_dict(model: nn.Module, state: dict | None = None) -> dict:
    """The full state dict (`state`, default the model's) with global expert ids, gathered over the
    expert-parallel group.

    A collective: call it on every rank. Each rank returns the same dict.
    """
    state = model.state_dict() if state is None else state
    blocks = [m for m in model.modules() if isinstance(m, DeepSpeedMoE)]
    if not blocks or blocks[0].ep_size == 1:
        return state
    ep_size = blocks[0].ep_size
    group = blocks[0].deepspeed_moe.ep_group
    local = blocks[0].num_local_experts
    out = {}
    for key, value in state.items():
        match = _EXPERT_KEY.match(key)
        if match is None:
            out[key] = value
            continue
        gathered = [torch.empty_like(value) for _ in range(ep_size)]
        dist.all_gather(gathered, value.contiguous(), group=group)
        for rank, tensor in enumerate(gathered):
            out[f"{match.group(1)}{rank * local + int(match.group(2))}{match.group(3)}"] = tensor
    return out


__all__ = [
    "DeepSpeedGate", "DeepSpeedMoE", "ensure_distributed", "ensure_expert_parallel", "expert_parallel_rank",
    "groups_missing", "localize_expert_state_dict", "globalize_expert_state_dict",
]
