"""The persistent/step part of the memory model against real DeepSpeed ZeRO 0-3 on the CPU.

A real DeepSpeed engine (the configs our emitter writes, bf16, fused AdamW) trains a small Llama for
three steps under `MemTracker`. With a short sequence the activations are negligible, so the peak
is parameters, gradients, optimizer states and DeepSpeed's buffers: what `model_state_bytes`,
`comm_buffer_bytes` and the phase rule (peak = persistent + max(backward, optimizer step)) predict.
"""

import json
import subprocess
import sys

import pytest

from adaptive.plan.ds_config.emit import ds_config
from adaptive.plan.hardware.gpus import get_gpu
from adaptive.plan.architecture.hf_config import default_kernels, spec_from_hf_config
from adaptive.plan.estimate.memory import TrainSetup, estimate_memory
from tests.conftest import REPO_ROOT, subprocess_env

pytestmark = pytest.mark.slow  # real DeepSpeed engines, ZeRO 0-3

CONFIG = dict(model_type="llama", vocab_size=2048, hidden_size=256, intermediate_size=768, num_hidden_layers=2,
              num_attention_heads=8, num_key_value_heads=4)
SEQ = 8


def run_engines(tmp_path_factory, stages, seq, grad_accum):
    path = tmp_path_factory.mktemp("cfg") / "config.json"
    path.write_text(json.dumps(CONFIG))
    spec = spec_from_hf_config(path)
    # the worker trains transformers' LlamaForCausalLM: its own (plain) ops
    setups = {stage: TrainSetup(spec, seq, 1, stage, False, False, False, gradient_accumulation_steps=grad_accum,
                                kernels=default_kernels(spec))
              for stage in stages}
    # fused AdamW: no foreach temporaries, as our training loop uses
    configs = {stage: {"ds": ds_config(s, grad_accum, get_gpu("a100")), "optimizer": "fused"}
               for stage, s in setups.items()}
    out = subprocess.run([sys.executable, str(REPO_ROOT / "tests/plan/estimate/_deepspeed_peak_worker.py"),
                          json.dumps(CONFIG), json.dumps(configs), str(seq)],
                         capture_output=True, text=True, env=subprocess_env(), timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    peaks = json.loads(out.stdout.strip().splitlines()[-1])
    return {int(k): v for k, v in peaks.items()}, setups


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    return run_engines(tmp_path_factory, (0, 1, 2, 3), SEQ, 1)


@pytest.fixture(scope="module")
def accumulating(tmp_path_factory):
    # seq 256: the activations outweigh the optimizer step, so the peak is in a later micro-batch's
    # backward, where ZeRO-0/1 still hold the previous micro-batch's 16-bit gradients
    return run_engines(tmp_path_factory, (0, 1, 2), 256, 2)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_model_state_peak_matches_real_deepspeed(measured, stage):
    peaks, setups = measured
    predicted = estimate_memory(setups[stage])
    assert predicted.peak_phase == "optimizer_step"
    assert predicted.allocated_peak_bytes == pytest.approx(peaks[stage], rel=0.02), (stage, peaks[stage])


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_gradient_accumulation_peak_matches_real_deepspeed(accumulating, stage):
    peaks, setups = accumulating
    predicted = estimate_memory(setups[stage])
    assert predicted.peak_phase == "backward"
    assert (predicted.parts["accumulated_grads"] > 0) == (stage < 2)
    assert predicted.allocated_peak_bytes == pytest.approx(peaks[stage], rel=0.02), (stage, peaks[stage])
