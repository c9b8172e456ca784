"""The fine-tune recipe with one fault on one rank, on the first start only (tests/train/faults/_fault_recipe.py's
faults, FAULT in the environment); `adaptive launch` reads its `recipe` declaration like recipes/finetune.py's:

    FAULT='{"rank": 1, "step": 5, "fault": "sigkill"}' adaptive launch tests/train/finetune_extras/_fault_finetune.py \
        --gpus 2 --max-restarts 1 --init-from CKPT --dataset chat.jsonl FLAGS
"""

from __future__ import annotations

from adaptive.recipe import Recipe

recipe = Recipe(finetune="lora")

if __name__ == "__main__":
    from tests.train.faults._fault_recipe import main_with_fault

    raise SystemExit(main_with_fault(recipe))
