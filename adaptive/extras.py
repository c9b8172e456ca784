"""What each command needs beyond the planner, and the one line that says how to install it.

`pip install .` (docs/install.md) is the planner (`fit`, `compare`, `models`, `gpus`, `launch --dry-run
--gpu ...`); measuring, training, exporting and drawing need the `train` extra (pyproject.toml), with
torch installed first so DeepSpeed does not pull a build for the wrong CUDA. A command checks its
modules with `require` before importing any of them, so a planner-only install gets one line and exit
code 2 instead of a ModuleNotFoundError traceback from deep inside.
"""

from __future__ import annotations

import importlib.util
import sys

from adaptive.errors import AdaptiveError

# docs/install.md's install table in one line: torch first (the CPU build here; PyPI's Linux wheel is a CUDA build), then
# the extras from the checkout
TRAIN_INSTALL = ('pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu (on a GPU machine: '
                 'the CUDA build pytorch.org gives), then pip install ".[train]" in the adaptive checkout')
MATPLOTLIB_INSTALL = 'pip install "matplotlib>=3.8"'

TRAIN = ("torch", "deepspeed", "accelerate", "transformers", "datasets")
# what each command imports beyond the planner, and the command that installs it
NEEDS: dict[str, tuple[tuple[str, ...], str]] = {
    "adaptive measure": (("torch", "transformers"), TRAIN_INSTALL),
    "adaptive export": (("torch", "transformers", "safetensors"), TRAIN_INSTALL),
    "adaptive report": (("matplotlib",), MATPLOTLIB_INSTALL + " (or the training extras: " + TRAIN_INSTALL + ")"),
    "adaptive launch": (("accelerate", "torch"), TRAIN_INSTALL),
    "training": (TRAIN, TRAIN_INSTALL),
    "adaptive scale": ((*TRAIN, "scipy", "matplotlib"), TRAIN_INSTALL),
    "finding the GPU (no --gpu given)": (("torch",), TRAIN_INSTALL + "; or pass --gpu NAME to plan without one"),
}


def installed(module: str) -> bool:
    """Whether `module` can be imported (a None in sys.modules blocks an import, as a missing module does)."""
    if module in sys.modules:
        return sys.modules[module] is not None
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def require(what: str) -> None:
    """AdaptiveError naming the missing modules and the install command unless `what`'s modules import."""
    modules, install = NEEDS[what]
    missing = [m for m in modules if not installed(m)]
    if missing:
        raise AdaptiveError(f"{what} needs {', '.join(missing)}, which this install lacks: {install}")


__all__ = ["NEEDS", "TRAIN_INSTALL", "installed", "require"]
