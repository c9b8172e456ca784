"""What torchtune's chunked cross-entropy keeps for backward, eager and compiled with inductor, counted with
saved_tensors_hooks on the CPU: the bytes per logit that estimate/losses.py's LOSSES state ("chunked": the fp32
log-softmax; "chunked_compiled": the 16-bit logits, inductor's partition recomputing the softmax in backward)."""

import pytest

torch = pytest.importorskip("torch")
F = torch.nn.functional

from adaptive.plan.estimate.losses import LOSSES  # noqa: E402

VOCAB, TOKENS = 4096, 256


def compute_cross_entropy(logits, labels):
    """torchtune's CEWithChunkedOutputLoss.compute_cross_entropy (modules/loss/ce_chunked_output_loss.py @1814feb)."""
    return F.cross_entropy(logits.float(), labels, ignore_index=-100, reduction="sum")


def saved_bytes_per_logit(fn) -> float:
    labels = torch.randint(0, VOCAB, (TOKENS,))
    logits = torch.randn(TOKENS, VOCAB, dtype=torch.bfloat16, requires_grad=True)
    fn(logits * 1, labels).backward()  # compiles (first call)
    storages: dict[int, int] = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    chunk = logits * 1  # a chunk of the output projection's logits
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = fn(chunk, labels)
    del chunk
    loss.backward()
    return sum(storages.values()) / (TOKENS * VOCAB)


def test_eager_chunk_keeps_its_fp32_log_softmax():
    assert saved_bytes_per_logit(compute_cross_entropy) == pytest.approx(LOSSES["chunked"].saved, rel=0.01)


def test_compiled_chunk_keeps_its_16_bit_logits():
    compiled = torch.compile(compute_cross_entropy, backend="inductor")
    try:
        measured = saved_bytes_per_logit(compiled)
    except Exception as e:  # inductor needs a C++ compiler on the CPU
        pytest.skip(f"inductor cannot compile here: {type(e).__name__}")
    assert measured == pytest.approx(LOSSES["chunked_compiled"].saved, rel=0.01)
