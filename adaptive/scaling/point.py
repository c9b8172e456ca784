"""One sweep point, in its own process: the point's initial weights, then the recipe trains them.

    python -m adaptive.scaling.point POINT_DIR [recipe flags...]

POINT_DIR/point.json names the shape (arch, width, vocab, sequence, seed). The first start writes the model,
freshly initialised from the seed, to POINT_DIR/init (an adaptive export: config.json + safetensors); the
recipe then trains it with `--init-from POINT_DIR/init`, the path every recipe run takes (planning, run
folder, checkpoints, metrics.jsonl, `--resume auto`). A preset cannot name a sweep's tiny shapes, an init
checkpoint can. Exit codes are the recipe's: 0 done, 2 bad input or a run that diverged (one line).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

POINT_FILE = "point.json"
INIT_DIR = "init"


def write_init(folder: Path) -> Path:
    """POINT_DIR/init, written once (beside, then renamed in: a killed start leaves no half folder)."""
    import torch

    from adaptive.durable import fsync_tree, replace_dir, temporary_name
    from adaptive.models import AdaptiveConfig, AdaptiveForCausalLM
    from adaptive.scaling.grid import spec_for

    init = folder / INIT_DIR
    if (init / "config.json").is_file():
        return init
    p = json.loads((folder / POINT_FILE).read_text(encoding="utf-8"))
    torch.manual_seed(p["seed"])
    config = AdaptiveConfig.from_spec(spec_for(p["arch"], p["width"], p["vocab_size"], p["seq_len"]))
    tmp = temporary_name(init)
    AdaptiveForCausalLM(config).save_pretrained(tmp)
    fsync_tree(tmp)
    replace_dir(tmp, init)
    return init


def main(argv: list[str]) -> int:
    from adaptive.config.commandline import fail
    from adaptive.errors import AdaptiveError
    from adaptive.recipe import Recipe

    folder = Path(argv[0])
    try:
        arch = json.loads((folder / POINT_FILE).read_text(encoding="utf-8"))["arch"]
        init = write_init(folder)
    except (OSError, KeyError, json.JSONDecodeError, AdaptiveError) as err:
        return fail(f"sweep point {folder}: {err}")
    # the debug recipe names nothing here that the flags do not: --init-from is the shape, --lr and
    # --output-dir are given
    return Recipe(model="debug", arch=arch).main(["--init-from", str(init), "--arch", arch, *argv[1:]])


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
