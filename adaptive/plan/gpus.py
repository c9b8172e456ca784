"""The GPU catalog: memory, peak dense 16-bit tensor FLOP/s, links and a default hourly price.

Sources: vendor datasheets (dense, no sparsity; GeForce figures with fp32 accumulation);
memory as `nvidia-smi` reports the total. Prices are typical on-demand cloud list prices per GPU
hour in 2026; they vary by provider, so `--price` overrides them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from adaptive.errors import AdaptiveError, closest, require_positive

GiB = 2**30
MiB = 2**20


@dataclass(frozen=True)
class GPU:
    name: str
    memory_bytes: int
    peak_tflops: float  # dense 16-bit tensor-core TFLOP/s (bf16, or fp16 where there is no bf16)
    bf16: bool
    memory_bandwidth_gbps: float  # GB/s, HBM/GDDR
    link: str  # intra-node GPU-to-GPU link
    link_gbps: float  # GB/s one direction per GPU, what collectives inside a node can use
    price_per_hour: float  # USD per GPU hour, default; override with --price
    mfu: float  # stated MFU assumption for a plain data-parallel run (see throughput.py)
    vendor: str = "nvidia"
    aliases: tuple[str, ...] = ()  # other names people type for it (lower case)

    @property
    def memory_gib(self) -> float:
        return self.memory_bytes / GiB


# mfu: llm-foundry reports ~60% (1B) and ~64% (7B) on A100, 46% (7B) on H100; torchtitan 33-39% on
# H100. We assume less than the best published numbers for a HF-style model under DeepSpeed:
# 0.45 on A100-class, 0.38 on Hopper/Blackwell (harder to feed), 0.35 on GeForce/Ada, 0.25 on
# T4 (fp16, small caches), 0.30 on MI300X (ROCm kernels). Override with --mfu.
#
# One row per GPU, keyword arguments; `aliases` are the other names people type for it.
_ROWS = (
    GPU(name="t4-16gb", memory_bytes=15360 * MiB, peak_tflops=65.0, bf16=False,
        memory_bandwidth_gbps=320, link="PCIe 3.0 x16", link_gbps=16,
        price_per_hour=0.35, mfu=0.25, aliases=('t4',)),
    GPU(name="rtx3090-24gb", memory_bytes=24576 * MiB, peak_tflops=71.0, bf16=True,
        memory_bandwidth_gbps=936, link="PCIe 4.0 x16", link_gbps=25,
        price_per_hour=0.22, mfu=0.35, aliases=('3090', 'rtx3090')),
    GPU(name="rtx4090-24gb", memory_bytes=24564 * MiB, peak_tflops=165.0, bf16=True,
        memory_bandwidth_gbps=1008, link="PCIe 4.0 x16 (no P2P)", link_gbps=20,
        price_per_hour=0.34, mfu=0.35, aliases=('4090', 'rtx4090')),
    GPU(name="rtx5090-32gb", memory_bytes=32607 * MiB, peak_tflops=209.5, bf16=True,
        memory_bandwidth_gbps=1792, link="PCIe 5.0 x16 (no P2P)", link_gbps=25,
        price_per_hour=0.69, mfu=0.35, aliases=('5090', 'rtx5090')),
    # A10G: 125 TFLOP/s on the datasheet, ~70 seen in practice; the MFU below is against 125.
    GPU(name="a10g-24gb", memory_bytes=23028 * MiB, peak_tflops=125.0, bf16=True,
        memory_bandwidth_gbps=600, link="PCIe 4.0 x16", link_gbps=25,
        price_per_hour=1.01, mfu=0.25, aliases=('a10g', 'a10')),
    GPU(name="l4-24gb", memory_bytes=23034 * MiB, peak_tflops=121.0, bf16=True,
        memory_bandwidth_gbps=300, link="PCIe 4.0 x16", link_gbps=25,
        price_per_hour=0.70, mfu=0.30, aliases=('l4',)),
    GPU(name="l40s-48gb", memory_bytes=46068 * MiB, peak_tflops=362.0, bf16=True,
        memory_bandwidth_gbps=864, link="PCIe 4.0 x16", link_gbps=25,
        price_per_hour=0.86, mfu=0.35, aliases=('l40s',)),
    GPU(name="a100-40gb", memory_bytes=40960 * MiB, peak_tflops=312.0, bf16=True,
        memory_bandwidth_gbps=1555, link="NVLink 3 (600 GB/s)", link_gbps=300,
        price_per_hour=1.29, mfu=0.45, aliases=('a100', 'a100-40g', 'a100-sxm4-40gb')),
    GPU(name="a100-80gb", memory_bytes=81920 * MiB, peak_tflops=312.0, bf16=True,
        memory_bandwidth_gbps=2039, link="NVLink 3 (600 GB/s)", link_gbps=300,
        price_per_hour=1.79, mfu=0.45, aliases=('a100-80g', 'a100-sxm4-80gb')),
    GPU(name="h100-80gb", memory_bytes=81559 * MiB, peak_tflops=989.0, bf16=True,
        memory_bandwidth_gbps=3350, link="NVLink 4 (900 GB/s)", link_gbps=450,
        price_per_hour=2.99, mfu=0.38, aliases=('h100', 'h100-sxm', 'h100-sxm-80gb', 'h100-sxm5-80gb')),
    GPU(name="h100-pcie-80gb", memory_bytes=81559 * MiB, peak_tflops=756.0, bf16=True,
        memory_bandwidth_gbps=2000, link="PCIe 5.0 x16", link_gbps=50,
        price_per_hour=2.49, mfu=0.38, aliases=('h100-pcie',)),
    GPU(name="h200-141gb", memory_bytes=143771 * MiB, peak_tflops=989.0, bf16=True,
        memory_bandwidth_gbps=4800, link="NVLink 4 (900 GB/s)", link_gbps=450,
        price_per_hour=3.79, mfu=0.38, aliases=('h200', 'h200-sxm')),
    GPU(name="b200-180gb", memory_bytes=183359 * MiB, peak_tflops=2250.0, bf16=True,
        memory_bandwidth_gbps=8000, link="NVLink 5 (1800 GB/s)", link_gbps=900,
        price_per_hour=5.99, mfu=0.38, aliases=('b200',)),
    GPU(name="mi300x-192gb", memory_bytes=196592 * MiB, peak_tflops=1307.0, bf16=True,
        memory_bandwidth_gbps=5300, link="Infinity Fabric (896 GB/s)", link_gbps=448,
        price_per_hour=2.99, mfu=0.30, vendor="amd", aliases=('mi300x', 'mi300')),
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
                   link="PCIe 4.0 x16", link_gbps=25, price_per_hour=0.0, mfu=0.35)
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
        mfu=base.mfu,
        vendor=base.vendor,
    )


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
