"""The per-operation step-time model (adaptive/plan/estimate/op_times.py): one layer against a hand computation, and
the behaviour it must have (wider GEMMs run closer to peak, tiny models are launch and memory bound, recompute adds
the forward again); the GEMM curve against published cuBLAS sweeps."""

import math
from dataclasses import replace

import pytest

from adaptive.plan.architecture.presets import Shape, preset_spec, spec_from_shape
from adaptive.plan.estimate.memory import TrainSetup
from adaptive.plan.estimate.op_times import (STACKS, Work, gemm_efficiency, gemm_seconds, layer_times,
                                             micro_batch_times, rates_of)
from adaptive.plan.estimate.throughput import estimate_throughput
from adaptive.plan.hardware.gpus import get_gpu

# Llama-3-8B's block: h 4096, 32 heads of 128, 8 KV heads, SwiGLU 14336
SPEC = spec_from_shape(Shape("l8", 0, vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                             num_attention_heads=32, num_key_value_heads=8), "dense")


def test_one_dense_layer_forward_matches_a_hand_computation():
    a100 = get_gpu("a100-80gb")
    r = rates_of(a100)
    tokens, seq = 4096, 4096
    w = Work(tokens=tokens, seq=seq, tp=1, sp=1, ep=1, capacity_factor=1.0, kernels="plain", attention="sdpa")
    got = layer_times(SPEC, "dense", w, r, "fwd")

    # By hand. GEMMs (output m x n, inner k): q, k, v, o, gate, up, down. 0.869 = MAMF 271.2 of 312 on an A100;
    # 128 x 128 output tiles in waves over 108 SMs; 2.5 us fixed per GEMM.
    peak, bw = 312e12, 2039e9 * 1732 / 2039
    def gemm(m, n, k):
        tiles = math.ceil(m / 128) * math.ceil(n / 128)
        eff = 271.2 / 312 * tiles / (math.ceil(tiles / 108) * 108)
        return max(2 * m * n * k / (peak * eff), 2 * (m * k + k * n + m * n) / bw) + 2.5e-6
    shapes = [(4096, 4096, 4096), (4096, 1024, 4096), (4096, 1024, 4096), (4096, 4096, 4096),
              (4096, 14336, 4096), (4096, 14336, 4096), (4096, 4096, 14336)]
    matmul = sum(gemm(*s) for s in shapes)
    # flash attention, causal: 4·s²·head_dim·heads / 2 FLOPs at 195·s/(s + 495) TFLOP/s (head dim 128)
    attention = 4 * seq * seq * 128 * 32 / 2 / (195e12 * seq / (seq + 495))
    # memory-bound bytes per token: RMSNorms and residual adds 42.7 h per half, RoPE 19.8 (q + kv), SwiGLU 9.9 f
    nbytes = tokens * (42.7 * 4096 + 19.8 * (4096 + 1024) + 42.7 * 4096 + 9.9 * 14336)
    assert got.matmul_s == pytest.approx(matmul, rel=1e-9)
    assert got.attention_s == pytest.approx(attention, rel=1e-9)
    assert got.memory_s == pytest.approx(nbytes / bw, rel=1e-9)
    assert got.launch_s == 0.0  # every kernel here is far longer than the 5 us floor
    assert got.matmul_flops == pytest.approx(2 * sum(m * n * k for m, n, k in shapes), rel=1e-12)
    assert got.kernels == 7 + 1 + 22 + 8  # GEMMs, attention, the norms'/RoPE's/SwiGLU's elementwise kernels


def test_the_backward_runs_two_gemms_per_linear_with_twice_the_forwards_flops():
    r = rates_of(get_gpu("h100-80gb"))
    w = Work(tokens=8192, seq=8192, tp=1, sp=1, ep=1, capacity_factor=1.0, kernels="lean", attention="sdpa")
    fwd, bwd = (layer_times(SPEC, "dense", w, r, phase) for phase in ("fwd", "bwd"))
    assert bwd.matmul_flops == pytest.approx(2 * fwd.matmul_flops, rel=1e-12)
    assert bwd.attention_s == pytest.approx(2.5 * fwd.attention_s, rel=1e-12)  # FlashAttention-2's backward


def test_a_wider_gemm_reaches_a_higher_efficiency():
    for name in ("a100-80gb", "h100-80gb", "t4-16gb", "rtx4090-24gb"):
        r = rates_of(get_gpu(name))
        effs = [gemm_efficiency(d, d, r) for d in (256, 512, 1024, 2048, 8192)]
        assert effs == sorted(effs) and effs[0] < 0.5 * effs[-1], name
        assert effs[-1] <= r.kf.matmul_fraction


