"""Per-GPU-class figures the speed model needs, each with its source (held by each row of gpus.py).

- `hfu`: the assumed hardware FLOPs utilisation of the compute kernels (hardware FLOPs, recompute
  included, over the dense 16-bit peak) for a DeepSpeed + transformers-style model with SDPA. It is a
  stated assumption taken from published measurements, and `--mfu` overrides it. The model FLOPs
  utilisation (MFU) `fit` reports is always model FLOPs over peak, after communication and recompute.
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

from adaptive.record import record

NCCL_BUS_EFFICIENCY = 0.8


@record
class ClassFigures:
    """Assumed figures for one GPU class, each with its source."""

    hfu: float
    hfu_source: str
    intra_node_source: str
    inter_node_gbps: float
    inter_node: str
    inter_node_source: str


_LLM_FOUNDRY = ("llm-foundry scripts/train/benchmarking/README.md (mosaicml/llm-foundry), rows without "
                "checkpointing, where MFU = HFU")
A100_HFU_SOURCE = ("HF transformers Llama-7B + DeepSpeed ZeRO-2/3 on 8 A800 (A100 compute), seq 4096: 0.37-0.48 "
             "hardware utilisation over 7 configurations, mean 0.43 (gist.github.com/chenyaofo/"
             "d4cd6a20ab4b95cb3a49491747e2139a; corpus entries gist-llama7b-*); for comparison: Llama 2 paper "
             "(arXiv 2307.09288) Table 2 GPU-hours: 7B/13B/70B imply 45%/43%/46% MFU on "
             "A100-80GB at scale; BigScience BLOOM-176B (Megatron-DeepSpeed) ~150 TFLOP/s per A100 = 48%; "
             f"{_LLM_FOUNDRY}: 56-64% with FlashAttention and FSDP, a leaner stack than ours")
H100_HFU_SOURCE = ("Llama 3 paper (arXiv 2407.21783) Table 4: 38-43% BF16 MFU on H100; torchtitan docs/performance.md: "
             f"Llama 3.1 8B on 8 H100 FSDP 33-39% MFU; {_LLM_FOUNDRY}: 40-46% on H100")

DEFAULT_FIGURES = ClassFigures(0.35, "stated guess for a GPU outside the catalog", "catalog link", 12.5,
                       "100 Gb/s per GPU", "assumption")


__all__ = ["A100_HFU_SOURCE", "ClassFigures", "DEFAULT_FIGURES", "H100_HFU_SOURCE", "NCCL_BUS_EFFICIENCY"]
