"""The GPU catalog: memory, peak dense 16-bit tensor FLOP/s, links and a default hourly price.

Sources: vendor datasheets (dense, no sparsity; GeForce figures with fp32 accumulation);
memory as `nvidia-smi` reports the total. Prices are typical on-demand cloud list prices per GPU
hour in 2026; they vary by provider, so `--price` overrides them.
"""

from __future__ import annotations

import re

from adaptive.errors import AdaptiveError, closest, require_positive
from adaptive.plan.hardware.figures import DEFAULT_FIGURES, ClassFigures
from adaptive.plan.hardware.kernel_figures import (A10G_KERNELS, A100_40_KERNELS, A100_80_KERNELS, B200_KERNELS,
                                                   H100_PCIE_KERNELS, H100_SXM_KERNELS, H200_KERNELS, L4_KERNELS,
                                                   L40S_KERNELS, MI300X_KERNELS, RTX3090_KERNELS, RTX4090_KERNELS,
                                                   RTX5090_KERNELS, T4_KERNELS, V100_KERNELS)
from adaptive.record import record

GiB = 2**30
MiB = 2**20


def gib_figure(n_bytes: float) -> str:
    """GiB as every screen shows it (header, tables, first line, catalog): two decimals, "23.99"."""
    return f"{n_bytes / GiB:,.2f}"


def format_gib(n_bytes: float) -> str:
    """ "23.99 GiB" """
    return f"{gib_figure(n_bytes)} GiB"


@record
class GPU:
    """One GPU type: memory, peak 16-bit FLOP/s, links and price."""

    name: str
    memory_bytes: int
    peak_tflops: float  # dense 16-bit tensor-core TFLOP/s (bf16, or fp16 where there is no bf16)
    bf16: bool
    memory_bandwidth_gbps: float  # GB/s, HBM/GDDR
    link: str  # intra-node GPU-to-GPU link
    link_gbps: float  # GB/s one direction per GPU, what collectives inside a node can use
    price_per_hour: float  # USD per GPU hour, default; override with --price
    figures: ClassFigures  # the speed model's figures for its class, each with its source (figures.py)
    vendor: str = "nvidia"
    aliases: tuple[str, ...] = ()  # other names people type for it (lower case)

    @property
    def memory_gib(self) -> float:
        return self.memory_bytes / GiB


