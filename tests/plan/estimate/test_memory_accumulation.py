"""Gradient accumulation under ZeRO-0/1: every 16-bit gradient stays on the GPU between boundaries.

(The real-engine measurement of this part is in test_memory_measured_deepspeed.py.)

DeepSpeed's stage_1_and_2 reduces a gradient only when `partition_gradients` (ZeRO-2) or at the
accumulation boundary, so under ZeRO-1 (and plain data parallelism, ZeRO-0) the full local 16-bit
gradients live through the next micro-batch's backward, beside its activations.
"""

import dataclasses

import pytest

from adaptive.plan import count_params, fit, make_request, preset_spec
from adaptive.plan.estimate.memory import TrainSetup, estimate_memory


def setup(stage, accum, offload=False, gpus=8, arch="dense"):
    return TrainSetup(preset_spec("b7", arch), seq_len=2048, micro_batch_size=1, zero_stage=stage,
                      offload_optimizer=offload, offload_params=False, gradient_checkpointing=True,
                      gpus_per_node=gpus, gradient_accumulation_steps=accum)


@pytest.mark.parametrize("offload", [False, True])
def test_zero1_holds_the_full_16bit_gradients_while_accumulating(offload):
    p = count_params(preset_spec("b7")).total
    once, accumulating = estimate_memory(setup(1, 1, offload)), estimate_memory(setup(1, 4, offload))
    # every parameter's 16-bit .grad, beside the 16-bit partition ZeRO-1 keeps anyway
    assert accumulating.parts["accumulated_grads"] == pytest.approx(2 * p, abs=2)
    assert accumulating.backward_bytes - once.backward_bytes == accumulating.parts["accumulated_grads"]
    assert once.parts["accumulated_grads"] == 0


def test_zero0_gradients_coexist_with_the_next_micro_batch_activations():
    once, accumulating = estimate_memory(setup(0, 1, gpus=1)), estimate_memory(setup(0, 2, gpus=1))
    activations = sum(once.parts[k] for k in ("activations", "logits_and_loss", "backward_transient"))
    assert accumulating.backward_bytes == activations + once.parts["params"]


@pytest.mark.parametrize("stage", [2, 3])
def test_zero2_and_3_reduce_every_micro_batch(stage):
    assert estimate_memory(setup(stage, 8)) == estimate_memory(setup(stage, 1))


def test_moe_experts_count_per_ep_shard():
    base = setup(1, 4, arch="moe")
    c = count_params(base.spec)
    held = estimate_memory(dataclasses.replace(base, ep_size=8)).parts["accumulated_grads"]
    assert held == pytest.approx(2 * (c.total - c.expert + c.expert / 8), abs=2)


def test_b7_on_one_a100_40gb_offloads_under_zero2_not_zero1():
    # under ZeRO-1 the held 16-bit gradients (13.5 GiB) would not fit beside the parameters and activations
    plan = fit(make_request(model="b7", gpu="a100-40gb", host_mem_gib=200), suggest=False)
    s = plan.shown.setup
    assert plan.fits and s.zero_stage == 2 and s.offload_optimizer and plan.shown.grad_accum > 1
    z1 = fit(make_request(model="b7", gpu="a100-40gb", host_mem_gib=200, zero=1, offload="optimizer",
                          micro_batch=s.micro_batch_size, checkpointing=s.gradient_checkpointing), suggest=False)
    assert not z1.fits and z1.shown.memory.peak_gpu_bytes > plan.request.gpu.memory_bytes
