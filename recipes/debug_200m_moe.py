"""Train debug_200m as moe on DeepSpeed, sized by the planner for the GPUs found.

debug_200m: ~200M parameters. moe: Mixture-of-Experts,
8 experts, top-2, DeepSpeed MoE in every layer.

    accelerate launch --use_deepspeed --num_processes 8 recipes/debug_200m_moe.py   # a GPU box
    adaptive launch recipes/debug_200m_moe.py --gpu h100 --gpus 8 --nodes 2 --hostfile hosts
    python recipes/debug_200m_moe.py --dry-run --gpu a100-80gb --gpus 8   # the plan, no training

Flags: `python recipes/debug_200m_moe.py --help` and docs/training.md (Recipe flags).
"""

from adaptive.recipe import Recipe

recipe = Recipe(model="debug_200m", arch="moe")

if __name__ == "__main__":
    raise SystemExit(recipe.main())
