"""The stack knobs of the memory model (estimate/memory.py FRAMEWORKS and PRECISIONS, estimate/losses.py LOSSES,
optimizer in backward, activation offload, Finetune.nf4_keeps_input), each against a count done here by hand, and
each at its default changing nothing."""

from dataclasses import replace

import pytest

from adaptive.errors import AdaptiveError
from adaptive.plan.architecture.params import count_params
from adaptive.plan.architecture.presets import Shape, spec_from_shape
from adaptive.plan.estimate.activations import activation_bytes, backward_peak_bytes
from adaptive.plan.estimate.losses import LOSSES
from adaptive.plan.estimate.memory import FRAGMENTATION, TrainSetup, estimate_memory
from adaptive.plan.estimate.optimizers import EIGHT_BIT_STATE_BYTES
from adaptive.plan.finetune.method import make_finetune
from adaptive.plan.finetune.roles import param_roles
from adaptive.plan.hardware.gpus import get_gpu
from adaptive.plan.search.planner import FitRequest, fit

V, H, F, L, A, KV = 512, 64, 176, 4, 4, 2
SPEC = replace(spec_from_shape(Shape("tiny", 0, vocab_size=V, hidden_size=H, intermediate_size=F, num_hidden_layers=L,
                                     num_attention_heads=A, num_key_value_heads=KV)), source="hf:llama")
P = count_params(SPEC).total
SEQ, MB = 128, 2
T = SEQ * MB


def setup(**kw) -> TrainSetup:
    base = dict(spec=SPEC, seq_len=SEQ, micro_batch_size=MB, zero_stage=0, offload_optimizer=False,
                offload_params=False, gradient_checkpointing=True, kernels="plain")
    return TrainSetup(**{**base, **kw})


@pytest.mark.parametrize("finetune", [None, make_finetune("lora", 8, 16, "all-linear"),
                                      make_finetune("qlora", 8, 16, "q_proj,v_proj", 0.1)])
@pytest.mark.parametrize("ckpt", ["off", "full", "every:2"])
def test_the_default_loss_named_is_the_default(finetune, ckpt):
    """loss "transformers" is what plain kernels count without a loss: formula and op-by-op paths alike."""
    for f in (activation_bytes, backward_peak_bytes):
        assert f(SPEC, SEQ, MB, ckpt, 1.0, "plain", finetune, loss="transformers") == f(SPEC, SEQ, MB, ckpt, 1.0,
                                                                                          "plain", finetune)


def test_knobs_at_their_defaults_change_no_estimate():
    s = setup(zero_stage=2, gpus_per_node=4, gradient_accumulation_steps=4, optimizer="adamw_torch")
    explicit = replace(s, framework="deepspeed", precision="mixed", loss=None, optimizer_in_backward=False,
                       activation_offload=False)
    assert estimate_memory(explicit) == estimate_memory(s)
    req = FitRequest(spec=SPEC, gpu=get_gpu("a100-80gb"), seq_len=SEQ, micro_batch_size=MB, grad_accum=1,
                     zero_stage=1, kernels="plain")
    assert req.memory_knobs == ()
    assert fit(replace(req, loss="transformers"), suggest=False).shown.memory == fit(req, suggest=False).shown.memory


def test_pure_precision_keeps_16_bit_weights_gradients_and_moments_only():
    m = estimate_memory(setup(framework="torch", precision="pure", optimizer="adamw_torch"))
    assert (m.parts["params"], m.parts["grads"], m.parts["optimizer"]) == (2 * P, 2 * P, 4 * P)  # bf16 m and v
    assert m.parts["optimizer_transient"] == 2 * P  # foreach AdamW's sqrt temporary, in bf16
    assert m.step_bytes == 2 * P + 2 * P  # the gradients and the temporary; no fp32 copies, no flatten
    mixed = estimate_memory(setup(optimizer="adamw_torch"))
    assert (mixed.parts["grads"], mixed.parts["optimizer"]) == (6 * P, 12 * P)  # DeepSpeed's, for contrast
    eight = estimate_memory(setup(framework="torch", precision="pure", optimizer="adamw_8bit"))
    assert eight.parts["optimizer"] == int(EIGHT_BIT_STATE_BYTES * P)


