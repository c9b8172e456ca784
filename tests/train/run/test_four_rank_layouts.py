"""Four processes on the CPU (gloo, accelerate launch, the debug recipes with a recording callback):

- `--zero-hpz 2` against plain ZeRO-3: a real secondary partition (half of each parameter, the primary being a
  quarter), the same losses.
- tp 2 x ep 2 against ep 2 on two processes, on DeepSpeed-MoE: the expert groups are built inside AutoTP's mesh,
  the losses match and the final exports gather to the same weights.

Helpers are test_sequence_tensor_parallel.py's.
"""

from __future__ import annotations

import json

import pytest

from tests.train.run.test_sequence_tensor_parallel import STEPS, assert_same_training, exported_weights, run

pytestmark = pytest.mark.slow  # four-process DeepSpeed runs


def test_tp_size_2_with_expert_parallel_2_on_four_ranks_trains_as_expert_parallel_alone(tmp_path):
    """tp 2 x ep 2 on four processes: the expert groups are built inside AutoTP's mesh (each TP pair shares an
    expert-parallel rank, so it holds the same two experts' shards), and the run trains as ep 2 on two."""
    ep, ep_records = run(tmp_path, "ep2", 2, "--zero", "2", "--ep-size", "2", arch="moe")
    both, both_records = run(tmp_path, "tp2ep2", 4, "--zero", "2", "--ep-size", "2", "--tp-size", "2", arch="moe")
    worst = assert_same_training(ep_records, both_records)
    assert ep[0]["local_experts"] == 4 and ep[0]["expert_up_proj_shape"] == [192, 64]
    assert all(both[r]["local_experts"] == 4 and both[r]["expert_up_proj_shape"] == [96, 64] for r in range(4))
    # the export gathers the TP shards and every expert-parallel rank's experts
    want, got = exported_weights(tmp_path / "ep2" / "run"), exported_weights(tmp_path / "tp2ep2" / "run")
    assert want.keys() == got.keys()
    assert max((want[k] - got[k]).abs().max().item() for k in want) < 1e-5
    print(f"MoE tp2 x ep2 vs ep2: max |loss difference| over {STEPS} steps = {worst:.3g}")


def test_zero_hpz_trains_as_zero_3(tmp_path):
    """ZeRO++ hpZ on four processes: each parameter keeps a secondary partition over 2 GPUs (half of it, where
    the primary ZeRO-3 partition is a quarter) for the backward all-gathers, and no number changes. Its
    quantized switches need DeepSpeed's GPU quantizer kernels (test_parallel_layout)."""
    _, zero3 = run(tmp_path, "z3", 4, "--zero", "3")
    ranks, hpz = run(tmp_path, "hpz", 4, "--zero", "3", "--zero-hpz", "2")
    assert json.loads((tmp_path / "hpz" / "run" / "ds_config.json").read_text())["zero_optimization"][
        "zero_hpz_partition_size"] == 2
    q_proj = 64 * 64
    for rank in range(4):
        assert ranks[rank]["q_proj_ds_tensor_numel"] == q_proj // 4
        assert ranks[rank]["q_proj_ds_secondary_tensor_numel"] == q_proj // 2
    assert_same_training(zero3, hpz)
