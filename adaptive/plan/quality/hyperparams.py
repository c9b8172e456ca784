"""Compute-optimal batch size and learning rate: DeepSeek LLM 2024 (arXiv 2401.02954, section 3.1).

Both are power laws of the compute budget C = M D, where M is the non-embedding FLOPs per token (6 per
non-embedding parameter plus attention: the model's FLOPs per token without its vocabulary projection) and
D the training tokens: B_opt = 0.2920 C^0.3271 tokens, eta_opt = 0.3118 C^-0.1250. They were fitted from
1e17 to 2e19 FLOPs (and checked at 1e20) with AdamW and a multi-step schedule; outside that they extrapolate.
Their own 7B and 67B runs used what the laws give (Table 2: batch 2304 and 4608 sequences of 4096, learning
rate 4.2e-4 and 3.2e-4).
"""

from __future__ import annotations

from adaptive.record import record

SOURCE = "DeepSeek LLM 2024, arXiv 2401.02954, section 3.1 (B_opt = 0.2920 C^0.3271, eta_opt = 0.3118 C^-0.1250)"
FITTED_FLOPS = (1e17, 2e19)


@record
class Hyperparams:
    global_batch_tokens: float  # the law's B_opt, in tokens
    lr: float  # the law's eta_opt (peak)
    flops: float  # C = M D
    extrapolated: bool  # C outside the fitted range
    source: str = SOURCE


def optimal_batch_tokens(flops: float) -> float:
    return 0.2920 * flops**0.3271


def optimal_lr(flops: float) -> float:
    return 0.3118 * flops**-0.1250


def compute_optimal(non_embedding_flops_per_token: float, tokens: float) -> Hyperparams:
    c = non_embedding_flops_per_token * tokens
    return Hyperparams(global_batch_tokens=optimal_batch_tokens(c), lr=optimal_lr(c), flops=c,
                       extrapolated=not FITTED_FLOPS[0] <= c <= FITTED_FLOPS[1])
