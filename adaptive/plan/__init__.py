"""The planner: pure Python, no torch. `fit(make_request(model="b7", gpu="a100-40gb"))`."""

from adaptive.plan.hardware.gpus import CATALOG, GPU, get_gpu
from adaptive.plan.architecture.params import ParamCounts, count_params
from adaptive.plan.search.planner import FitRequest, Plan, fit
from adaptive.plan.architecture.presets import ARCHS, PRESETS, ModelSpec, preset_spec
from adaptive.plan.request import make_request, resolve_gpu, resolve_model

__all__ = ["ARCHS", "CATALOG", "GPU", "PRESETS", "FitRequest", "ModelSpec", "ParamCounts", "Plan",
           "count_params", "fit", "get_gpu", "make_request", "preset_spec", "resolve_gpu", "resolve_model"]
