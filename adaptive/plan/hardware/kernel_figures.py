"""How fast each GPU class runs each kind of kernel: the step-time model's figures (estimate/op_times.py).

Per class, each with its published source:
- matmul: the largest achievable dense 16-bit matmul rate over the datasheet peak (Bekman's "maximum achievable
  matmul FLOPS", a sweep of cuBLAS GEMM shapes) and the SMs a GEMM's tiles fill (how small GEMMs fall short,
  checked against published square-GEMM sweeps);
- attention: FlashAttention-2's forward+backward rate at head dim 128 on long causal sequences, as a share of the
  peak, and how it falls for short sequences and small heads (its paper's benchmark figures); where
  FlashAttention-2 does not run (Turing, Volta), PyTorch SDPA's memory-efficient kernel;
- memory: the bandwidth a large device-to-device copy reaches, over the datasheet's;
- launch: the shortest a kernel takes in eager PyTorch through autograd, which bounds tiny models.
"""

from __future__ import annotations

from adaptive.record import record


@record
class KernelFigures:
    """How fast one GPU class runs each kind of kernel (estimate/op_times.py), each figure with its source."""

    matmul_fraction: float  # the largest achievable dense 16-bit matmul rate, over the datasheet peak
    sm_count: int  # streaming multiprocessors (compute units): a GEMM's output tiles run in waves of this many
    matmul_source: str
    attention_fraction: float  # flash attention forward+backward over the dense peak: head dim 128, long causal
    attention_half_seq: float  # a sequence s scales it by s / (s + attention_half_seq)
    attention_half_head_dim: float  # a head dim d by d / (d + this), relative to 128
    attention_source: str
    memory_fraction: float  # achievable memory bandwidth (a large copy) over the datasheet's
    memory_source: str
    launch_us: float  # the shortest a kernel takes in eager PyTorch: issuing it from Python through autograd
    launch_source: str

    def __hash__(self) -> int:  # a cache key of op_times on the planner's hot path
        return hash((self.matmul_fraction, self.sm_count, self.attention_fraction, self.memory_fraction,
                     self.launch_us))


# Sources, one per kind of figure (each row below names which it takes, and what it assumes where none exists).
MAMF = ("Bekman, ml-engineering compute/accelerator/README.md 'Maximum Achievable Matmul FLOPS comparison table' "
        "(stas00/ml-engineering; BF16, best of a cuBLAS shape sweep, mean of 100 iterations)")
GEMM_SWEEPS = ("checked against cuBLAS square-GEMM sweeps: A100-80GB cuBLASLt 119/222/228/254 TFLOP/s at 1k/2k/4k/8k "
               "(Azure/AI-benchmarking-guide Azure_Results/ND_A100_v4_results.md); H100 bf16 44/253/641/780 at "
               "512/1k/2k/4k (openxla xla/service/gpu/model/matmul_interpolator_data.h, sm_90)")
FA2_A100 = ("FlashAttention-2 paper (Dao 2023, arXiv 2307.08691) Fig. 4, A100-80GB forward+backward, causal: head dim 128 "
            "99/133/155/173/182/189 TFLOP/s at seq 512-16k, head dim 64 88/119/140/156/165/171 (causal FLOPs halved, "
            "backward 2.5x forward)")
FA2_H100 = ("FlashAttention-2 H100 SXM5 forward+backward, causal (Dao-AILab/flash-attention "
            "assets/flash2_h100_fwd_bwd_benchmark.png): head dim 128 163/221/265/294/308/328 TFLOP/s at seq 512-16k, "
            "head dim 64 141/192/232/257/273/284")
STREAM = ("te42kyfo/gpu-benches gpu-stream (STREAM 'scale'): A100-40 1381 of 1555 GB/s, A100-80 1732 of 2039, H100 PCIe "
          "1704 of 2039, V100 802 of 900, L40 (AD102) 770 of 864, A40 (GA102) 652 of 696; Azure/AI-benchmarking-guide "
          "(copy): H100 SXM 2.90 of 3.35 TB/s, H200 4.01 of 4.8, MI300X 4.11 of 5.3")
LAUNCH = ("CPU side of a kernel launch 5-20 us (facebookresearch/HolisticTraceAnalysis docs cuda_kernel_launch_stats.rst); "
          "eager PyTorch ~3.6 us per op on tiny tensors (He, 'Making Deep Learning Go Brrrr', horace.io/brrr_intro.html): "
          "5 us, the low end")
LAUNCH_US = 5.0


def _row(fraction: float, sms: int, matmul_source: str, attention: tuple[float, float, float], attention_source: str,
         memory_fraction: float, memory_source: str = STREAM) -> KernelFigures:
    share, half_seq, half_head = attention
    return KernelFigures(matmul_fraction=fraction, sm_count=sms, matmul_source=matmul_source, attention_fraction=share,
                         attention_half_seq=half_seq, attention_half_head_dim=half_head,
                         attention_source=attention_source, memory_fraction=memory_fraction, memory_source=memory_source,
                         launch_us=LAUNCH_US, launch_source=LAUNCH)


# FlashAttention-2's curves fitted as tflops·s/(s + half_seq)·(d/(d + half_head))/(128/(128 + half_head)), kept as
# a share of the peak (so --gpu-tflops moves it too): A100 195 TFLOP/s, 495, 16 (within 2% of every causal point
# above); H100 339, 553, 23.5
A100_ATTENTION = (195.0 / 312, 495.0, 16.0)
H100_ATTENTION = (339.0 / 989, 553.0, 23.5)
V100_GEMM = ("cuBLAS fp16 GEMM at 8192 cubed on a V100 PCIe: ~101 TFLOP/s, 90% of its 112 peak (NVIDIA developer "
             "forums, 'Understanding IPC and issue slot utilization when using tensor cores', thread 79781)")
