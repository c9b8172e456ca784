"""Train debug as dense on DeepSpeed, sized by the planner for the GPUs found.

debug: ~0.5M parameters, trains on a CPU in seconds. dense: a dense decoder.

    accelerate launch --use_deepspeed --num_processes 1 recipes/debug_dense.py --max-steps 40  # CPU
    accelerate launch --use_deepspeed --num_processes 8 recipes/debug_dense.py   # a GPU box
    python recipes/debug_dense.py --dry-run --gpu a100-80gb --gpus 8   # the plan, no training

Flags: `python recipes/debug_dense.py --help` and docs/training.md (Recipe flags).
"""

from adaptive.recipe import Recipe

recipe = Recipe(model="debug", arch="dense")

if __name__ == "__main__":
    raise SystemExit(recipe.main())
