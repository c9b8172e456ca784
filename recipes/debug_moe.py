"""debug as moe: the debug (~0.5M parameters; runs on a CPU) preset as Mixture-of-Experts: 8 experts, top-2, DeepSpeed MoE in every layer.

    accelerate launch --use_deepspeed --num_processes 1 recipes/debug_moe.py --max-steps 40   # CPU
    accelerate launch recipes/debug_moe.py                  # a GPU box: plans for the GPUs it finds
    python recipes/debug_moe.py --dry-run --gpu a100-80gb --gpus 8   # print the plan, no training

Flags: `python recipes/debug_moe.py --help`, or the Training section of README.md.
"""

from adaptive.train.entry import main

if __name__ == "__main__":
    raise SystemExit(main(preset="debug", arch="moe"))
