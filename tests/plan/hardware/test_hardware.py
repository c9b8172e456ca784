"""The speed model's per-GPU-class figures and its communication overlap (adaptive/plan/hardware/figures.py,
throughput.py)."""

from dataclasses import replace

import pytest

from adaptive.plan.hardware.gpus import CATALOG, get_gpu
from adaptive.plan.hardware.gpus import figures
from adaptive.plan.estimate.memory import TrainSetup
from adaptive.plan.architecture.presets import preset_spec
from adaptive.plan.estimate.throughput import estimate_throughput


def test_every_catalog_gpu_has_cited_class_figures():
    CLASS = {name: g.figures for name, g in CATALOG.items()}
    assert set(CLASS) == set(CATALOG)
    for name, f in CLASS.items():
        k = f.kernels
        assert 0 < k.matmul_fraction < 1 and 0 < k.memory_fraction < 1 and f.inter_node_gbps > 0, name
        assert 0 < k.attention_fraction < 1 and k.sm_count > 0 and k.launch_us > 0, name
        assert k.matmul_source and k.attention_source and k.memory_source and k.launch_source, name
        assert f.inter_node_source and f.intra_node_source, name
    assert figures("a100-40gb*") == CLASS["a100-40gb"]  # a catalog GPU with overrides keeps its class
    assert CLASS["h100-80gb"].inter_node_gbps == 2 * CLASS["a100-80gb"].inter_node_gbps  # NDR 400 vs HDR 200


def test_mfu_is_model_flops_over_peak_and_the_utilisation_is_its_own_figure():
    gpu = get_gpu("a100-80gb")
    plain = TrainSetup(preset_spec("b1"), 2048, 4, 2, False, False, False)
    ckpt = replace(plain, gradient_checkpointing=True)
    t0, t1 = (estimate_throughput(s, gpu, 1) for s in (plain, ckpt))
    # the utilisation is hardware FLOPs over compute time: the recompute runs at its own kernels' speed, so
    # checkpointing moves it only a little, while MFU falls by the recompute
    assert t1.utilisation == pytest.approx(t0.utilisation, rel=0.05) and t1.mfu < 0.85 * t0.mfu
    for t in (t0, t1):
        assert t.utilisation == pytest.approx(
            t.tokens_per_second * t.hardware_flops_per_token / (t.compute_seconds / t.step_seconds)
            / (gpu.peak_tflops * 1e12))
        assert t.mfu == pytest.approx(t.tokens_per_second * t.model_flops_per_token / (gpu.peak_tflops * 1e12))
    # one GPU, no communication: MFU = utilisation x model/hardware FLOPs
    assert t1.mfu == pytest.approx(t1.utilisation * t1.model_flops_per_token / t1.hardware_flops_per_token)


def test_only_communication_that_cannot_hide_behind_compute_is_counted():
    gpu = get_gpu("a100-80gb")
    one_node = TrainSetup(preset_spec("b7"), 2048, 4, 3, False, False, False, gpus_per_node=8)
    t = estimate_throughput(one_node, gpu, 8)
    assert 0 <= t.comm_seconds < t.comm_total_seconds  # NVLink: most of ZeRO-3's gathers hide
    assert t.step_seconds == pytest.approx(t.compute_seconds + t.comm_seconds)
    many_nodes = replace(one_node, num_nodes=64, micro_batch_size=1)
    tm = estimate_throughput(many_nodes, gpu, 1)
    assert tm.comm_seconds > 0  # over 25 GB/s InfiniBand with one sequence per GPU, some cannot hide
    faster_link = estimate_throughput(many_nodes, replace(gpu, name="h100-80gb"), 1)
    assert faster_link.comm_seconds < tm.comm_seconds  # H100 clusters: 50 GB/s per GPU
