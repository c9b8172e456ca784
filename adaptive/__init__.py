"""adaptive: plan, build and train dense, MoE, MoD and hybrid language models with DeepSpeed.

`import adaptive` stays light (no torch): the planner CLI depends on that. The HF classes are
registered with transformers' Auto classes as soon as transformers is imported, before or after
this package (see `_hf_registration`), and are reachable as lazy attributes here.
"""

from __future__ import annotations

from adaptive._hf_registration import install as _install_hf_registration
from adaptive.errors import AdaptiveError

__version__ = "0.1.0"

_LAZY_MODEL_NAMES = ("AdaptiveConfig", "AdaptiveModel", "AdaptiveForCausalLM", "AdaptivePreTrainedModel")


def __getattr__(name: str):
    if name in _LAZY_MODEL_NAMES:
        import adaptive.models as models

        return getattr(models, name)
    raise AttributeError(f"module 'adaptive' has no attribute {name!r}")


_install_hf_registration()

__all__ = ["AdaptiveError", "__version__", *_LAZY_MODEL_NAMES]
