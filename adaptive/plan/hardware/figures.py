"""Per-GPU-class figures the speed model needs, each with its source (held by each row of gpus.py).

- `kernels`: what the step-time model (estimate/op_times.py) times each operation with: the largest
  achievable dense matmul rate and the SMs its tiles fill, flash attention's rate, the achievable memory
  bandwidth and the launch floor (`KernelFigures` in kernel_figures.py), each from a published benchmark.
  `--mfu` replaces the compute model by one utilisation. The model FLOPs utilisation (MFU) `fit` reports is always model FLOPs
  over peak, after communication and recompute.
- `inter_node_gbps`: GB/s per GPU, one direction, between nodes, from the vendors' system specs
  (NICs per node x line rate / GPUs per node). Intra-node links are the catalog's `link_gbps`
  (NVLink generation or PCIe, vendor datasheets), restated here with their source.

Collectives reach about NCCL_BUS_EFFICIENCY of a link's line rate (nccl-tests' "busbw", which NVIDIA
documents as the figure to compare with the hardware's peak: github.com/NVIDIA/nccl-tests
doc/PERFORMANCE.md); 0.8 is our stated assumption.

Each catalog row in gpus.py carries its `ClassFigures`; this module defines them and their shared sources
(`gpus.figures(name)` looks one up).
"""

from __future__ import annotations

from adaptive.plan.hardware.kernel_figures import DEFAULT_KERNELS, KernelFigures
from adaptive.record import record

NCCL_BUS_EFFICIENCY = 0.8


@record
class ClassFigures:
    """Figures for one GPU class, each with its source."""

    kernels: KernelFigures
    intra_node_source: str
    inter_node_gbps: float
    inter_node: str
    inter_node_source: str


DEFAULT_FIGURES = ClassFigures(DEFAULT_KERNELS, "catalog link", 12.5, "100 Gb/s per GPU", "assumption")


__all__ = ["ClassFigures", "DEFAULT_FIGURES", "KernelFigures", "NCCL_BUS_EFFICIENCY"]
