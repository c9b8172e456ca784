"""b7 as hybrid: the b7 (~7B parameters, Mistral-7B's shape) preset as hybrid MoE + MoD: MoD-routed blocks whose MLPs are MoE layers.

    accelerate launch recipes/b7_hybrid.py                  # a GPU box: plans for the GPUs it finds
    adaptive launch recipes/b7_hybrid.py --gpu a100-80gb --gpus 8 --nodes 2 --hostfile hosts
    python recipes/b7_hybrid.py --dry-run --gpu a100-80gb --gpus 8   # print the plan, no training

Flags: `python recipes/b7_hybrid.py --help`, or the Training section of README.md.
"""

from adaptive.train.entry import main

if __name__ == "__main__":
    raise SystemExit(main(preset="b7", arch="hybrid"))
