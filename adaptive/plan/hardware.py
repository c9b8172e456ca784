"""Per-GPU-class figures the speed model needs beyond the catalog row, each with its source.

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

The lead is moving catalog rows to keyword arguments; these figures can fold into them then.
"""

from __future__ import annotations

from dataclasses import dataclass

NCCL_BUS_EFFICIENCY = 0.8


@dataclass(frozen=True)
class ClassFigures:
    hfu: float
    hfu_source: str
    intra_node_source: str
    inter_node_gbps: float
    inter_node: str
    inter_node_source: str


_LLM_FOUNDRY = ("llm-foundry scripts/train/benchmarking/README.md (mosaicml/llm-foundry), rows without "
                "checkpointing, where MFU = HFU")
_A100_HFU = ("HF transformers Llama-7B + DeepSpeed ZeRO-2/3 on 8 A800 (A100 compute), seq 4096: 0.37-0.48 "
             "hardware utilisation over 7 configurations, mean 0.43 (gist.github.com/chenyaofo/"
             "d4cd6a20ab4b95cb3a49491747e2139a; corpus entries gist-llama7b-*); for comparison: Llama 2 paper "
             "(arXiv 2307.09288) Table 2 GPU-hours: 7B/13B/70B imply 45%/43%/46% MFU on "
             "A100-80GB at scale; BigScience BLOOM-176B (Megatron-DeepSpeed) ~150 TFLOP/s per A100 = 48%; "
             f"{_LLM_FOUNDRY}: 56-64% with FlashAttention and FSDP, a leaner stack than ours")
_H100_HFU = ("Llama 3 paper (arXiv 2407.21783) Table 4: 38-43% BF16 MFU on H100; torchtitan docs/performance.md: "
             f"Llama 3.1 8B on 8 H100 FSDP 33-39% MFU; {_LLM_FOUNDRY}: 40-46% on H100")

CLASS: dict[str, ClassFigures] = {
    "t4-16gb": ClassFigures(0.25, "no published large-model training measurement; stated guess (fp16, small caches)",
                            "PCIe 3.0 x16: 16 GB/s per direction (PCI-SIG)", 1.5,
                            "100 Gb/s Ethernet per 8-GPU node (AWS g4dn.metal)", "AWS EC2 G4 instance specs"),
    "v100-32gb": ClassFigures(0.35, "Megatron-LM (arXiv 1909.08053) 39 TFLOP/s per V100 = 30% of 125 at 512 GPUs "
                              "incl. model parallel; ZeRO paper (arXiv 1910.02054): 100B at 15 PFLOP/s on 400 V100, ~38 per GPU",
                              "NVLink 2: 300 GB/s total, 150 per direction (NVIDIA V100 datasheet)", 12.5,
                              "8 x 100 Gb/s EDR InfiniBand per DGX-2 node of 16 GPUs (~6 GB/s per GPU); "
                              "AWS p3dn 100 Gb/s per 8 GPUs", "NVIDIA DGX-2 datasheet; AWS p3dn specs"),
    "rtx3090-24gb": ClassFigures(0.35, "stated guess (GeForce, fp32 accumulation)", "PCIe 4.0 x16: 32 GB/s line "
                                 "rate, ~25 usable", 1.5, "100 Gb/s Ethernet per 8-GPU node", "typical workstation NIC"),
    "rtx4090-24gb": ClassFigures(0.35, "stated guess (GeForce, fp32 accumulation)", "PCIe 4.0 x16, no P2P", 1.5,
                                 "100 Gb/s Ethernet per 8-GPU node", "typical workstation NIC"),
    "rtx5090-32gb": ClassFigures(0.35, "stated guess (GeForce)", "PCIe 5.0 x16, no P2P", 1.5,
                                 "100 Gb/s Ethernet per 8-GPU node", "typical workstation NIC"),
    "a10g-24gb": ClassFigures(0.25, "A10G reaches ~70 of its 125 datasheet TFLOP/s in practice; 0.25 of 125",
                              "PCIe 4.0 x16", 1.5, "100 Gb/s per 8-GPU g5.48xlarge", "AWS EC2 G5 instance specs"),
    "l4-24gb": ClassFigures(0.30, "stated guess", "PCIe 4.0 x16", 1.5, "100 Gb/s per 8-GPU g6.48xlarge",
                            "AWS EC2 G6 instance specs"),
    "l40s-48gb": ClassFigures(0.35, "stated guess", "PCIe 4.0 x16", 5.0, "400 Gb/s per 8-GPU g6e.48xlarge",
                              "AWS EC2 G6e instance specs"),
    "a100-40gb": ClassFigures(0.43, _A100_HFU, "NVLink 3: 600 GB/s total, 300 per direction (NVIDIA A100 datasheet)",
                              25.0, "8 x 200 Gb/s HDR InfiniBand per 8-GPU node",
                              "NVIDIA DGX A100 datasheet (8 single-port ConnectX-6 HDR for compute)"),
    "a100-80gb": ClassFigures(0.43, _A100_HFU, "NVLink 3: 600 GB/s total, 300 per direction (NVIDIA A100 datasheet)",
                              25.0, "8 x 200 Gb/s HDR InfiniBand per 8-GPU node",
                              "NVIDIA DGX A100 datasheet (8 single-port ConnectX-6 HDR for compute)"),
    "h100-80gb": ClassFigures(0.40, _H100_HFU, "NVLink 4: 900 GB/s total, 450 per direction (NVIDIA H100 datasheet)",
                              50.0, "8 x 400 Gb/s NDR InfiniBand per 8-GPU node",
                              "NVIDIA DGX H100 datasheet (8 ConnectX-7 NDR 400 Gb/s for compute); AWS p5 3200 Gb/s"),
    "h100-pcie-80gb": ClassFigures(0.38, _H100_HFU, "PCIe 5.0 x16 (NVLink bridge pairs only)", 25.0,
                                   "1 x 200 Gb/s per GPU", "typical H100 PCIe server build"),
    "h200-141gb": ClassFigures(0.40, _H100_HFU, "NVLink 4: 900 GB/s total (NVIDIA H200 datasheet)", 50.0,
                               "8 x 400 Gb/s NDR InfiniBand per 8-GPU node", "NVIDIA DGX H200 datasheet"),
    "b200-180gb": ClassFigures(0.40, "no public DeepSpeed measurement yet; Hopper's figure", "NVLink 5: 1.8 TB/s total, "
                               "900 per direction (NVIDIA B200 datasheet)", 50.0,
                               "8 x 400 Gb/s ConnectX-7 per 8-GPU node", "NVIDIA DGX B200 datasheet"),
    "mi300x-192gb": ClassFigures(0.30, "stated guess (ROCm kernels)", "Infinity Fabric: 7 x 64 GB/s per direction "
                                 "(AMD MI300X datasheet)", 50.0, "8 x 400 Gb/s per 8-GPU node",
                                 "Azure ND MI300X v5 specs (400 Gb/s InfiniBand per GPU)"),
}
DEFAULT = ClassFigures(0.35, "stated guess for a GPU outside the catalog", "catalog link", 12.5,
                       "100 Gb/s per GPU", "assumption")


def figures(gpu_name: str) -> ClassFigures:
    """The class figures for a catalog name, or for a catalog GPU with overrides ("a100-40gb*")."""
    return CLASS.get(gpu_name.rstrip("*"), DEFAULT)


__all__ = ["ClassFigures", "CLASS", "NCCL_BUS_EFFICIENCY", "figures"]
