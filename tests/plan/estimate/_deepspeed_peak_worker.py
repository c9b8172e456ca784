"""Real DeepSpeed training steps on the CPU, one engine per named run, printing each tracked peak.

Invoked by test_memory_measured_deepspeed.py and test_memory_measured_deepspeed_inputs.py in a fresh
process (it initialises torch.distributed). argv: model config JSON, runs JSON {name: {"ds": ds_config
dict, "optimizer": "fused" | "foreach"}}, sequence length. Prints one JSON object {name: peak_bytes}.
Everything from model creation on is tracked, so DeepSpeed's own buffers (fp32 master copies, gradient
partitions, buckets) count; two accumulation cycles reach the steady state (optimizer states exist from
the first optimizer step on).
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
    runs = json.loads(sys.argv[2])
    seq = int(sys.argv[3])
    cfg = LlamaConfig(**{k: v for k, v in config.items() if k != "model_type"}, attn_implementation="sdpa")
    peaks = {}
    for name, run in runs.items():
        torch.manual_seed(0)
        tracker = MemTracker()
        ds = run["ds"]
        with tracker:
            model = LlamaForCausalLM(cfg).to(torch.bfloat16)
            # fused: what our loop builds; foreach: torch AdamW's multi-tensor path (transformers'
            # optim="adamw_torch"; on a GPU torch picks it by default, on the CPU it must be asked for)
            kind = {"fused": {"fused": True}, "foreach": {"foreach": True}}[run["optimizer"]]
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, **kind)
            engine, _, _, _ = deepspeed.initialize(model=model, config=ds, optimizer=optimizer)
            ids = torch.randint(0, cfg.vocab_size, (1, seq))
            for _ in range(2 * ds.get("gradient_accumulation_steps", 1)):
                tracker.reset_mod_stats()
                engine.backward(engine(input_ids=ids, labels=ids).loss)
                engine.step()
            peaks[name] = sum(d["Total"] for d in tracker.get_tracker_snapshot("peak").values())
        del engine, model, optimizer
    print(json.dumps(peaks))


if __name__ == "__main__":
    main()
