"""How a training stack computes the loss from the last hidden states, as memory sees it (`loss` of TrainSetup and
FitRequest). The default, transformers' loss on its classes, is counted in activations.py and hf_blocks.py from
measurements; the others are what published fine-tuning stacks run, each with the code that makes it so.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

LOSS_CHUNK_ELEMENTS = 2**24  # logits per tile of the lean loss: 16M (fp32: 64 MiB), a tile fills a GPU


def loss_chunk_tokens(vocab_size: int) -> int:
    """Tokens per tile of the lean chunked cross-entropy. adaptive/models/lean.py computes with it, and an
    adaptive export carries a copy of this file with its modeling code (adaptive/models/export.py, write_remote_code)."""
    return max(1, LOSS_CHUNK_ELEMENTS // vocab_size)


@dataclass(frozen=True)
class LossImpl:
    """How a training stack turns the last hidden states into the loss, as memory sees it, in bytes per logit (a
    token's logits are `vocab_size` of them)."""

    saved: float  # kept from the end of the forward until the loss's backward has run
    held: float  # held by the training loop through the whole backward (the logits the model returned)
    working: float  # what the loss's backward adds, over one chunk of tokens at a time
    chunks: int = 1  # the tokens are split into this many chunks along the sequence (1: all at once) ...
    chunk_positions: int = 0  # ... or into chunks of this many positions of each sequence (0: by `chunks`)
    source: str = ""

    def chunk_tokens(self, seq_len: int, micro_batch: int) -> int:
        if self.chunk_positions:
            return min(seq_len, self.chunk_positions) * micro_batch
        return math.ceil(seq_len / self.chunks) * micro_batch


# A stack's loss (`loss` of TrainSetup / FitRequest; None: the one `kernels` implies, transformers' for "plain").
# Only "plain" kernels take one: the lean blocks have their own tiled loss.
LOSSES: dict[str, LossImpl] = {
    "transformers": LossImpl(
        saved=4, held=0, working=8,
        source="transformers 5 ForCausalLMLoss (loss/loss_utils.py): logits.float(), then cross_entropy keeps the fp32 "
               "log-softmax; its backward's fp32 logit gradient and 16-bit cast, measured (tests/fidelity)"),
    "transformers_fp32_logits": LossImpl(
        saved=4, held=4, working=8,
        source="transformers before 4.45 (LlamaForCausalLM.forward: `logits = logits.float()`, returned in the "
               "output): a loop that keeps the output through backward (fsdp_qlora's train.py: `output = model(...)`, "
               "then `output.loss.backward()`) holds the fp32 logits too"),
    "chunked": LossImpl(
        saved=4, held=0, working=8, chunks=8,
        source="torchtune CEWithChunkedOutputLoss (modules/loss/ce_chunked_output_loss.py), not compiled: the output "
               "projection and the loss in 8 chunks over the sequence, each chunk upcast and its fp32 log-softmax "
               "kept; the loop deletes the logits before backward, which then runs chunk by chunk"),
    "chunked_compiled": LossImpl(
        saved=2, held=0, working=2, chunks=8,
        source="torchtune CEWithChunkedOutputLoss with compile_loss (training/_compile.py compiles "
               "compute_cross_entropy): inductor's partition keeps each chunk's 16-bit logits (and two fp32 values "
               "a token), and its backward writes the chunk's 16-bit logit gradient in one kernel; counted with "
               "inductor on the CPU (tests/fidelity/test_compiled_loss.py)"),
    "litgpt_chunked": LossImpl(
        saved=2, held=2, working=4, chunk_positions=128,
        source="lit-gpt bf16-true (finetune/lora.py: `logits = model(input_ids, lm_head_chunk_size=128)`, kept by the "
               "loop through backward; utils.py chunked_cross_entropy: F.cross_entropy on each 16-bit chunk keeps "
               "its 16-bit log-softmax); a chunk's backward: the 16-bit gradients of its log-softmax and logits"),
}
DEFAULT_LOSS = "transformers"


def loss_impl(loss: str | None) -> LossImpl | None:
    """The implementation a non-default `loss` names; None for the default (transformers' on plain kernels, whose
    terms below are the measured ones, kept as they are)."""
    return None if loss in (None, DEFAULT_LOSS) else LOSSES[loss]


__all__ = ["DEFAULT_LOSS", "LOSSES", "LOSS_CHUNK_ELEMENTS", "LossImpl", "loss_chunk_tokens", "loss_impl"]
