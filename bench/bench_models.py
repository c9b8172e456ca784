"""Step-time ratios of the adaptive model classes, measured side by side in one run on CPU.

    PYTHONPATH=. python bench/bench_models.py            # full run
    PYTHONPATH=. python bench/bench_models.py --quick    # smoke run
    PYTHONPATH=. python bench/bench_models.py --kernels-only   # lean vs plain kernels only

Shape: hidden 256, 8 layers, GQA 8/2 heads, SwiGLU 2.75x, vocab 2048, batch 4 x seq 512. The ratios that
matter are b1's: attention is ~20% of a layer's FLOPs at seq = hidden, the LM head ~6% of the model.
Each step is forward + backward (loss.backward, grads zeroed), models interleaved (each round starts one model
later), median of --repeats (3x that for the single MoE blocks). The MoE block rows also print the median over
rounds of the per-round ratio ("per round"), which a load change between rounds does not move.

Prints:
- MoD (capacity 0.125, every other block) vs dense; target <= 0.65x (ideal ~0.56x);
- MoD (capacity 0.5) vs dense;
- native MoE (8 experts, top-2, every layer) vs a dense model with the same active parameters; target <= 1.3x;
- our native MoE block vs transformers' MixtralSparseMoeBlock with the same weights (outputs checked equal
  first), at 8, 32 and 64 experts (top-2, 2048 tokens, expert width 704); target: not slower.
  Both blocks hold the same 3D expert tensors (Mixtral's layout) and run `torch._grouped_mm` on the CPU in
  fp32 (bitwise equal to a per-expert loop); ours with lean kernels (the default) and with plain ones,
  theirs `grouped_mm` (transformers' default) and `eager`;
- lean kernels (the default: adaptive/models/lean.py) vs plain kernels (transformers' Llama ops), dense and
  MoE; target <= 1.10x.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from adaptive.models import AdaptiveConfig, AdaptiveForCausalLM

SHAPE = dict(vocab_size=2048, hidden_size=256, intermediate_size=704, num_hidden_layers=8, num_attention_heads=8,
             num_key_value_heads=2, head_dim=32, max_position_embeddings=4096)


def build(arch: str, **overrides) -> AdaptiveForCausalLM:
    torch.manual_seed(0)
    layers = SHAPE["num_hidden_layers"]
    knobs = dict(mod_layer_freq=2, moe_layer_freq=1)
    block_types = None
    if arch != "dense":
        from adaptive.plan.architecture.presets import layer_pattern

        block_types = list(layer_pattern(arch, layers, knobs["moe_layer_freq"], knobs["mod_layer_freq"]))
    config = AdaptiveConfig.from_preset("debug", arch=arch, **{**SHAPE, "block_types": block_types or ["dense"] * layers,
                                                               "moe_intermediate_size": 704, **overrides})
    return AdaptiveForCausalLM(config).train()


def lm_step(model: torch.nn.Module, ids: torch.Tensor) -> None:
    model.zero_grad(set_to_none=True)
    model(ids, labels=ids).loss.backward()


def block_step(block: torch.nn.Module, x: torch.Tensor) -> None:
    block.zero_grad(set_to_none=True)
    out = block(x)
    out = out[0] if isinstance(out, tuple) else out
    out.float().square().mean().backward()


CLOCK = time.perf_counter  # --cpu-time: time.process_time, the CPU this process used (steadier on a shared machine)


def time_interleaved(cases: dict, repeats: int, samples: dict | None = None) -> dict[str, float]:
    """Median seconds per call; one warm-up each, then the cases take turns, each round starting one case later
    (no case always runs first or right after the same one). `samples` (a dict) receives the per-round times."""
    for fn in cases.values():
        fn()
    names = list(cases)
    samples = {} if samples is None else samples
    samples.update({name: [] for name in names})
    for round_ in range(repeats):
        for name in names[round_ % len(names):] + names[:round_ % len(names)]:
            start = CLOCK()
            cases[name]()
            samples[name].append(CLOCK() - start)
    return {name: statistics.median(values) for name, values in samples.items()}


def paired_ratio(samples: dict, a: str, b: str) -> float:
    """Median over rounds of a's time / b's in the same round: a load change between rounds cancels out."""
    return statistics.median(x / y for x, y in zip(samples[a], samples[b]))


def mixtral_twin(block) -> torch.nn.Module:
    """transformers' MixtralSparseMoeBlock carrying the weights of our native block (the same layout)."""
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    config = MixtralConfig(hidden_size=SHAPE["hidden_size"], intermediate_size=704, num_local_experts=block.num_experts,
                           num_experts_per_tok=2)
    twin = MixtralSparseMoeBlock(config)
    with torch.no_grad():
        twin.gate.weight.copy_(block.gate.weight)
        twin.experts.gate_up_proj.copy_(block.experts.gate_up_proj)
        twin.experts.down_proj.copy_(block.experts.down_proj)
    return twin.train()


