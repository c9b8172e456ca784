"""Train debug_200m as mod on DeepSpeed, sized by the planner for the GPUs found.

debug_200m: ~200M parameters. mod: Mixture-of-Depths,
every other block routed at capacity 0.5.

    accelerate launch --use_deepspeed --num_processes 8 recipes/debug_200m_mod.py   # a GPU box
    adaptive launch recipes/debug_200m_mod.py --gpu h100 --gpus 8 --nodes 2 --hostfile hosts
    python recipes/debug_200m_mod.py --dry-run --gpu a100-80gb --gpus 8   # the plan, no training

Flags: `python recipes/debug_200m_mod.py --help` and docs/training.md (Recipe flags).
"""

from adaptive.recipe import Recipe

recipe = Recipe(model="debug_200m", arch="mod")

if __name__ == "__main__":
    raise SystemExit(recipe.main())
