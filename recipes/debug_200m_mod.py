"""debug_200m as mod: the debug_200m (~200M parameters) preset as Mixture-of-Depths: every other block routed, capacity 0.5.

    accelerate launch recipes/debug_200m_mod.py                  # a GPU box: plans for the GPUs it finds
    adaptive launch recipes/debug_200m_mod.py --gpu a100-80gb --gpus 8 --nodes 2 --hostfile hosts
    python recipes/debug_200m_mod.py --dry-run --gpu a100-80gb --gpus 8   # print the plan, no training

Flags: `python recipes/debug_200m_mod.py --help`, or the Training section of README.md.
"""

from adaptive.train.entry import main

if __name__ == "__main__":
    raise SystemExit(main(preset="debug_200m", arch="mod"))
