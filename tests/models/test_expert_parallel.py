"""Real expert parallelism: two processes (torchrun, gloo), ep_size=2, against ep_size=1 with the same weights."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # two processes under torchrun

REPO = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("_ep_worker.py")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_ep_size_2_matches_ep_size_1(tmp_path):
    # a clean environment: no rank variables left behind by in-process single-rank DeepSpeed tests
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "LOCAL_WORLD_SIZE")}
    env.update(PYTHONPATH=str(REPO), HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
           str(free_port()), str(WORKER), str(tmp_path)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    for rank in (0, 1):
        r = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert r["refused"].startswith("DeepSpeed MoE under several processes needs its process groups"), r["refused"]
        assert r["local_expert_tensors"] == 2 * 2 * 3  # 2 MoE layers x 2 local experts x 3 projections
        assert r["expert0_matches_global"], "rank keeps global experts 2r, 2r+1 as local 0, 1"
        for mode in ("train", "eval"):
            assert r[f"{mode}_logits"] < 1e-5, r
            assert r[f"{mode}_loss"] < 1e-5, r
            assert r[f"{mode}_aux_loss"] < 1e-6, r
        assert max(r["train_dropped"]) > 0, "capacity 1.0 should drop some tokens in training: drops must match too"
        assert r["eval_dropped"] == [0.0, 0.0]
        assert r["grad_names_match"]
        assert r["grad_expert"] < 1e-6, r
        assert r["grad_other"] < 1e-6, r
        assert r["global_state_dict"], "global_state_dict() gathers every expert back"
        assert r["from_pretrained_local_experts"], "from_pretrained(ep_size=2) loads this rank's experts"
        assert r["saved_config_is_portable"] and r["saved_all_experts"] and r["ep_config_unchanged"]
        assert r["engine_loss"] < 1e-5, "deepspeed.initialize (ZeRO-2) after our own EP setup: same loss"
        assert r["engine_step_moved_experts"]
    skips = [json.loads((tmp_path / f"rank{rank}.json").read_text())["causal_skip_rate"] for rank in (0, 1)]
    assert skips[0] < 1.0 and skips[1] == 1.0, "rank 1 routed nothing yet took part in the all-to-all"
