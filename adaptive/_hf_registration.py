"""Register our model classes with transformers' Auto classes without importing torch eagerly.

`adaptive fit` must start in a fraction of a second, so `import adaptive` cannot import
transformers (and with it torch). Instead: if transformers is already imported, register now;
otherwise register right after the first `import transformers` finishes. Either way
`import adaptive; AutoModelForCausalLM.from_pretrained(path)` works.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import sys

from adaptive.extras import installed

_done = False


def _register() -> None:
    global _done
    if _done:
        return
    _done = True
    from adaptive.models import register_auto_classes

    register_auto_classes()


# The import system asks a loader for create_module/exec_module and a meta path finder for find_spec only; these
# two do not subclass importlib.abc's ABCs, whose import (importlib.resources, tempfile, ...) `adaptive fit` skips.
class _RegisterAfterLoad:
    def __init__(self, loader):
        self._loader = loader

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module) -> None:
        self._loader.exec_module(module)
        _register()


class _TransformersWatcher:
    """Finds nothing itself; wraps the loader of the top-level `transformers` package."""

    def find_spec(self, fullname, path, target=None):
        if fullname != "transformers":
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _RegisterAfterLoad(spec.loader)
        return spec


def install() -> None:
    if importlib.util.find_spec("adaptive.models") is None:
        return
    if sys.modules.get("transformers") is not None:
        _register()
    elif installed("transformers"):  # not when a planner-only install lacks it (or sys.modules blocks it)
        if not any(isinstance(f, _TransformersWatcher) for f in sys.meta_path):
            sys.meta_path.insert(0, _TransformersWatcher())
