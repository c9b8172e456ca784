"""Train debug as moe on DeepSpeed, sized by the planner for the GPUs found.

debug: ~0.5M parameters, trains on a CPU in seconds. moe: Mixture-of-Experts,
8 experts, top-2, DeepSpeed MoE in every layer.

    accelerate launch --use_deepspeed --num_processes 1 recipes/debug_moe.py --max-steps 40  # CPU
    accelerate launch --use_deepspeed --num_processes 8 recipes/debug_moe.py   # a GPU box
    python recipes/debug_moe.py --dry-run --gpu a100-80gb --gpus 8   # the plan, no training

Flags: `python recipes/debug_moe.py --help` and docs/training.md (Recipe flags).
"""

from adaptive.recipe import Recipe

recipe = Recipe(model="debug", arch="moe")

if __name__ == "__main__":
    raise SystemExit(recipe.main())
