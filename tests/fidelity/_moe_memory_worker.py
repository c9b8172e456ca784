"""One training step's memory of the debug MoE model, on real bf16 CPU tensors, for one MoE implementation.

Run by test_deepspeed_moe_memory.py in a fresh process (DeepSpeed MoE initialises torch.distributed).
Prints one JSON object: bytes live after forward (parameters + what autograd saved), the backward peak
above that, and the step's peak, counted by the same storage counter `adaptive measure` uses.
"""

import gc
import json
import sys

import torch
import torch.distributed as dist

from adaptive.fidelity.measure import PeakBytes
from adaptive.models import AdaptiveConfig, AdaptiveForCausalLM


def main() -> None:
    impl, seq, batch = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    # an in-memory store: no TCP port to race for with tests running beside this one, no file left
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    if impl == "deepspeed":
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)  # wraps the group above
    torch.manual_seed(0)
    config = AdaptiveConfig.from_preset("debug", arch="moe", moe_implementation=impl)
    model = AdaptiveForCausalLM(config).to(torch.bfloat16).train()
    model.setup_expert_parallel()  # DeepSpeed's expert groups, before the first forward
    ids = torch.randint(0, config.vocab_size, (batch, seq))
    model(input_ids=ids, labels=ids).loss.backward()  # warm-up: lazy buffers
    model.zero_grad(set_to_none=True)
    gc.collect()
    counter = PeakBytes()
    with counter:
        out = model(input_ids=ids, labels=ids)
        after_forward = counter.current
        counter.reset_peak()
        out.loss.backward()
    print(json.dumps({"after_forward": after_forward, "backward": counter.peak - after_forward,
                      "peak": counter.peak}))


if __name__ == "__main__":
    main()
