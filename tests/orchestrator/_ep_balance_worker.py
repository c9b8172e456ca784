"""Worker for test_balance.py: DeepSpeed MoE, ep_size=2, two processes, balancing off then on.

    PYTHONPATH=<repo> python -m torch.distributed.run --nproc_per_node 2 tests/orchestrator/_ep_balance_worker.py \
        OUT_DIR STEPS RATE

Each rank holds 4 of the 8 experts (DeepSpeed's layout) and a replica of the gates; each feeds its
own fixed batches. The same skewed model trains through a DeepSpeed engine (ZeRO-2, MoE param
groups) with the orchestrator's monitor, balancing and EP-advice policies. Writes OUT_DIR/rank{r}.json.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist

from adaptive.models.moe_deepspeed import ensure_distributed
from adaptive.orchestrator import OrchestratorConfig, policies
from tests.orchestrator._harness import fixed_data, knobs, run_steps, skewed_moe


def train(balance: bool, steps: int, rate: float, rank: int) -> dict:
    import deepspeed
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

    from adaptive.train.run.setup import reinit_local_experts

    model = skewed_moe(moe_implementation="deepspeed", ep_size=2)
    reinit_local_experts(model, seed=0)  # each rank draws its own experts; the gates stay replicated
    groups = split_params_into_different_moe_groups_for_optimizer({"params": list(model.parameters()), "name": "all"})
    optimizer = torch.optim.AdamW(groups, lr=3e-3)
    config = {"train_micro_batch_size_per_gpu": 8, "zero_optimization": {"stage": 2}, "gradient_clipping": 1.0}
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    settings = {"balance": {"rate": rate}, "monitor": {"every": 10}, "ep": {"sample_every": 5}}
    callbacks = policies(OrchestratorConfig(policies=("balance", "ep") if balance else ("ep",), settings=settings))
    run = run_steps(model, callbacks, fixed_data(1 + rank), steps, engine=engine, knob_set=knobs(ep_size=2),
                    world_size=dist.get_world_size())
    loss = torch.tensor(sum(run.losses[-10:]) / 10, dtype=torch.float64)
    dist.all_reduce(loss)
    ep = next(c for c in callbacks if getattr(c, "name", "") == "ep")
    return {"model": model, "max_vio": callbacks[0].latest.max_vio_max, "loss": loss.item() / dist.get_world_size(),
            "a2a_share": ep.a2a_share(), "recommendation": ep.recommendation.ep_size}


def main(out_dir: str, steps: int, rate: float) -> None:
    ensure_distributed(torch.device("cpu"))
    rank, world = dist.get_rank(), dist.get_world_size()
    assert world == 2, world
    off = train(False, steps, rate, rank)
    on = train(True, steps, rate, rank)
    gates = on["model"].moe_gates()
    bias = torch.stack([g.e_score_correction_bias.detach() for g in gates])
    gathered = [torch.empty_like(bias) for _ in range(world)]
    dist.all_gather(gathered, bias)
    result = {
        "rank": rank,
        "ep_size": on["model"].config.ep_size,
        "local_experts": on["model"].model.layers[0].mlp.num_local_experts,
        "bias_on": bias.tolist(),
        "bias_bits_equal": all(torch.equal(g.view(torch.int32), bias.view(torch.int32)) for g in gathered),
        "bias_moved": bool(bias.abs().max() > 0),
        "max_vio_off": off["max_vio"], "max_vio_on": on["max_vio"],
        "loss_off": off["loss"], "loss_on": on["loss"],
        "a2a_share": on["a2a_share"], "recommended_ep_size": on["recommendation"],
    }
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.barrier()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), float(sys.argv[3]))