def test_pure_precision_needs_a_framework_without_master_weights():
    req = FitRequest(spec=SPEC, gpu=get_gpu("a100-80gb"), seq_len=SEQ, micro_batch_size=MB, grad_accum=1,
                     kernels="plain", precision="pure")
    with pytest.raises(AdaptiveError, match="master weights"):
        fit(req, suggest=False)
    with pytest.raises(AdaptiveError, match="grad_accum 1"):
        fit(replace(req, framework="torch", optimizer_in_backward=True, grad_accum=2), suggest=False)
    with pytest.raises(AdaptiveError, match="lean"):
        fit(replace(req, framework="torch", loss="chunked_compiled", kernels="lean"), suggest=False)
    plan = fit(replace(req, framework="torch"), suggest=False)
    assert plan.shown.setup.zero_stage == 0  # torch: one GPU or DDP


def test_optimizer_in_backward_keeps_one_gradient_at_a_time():
    plain = estimate_memory(setup(framework="torch", precision="pure", optimizer="adamw_torch"))
    fused = estimate_memory(setup(framework="torch", precision="pure", optimizer="adamw_torch",
                                  optimizer_in_backward=True))
    largest = count_params(SPEC).largest_layer
    assert fused.parts["grads"] == 0 and fused.step_bytes == 0
    assert fused.parts["optimizer_transient"] == 2 * largest + 2 * largest  # its gradient and its foreach temporary
    assert fused.backward_bytes == plain.parts["activations"] + plain.parts["logits_and_loss"] + \
        plain.parts["backward_transient"] + 4 * largest


def test_activation_offload_leaves_one_layer_on_the_gpu():
    """Full checkpointing keeps each layer's input (T x 2h); offloaded, all but one go to the host."""
    kept = estimate_memory(setup(framework="torch", precision="pure"))
    off = estimate_memory(setup(framework="torch", precision="pure", activation_offload=True))
    assert kept.saved_bytes - off.saved_bytes == (L - 1) * T * 2 * H
    assert kept.backward_bytes - off.backward_bytes == (L - 1) * T * 2 * H