def moe_block_rows(x: torch.Tensor, repeats: int, experts: int, eager: bool = True) -> tuple[dict[str, float], float]:
    """ms per fwd+bwd of our block (no drop; lean and plain kernels) and Mixtral's (grouped_mm, eager) at
    `experts` experts."""
    ours = build("moe", drop_tokens=False, num_local_experts=experts).model.layers[0].mlp.train()
    plain = build("moe", drop_tokens=False, num_local_experts=experts, kernels="plain").model.layers[0].mlp.train()
    plain.load_state_dict(ours.state_dict())
    theirs = mixtral_twin(ours)
    with torch.no_grad():
        diff = (ours(x)[0] - theirs(x[None])[0]).abs().max().item()
    assert diff < 1e-5, f"native MoE block and Mixtral block disagree by {diff} at {experts} experts"
    theirs.experts.config._experts_implementation = "grouped_mm"  # transformers' default for Mixtral models
    samples = {}
    times = time_interleaved({"ours": lambda: block_step(ours, x), "ours_plain": lambda: block_step(plain, x),
                              "mixtral_grouped_mm": lambda: block_step(theirs, x[None])}, repeats, samples)
    times["paired"] = paired_ratio(samples, "ours", "mixtral_grouped_mm")
    times["paired_plain"] = paired_ratio(samples, "ours_plain", "mixtral_grouped_mm")
    theirs.experts.config._experts_implementation = "eager"
    times["mixtral_eager"] = float("nan")
    if eager:
        times.update(time_interleaved({"mixtral_eager": lambda: block_step(theirs, x[None])}, repeats))
    return times, diff


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--quick", action="store_true", help="2 repeats, seq 128")
    parser.add_argument("--experts", type=int, nargs="+", default=[8, 32, 64],
                        help="expert counts of the MoE block rows")
    parser.add_argument("--blocks-only", action="store_true", help="only the MoE block rows (skip the models)")
    parser.add_argument("--kernels-only", action="store_true", help="only lean vs plain kernels")
    parser.add_argument("--no-eager", action="store_true", help="skip Mixtral's eager experts (minutes at 64 experts)")
    parser.add_argument("--cpu-time", action="store_true", help="time the process's CPU use, not the wall clock")
    args = parser.parse_args()
    if args.cpu_time:
        global CLOCK
        CLOCK = time.process_time
    if args.quick:
        args.repeats, args.seq = 2, 128
    torch.set_num_threads(args.threads)
    ids = torch.randint(0, SHAPE["vocab_size"], (args.batch, args.seq), generator=torch.Generator().manual_seed(0))

    models = {} if args.blocks_only else {
        "dense": build("dense"),
        "dense_plain": build("dense", kernels="plain"),
        "moe_native": build("moe"),
        "moe_native_plain": build("moe", kernels="plain"),
    }
    if not args.kernels_only:
        models.update({
            "mod_0.125": build("mod", mod_capacity=0.125),
            "mod_0.5": build("mod", mod_capacity=0.5),
            "dense_same_active": build("dense", intermediate_size=2 * 704),
        })
    times = time_interleaved({name: (lambda m=m: lm_step(m, ids)) for name, m in models.items()}, args.repeats)
    if args.blocks_only:
        times = dict.fromkeys(("dense", "dense_plain", "mod_0.125", "mod_0.5", "moe_native", "moe_native_plain",
                               "dense_same_active"), float("nan"))
    kernel_rows = [
        ("dense: lean kernels / plain kernels", times["dense"] / times["dense_plain"], "<= 1.10"),
        ("native MoE: lean kernels / plain kernels", times["moe_native"] / times["moe_native_plain"], "<= 1.10"),
    ]
    if args.kernels_only:
        print(f"CPU, {args.threads} threads, batch {args.batch} x seq {args.seq}, median of {args.repeats} fwd+bwd steps")
        for name, seconds in times.items():
            print(f"  {name:<20} {seconds * 1e3:8.1f} ms/step")
        for name, ratio, target in kernel_rows:
            print(f"{name:<45} {ratio:6.3f}x   target {target}")
        return

    x = torch.randn(args.batch * args.seq, SHAPE["hidden_size"], generator=torch.Generator().manual_seed(1))
    capacity_block = build("moe").model.layers[0].mlp.train()  # capacity_factor 1.0: the training default
    capacity_ms = time_interleaved({"c": lambda: block_step(capacity_block, x)}, 3 * args.repeats)["c"]
    # blocks are fast: more repeats
    experts_rows = {e: moe_block_rows(x, 3 * args.repeats, e, not args.no_eager) for e in args.experts}

    print(f"CPU, {args.threads} threads, batch {args.batch} x seq {args.seq}, hidden {SHAPE['hidden_size']}, "
          f"{SHAPE['num_hidden_layers']} layers, median of {args.repeats} fwd+bwd steps")
    for name, seconds in times.items():
        print(f"  {name:<20} {seconds * 1e3:8.1f} ms/step")
    rows = kernel_rows + [
        ("MoD 0.125 (every other block) / dense", times["mod_0.125"] / times["dense"], "<= 0.65 (ideal ~0.56)"),
        ("MoD 0.5 / dense", times["mod_0.5"] / times["dense"], "report"),
        ("native MoE 8x top-2 / dense same active", times["moe_native"] / times["dense_same_active"], "<= 1.3"),
    ]
    print(f"MoE block fwd+bwd on {x.shape[0]} tokens, top-2, expert width 704 (ours with capacity 1.0, 8 experts: "
          f"{capacity_ms * 1e3:.1f} ms/step):")
    print(f"  {'experts':>7} {'ours':>9} {'ours plain':>11} {'grouped_mm':>11} {'eager':>9}   max |ours - Mixtral|")
    for e, (t, diff) in experts_rows.items():
        print(f"  {e:>7} {t['ours'] * 1e3:9.1f} {t['ours_plain'] * 1e3:11.1f} {t['mixtral_grouped_mm'] * 1e3:11.1f}"
              f" {t['mixtral_eager'] * 1e3:9.1f}   {diff:.1e}")
        rows += [
            (f"our MoE block / Mixtral grouped_mm, {e} experts", t["ours"] / t["mixtral_grouped_mm"], "<= 1.0"),
            (f"our MoE block plain / Mixtral grouped_mm, {e} experts", t["ours_plain"] / t["mixtral_grouped_mm"],
             "<= 1.0"),
            (f"our MoE block / Mixtral grouped_mm, {e} experts, per round", t["paired"], "<= 1.0"),
            (f"our MoE block plain / Mixtral grouped_mm, {e} experts, per round", t["paired_plain"], "<= 1.0"),
            (f"our MoE block / Mixtral eager, {e} experts", t["ours"] / t["mixtral_eager"], "<= 1.0"),
        ]
    for name, ratio, target in rows:
        print(f"{name:<45} {ratio:6.3f}x   target {target}")


if __name__ == "__main__":
    main()
