"""Measured activation bytes that replace the formula for one model (`adaptive fit --calibrate`).

`adaptive measure --save-calibration FILE` measures the real model class (with and without
checkpointing) and writes per-token figures; a later `adaptive fit --calibrate FILE` plans with them.
Activations and the backward working set grow linearly with tokens per micro-batch (SDPA/flash
attention keeps no sequence-squared term), so per-token figures carry over to other micro-batches;
the file records the sequence it was measured at, and a plan at another sequence says so.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from adaptive.errors import AdaptiveError
from adaptive.plan.architecture.presets import ModelSpec

KIND = "adaptive-calibration"
VERSION = 1


@dataclass(frozen=True)
class Calibration:
    model_signature: str
    seq_len: int  # measured at this sequence length
    activation_bytes_per_token: tuple[float, float]  # (no checkpointing, full checkpointing)
    backward_bytes_per_token: tuple[float, float]  # backward-phase bytes (activations + working set)
    method: str
    capacity_factor: float = 1.0  # MoE capacity factor the model was measured at

    def activation_bytes(self, tokens: int, checkpointing: bool) -> int:
        return int(self.activation_bytes_per_token[checkpointing] * tokens)

    def backward_bytes(self, tokens: int, checkpointing: bool) -> int:
        return int(self.backward_bytes_per_token[checkpointing] * tokens)


def signature(spec: ModelSpec) -> str:
    """What must match for a calibration to apply: the shape, not the name."""
    return (f"{spec.source}:{spec.arch}:V{spec.vocab_size}:h{spec.hidden_size}:f{spec.intermediate_size}:"
            f"L{spec.num_hidden_layers}:a{spec.num_attention_heads}/{spec.num_key_value_heads}x{spec.head_dim}:"
            f"E{spec.num_local_experts}k{spec.num_experts_per_tok}m{spec.moe_intermediate_size}:"
            f"s{spec.shared_expert_intermediate_size}:c{spec.mod_capacity}:{''.join(t[0] for t in spec.layer_types)}")


def to_json(c: Calibration) -> str:
    return json.dumps({"kind": KIND, "version": VERSION, "model_signature": c.model_signature,
                       "seq_len": c.seq_len,
                       "activation_bytes_per_token": {"no_checkpointing": c.activation_bytes_per_token[0],
                                                      "checkpointing": c.activation_bytes_per_token[1]},
                       "backward_bytes_per_token": {"no_checkpointing": c.backward_bytes_per_token[0],
                                                    "checkpointing": c.backward_bytes_per_token[1]},
                       "capacity_factor": c.capacity_factor, "method": c.method}, indent=2) + "\n"


def load(path: str | Path, spec: ModelSpec, capacity_factor: float = 1.0) -> Calibration:
    """Read a calibration file for `spec`; AdaptiveError when it is malformed or for another model or
    MoE capacity factor."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
        if not isinstance(data, dict):
            raise TypeError(f"expected a JSON object, got {type(data).__name__}")
        if data.get("kind") != KIND:
            raise KeyError("kind")
        act = data["activation_bytes_per_token"]
        bwd = data["backward_bytes_per_token"]
        c = Calibration(model_signature=str(data["model_signature"]), seq_len=int(data["seq_len"]),
                        activation_bytes_per_token=(float(act["no_checkpointing"]), float(act["checkpointing"])),
                        backward_bytes_per_token=(float(bwd["no_checkpointing"]), float(bwd["checkpointing"])),
                        method=str(data.get("method", "")),
                        capacity_factor=float(data.get("capacity_factor", 1.0)))
        figures = (*c.activation_bytes_per_token, *c.backward_bytes_per_token, c.seq_len, c.capacity_factor)
        if not all(math.isfinite(v) and v > 0 for v in figures):
            raise ValueError(f"bytes per token, seq_len and capacity_factor must be positive numbers, got {figures}")
    except FileNotFoundError:
        raise AdaptiveError(f"calibration file {str(path)!r} does not exist; write one with "
                            "`adaptive measure ... --save-calibration FILE`") from None
    except OSError as e:
        raise AdaptiveError(f"cannot read calibration file {str(path)!r}: {e.strerror}") from None
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise AdaptiveError(f"malformed calibration file {str(path)!r}: {e}") from None
    if c.model_signature != signature(spec):
        raise AdaptiveError(f"calibration file {str(path)!r} was measured for another model "
                            f"({c.model_signature}); measure this one with adaptive measure")
    if spec.is_moe and c.capacity_factor != capacity_factor:
        raise AdaptiveError(f"calibration file {str(path)!r} was measured at MoE capacity factor "
                            f"{c.capacity_factor:g}, not {capacity_factor:g}; measure again with "
                            f"--capacity-factor {capacity_factor:g}")
    return c
