"""The lean blocks (adaptive/models/lean.py) against the plain path: same loss, same gradients within the
dtype's tolerance, for every architecture (MoE experts and MoD-routed blocks included), and fewer saved bytes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from _model_helpers import tiny_config

from adaptive.models import AdaptiveForCausalLM
from adaptive.models.lean import (
    ChunkedLMLossFunction,
    LeanLMHead,
    SwiGLUDownFunction,
    experts_swiglu,
    rms_norm,
    swiglu,
)

# Gradient tolerance per dtype, as ||lean - plain|| / ||plain|| per tensor: bf16's unit roundoff (2^-8)
# and a few fp32 ulps grown over five layers. Lean backward sums in another order (chunked loss, the norm's
# closed-form gradient), so elements near zero may differ by more than an elementwise rtol allows.
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2.0**-8}


def twins(arch: str, dtype: torch.dtype, **overrides):
    """The same weights built with lean and with plain kernels."""
    torch.manual_seed(0)
    lean = AdaptiveForCausalLM(tiny_config(arch, kernels="lean", **overrides)).to(dtype).train()
    plain = AdaptiveForCausalLM(tiny_config(arch, kernels="plain", **overrides)).to(dtype).train()
    plain.load_state_dict(lean.state_dict())
    return lean, plain


def step(model, ids, labels):
    model.zero_grad(set_to_none=True)
    out = model(ids, labels=labels)
    out.loss.backward()
    return out, {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lean_and_plain_give_the_same_loss_and_gradients(arch, dtype):
    assert_same_loss_and_gradients(arch, *twins(arch, dtype), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("arch", ["moe", "hybrid"])
@pytest.mark.parametrize("moe", [dict(moe_implementation="deepspeed"), dict(drop_tokens=False)],
                         ids=["deepspeed", "grouped"])
def test_lean_and_plain_experts_agree_in_every_dispatch(arch, dtype, moe):
    """DeepSpeed's expert modules, and the native block's sorted-group dispatch (no dropping; the default
    trains on the slot buffer), lean vs plain."""
    lean, plain = twins(arch, dtype, **moe)
    if "moe_implementation" in moe:
        lean.setup_expert_parallel(), plain.setup_expert_parallel()
    assert_same_loss_and_gradients(arch, lean, plain, dtype)


def assert_same_loss_and_gradients(arch, lean, plain, dtype):
    ids = torch.randint(0, 128, (3, 24), generator=torch.Generator().manual_seed(1))
    labels = ids.clone()
    labels[0, :5] = -100  # ignored labels are skipped alike
    out_lean, grads_lean = step(lean, ids, labels)
    out_plain, grads_plain = step(plain, ids, labels)
    assert out_lean.logits is None and out_plain.logits is not None  # the lean loss never builds the logits
    torch.testing.assert_close(out_lean.loss, out_plain.loss, rtol=1e-6, atol=1e-6)
    assert grads_lean.keys() == grads_plain.keys()
    experts = [n for n in grads_lean if ".experts." in n]
    assert bool(experts) == (arch in ("moe", "hybrid"))  # the experts' SwiGLU is on the compared path
    for name, grad in grads_lean.items():
        want = grads_plain[name].double()
        error = ((grad.double() - want).norm() / want.norm().clamp(min=1e-30)).item()
        assert error <= TOLERANCE[dtype], (name, error)


def test_mod_routed_blocks_run_the_lean_kernels():
    lean, _ = twins("mod", torch.float32)
    routed = [layer for layer in lean.model.layers if layer.mod is not None]
    assert routed and all(layer.mlp.lean and layer.input_layernorm.lean for layer in routed)


def test_evaluation_returns_logits_with_the_same_loss():
    lean, plain = twins("dense", torch.float32)
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(2))
    lean.eval(), plain.eval()
    a, b = lean(ids, labels=ids), plain(ids, labels=ids)
    torch.testing.assert_close(a.logits, b.logits, rtol=0, atol=0)
    torch.testing.assert_close(a.loss, b.loss, rtol=0, atol=0)


def test_num_items_in_batch_divides_the_summed_loss():
    lean, plain = twins("dense", torch.float32)
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(3))
    a = lean(ids, labels=ids, num_items_in_batch=100).loss
    b = plain(ids, labels=ids, num_items_in_batch=100).loss
    torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("chunk", [1, 5, 64])
def test_chunked_loss_matches_cross_entropy_for_any_tile(chunk):
    g = torch.Generator().manual_seed(4)
    hidden = torch.randn(37, 16, generator=g, requires_grad=True)
    weight = torch.randn(50, 16, generator=g, requires_grad=True)
    labels = torch.randint(0, 50, (37,), generator=g)
    labels[[3, 20]] = -100
    got = ChunkedLMLossFunction.apply(hidden, weight, labels, chunk) * 0.37  # an upstream gradient != 1
    want = F.cross_entropy(F.linear(hidden, weight), labels, reduction="sum") * 0.37
    torch.testing.assert_close(got, want)
    grads = torch.autograd.grad(got, (hidden, weight))
    expected = torch.autograd.grad(want, (hidden, weight))
    for a, b in zip(grads, expected):
        torch.testing.assert_close(a, b)


def test_norm_function_matches_autograd_through_the_plain_ops():
    g = torch.Generator().manual_seed(5)
    x = torch.randn(4, 6, 8, generator=g, requires_grad=True)
    w = torch.randn(8, generator=g, requires_grad=True)
    upstream = torch.randn(4, 6, 8, generator=g)

    def plain(x, w):  # AdaptiveRMSNorm's plain forward
        xf = x.float()
        return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(x.dtype)

    got = torch.autograd.grad(rms_norm(x, w, 1e-5), (x, w), upstream)
    want = torch.autograd.grad(plain(x, w), (x, w), upstream)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)


def test_swiglu_functions_pass_gradcheck_in_float64():
    g = torch.Generator().manual_seed(5)
    gate = torch.randn(5, 7, dtype=torch.float64, generator=g, requires_grad=True)
    up = torch.randn(5, 7, dtype=torch.float64, generator=g, requires_grad=True)
    down = torch.randn(3, 7, dtype=torch.float64, generator=g, requires_grad=True)
    bias = torch.randn(3, dtype=torch.float64, generator=g, requires_grad=True)
    assert torch.autograd.gradcheck(swiglu, (gate, up))
    assert torch.autograd.gradcheck(SwiGLUDownFunction.apply, (gate, up, down, bias))
    # the experts' form, gate_up [E, 2I, H] and down [E, H, I], with and without a gate_up bias: a [E, C, H] slot
    # buffer, and rows in groups (an empty one included) for the loop
    gate_up = torch.randn(3, 8, 6, dtype=torch.float64, generator=g, requires_grad=True)
    experts = torch.randn(3, 6, 4, dtype=torch.float64, generator=g, requires_grad=True)
    gate_up_bias = torch.randn(3, 8, dtype=torch.float64, generator=g, requires_grad=True)
    slots = torch.randn(3, 5, 6, dtype=torch.float64, generator=g, requires_grad=True)
    rows = torch.randn(9, 6, dtype=torch.float64, generator=g, requires_grad=True)
    for bias in (None, gate_up_bias):
        assert torch.autograd.gradcheck(lambda x, w, d, b: experts_swiglu(x, w, d, b), (slots, gate_up, experts, bias))
        assert torch.autograd.gradcheck(lambda x, w, d, b: experts_swiglu(x, w, d, b, [4, 0, 5]),
                                        (rows, gate_up, experts, bias))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("counts", [None, [4, 0, 5]], ids=["slots", "groups"])
def test_experts_swiglu_matches_the_plain_ops_in_both_gradient_layouts(dtype, counts):
    """fp32 keeps grad_gate and grad_up apart, 16-bit writes them into one [rows, 2I] tensor: both give the
    values of the plain ops (matmul, bias, silu, mul, matmul), biases included."""
    from adaptive.models.grouped import expert_rows, grouped_linear

    g = torch.Generator().manual_seed(6)
    x = torch.randn(*((3, 5) if counts is None else (9,)), 16, generator=g).to(dtype).requires_grad_()
    gate_up = (torch.randn(3, 24, 16, generator=g) / 4).to(dtype).requires_grad_()
    down = (torch.randn(3, 16, 12, generator=g) / 4).to(dtype).requires_grad_()
    bias = torch.randn(3, 24, generator=g).to(dtype).requires_grad_()
    upstream = torch.randn(*x.shape, generator=g).to(dtype)
    got = experts_swiglu(x, gate_up, down, bias, counts)
    grads = torch.autograd.grad(got, (x, gate_up, down, bias), upstream)
    h = grouped_linear(x, gate_up, counts) + expert_rows(bias, counts)
    gate, up = h.chunk(2, dim=-1)
    want = grouped_linear(F.silu(gate) * up, down, counts)
    expected = torch.autograd.grad(want, (x, gate_up, down, bias), upstream)
    torch.testing.assert_close(got, want)
    for a, b in zip(grads, expected):
        error = ((a.double() - b.double()).norm() / b.double().norm()).item()
        assert error <= TOLERANCE[dtype], error


def test_lean_modules_keep_the_plain_state_dict_keys():
    lean, plain = twins("hybrid", torch.float32)
    assert list(lean.state_dict()) == list(plain.state_dict())
    assert isinstance(lean.lm_head, LeanLMHead) and isinstance(lean.lm_head, torch.nn.Linear)


def _saved_bytes(model, ids) -> int:
    from adaptive.fidelity.measure import count_saved_bytes

    result: dict = {}
    with count_saved_bytes(result):
        out = model(ids, labels=ids)
    out.loss.backward()
    return result["bytes"]


def test_lean_saves_fewer_bytes_in_every_architecture(arch):
    lean, plain = twins(arch, torch.bfloat16)
    ids = torch.randint(0, 128, (2, 64), generator=torch.Generator().manual_seed(6))
    assert _saved_bytes(lean, ids) < 0.8 * _saved_bytes(plain, ids)


@pytest.mark.parametrize("arch", ["moe", "hybrid"])
def test_deepspeed_and_native_experts_save_the_same_bytes(arch):
    ids = torch.randint(0, 128, (2, 64), generator=torch.Generator().manual_seed(6))
    for kernels in ("lean", "plain"):
        torch.manual_seed(0)
        native = AdaptiveForCausalLM(tiny_config(arch, kernels=kernels)).to(torch.bfloat16).train()
        deepspeed = AdaptiveForCausalLM(tiny_config(arch, kernels=kernels, moe_implementation="deepspeed"))
        deepspeed.to(torch.bfloat16).train().setup_expert_parallel()
        assert _saved_bytes(native, ids) == _saved_bytes(deepspeed, ids), kernels


@pytest.mark.parametrize("arch", ["moe", "hybrid"])
def test_moe_layer_saved_bytes_are_the_planned_formula(arch):
    """Per routed layer (three depths less two, on fake tensors), lean and plain, against `layer_bytes`. The
    formula is 6144 (MoE) and 5120 (hybrid) bytes over the count per layer, whatever the shape: small
    per-layer constants of the router, under 0.4% at debug's shape (0.03% at debug_200m)."""
    from adaptive.models import AdaptiveConfig
    from adaptive.plan.estimate.activations import layer_bytes

    seq, counted = 512, {}
    for kernels in ("lean", "plain"):
        def build(depth):
            return lambda: AdaptiveForCausalLM(AdaptiveConfig.from_preset(
                "debug", arch=arch, num_hidden_layers=depth, block_types=["dense"] + [arch] * (depth - 1),
                kernels=kernels))

        config = AdaptiveConfig.from_preset("debug", arch=arch, kernels=kernels)
        counted[kernels] = _fake_saved_bytes(build(3), seq) - _fake_saved_bytes(build(2), seq)
        planned = layer_bytes(config.to_spec(), arch, seq, 1, config.capacity_factor, kernels)
        assert planned - counted[kernels] == {"moe": 6144, "hybrid": 5120}[arch], (kernels, planned, counted)
    assert counted["lean"] < 0.65 * counted["plain"]


