"""debug_200m as moe: the debug_200m (~200M parameters) preset as Mixture-of-Experts: 8 experts, top-2, DeepSpeed MoE in every layer.

    accelerate launch recipes/debug_200m_moe.py                  # a GPU box: plans for the GPUs it finds
    adaptive launch recipes/debug_200m_moe.py --gpu a100-80gb --gpus 8 --nodes 2 --hostfile hosts
    python recipes/debug_200m_moe.py --dry-run --gpu a100-80gb --gpus 8   # print the plan, no training

Flags: `python recipes/debug_200m_moe.py --help`, or the Training section of README.md.
"""

from adaptive.train.entry import main

if __name__ == "__main__":
    raise SystemExit(main(preset="debug_200m", arch="moe"))
