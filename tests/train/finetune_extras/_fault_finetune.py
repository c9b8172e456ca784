"""The fine-tune recipe with one fault on one rank, on the first start only (tests/train/faults/_fault_recipe.py's
faults, FAULT in the environment); `adaptive launch` reads its `recipe` declaration like recipes/finetune.py's:

    FAULT='{"rank": 1, "step": 5, "fault": "sigkill"}' adaptive launch tests/train/finetune_extras/_fault_finetune.py \
        --gpus 2 --max-restarts 1 --init-from CKPT --dataset chat.jsonl FLAGS
"""

from __future__ import annotations

import json
import os

from adaptive.recipe import Recipe
from adaptive.train.run.restart import restart_count

recipe = Recipe(finetune="lora")

if __name__ == "__main__":
    from tests.train.faults._fault_recipe import Fault, kill_inside_checkpoint

    spec = json.loads(os.environ.get("FAULT", "null"))
    callbacks = []
    if spec and restart_count() == 0 and int(os.environ.get("RANK", "0")) == spec["rank"]:
        if spec["fault"] == "sigkill_in_checkpoint":
            kill_inside_checkpoint(spec["step"], spec["rank"])
        else:
            callbacks.append(Fault(spec))
    raise SystemExit(recipe.main(callbacks=callbacks))