def _fake_saved_bytes(build, seq: int, micro_batch: int = 1) -> int:
    """Saved bytes of one bf16 training forward on fake tensors (no memory)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from adaptive.fidelity.measure import count_saved_bytes

    result: dict = {}
    previous = torch.get_default_dtype()
    with FakeTensorMode(allow_non_fake_inputs=True):
        torch.set_default_dtype(torch.bfloat16)
        try:
            model = build().train()
        finally:
            torch.set_default_dtype(previous)
        ids = torch.randint(0, 100, (micro_batch, seq))
        with count_saved_bytes(result):
            out = model(input_ids=ids, labels=ids)  # held: what the graph keeps is counted at the block's end
        del out
    return result["bytes"]


def test_lean_dense_layer_saves_at_most_065x_of_transformers_llama_at_b1_shape():
    """Per-layer bytes (two depths, differenced) at b1's shape, sequence 2048, on the real classes."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from adaptive.models import AdaptiveConfig

    b1 = AdaptiveConfig.from_preset("b1", arch="dense")
    seq = 2048

    def ours(depth):
        return lambda: AdaptiveForCausalLM(AdaptiveConfig.from_preset(
            "b1", arch="dense", num_hidden_layers=depth, block_types=["dense"] * depth))

    def llama(depth):
        config = LlamaConfig(vocab_size=b1.vocab_size, hidden_size=b1.hidden_size,
                             intermediate_size=b1.intermediate_size, num_hidden_layers=depth,
                             num_attention_heads=b1.num_attention_heads, num_key_value_heads=b1.num_key_value_heads,
                             head_dim=b1.head_dim, rms_norm_eps=b1.rms_norm_eps, attn_implementation="sdpa")
        return lambda: LlamaForCausalLM(config)

    def per_layer(build):
        return _fake_saved_bytes(build(2), seq) - _fake_saved_bytes(build(1), seq)

    ours_bytes, llama_bytes = per_layer(ours), per_layer(llama)
    assert 0 < ours_bytes <= 0.65 * llama_bytes, (ours_bytes, llama_bytes)
    # the planner's lean formula is the count, byte for byte
    from adaptive.plan.estimate.activations import dense_layer_bytes

    assert ours_bytes == seq * dense_layer_bytes(b1.to_spec(), kernels="lean")
    assert llama_bytes == seq * dense_layer_bytes(b1.to_spec(), kernels="plain")
