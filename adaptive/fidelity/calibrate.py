"""Write a calibration file from measurements (`adaptive measure --save-calibration FILE`)."""

from __future__ import annotations

from pathlib import Path

from adaptive.fidelity.measure import measure_step
from adaptive.plan.calibration import Calibration, signature, to_json
from adaptive.plan.hf_config import looks_like_path, read_config_json
from adaptive.plan.planner import FitRequest


def measure_calibration(request: FitRequest, model_arg: str, micro_batch: int = 1) -> Calibration:
    """Per-token activation and backward-phase bytes, with and without checkpointing."""
    hf_config = read_config_json(model_arg) if looks_like_path(model_arg) else None
    dtype = "bf16" if request.gpu.bf16 else "fp16"
    tokens = request.seq_len * micro_batch
    act, bwd, method = [], [], ""
    for ckpt in (False, True):
        m = measure_step(request.spec, request.seq_len, micro_batch, ckpt, zero_stage=2, dtype=dtype,
                         hf_config=hf_config, bucket_elements=1)
        act.append(m.phases.activations / tokens)
        bwd.append(m.phases.backward / tokens)
        method = m.method
    return Calibration(model_signature=signature(request.spec), seq_len=request.seq_len,
                       activation_bytes_per_token=(act[0], act[1]), backward_bytes_per_token=(bwd[0], bwd[1]),
                       method=method)


def write_calibration(request: FitRequest, model_arg: str, path: str, micro_batch: int = 1) -> Path:
    out = Path(path)
    out.write_text(to_json(measure_calibration(request, model_arg, micro_batch)))
    return out
