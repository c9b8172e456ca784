"""Write a calibration file from measurements (`adaptive measure --save-calibration FILE`)."""

from __future__ import annotations

import os
from pathlib import Path

from adaptive.errors import AdaptiveError
from adaptive.fidelity.measure import measure_step
from adaptive.plan.estimate.calibration import Calibration, signature, to_json
from adaptive.plan.architecture.hf_config import looks_like_path, read_config_json
from adaptive.plan.search.planner import FitRequest


def measure_calibration(request: FitRequest, model_arg: str, micro_batch: int = 1) -> Calibration:
    """Per-token activation and backward-phase bytes, with and without checkpointing."""
    hf_config = read_config_json(model_arg) if looks_like_path(model_arg) else None
    dtype = "bf16" if request.gpu.bf16 else "fp16"
    tokens = request.seq_len * micro_batch
    act, bwd, method = [], [], ""
    for ckpt in (False, True):
        m = measure_step(request.spec, request.seq_len, micro_batch, ckpt, zero_stage=2, dtype=dtype,
                         hf_config=hf_config, bucket_elements=1, capacity_factor=request.capacity_factor,
                         kernels=request.kernels)
        act.append(m.phases.activations / tokens)
        bwd.append(m.phases.backward / tokens)
        method = m.method.replace(", full activation checkpointing", "")
    return Calibration(model_signature=signature(request.spec), seq_len=request.seq_len,
                       activation_bytes_per_token=(act[0], act[1]), backward_bytes_per_token=(bwd[0], bwd[1]),
                       method=f"{method} (once without and once with full activation checkpointing)",
                       capacity_factor=request.capacity_factor)


def write_calibration(request: FitRequest, model_arg: str, path: str, micro_batch: int = 1) -> Path:
    out = Path(path)
    text = to_json(measure_calibration(request, model_arg, micro_batch))
    try:
        out.write_text(text)
    except OSError as e:
        raise AdaptiveError(f"cannot write calibration file {path!r}: {e.strerror}") from None
    return out


def check_writable(path: str) -> None:
    """AdaptiveError unless a file can be written at `path`."""
    out = Path(path)
    if out.is_dir():
        raise AdaptiveError(f"--save-calibration {path!r} is a directory; give a file name")
    if not out.parent.is_dir():
        raise AdaptiveError(f"--save-calibration {path!r}: directory {str(out.parent)!r} does not exist")
    if not os.access(out.parent, os.W_OK) or (out.exists() and not os.access(out, os.W_OK)):
        raise AdaptiveError(f"--save-calibration {path!r} is not writable")
