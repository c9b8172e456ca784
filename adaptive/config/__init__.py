"""The run configuration shared by `adaptive fit`, `adaptive launch` and the recipes (torch-free)."""

from adaptive.config.run import FIT, LAUNCH, TRAIN, RunConfig, to_argv

__all__ = ["FIT", "LAUNCH", "TRAIN", "RunConfig", "to_argv"]
