"""Worker for test_expert_parallel.py: DeepSpeed MoE with ep_size=2 against a single-process reference.

Run by the test as:
    PYTHONPATH=<repo> python -m torch.distributed.run --nproc_per_node 2 tests/models/_ep_worker.py OUT_DIR

Each rank builds the same full model (native MoE, ep_size=1), loads its state dict into an ep_size=2
DeepSpeed model (each rank keeps its 2 of 4 experts), feeds both models this rank's own batch and
compares logits, losses and gradients. Expert gradients under EP collect tokens from both ranks, so
they are compared with the reference's gradients summed over ranks. Writes OUT_DIR/rank{r}.json.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist

from adaptive.errors import AdaptiveError
from adaptive.models import AdaptiveConfig, AdaptiveForCausalLM
from adaptive.models.moe import from_deepspeed_layout, to_deepspeed_layout
from adaptive.models.moe_deepspeed import ensure_distributed, localize_expert_state_dict

TINY = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, block_types=["moe", "hybrid"],
            num_attention_heads=4, num_key_value_heads=2, head_dim=8, moe_intermediate_size=48,
            num_local_experts=4, num_experts_per_tok=2, mod_capacity=0.5, capacity_factor=1.0, min_capacity=2)


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


def main(out_dir: str) -> None:
    # before the launcher's group exists: a one-process forward (ep_size 1) must leave nothing that stops it
    early = AdaptiveForCausalLM(AdaptiveConfig.from_preset("debug", arch="moe", moe_implementation="deepspeed", **TINY))
    early(torch.randint(0, 96, (1, 8)))
    ensure_distributed(torch.device("cpu"))
    rank, world = dist.get_rank(), dist.get_world_size()
    assert world == 2, world
    result: dict = {"rank": rank}
    try:  # under several processes a forward creates no group (a collective): it says what to call
        early(torch.randint(0, 96, (1, 8)))
        result["refused"] = ""
    except AdaptiveError as err:
        result["refused"] = str(err)
    torch.manual_seed(0)
    ref = AdaptiveForCausalLM(AdaptiveConfig.from_preset("debug", arch="hybrid", **TINY))
    # in DeepSpeed's names (experts split per expert), the layout the EP model holds
    full = {k: v.clone() for k, v in to_deepspeed_layout(ref.state_dict()).items()}
    ep = AdaptiveForCausalLM(AdaptiveConfig.from_preset("debug", arch="hybrid", moe_implementation="deepspeed",
                                                        ep_size=2, **TINY))
    ep.load_global_state_dict(full)
    local_experts = [n for n in ep.state_dict() if "deepspeed_experts" in n]
    result["local_expert_tensors"] = len(local_experts)
    expert0 = "model.layers.0.mlp.deepspeed_moe.experts.deepspeed_experts.0.up_proj.weight"
    result["expert0_is_global"] = 2 * rank
    result["expert0_matches_global"] = torch.equal(
        ep.state_dict()[expert0], full[expert0.replace("experts.0.", f"experts.{2 * rank}.")]
    )

    torch.manual_seed(100 + rank)  # each rank its own batch
    batch = torch.randint(0, 96, (2, 12))
    for mode in ("train", "eval"):
        ref.train(mode == "train")
        ep.train(mode == "train")
        ref.zero_grad()
        ep.zero_grad()
        out_ref = ref(batch, labels=batch)
        out_ep = ep(batch, labels=batch)
        if out_ref.logits is None:  # training with labels: the lean loss builds no logits; compare them without
            with torch.no_grad():
                result[f"{mode}_logits"] = max_diff(ref(batch).logits, ep(batch).logits)
        else:
            result[f"{mode}_logits"] = max_diff(out_ref.logits, out_ep.logits)
        result[f"{mode}_loss"] = abs(out_ref.loss.item() - out_ep.loss.item())
        result[f"{mode}_aux_loss"] = abs(out_ref.aux_loss.item() - out_ep.aux_loss.item())
        result[f"{mode}_dropped"] = out_ref.router_stats.dropped_fraction.tolist()
        if mode != "train":
            continue
        result["train_loss_value"] = out_ep.loss.item()
        out_ref.loss.backward()
        out_ep.loss.backward()
        ref_grads = {n: g.clone() for n, g in to_deepspeed_layout({n: p.grad for n, p in ref.named_parameters()}).items()}
        for name, grad in ref_grads.items():
            if "deepspeed_experts" in name:
                dist.all_reduce(grad)  # EP experts see both ranks' tokens
        local_ref = localize_expert_state_dict(ref_grads, 4, 2, rank)
        ep_grads = {n: p.grad for n, p in ep.named_parameters()}
        result["grad_names_match"] = sorted(ep_grads) == sorted(local_ref)
        result["grad_expert"] = max(max_diff(ep_grads[n], local_ref[n]) for n in ep_grads if "experts" in n)
        result["grad_other"] = max(max_diff(ep_grads[n], local_ref[n]) for n in ep_grads if "experts" not in n)

    gathered = ep.global_state_dict()
    result["global_state_dict"] = sorted(gathered) == sorted(full) and all(
        torch.equal(gathered[k], full[k]) for k in full
    )

    save_dir = os.path.join(out_dir, "checkpoint")
    if rank == 0:
        ref.save_pretrained(save_dir)
    dist.barrier()
    loaded = AdaptiveForCausalLM.from_pretrained(save_dir, moe_implementation="deepspeed", ep_size=2)
    expected = localize_expert_state_dict(full, 4, 2, rank)
    got = loaded.state_dict()
    result["from_pretrained_local_experts"] = sorted(got) == sorted(expected) and all(
        torch.equal(got[k], expected[k]) for k in expected
    )
    portable = os.path.join(out_dir, "portable")
    ep.save_pretrained(portable, is_main_process=rank == 0)  # gathers experts: every rank calls it
    dist.barrier()
    native = AdaptiveForCausalLM.from_pretrained(portable)
    result["saved_config_is_portable"] = (native.config.moe_implementation, native.config.ep_size) == ("native", 1)
    native_full = from_deepspeed_layout(full)
    result["saved_all_experts"] = all(torch.equal(native.state_dict()[k], native_full[k]) for k in native_full)
    result["ep_config_unchanged"] = (ep.config.moe_implementation, ep.config.ep_size) == ("deepspeed", 2)
    result.update(deepspeed_engine_step(ep, batch, result["train_loss_value"]))
    # causal routing where rank 1 routes nothing in the hybrid layer: it must still join the MoE all-to-all
    loaded.eval()
    with torch.no_grad():
        if rank == 1:
            loaded.model.layers[1].mod.router.weight.zero_()  # logit 0 -> never routed
        skip = loaded(batch).router_stats.mod_skip_rate[0].item()
    result["causal_skip_rate"] = skip
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.barrier()


def deepspeed_engine_step(model, batch, expected_loss: float) -> dict:
    """deepspeed.initialize (ZeRO-2, MoE param groups) on the already set-up EP model, one training step."""
    import deepspeed
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

    groups = split_params_into_different_moe_groups_for_optimizer({"params": list(model.parameters()), "name": "all"})
    optimizer = torch.optim.AdamW(groups, lr=1e-2)
    config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2}}
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    engine.train()
    expert = "module.model.layers.0.mlp.deepspeed_moe.experts.deepspeed_experts.0.up_proj.weight"
    before = engine.state_dict()[expert].clone()
    loss = engine(batch, labels=batch).loss
    engine.backward(loss)
    engine.step()
    return {"engine_loss": abs(loss.item() - expected_loss),
            "engine_step_moved_experts": not torch.equal(before, engine.state_dict()[expert])}


if __name__ == "__main__":
    main(sys.argv[1])
