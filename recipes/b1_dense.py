"""b1 as dense: the b1 (~1B parameters) preset as a dense decoder.

    accelerate launch recipes/b1_dense.py                  # a GPU box: plans for the GPUs it finds
    adaptive launch recipes/b1_dense.py --gpu a100-80gb --gpus 8 --nodes 2 --hostfile hosts
    python recipes/b1_dense.py --dry-run --gpu a100-80gb --gpus 8   # print the plan, no training

Flags: `python recipes/b1_dense.py --help`, or the Training section of README.md.
"""

from adaptive.train.entry import main

if __name__ == "__main__":
    raise SystemExit(main(preset="b1", arch="dense"))
