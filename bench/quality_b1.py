"""The brief's B1 scenario (20B tokens, three epochs of a 6.7B-token subset) side by side: our predicted final
loss for b1 dense, moe, mod and hybrid under each published law, next to the brief's projected losses.

    python bench/quality_b1.py
"""

from __future__ import annotations

import argparse

from adaptive.plan import count_params, preset_spec
from adaptive.plan.quality.predict import predict, resolve_law

BRIEF = {"dense": 3.18, "moe": 3.01, "mod": 3.25, "hybrid": 2.93}  # ../shared/seeds: "Small-Scale Models", B1
TOKENS, UNIQUE = 20e9, 6.7e9


def rows() -> list[dict]:
    out = []
    for arch, brief in BRIEF.items():
        spec = preset_spec("b1", arch)
        counts = count_params(spec)
        row = {"arch": arch, "params": counts.total, "active": counts.active, "brief": brief}
        for law in ("epoch", "chinchilla"):
            q = predict(spec, counts, TOKENS, resolve_law(law), unique_tokens=UNIQUE)
            row[law] = q.predicted_loss
            row[f"{law}_band"] = q.band
        out.append(row)
    return out


def main() -> None:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()
    table = rows()
    dense = {law: table[0][law] for law in ("epoch", "chinchilla")}
    print("| b1 | params (active) | brief | brief vs dense | ours: epoch (band) | ours vs dense | ours: chinchilla |")
    print("|---|---|---|---|---|---|---|")
    for r in table:
        lo, hi = r["epoch_band"]
        print(f"| {r['arch']} | {r['params'] / 1e9:.2f}B ({r['active'] / 1e9:.2f}B) | {r['brief']:.2f} | "
              f"{(r['brief'] / BRIEF['dense'] - 1):+.1%} | {r['epoch']:.3f} ({lo:.3f}-{hi:.3f}) | "
              f"{(r['epoch'] / dense['epoch'] - 1):+.1%} | {r['chinchilla']:.3f} |")


if __name__ == "__main__":
    main()
