"""A fine-tuning method as the planner sees it: which parameters train, and how the frozen base is stored.

`full` trains every parameter, as pretraining does. `lora` freezes a 16-bit base and trains PEFT's LoRA adapters
(A: in -> rank, B: rank -> out, no bias) on the targeted linear layers. `qlora` does the same on a base that
bitsandbytes holds in NF4 with double quantisation (Dettmers et al. 2023), computing in bf16 (fp16 on a T4).
"""

from __future__ import annotations

from dataclasses import dataclass

from adaptive.errors import AdaptiveError

METHODS = ("full", "lora", "qlora")
DEFAULT_LORA_RANK = 16
DEFAULT_LORA_TARGETS = "all-linear"  # PEFT's word for every nn.Linear but the output layer
DEFAULT_LORA_DROPOUT = 0.0  # PEFT's LoraConfig default


@dataclass(frozen=True)  # hashed on the planner's hot path (param_roles' cache key): a compiled __hash__
class Finetune:
    """How a fine-tune trains its model. `lora_*` apply to lora and qlora."""

    method: str = "full"
    lora_rank: int = DEFAULT_LORA_RANK
    lora_alpha: float | None = None  # None: 2 x rank
    lora_targets: str = DEFAULT_LORA_TARGETS
    lora_dropout: float = DEFAULT_LORA_DROPOUT
    # bitsandbytes before 0.43.2 (autograd/_functions.py MatMul4Bit.forward: `ctx.tensors = (A, B)`, dropped by #1270,
    # 2024-07-16): each 4-bit matmul keeps its input for backward when the input needs a gradient; since then it keeps
    # only the packed weight (False, what adaptive installs). Published QLoRA runs of early 2024 and before ran the old one
    nf4_keeps_input: bool = False

    @property
    def adapted(self) -> bool:
        """A frozen base with LoRA adapters (lora, qlora)."""
        return self.method in ("lora", "qlora")

    @property
    def quantized(self) -> bool:
        return self.method == "qlora"

    @property
    def alpha(self) -> float:
        return self.lora_alpha if self.lora_alpha is not None else 2.0 * self.lora_rank

    @property
    def base_bits(self) -> int:
        return 4 if self.quantized else 16


def make_finetune(method: str, lora_rank: int | None = None, lora_alpha: float | None = None,
                  lora_targets: str | None = None, lora_dropout: float | None = None) -> Finetune:
    """A validated Finetune; AdaptiveError (one line) for a bad value."""
    if method not in METHODS:
        from adaptive.errors import closest

        near = closest(method, METHODS)
        raise AdaptiveError(f"--finetune must be one of {', '.join(METHODS)}, got {method!r}"
                            + (f"; did you mean {near}?" if near else ""))
    rank = DEFAULT_LORA_RANK if lora_rank is None else lora_rank
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise AdaptiveError(f"--lora-rank must be a positive integer, got {lora_rank}")
    if lora_alpha is not None and not lora_alpha > 0:
        raise AdaptiveError(f"--lora-alpha must be positive, got {lora_alpha}")
    if lora_targets is not None and not lora_targets.strip(" ,"):
        raise AdaptiveError(f"--lora-targets names no module, got {lora_targets!r}; give all-linear (the default), "
                            "attention, or module names such as q_proj,v_proj")
    dropout = DEFAULT_LORA_DROPOUT if lora_dropout is None else lora_dropout
    if not 0.0 <= dropout < 1.0:
        raise AdaptiveError(f"--lora-dropout must be in [0, 1), got {lora_dropout}")
    ft = Finetune(method=method, lora_rank=rank, lora_alpha=lora_alpha,
                  lora_targets=(lora_targets or DEFAULT_LORA_TARGETS).strip(), lora_dropout=float(dropout))
    if not ft.adapted and any(v is not None for v in (lora_rank, lora_alpha, lora_targets, lora_dropout)):
        raise AdaptiveError(f"--lora-rank, --lora-alpha, --lora-targets and --lora-dropout apply to --finetune lora "
                            f"or qlora, not {method}")
    return ft


__all__ = ["DEFAULT_LORA_DROPOUT", "DEFAULT_LORA_RANK", "DEFAULT_LORA_TARGETS", "Finetune", "METHODS",
           "make_finetune"]
