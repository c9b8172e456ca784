"""`adaptive models` and `adaptive gpus`: the presets and the GPU catalog."""

from __future__ import annotations

import json
from dataclasses import asdict
from typing import Annotated

import typer

from adaptive.plan import ARCHS, CATALOG, PRESETS, count_params, preset_spec
from adaptive.plan.hardware.gpus import figures, gib_figure

Json = Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")]


def model_rows() -> list[dict]:
    rows = []
    for name in PRESETS:
        for arch in ARCHS:
            s = preset_spec(name, arch)
            c = count_params(s)
            rows.append({
                "model": name, "arch": arch, "layers": s.num_hidden_layers, "hidden_size": s.hidden_size,
                "num_attention_heads": s.num_attention_heads, "num_key_value_heads": s.num_key_value_heads,
                "head_dim": s.head_dim, "intermediate_size": s.intermediate_size, "vocab_size": s.vocab_size,
                "num_experts": s.num_local_experts, "top_k": s.num_experts_per_tok,
                "moe_layers": s.num_moe_layers, "mod_capacity": s.mod_capacity if s.is_mod else None,
                "mod_layers": s.num_mod_layers, "params_total": c.total, "params_active": c.active,
            })
    return rows


def models(json_output: Json = False) -> None:
    """Every preset and architecture with its shape and exact parameter counts."""
    rows = model_rows()
    if json_output:
        print(json.dumps(rows, indent=2))
        return
    from rich import box
    from rich.table import Table

    from cli.render import console, human

    t = Table(title="Model presets (Llama-style: RMSNorm, RoPE, GQA, SwiGLU)", box=box.SIMPLE_HEAD)
    for col in ("model", "arch", "layers", "hidden", "heads/kv", "FFN", "experts", "top-k", "MoD capacity",
                "total params", "active params"):
        t.add_column(col, justify="left" if col in ("model", "arch") else "right")
    for r in rows:
        t.add_row(r["model"], r["arch"], str(r["layers"]), str(r["hidden_size"]),
                  f"{r['num_attention_heads']}/{r['num_key_value_heads']}", str(r["intermediate_size"]),
                  str(r["num_experts"] or "-"), str(r["top_k"] or "-"),
                  f"{r['mod_capacity']:g} ({r['mod_layers']} layers)" if r["mod_capacity"] else "-",
                  human(r["params_total"]), human(r["params_active"]))
    console.print(t)


def gpus(json_output: Json = False) -> None:
    """The GPU catalog: memory, peak 16-bit TFLOP/s, bf16, bandwidth, link, default price, kernel speeds."""
    if json_output:
        print(json.dumps([dict(asdict(g), inter_node_gbps=figures(g.name).inter_node_gbps) for g in CATALOG.values()],
                         indent=2))
        return
    from rich import box
    from rich.table import Table

    from cli.render import console

    t = Table(title="GPU catalog (prices: typical on-demand USD per GPU hour; override with --price)",
              box=box.SIMPLE_HEAD)
    for col in ("gpu", "memory GiB", "TFLOP/s 16-bit", "bf16", "HBM GB/s", "intra-node link", "inter-node GB/s per GPU", "$/h",
                "matmul TFLOP/s", "flash-attn TFLOP/s"):
        t.add_column(col, justify="left" if col in ("gpu", "intra-node link") else "right")
    for g in CATALOG.values():
        t.add_row(g.name, gib_figure(g.memory_bytes), f"{g.peak_tflops:g}", "yes" if g.bf16 else "no (fp16)",
                  f"{g.memory_bandwidth_gbps:g}", g.link, f"{figures(g.name).inter_node_gbps:g}",
                  f"{g.price_per_hour:.2f}", f"{g.peak_tflops * figures(g.name).kernels.matmul_fraction:.0f}",
                  f"{g.peak_tflops * figures(g.name).kernels.attention_fraction:.0f}")
    console.print(t)