@pytest.mark.parametrize("gpu, measured", [
    # Azure/AI-benchmarking-guide ND_A100_v4 cuBLASLt, fp16, m = n = k
    ("a100-80gb", {2048: 221.8, 4096: 228.0, 8192: 253.7, 16384: 256.5}),
    # openxla matmul_interpolator_data.h, sm_90 (H100), bf16, m = n = k
    ("h100-80gb", {1024: 252.8, 2048: 641.0, 4096: 780.2}),
])
def test_gemm_times_follow_published_cublas_sweeps(gpu, measured):
    r = rates_of(get_gpu(gpu))
    for d, tflops in measured.items():
        ours = 2 * d**3 / gemm_seconds(d, d, d, r) / 1e12
        assert ours == pytest.approx(tflops, rel=0.20), (gpu, d, ours, tflops)


def test_a_tiny_model_is_launch_and_memory_bound_and_a_large_one_matmul_bound():
    gpu = get_gpu("a100-80gb")
    tiny = estimate_throughput(TrainSetup(preset_spec("debug"), 128, 1, 0, False, False, False), gpu, 1)
    assert tiny.launch_seconds > 0
    assert tiny.launch_seconds + tiny.memory_bound_seconds > 4 * tiny.matmul_seconds
    big = estimate_throughput(TrainSetup(preset_spec("b7"), 4096, 1, 3, False, False, False, gpus_per_node=8), gpu, 4)
    assert big.launch_seconds == 0 and big.matmul_seconds > 2 * (big.memory_bound_seconds + big.attention_seconds)
    # the step's hardware utilisation follows: a few percent for the tiny model, most of the kernels' rate for b7
    assert tiny.utilisation < 0.05 < 0.35 < big.utilisation


@pytest.mark.parametrize("policy, layers_redone", [("full", 32), ("every:4", 8), ("every:3", 11)])
def test_recompute_adds_the_forward_of_what_checkpointing_dropped(policy, layers_redone):
    r = rates_of(get_gpu("a100-80gb"))
    plain = TrainSetup(preset_spec("b7"), 2048, 2, 2, False, False, False)
    ckpt = replace(plain, gradient_checkpointing=policy == "full", checkpoint_policy=None if policy == "full" else policy)
    off, on = micro_batch_times(plain, r), micro_batch_times(ckpt, r)
    w = Work(tokens=4096, seq=2048, tp=1, sp=1, ep=1, capacity_factor=1.0, kernels="lean", attention="sdpa")
    one_layer = layer_times(plain.spec, "dense", w, r, "fwd")
    assert on.recompute.total_s == pytest.approx(layers_redone * one_layer.total_s, rel=1e-9)
    assert on.total.total_s - off.total.total_s == pytest.approx(on.recompute.total_s, rel=1e-9)
    mlp = micro_batch_times(replace(plain, checkpoint_policy="mlp"), r)  # only the MLP halves run again
    half = layer_times(plain.spec, "dense", w, r, "fwd", half="mlp")
    assert mlp.recompute.total_s == pytest.approx(32 * half.total_s, rel=1e-9)
    assert mlp.recompute.total_s < 32 * one_layer.total_s


def test_tensor_parallelism_splits_the_gemms_but_not_the_norms():
    r = rates_of(get_gpu("h100-80gb"))
    w1 = Work(tokens=8192, seq=8192, tp=1, sp=1, ep=1, capacity_factor=1.0, kernels="lean", attention="sdpa")
    one, four = (layer_times(SPEC, "dense", replace(w1, tp=t), r, "fwd") for t in (1, 4))
    assert four.matmul_flops == pytest.approx(one.matmul_flops / 4, rel=1e-12)
    # AutoTP keeps the RMSNorms and residual adds whole on every rank: only RoPE's and SwiGLU's bytes split
    h_bytes = 8192 * 2 * 42.7 * 4096
    assert four.memory_s * r.bytes_per_s == pytest.approx(h_bytes + (one.memory_s * r.bytes_per_s - h_bytes) / 4,
                                                          rel=1e-9)


def test_the_stack_scales_compute_and_mfu_overrides_the_model():
    gpu = get_gpu("a100-80gb")
    eager = TrainSetup(preset_spec("b1"), 2048, 4, 2, False, False, False)
    fused = replace(eager, stack="fused")
    te, tf = (estimate_throughput(s, gpu, 2) for s in (eager, fused))
    assert tf.compute_seconds < te.compute_seconds  # fewer elementwise bytes, at a higher sustained efficiency
    raw = micro_batch_times(eager, rates_of(gpu))
    assert te.compute_seconds == pytest.approx((2 * raw.total.total_s + te.optimizer_seconds * STACKS["eager"].efficiency)
                                               / STACKS["eager"].efficiency, rel=1e-9)
    given = estimate_throughput(eager, gpu, 2, mfu=0.5)
    assert given.utilisation == pytest.approx(0.5) and given.kernels_per_step == 0
    scaled = estimate_throughput(eager, gpu, 2, compute_scale=1.25)
    assert scaled.compute_seconds == pytest.approx(1.25 * te.compute_seconds, rel=1e-9)
