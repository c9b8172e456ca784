"""Write ds_configs/*.json from the planner's emitter (`adaptive.plan.ds_config.emit.preset_ds_configs`).

    python ds_configs/generate.py

tests/train/run/test_ds_configs.py fails when a checked-in file differs from what this writes.
"""

import json
from pathlib import Path

from adaptive.plan.ds_config.emit import preset_ds_configs

if __name__ == "__main__":
    here = Path(__file__).resolve().parent
    for name, cfg in preset_ds_configs().items():
        (here / f"{name}.json").write_text(json.dumps(cfg, indent=2) + "\n")
