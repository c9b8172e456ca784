"""Run real DeepSpeed training steps on the CPU for each ZeRO stage and print the tracked peak.

Invoked by test_memory_measured_deepspeed.py in a fresh process (it initialises torch.distributed).
Prints one JSON object: {stage: peak_bytes}. Everything from model creation on is tracked, so
DeepSpeed's own buffers (fp32 master copies, gradient partitions, buckets) count.
"""

import json
import os
import socket
import sys

import torch

with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")

import deepspeed  # noqa: E402
from torch.distributed._tools.mem_tracker import MemTracker  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402


def main() -> None:
    config = json.loads(sys.argv[1])
    ds_configs = json.loads(sys.argv[2])  # stage -> ds_config dict, from our emitter
    seq = int(sys.argv[3])
    cfg = LlamaConfig(**{k: v for k, v in config.items() if k != "model_type"}, attn_implementation="sdpa")
    peaks = {}
    for stage, ds in ds_configs.items():
        torch.manual_seed(0)
        tracker = MemTracker()
        with tracker:
            model = LlamaForCausalLM(cfg).to(torch.bfloat16)
            # fused AdamW: no foreach temporaries, as our training loop uses
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
            engine, _, _, _ = deepspeed.initialize(model=model, config=ds, optimizer=optimizer)
            ids = torch.randint(0, cfg.vocab_size, (1, seq))
            # steady state: the optimizer states exist from the first optimizer step on
            for _ in range(2 * ds.get("gradient_accumulation_steps", 1)):
                tracker.reset_mod_stats()
                engine.backward(engine(input_ids=ids, labels=ids).loss)
                engine.step()
            peaks[stage] = sum(d["Total"] for d in tracker.get_tracker_snapshot("peak").values())
        del engine, model, optimizer
    print(json.dumps(peaks))


if __name__ == "__main__":
    main()
