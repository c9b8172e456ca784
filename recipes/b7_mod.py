"""b7 as mod: the b7 (~7B parameters, Mistral-7B's shape) preset as Mixture-of-Depths: every other block routed, capacity 0.5.

    accelerate launch recipes/b7_mod.py                  # a GPU box: plans for the GPUs it finds
    adaptive launch recipes/b7_mod.py --gpu a100-80gb --gpus 8 --nodes 2 --hostfile hosts
    python recipes/b7_mod.py --dry-run --gpu a100-80gb --gpus 8   # print the plan, no training

Flags: `python recipes/b7_mod.py --help`, or the Training section of README.md.
"""

from adaptive.train.entry import main

if __name__ == "__main__":
    raise SystemExit(main(preset="b7", arch="mod"))
