"""Train debug as mod on DeepSpeed, sized by the planner for the GPUs found.

debug: ~0.5M parameters, trains on a CPU in seconds. mod: Mixture-of-Depths,
every other block routed at capacity 0.5.

    accelerate launch --use_deepspeed --num_processes 1 recipes/debug_mod.py --max-steps 40  # CPU
    accelerate launch --use_deepspeed --num_processes 8 recipes/debug_mod.py   # a GPU box
    python recipes/debug_mod.py --dry-run --gpu a100-80gb --gpus 8   # the plan, no training

Flags: `python recipes/debug_mod.py --help` and docs/training.md (Recipe flags).
"""

from adaptive.recipe import Recipe

recipe = Recipe(model="debug", arch="mod")

if __name__ == "__main__":
    raise SystemExit(recipe.main())
