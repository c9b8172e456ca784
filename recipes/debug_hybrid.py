"""Train debug as hybrid on DeepSpeed, sized by the planner for the GPUs found.

debug: ~0.5M parameters, trains on a CPU in seconds. hybrid: MoE in every
block, every other block MoD-routed.

    accelerate launch --use_deepspeed --num_processes 1 recipes/debug_hybrid.py --max-steps 40  # CPU
    accelerate launch --use_deepspeed --num_processes 8 recipes/debug_hybrid.py   # a GPU box
    python recipes/debug_hybrid.py --dry-run --gpu a100-80gb --gpus 8   # the plan, no training

Flags: `python recipes/debug_hybrid.py --help` and docs/training.md (Recipe flags).
"""

from adaptive.recipe import Recipe

recipe = Recipe(model="debug", arch="hybrid")

if __name__ == "__main__":
    raise SystemExit(recipe.main())