NO_SWEEP = "no published sweep for this GPU: A100 PCIe's MAMF fraction (252.9 of 312), " + MAMF

A100_40_KERNELS = _row(271.2 / 312, 108, f"{MAMF}: A100 SXM 271.2 of 312; {GEMM_SWEEPS}", A100_ATTENTION, FA2_A100,
                       1381 / 1555)
A100_80_KERNELS = _row(271.2 / 312, 108, f"{MAMF}: A100 SXM 271.2 of 312; {GEMM_SWEEPS}", A100_ATTENTION, FA2_A100,
                       1732 / 2039)
H100_SXM_KERNELS = _row(794.5 / 989, 132, f"{MAMF}: H100 SXM 794.5 of 989; {GEMM_SWEEPS}", H100_ATTENTION, FA2_H100,
                        2.90 / 3.35)
H100_PCIE_KERNELS = _row(794.5 / 989, 114, f"{MAMF}: H100 SXM's fraction (same die, 114 SMs, 350 W cap)",
                         H100_ATTENTION, FA2_H100 + ", the same share of its peak (756)", 1704 / 2039)
H200_KERNELS = _row(794.5 / 989, 132, f"{MAMF}: H100 SXM 794.5 of 989 ('H200 is the same')", H100_ATTENTION,
                    FA2_H100 + "; Azure/AI-benchmarking-guide FA2 at seq 8192: H200 329, H100 328", 4.01 / 4.8)
B200_KERNELS = _row(1745.0 / 2250, 148, f"{MAMF}: B200 1745 of 2250",
                    (374.0 / 2250, 553.0, 23.5), "Azure/AI-benchmarking-guide: FlashAttention-2 on GB200, head dim 128, seq "
                    "8192: 373.9 TFLOP/s (FlashAttention-2 is not tuned for Blackwell); H100's curve shape", 4.01 / 4.8,
                    STREAM + "; none for B200: H200's fraction")
MI300X_KERNELS = _row(668.4 / 1307, 304, f"{MAMF}: MI300X 668.4 (ROCm 6.3, TunableOp)",
                      (365.0 / 1307, 495.0, 16.0), "Azure/AI-benchmarking-guide (samuel-bohman fork): FlashAttention-2 on "
                      "MI300X, head dim 64, seq 8192: 328.6 TFLOP/s (365 at head dim 128, long sequences); A100's curve shape",
                      4.11 / 5.3)
# Volta and Turing run no FlashAttention-2: PyTorch SDPA's memory-efficient kernel. The only published figure is
# ssiu/flash-attention-turing's: the memory-efficient kernel at 28-30% "compute throughput" on a T4; taken as 0.3 of peak.
MEM_EFFICIENT = ("PyTorch SDPA memory-efficient kernel (no FlashAttention-2 before Ampere); ssiu/flash-attention-turing "
                 "utils/Compute_Throughput.png: 27.8-30.3% on T4, taken as 0.3 of peak; A100's curve shape")
V100_KERNELS = _row(0.90, 80, V100_GEMM, (0.3, 495.0, 16.0), MEM_EFFICIENT, 802 / 900)
T4_KERNELS = _row(0.811, 40, NO_SWEEP + " (a 70 W card: clocks fall under sustained load)", (0.3, 495.0, 16.0),
                  MEM_EFFICIENT, 239.6 / 320, "CUDA samples bandwidthTest device-to-device on a T4: 239.6 of 320 GB/s "
                  "(router-gao/cuda-demo cuda-samples/02-cuda-bandwidth.md)")
# GeForce and the workstation/inference parts: FlashAttention-2 on an RTX 4090 (apache/tvm tl_doc/flash_perf.md,
# seq 2048, causal, head dim 128: forward 151, backward 99 TFLOP/s, so 108 forward+backward); the same share of the
# peak for the other Ampere/Ada parts
ADA_ATTENTION = (108.0 * (2048 + 495) / 2048 / 165.0, 495.0, 16.0)
ADA_SOURCE = ("apache/tvm tl_doc/flash_perf.md: FlashAttention-2 on an RTX 4090, seq 2048, causal, head dim 128, "
              "forward 151 and backward 99 TFLOP/s (108 forward+backward); A100's curve shape")
SHARE = ", the RTX 4090's share of the peak"

RTX4090_KERNELS = _row(0.811, 128, NO_SWEEP, ADA_ATTENTION, ADA_SOURCE, 770 / 864)
RTX5090_KERNELS = _row(0.811, 170, NO_SWEEP, ADA_ATTENTION, ADA_SOURCE + SHARE, 770 / 864)
L40S_KERNELS = _row(0.811, 142, NO_SWEEP, ADA_ATTENTION, ADA_SOURCE + SHARE, 770 / 864)
L4_KERNELS = _row(0.811, 58, NO_SWEEP, ADA_ATTENTION, ADA_SOURCE + SHARE, 770 / 864)
RTX3090_KERNELS = _row(0.811, 82, NO_SWEEP, ADA_ATTENTION, ADA_SOURCE + SHARE, 652 / 696)
A10G_KERNELS = _row(0.811, 80, NO_SWEEP, ADA_ATTENTION, ADA_SOURCE + SHARE, 652 / 696)
DEFAULT_KERNELS = _row(0.811, 108, NO_SWEEP, A100_ATTENTION, FA2_A100 + " (a GPU outside the catalog: A100's)", 0.85)
