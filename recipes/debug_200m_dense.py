"""Train debug_200m as dense on DeepSpeed, sized by the planner for the GPUs found.

debug_200m: ~200M parameters. dense: a dense decoder.

    accelerate launch --use_deepspeed --num_processes 8 recipes/debug_200m_dense.py   # a GPU box
    adaptive launch recipes/debug_200m_dense.py --gpu h100 --gpus 8 --nodes 2 --hostfile hosts
    python recipes/debug_200m_dense.py --dry-run --gpu a100-80gb --gpus 8   # the plan, no training

Flags: `python recipes/debug_200m_dense.py --help` and docs/training.md (Recipe flags).
"""

from adaptive.recipe import Recipe

recipe = Recipe(model="debug_200m", arch="dense")

if __name__ == "__main__":
    raise SystemExit(recipe.main())