def test_losses_keep_their_bytes_per_logit():
    """What each loss keeps beside the layers: transformers' fp32 log-softmax (4 bytes a logit), the compiled chunk's
    16-bit logits (2), lit-gpt's 16-bit logits held by the loop and its 16-bit log-softmax (2 + 2)."""
    base = activation_bytes(SPEC, SEQ, MB, "full", 1.0, "plain")
    for name, per_logit in (("chunked_compiled", 2), ("chunked", 4), ("litgpt_chunked", 4),
                            ("transformers_fp32_logits", 8)):
        assert activation_bytes(SPEC, SEQ, MB, "full", 1.0, "plain", loss=name) - base == T * V * (per_logit - 4)
    # the compiled chunk's backward: a chunk's 16-bit logit gradient (8 chunks over the sequence), the hidden states'
    # gradient, the head's weight gradient (trained): the loss's moment on top of what is saved
    impl = LOSSES["chunked_compiled"]
    saved = activation_bytes(SPEC, SEQ, MB, "off", 1.0, "plain", loss="chunked_compiled")
    moment = saved + 2 * V * (SEQ // 8) * MB + 2 * H * T + 2 * V * H
    assert impl.chunk_tokens(SEQ, MB) == SEQ // 8 * MB
    assert backward_peak_bytes(SPEC, SEQ, MB, "off", 1.0, "plain", loss="chunked_compiled") >= moment


def test_old_bitsandbytes_keeps_each_4_bit_matmuls_input():
    """bitsandbytes < 0.43.2: without checkpointing every layer also keeps its MLP norm's output (gate/up's input, 2h)
    and the SwiGLU product (down's input, 2f); q, k, v read the attention norm's output that LoRA on q keeps already,
    o_proj the SDPA output that SDPA keeps."""
    new = make_finetune("qlora", 8, 16, "q_proj,v_proj", 0.0)
    old = replace(new, nf4_keeps_input=True)
    diff = activation_bytes(SPEC, SEQ, MB, "off", 1.0, "plain", old) - activation_bytes(SPEC, SEQ, MB, "off", 1.0,
                                                                                          "plain", new)
    assert diff == L * T * (2 * H + 2 * F)
    # checkpointed layers keep only their input: the same either way
    assert activation_bytes(SPEC, SEQ, MB, "full", 1.0, "plain", old) == activation_bytes(SPEC, SEQ, MB, "full", 1.0,
                                                                                          "plain", new)


def test_fsdp_shards_everything_and_gathers_whole_layers():
    world = 4
    s = setup(framework="fsdp", precision="pure", zero_stage=3, gpus_per_node=world)
    m = estimate_memory(s)
    c = count_params(SPEC)
    assert (m.parts["params"], m.parts["grads"], m.parts["optimizer"]) == (2 * P // world, 2 * P // world,
                                                                          4 * P // world)
    assert m.parts["zero3_grad_partition"] == 0  # DeepSpeed's own
    assert m.parts["zero3_live_params"] == 2 * 2 * max(c.per_layer)  # the running unit and the prefetched one
    assert m.parts["fsdp_root_params"] == 2 * (c.embedding + H)  # FSDP's root, whole through backward
    assert m.parts["comm_buckets"] == 2 * P // L  # a unit's unsharded gradient
    root = estimate_memory(replace(s, framework="fsdp_sharded_root"))
    assert "fsdp_root_params" not in root.parts
    assert root.parts["zero3_live_params"] == 2 * 2 * max(max(c.per_layer), V * H)  # embedding/output as units


def test_fsdp_cpu_offload_moves_the_nf4_codes_too():
    qlora = make_finetune("qlora", 8, 16, "all-linear")
    roles = param_roles(SPEC, qlora)
    kw = dict(finetune=qlora, zero_stage=3, gpus_per_node=2, precision="pure", offload_optimizer=True,
              offload_params=True)
    fsdp = estimate_memory(setup(framework="fsdp", **kw))
    assert fsdp.parts["frozen_params"] == roles.nf4_state_bytes  # the quantization state stays on the GPU
    ds = estimate_memory(setup(**{**kw, "precision": "mixed"}))
    assert ds.parts["frozen_params"] == roles.nf4_state_bytes + roles.nf4_packed_bytes // 2


def test_reserved_is_compared_with_the_fragmentation_allowance():
    from adaptive.plan.evidence.finetune_corpus import comparable_bytes

    m = estimate_memory(setup(framework="torch", precision="pure"))
    assert comparable_bytes(m, "allocated") == m.allocated_peak_bytes == comparable_bytes(m, "active")
    assert comparable_bytes(m, "reserved") == pytest.approx(m.allocated_peak_bytes * (1 + FRAGMENTATION))
    assert comparable_bytes(m, "process") == m.peak_gpu_bytes


def test_make_request_takes_the_stack_knobs():
    from adaptive.plan.request import make_request
    from tests.conftest import REPO_ROOT

    req = make_request(model=str(REPO_ROOT / "tests/plan/data/llama-3.1-8b/config.json"),
                       gpu="rtx4090", finetune="lora", micro_batch=2, grad_accum=1, framework="torch",
                       precision="pure", loss="chunked_compiled", activation_offload=True)
    assert req.memory_knobs == (("framework", "torch"), ("precision", "pure"), ("loss", "chunked_compiled"),
                                ("activation_offload", True))
    assert fit(req, suggest=False).shown.setup.activation_offload
