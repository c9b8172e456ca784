"""Train debug_200m as hybrid on DeepSpeed, sized by the planner for the GPUs found.

debug_200m: ~200M parameters. hybrid: MoE in every
block, every other block MoD-routed.

    accelerate launch --use_deepspeed --num_processes 8 recipes/debug_200m_hybrid.py   # a GPU box
    adaptive launch recipes/debug_200m_hybrid.py --gpu h100 --gpus 8 --nodes 2 --hostfile hosts
    python recipes/debug_200m_hybrid.py --dry-run --gpu a100-80gb --gpus 8   # the plan, no training

Flags: `python recipes/debug_200m_hybrid.py --help` and docs/training.md (Recipe flags).
"""

from adaptive.recipe import Recipe

recipe = Recipe(model="debug_200m", arch="hybrid")

if __name__ == "__main__":
    raise SystemExit(recipe.main())
