"""The shape of the DeepSpeed config sections the planner and the recipes read, as pydantic models.

Only those sections are modelled (batch sizes, `gradient_clipping`, `zero_optimization` with its
offload sections, `bf16`/`fp16`, `optimizer`); other keys pass through, for DeepSpeed's own
`DeepSpeedConfig` to judge on the training side (`adaptive.train.run.runplan.check_with_deepspeed`).
Values follow DeepSpeed 0.19 (`runtime/zero/config.py`, `runtime/zero/offload_config.py`) and the
`"auto"` that accelerate and transformers fill at launch. pydantic is imported on first use, so a
planner run without `--ds-config` does not pay for it.
"""

from __future__ import annotations

import json
import math
from typing import Any

from adaptive.errors import AdaptiveError, from_validation

AUTO = "auto"
OFFLOAD_DEVICES = ("none", "cpu", "nvme", AUTO)


def _count(value: Any) -> Any:
    """A positive integer (JSON may write 5e8), or "auto"."""
    if value == AUTO:
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0 \
            or int(value) != value:
        raise ValueError('must be a positive integer or "auto"')
    return int(value)


def _clipping(value: Any) -> Any:
    """A finite number >= 0 (0 turns clipping off), or "auto"."""
    if value == AUTO:
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ValueError('must be a finite number >= 0 (0: no clipping) or "auto"')
    return float(value)


def _choice(*choices: Any) -> Any:
    """One of `choices`, by type too (JSON's true is not the stage 1, nor 1.0)."""
    def check(value: Any) -> Any:
        if any(type(value) is type(c) and value == c for c in choices):
            return value
        raise ValueError("must be " + ", ".join(json.dumps(c) for c in choices[:-1]) + f" or {json.dumps(choices[-1])}")
    return check


def _switch(value: Any) -> Any:
    if value is True or value is False or value == AUTO:
        return value
    raise ValueError('must be true, false or "auto"')


_MODEL: type | None = None


def _model() -> type:
    """The pydantic model of a DeepSpeed config, built on first use."""
    global _MODEL
    if _MODEL is not None:
        return _MODEL
    from typing import Annotated, Optional

    from pydantic import BaseModel, ConfigDict, PlainValidator, StrictBool, StrictStr, model_validator

    count = Annotated[Any, PlainValidator(_count)]
    switch = Annotated[Any, PlainValidator(_switch)]

    class Section(BaseModel):
        model_config = ConfigDict(extra="allow")

    class Offload(Section):
        device: Annotated[Any, PlainValidator(_choice(*OFFLOAD_DEVICES))] = "none"

    class Zero(Section):
        stage: Annotated[Any, PlainValidator(_choice(0, 1, 2, 3, AUTO))] = 0
        offload_optimizer: Optional[Offload] = None
        offload_param: Optional[Offload] = None
        reduce_bucket_size: count = None
        allgather_bucket_size: count = None
        stage3_prefetch_bucket_size: count = None
        overlap_comm: Optional[StrictBool] = None
        contiguous_gradients: Optional[StrictBool] = None

    class Precision(Section):
        enabled: switch = False

    class Optimizer(Section):
        type: StrictStr
        params: dict[str, Any] = {}

    class DsConfig(Section):
        train_batch_size: count = None
        train_micro_batch_size_per_gpu: count = None
        gradient_accumulation_steps: count = None
        gradient_clipping: Annotated[Any, PlainValidator(_clipping)] = None
        zero_optimization: Zero = Zero()
        bf16: Precision = Precision()
        fp16: Precision = Precision()
        optimizer: Optimizer | None = None

        @model_validator(mode="after")
        def _one_precision(self) -> DsConfig:
            if self.bf16.enabled is True and self.fp16.enabled is True:
                raise ValueError("bf16.enabled and fp16.enabled are both true; DeepSpeed takes one (set the other "
                                 "false)")
            return self

    _MODEL = DsConfig
    return _MODEL


def check(data: Any, where: str) -> None:
    """Raise AdaptiveError (one line, naming the key) unless `data` is a DeepSpeed config object whose
    sections we read are well formed."""
    if not isinstance(data, dict):
        raise AdaptiveError(f"{where} must hold a JSON object {{\"zero_optimization\": ...}}, got "
                            f"{type(data).__name__}")
    from pydantic import ValidationError

    try:
        _model().model_validate(data)
    except ValidationError as err:
        raise from_validation(where, err) from None


__all__ = ["AUTO", "OFFLOAD_DEVICES", "check"]
