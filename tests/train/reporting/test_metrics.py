"""Metrics arithmetic against hand computations: MaxVio, MFU, the interval means over micro-batches, the
metrics.jsonl record and its resume truncation."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
import torch

from adaptive.train.reporting.metrics import IntervalMeter, MetricsWriter, StepStats, max_vio, mfu, read_metrics, train_record


def outputs(loss_aux: float | None, counts=None, dropped=None, skip=None):
    stats = None
    if counts is not None or skip is not None:
        stats = SimpleNamespace(expert_counts=torch.tensor(counts) if counts is not None else None,
                                dropped_fraction=torch.tensor(dropped) if dropped is not None else None,
                                mod_skip_rate=torch.tensor(skip) if skip is not None else None)
    return SimpleNamespace(aux_loss=torch.tensor(loss_aux) if loss_aux is not None else None, router_stats=stats)


def test_max_vio_is_max_load_over_mean_minus_one():
    assert max_vio([10, 10, 10, 10]) == 0.0
    assert max_vio([40, 0, 0, 0]) == pytest.approx(3.0)  # mean 10, max 40
    assert max_vio([6, 2, 2, 2]) == pytest.approx(1.0)
    assert max_vio([0, 0]) is None and max_vio([]) is None


def test_mfu_is_model_flops_over_peak_and_unknown_without_a_peak():
    # 1000 tokens/s x 6e9 FLOPs/token on 2 GPUs of 312 TFLOP/s
    assert mfu(1000.0, 6e9, 312.0, 2) == pytest.approx(6e12 / 624e12)
    assert mfu(1000.0, 6e9, None, 1) is None and mfu(None, 6e9, 312.0, 1) is None


def test_the_interval_means_losses_and_sums_router_counts_over_micro_batches():
    meter = IntervalMeter(torch.device("cpu"))
    for step in range(2):
        stats = StepStats.zeros(torch.device("cpu"))
        stats.add(outputs(0.5, [[3, 1], [2, 2]], [0.1, 0.0], [0.5]), torch.tensor(4.0 + step))
        stats.add(outputs(0.5, [[1, 3], [4, 0]], [0.3, 0.2], [0.25]), torch.tensor(6.0 + step))
        meter.add(stats, seconds=0.5, tokens=100)
    reduced = meter.reduce(None)
    assert reduced["loss"] == pytest.approx((4 + 6 + 5 + 7) / 4)
    assert reduced["lm_loss"] == pytest.approx(reduced["loss"] - 0.5) and reduced["aux_loss"] == pytest.approx(0.5)
    assert reduced["expert_counts"] == [[8, 8], [12, 4]]
    assert reduced["dropped_fraction"] == pytest.approx([0.2, 0.1])
    assert reduced["mod_skip_rate"] == pytest.approx([0.375])
    assert (reduced["seconds"], reduced["tokens"]) == (1.0, 200) and meter.steps == []

    record = train_record(step=2, tokens_seen=200, reduced=reduced, lr=1e-3, grad_norm=0.7, skipped_steps=0,
                          flops_per_token=1e6, peak_tflops=None, num_gpus=1, memory=None, knobs={})
    assert record["max_vio"] == [0.0, pytest.approx(0.5)] and record["max_vio_max"] == pytest.approx(0.5)
    assert record["tokens_per_s"] == 200.0 and record["mfu"] is None
    assert record["ppl"] == pytest.approx(math.exp(record["lm_loss"]))


def test_a_dense_step_has_no_aux_loss_and_a_nan_loss_is_not_finite():
    stats = StepStats.zeros(torch.device("cpu"))
    stats.add(outputs(None), torch.tensor(float("nan")))
    assert not bool(stats.finite())
    meter = IntervalMeter(torch.device("cpu"))
    meter.add(stats, 1.0, 10)
    reduced = meter.reduce(None)
    assert reduced["aux_loss"] is None and reduced["expert_counts"] is None and math.isnan(reduced["loss"])


def test_metrics_file_writes_null_for_nan_and_truncates_redone_steps_on_resume(tmp_path):
    writer = MetricsWriter(tmp_path, enabled=True)
    writer.write({"kind": "start", "step": 0})
    for step in (1, 2, 3):
        writer.write({"kind": "train", "step": step, "loss": float("nan") if step == 2 else 1.0})
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"kind": "train", "st')  # a line cut short by a crash
    assert json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[2])["loss"] is None
    writer.truncate_after(2)
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [0, 1, 2]
    # a rollback to step 1 is recorded after step 2: on resume from step 2 it belongs to the abandoned history
    writer.write({"kind": "train", "step": 3})
    writer.write({"kind": "rollback", "step": 1})
    writer.truncate_after(2)
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [0, 1, 2]
    writer.truncate_after(None)  # a fresh run in an old folder
    assert read_metrics(tmp_path / "metrics.jsonl") == []
    MetricsWriter(tmp_path / "other", enabled=False).write({"kind": "start"})  # other ranks write nothing
    assert not (tmp_path / "other").exists()