# One row per GPU, keyword arguments: adding a GPU is one row. `figures` are the speed model's
# assumptions for its class with their sources (figures.py explains them; --mfu overrides the
# utilisation); `aliases` are the other names people type for it.
_ROWS = (
    GPU(name="t4-16gb", memory_bytes=15360 * MiB, peak_tflops=65.0, bf16=False,
        memory_bandwidth_gbps=320, link="PCIe 3.0 x16", link_gbps=16,
        price_per_hour=0.35, figures=ClassFigures(
            kernels=T4_KERNELS,
            intra_node_source="PCIe 3.0 x16: 16 GB/s per direction (PCI-SIG)",
            inter_node_gbps=1.5, inter_node="100 Gb/s Ethernet per 8-GPU node (AWS g4dn.metal)",
            inter_node_source="AWS EC2 G4 instance specs"),
        aliases=('t4',)),
    GPU(name="rtx3090-24gb", memory_bytes=24576 * MiB, peak_tflops=71.0, bf16=True,
        memory_bandwidth_gbps=936, link="PCIe 4.0 x16", link_gbps=25,
        price_per_hour=0.22, figures=ClassFigures(
            kernels=RTX3090_KERNELS,
            intra_node_source="PCIe 4.0 x16: 32 GB/s line rate, ~25 usable",
            inter_node_gbps=1.5, inter_node="100 Gb/s Ethernet per 8-GPU node",
            inter_node_source="typical workstation NIC"),
        aliases=('3090', 'rtx3090')),
    GPU(name="rtx4090-24gb", memory_bytes=24564 * MiB, peak_tflops=165.0, bf16=True,
        memory_bandwidth_gbps=1008, link="PCIe 4.0 x16 (no P2P)", link_gbps=20,
        price_per_hour=0.34, figures=ClassFigures(
            kernels=RTX4090_KERNELS,
            intra_node_source="PCIe 4.0 x16, no P2P",
            inter_node_gbps=1.5, inter_node="100 Gb/s Ethernet per 8-GPU node",
            inter_node_source="typical workstation NIC"),
        aliases=('4090', 'rtx4090')),
    GPU(name="rtx5090-32gb", memory_bytes=32607 * MiB, peak_tflops=209.5, bf16=True,
        memory_bandwidth_gbps=1792, link="PCIe 5.0 x16 (no P2P)", link_gbps=25,
        price_per_hour=0.69, figures=ClassFigures(
            kernels=RTX5090_KERNELS,
            intra_node_source="PCIe 5.0 x16, no P2P",
            inter_node_gbps=1.5, inter_node="100 Gb/s Ethernet per 8-GPU node",
            inter_node_source="typical workstation NIC"),
        aliases=('5090', 'rtx5090')),
    # A10G: 125 TFLOP/s on the datasheet, ~70 seen in practice; the MFU below is against 125.
    GPU(name="a10g-24gb", memory_bytes=23028 * MiB, peak_tflops=125.0, bf16=True,
        memory_bandwidth_gbps=600, link="PCIe 4.0 x16", link_gbps=25,
        price_per_hour=1.01, figures=ClassFigures(
            kernels=A10G_KERNELS,
            intra_node_source="PCIe 4.0 x16",
            inter_node_gbps=1.5, inter_node="100 Gb/s per 8-GPU g5.48xlarge",
            inter_node_source="AWS EC2 G5 instance specs"),
        aliases=('a10g', 'a10')),
    GPU(name="l4-24gb", memory_bytes=23034 * MiB, peak_tflops=121.0, bf16=True,
        memory_bandwidth_gbps=300, link="PCIe 4.0 x16", link_gbps=25,
        price_per_hour=0.70, figures=ClassFigures(
            kernels=L4_KERNELS,
            intra_node_source="PCIe 4.0 x16",
            inter_node_gbps=1.5, inter_node="100 Gb/s per 8-GPU g6.48xlarge",
            inter_node_source="AWS EC2 G6 instance specs"),
        aliases=('l4',)),
    GPU(name="l40s-48gb", memory_bytes=46068 * MiB, peak_tflops=362.0, bf16=True,
        memory_bandwidth_gbps=864, link="PCIe 4.0 x16", link_gbps=25,
        price_per_hour=0.86, figures=ClassFigures(
            kernels=L40S_KERNELS,
            intra_node_source="PCIe 4.0 x16",
            inter_node_gbps=5.0, inter_node="400 Gb/s per 8-GPU g6e.48xlarge",
            inter_node_source="AWS EC2 G6e instance specs"),
        aliases=('l40s',)),
    GPU(name="a100-40gb", memory_bytes=40960 * MiB, peak_tflops=312.0, bf16=True,
        memory_bandwidth_gbps=1555, link="NVLink 3 (600 GB/s)", link_gbps=300,
        price_per_hour=1.29, figures=ClassFigures(
            kernels=A100_40_KERNELS,
            intra_node_source="NVLink 3: 600 GB/s total, 300 per direction (NVIDIA A100 datasheet)",
            inter_node_gbps=25.0, inter_node="8 x 200 Gb/s HDR InfiniBand per 8-GPU node",
            inter_node_source="NVIDIA DGX A100 datasheet (8 single-port ConnectX-6 HDR for compute)"),
        aliases=('a100', 'a100-40g', 'a100-sxm4-40gb')),
    GPU(name="a100-80gb", memory_bytes=81920 * MiB, peak_tflops=312.0, bf16=True,
        memory_bandwidth_gbps=2039, link="NVLink 3 (600 GB/s)", link_gbps=300,
        price_per_hour=1.79, figures=ClassFigures(
            kernels=A100_80_KERNELS,
            intra_node_source="NVLink 3: 600 GB/s total, 300 per direction (NVIDIA A100 datasheet)",
            inter_node_gbps=25.0, inter_node="8 x 200 Gb/s HDR InfiniBand per 8-GPU node",
            inter_node_source="NVIDIA DGX A100 datasheet (8 single-port ConnectX-6 HDR for compute)"),
        aliases=('a100-80g', 'a100-sxm4-80gb')),
    GPU(name="h100-80gb", memory_bytes=81559 * MiB, peak_tflops=989.0, bf16=True,
        memory_bandwidth_gbps=3350, link="NVLink 4 (900 GB/s)", link_gbps=450,
        price_per_hour=2.99, figures=ClassFigures(
            kernels=H100_SXM_KERNELS,
            intra_node_source="NVLink 4: 900 GB/s total, 450 per direction (NVIDIA H100 datasheet)",
            inter_node_gbps=50.0, inter_node="8 x 400 Gb/s NDR InfiniBand per 8-GPU node",
            inter_node_source="NVIDIA DGX H100 datasheet (8 ConnectX-7 NDR 400 Gb/s for compute); AWS p5 3200 Gb/s"),
        aliases=('h100', 'h100-sxm', 'h100-sxm-80gb', 'h100-sxm5-80gb')),
    GPU(name="h100-pcie-80gb", memory_bytes=81559 * MiB, peak_tflops=756.0, bf16=True,
        memory_bandwidth_gbps=2000, link="PCIe 5.0 x16", link_gbps=50,
        price_per_hour=2.49, figures=ClassFigures(
            kernels=H100_PCIE_KERNELS,
            intra_node_source="PCIe 5.0 x16 (NVLink bridge pairs only)",
            inter_node_gbps=25.0, inter_node="1 x 200 Gb/s per GPU",
            inter_node_source="typical H100 PCIe server build"),
        aliases=('h100-pcie',)),
    GPU(name="h200-141gb", memory_bytes=143771 * MiB, peak_tflops=989.0, bf16=True,
        memory_bandwidth_gbps=4800, link="NVLink 4 (900 GB/s)", link_gbps=450,
        price_per_hour=3.79, figures=ClassFigures(
            kernels=H200_KERNELS,
            intra_node_source="NVLink 4: 900 GB/s total (NVIDIA H200 datasheet)",
            inter_node_gbps=50.0, inter_node="8 x 400 Gb/s NDR InfiniBand per 8-GPU node",
            inter_node_source="NVIDIA DGX H200 datasheet"),
        aliases=('h200', 'h200-sxm')),
    GPU(name="b200-180gb", memory_bytes=183359 * MiB, peak_tflops=2250.0, bf16=True,
        memory_bandwidth_gbps=8000, link="NVLink 5 (1800 GB/s)", link_gbps=900,
        price_per_hour=5.99, figures=ClassFigures(
            kernels=B200_KERNELS,
            intra_node_source="NVLink 5: 1.8 TB/s total, 900 per direction (NVIDIA B200 datasheet)",
            inter_node_gbps=50.0, inter_node="8 x 400 Gb/s ConnectX-7 per 8-GPU node",
            inter_node_source="NVIDIA DGX B200 datasheet"),
        aliases=('b200',)),
    GPU(name="mi300x-192gb", memory_bytes=196592 * MiB, peak_tflops=1307.0, bf16=True,
        memory_bandwidth_gbps=5300, link="Infinity Fabric (896 GB/s)", link_gbps=448,
        price_per_hour=2.99, figures=ClassFigures(
            kernels=MI300X_KERNELS,
            intra_node_source="Infinity Fabric: 7 x 64 GB/s per direction (AMD MI300X datasheet)",
            inter_node_gbps=50.0, inter_node="8 x 400 Gb/s per 8-GPU node",
            inter_node_source="Azure ND MI300X v5 specs (400 Gb/s InfiniBand per GPU)"),
        vendor="amd", aliases=('mi300x', 'mi300')),
    # V100-SXM2-32GB (published runs in plan/evidence/corpus_runs.json use it): 125 TFLOP/s fp16 tensor, no bf16,
    # 900 GB/s HBM2, NVLink 2 at 150 GB/s per direction (NVIDIA V100 datasheet); 32510 MiB as PyTorch
    # reports it ("31.75 GiB total capacity" in its OOM messages).
    GPU(name="v100-32gb", memory_bytes=32510 * MiB, peak_tflops=125.0, bf16=False,
        memory_bandwidth_gbps=900, link="NVLink 2 (300 GB/s)", link_gbps=150,
        price_per_hour=2.48, figures=ClassFigures(
            kernels=V100_KERNELS,
            intra_node_source="NVLink 2: 300 GB/s total, 150 per direction (NVIDIA V100 datasheet)",
            inter_node_gbps=12.5, inter_node="8 x 100 Gb/s EDR InfiniBand per DGX-2 node of 16 GPUs (~6 GB/s per "
                                             "GPU); AWS p3dn 100 Gb/s per 8 GPUs",
            inter_node_source="NVIDIA DGX-2 datasheet; AWS p3dn specs"),
        aliases=('v100', 'v100-32g', 'v100-sxm2-32gb')),
)
CATALOG: dict[str, GPU] = {g.name: g for g in _ROWS}
ALIASES: dict[str, str] = {alias: g.name for g in _ROWS for alias in g.aliases}


def _normalise(name: str) -> str:
    return re.sub(r"[\s_]+", "-", name.strip().lower()).removeprefix("nvidia-").removeprefix("amd-")


def get_gpu(name: str) -> GPU:
    """The catalog entry for a name or alias (case-insensitive). Raises AdaptiveError otherwise."""
    key = _normalise(name)
    key = ALIASES.get(key, key)
    if key in CATALOG:
        return CATALOG[key]
    near = closest(key, list(CATALOG) + list(ALIASES))
    near = ALIASES.get(near, near) if near else None
    hint = f"did you mean {near}?" if near else "run `adaptive gpus` for the catalog"
    raise AdaptiveError(f"unknown GPU {name!r}; {hint}")


def custom_gpu(base: GPU | None, memory_gib: float | None, tflops: float | None,
               price_per_hour: float | None, bf16: bool | None = None) -> GPU:
    """A catalog GPU with some figures overridden, or a GPU given wholly by flags."""
    require_positive("--gpu-mem", memory_gib)
    require_positive("--gpu-tflops", tflops)
    if price_per_hour is not None and not 0 <= price_per_hour < float("inf"):  # also refuses nan
        raise AdaptiveError(f"--price must be a non-negative finite number, got {price_per_hour}")
    if base is None:
        if memory_gib is None and tflops is None:
            raise AdaptiveError("missing --gpu NAME (see `adaptive gpus`), e.g. --gpu a100-40gb; "
                                "or a custom GPU with --gpu-mem GIB --gpu-tflops T")
        if memory_gib is None or tflops is None:
            raise AdaptiveError("a custom GPU needs both --gpu-mem (GiB) and --gpu-tflops; or give --gpu NAME")
        base = GPU(name="custom", memory_bytes=0, peak_tflops=0.0, bf16=True, memory_bandwidth_gbps=1000,
                   link="PCIe 4.0 x16", link_gbps=25, price_per_hour=0.0, figures=DEFAULT_FIGURES)
        name = f"custom-{memory_gib:g}gib"
    else:
        name = base.name if memory_gib is None and tflops is None else f"{base.name}*"
    return GPU(
        name=name,
        memory_bytes=int(memory_gib * GiB) if memory_gib is not None else base.memory_bytes,
        peak_tflops=tflops if tflops is not None else base.peak_tflops,
        bf16=base.bf16 if bf16 is None else bf16,
        memory_bandwidth_gbps=base.memory_bandwidth_gbps,
        link=base.link,
        link_gbps=base.link_gbps,
        price_per_hour=price_per_hour if price_per_hour is not None else base.price_per_hour,
        figures=base.figures,
        vendor=base.vendor,
    )


def figures(gpu_name: str) -> ClassFigures:
    """The class figures for a catalog name, or for a catalog GPU with overrides ("a100-40gb*")."""
    row = CATALOG.get(gpu_name.rstrip("*"))
    return row.figures if row is not None else DEFAULT_FIGURES


def match_detected_gpu(device_name: str, total_memory_bytes: int) -> GPU | None:
    """The catalog entry for a `torch.cuda.get_device_properties` name and memory, if one matches.

    Names such as "NVIDIA A100-SXM4-40GB" or "NVIDIA GeForce RTX 4090" are matched by model; the
    memory picks between sizes of one model (A100 40 vs 80 GB); "PCIe" in the name picks that variant.
    """
    name = _normalise(device_name).replace("geforce-", "").replace("-", "")
    pcie = "pcie" in name
    candidates = [g for g in CATALOG.values()
                  if g.name.split("-")[0] in name and ("pcie" in g.name) == pcie]
    if not candidates and pcie:
        candidates = [g for g in CATALOG.values() if g.name.split("-")[0] in name]
    if not candidates:
        return None
    return min(candidates, key=lambda g: abs(g.memory_bytes - total_memory_bytes))
