"""AutoTP, Ulysses SP and ZeRO++ in the planner (issue 12): memory by hand, DeepSpeed's own config check,
the combinations DeepSpeed refuses, and the runs the issue names."""

from dataclasses import replace
from pathlib import Path

import pytest
from deepspeed.runtime.config import DeepSpeedConfig

from adaptive.errors import AdaptiveError
from adaptive.plan import fit, make_request
from adaptive.plan.estimate.activations import activation_bytes
from adaptive.plan.ds_config.emit import ds_config, plan_dict
from adaptive.plan.hardware.gpus import get_gpu
from adaptive.plan.estimate.memory import TrainSetup, estimate_memory, model_state_bytes
from adaptive.plan.architecture.params import count_params
from adaptive.plan.estimate.parallel import sp_alltoall_bytes_per_layer
from adaptive.plan.architecture.presets import preset_spec
from adaptive.plan.estimate.throughput import estimate_throughput
from tests._deepspeed_config import DataParallel, single_process_group  # noqa: F401 (fixture)

DATA = Path(__file__).parents[1] / "data"
LLAMA_405B = str(DATA / "llama-3.1-405b" / "config.json")
LLAMA_8B = str(DATA / "llama-3.1-8b" / "config.json")
GiB = 2**30


def setup(**kw) -> TrainSetup:
    base = dict(spec=preset_spec("b7"), seq_len=4096, micro_batch_size=1, zero_stage=1, offload_optimizer=False,
                offload_params=False, gradient_checkpointing=False, gpus_per_node=8, num_nodes=2)
    return TrainSetup(**{**base, **kw})


# --- memory, against the formulas by hand -------------------------------------------------------------

def test_tp_shards_every_linear_and_embedding_and_keeps_the_norms_whole():
    s = setup(tp_size=4)
    spec, c = s.spec, count_params(s.spec)
    norms = (2 * spec.num_hidden_layers + 1) * spec.hidden_size
    local = (c.total - norms) / 4 + norms
    parts = model_state_bytes(s)
    assert parts["params"] == int(2 * local)  # ZeRO-1: 16-bit params whole on each TP rank's shard
    assert parts["optimizer"] == int(12 * (c.total + norms * 3) / 16)  # partitioned over world/tp = 4 ranks
    z3 = model_state_bytes(replace(s, zero_stage=3))
    assert z3["zero3_live_params"] == int(4 * c.largest_layer / 4)


def test_sp_activations_are_those_of_seq_over_sp():
    s = setup(sp_size=4, zero_stage=3)
    m = estimate_memory(s)
    assert m.parts["activations"] == activation_bytes(s.spec, 4096 // 4, 1, "off", 1.0, "lean")
    one = estimate_memory(replace(s, sp_size=1))
    assert 3.9 < one.parts["activations"] / m.parts["activations"] < 4.1


def test_tp_activations_split_as_korthikanti_without_sequence_parallel():
    s = setup(tp_size=8, kernels="lean")
    whole = estimate_memory(replace(s, tp_size=1)).parts["activations"]
    assert estimate_memory(s).parts["activations"] == int(whole * (10 + 24 / 8) / 34)


def test_hpz_keeps_a_secondary_16bit_copy_over_its_ranks():
    s = setup(zero_stage=3, zero_hpz=8)
    c = count_params(s.spec)
    m = estimate_memory(s)
    assert m.parts["hpz_secondary_params"] == int(2 * c.total / 8)
    off = estimate_memory(replace(s, zero_hpz=1))
    assert m.persistent_bytes - off.persistent_bytes == m.parts["hpz_secondary_params"]
    assert model_state_bytes(replace(s, zero_stage=2, zero_hpz=8))["hpz_secondary_params"] == 0  # ZeRO-3 only


# --- time -------------------------------------------------------------------------------------------------

def test_zeropp_cuts_exposed_zero3_communication_across_nodes():
    gpu = get_gpu("a100-80gb")
    s = setup(spec=preset_spec("b70"), zero_stage=3, num_nodes=32, gradient_checkpointing=True)
    plain = estimate_throughput(s, gpu, 1)
    hpz = estimate_throughput(replace(s, zero_hpz=8), gpu, 1)
    full = estimate_throughput(replace(s, zero_hpz=8, zero_quantized_weights=True, zero_quantized_gradients=True),
                               gpu, 1)
    assert full.comm_total_seconds < hpz.comm_total_seconds < plain.comm_total_seconds
    assert full.tokens_per_second > plain.tokens_per_second


def test_tp_and_sp_communication_sits_on_the_critical_path():
    gpu = get_gpu("h100-80gb")
    s = setup(gpus_per_node=8, num_nodes=1)
    tp = estimate_throughput(replace(s, tp_size=8), gpu, 1)
    assert tp.tp_allreduce_seconds > 0 and tp.step_seconds == pytest.approx(
        tp.compute_seconds + tp.comm_seconds + tp.tp_allreduce_seconds)
    # 4 all-reduces of s·h 16-bit values per layer, ring 2(t-1)/t, at 0.8 of the 450 GB/s NVLink
    by_hand = 4 * 4096 * 4096 * 2 * 2 * 7 / 8 * 32 / (450e9 * 0.8)
    assert tp.tp_allreduce_seconds == pytest.approx(by_hand)
    sp = estimate_throughput(replace(s, sp_size=8), gpu, 1)
    volume = sp_alltoall_bytes_per_layer(s.spec, 4096 // 8, 8, 2) * 7 / 8 * 32
    assert sp.sp_alltoall_seconds == pytest.approx(volume / (450e9 * 0.8))


# --- DeepSpeed accepts what we emit -----------------------------------------------------------------------

@pytest.mark.parametrize("kw", [dict(tp_size=2, zero_stage=1), dict(tp_size=8, zero_stage=3),
                                dict(sp_size=4, zero_stage=2), dict(sp_size=2, zero_stage=3, zero_hpz=8,
                                                                    zero_quantized_weights=True,
                                                                    zero_quantized_gradients=True),
                                dict(zero_stage=3, zero_hpz=4, zero_quantized_weights=True)])
def test_deepspeed_accepts_every_emitted_combination(kw, single_process_group):
    s = setup(**kw)
    cfg = ds_config(s, 2, get_gpu("h100-80gb"))
    parsed = DeepSpeedConfig(cfg, mpu=DataParallel(s.dp_size))
    assert parsed.train_batch_size == s.micro_batch_size * 2 * s.dp_size
    z = parsed.zero_config
    assert z.zero_hpz_partition_size == s.zero_hpz
    assert z.zero_quantized_weights == s.zero_quantized_weights and z.zero_quantized_gradients == s.zero_quantized_gradients
    assert parsed.tensor_parallel_config.autotp_size == (s.tp_size if s.tp_size > 1 else 0)
    assert cfg.get("sequence_parallel_size", 1) == s.sp_size


def test_the_scenario_plans_emit_configs_deepspeed_accepts(single_process_group):
    for req in (_405b(), _llama2_70b()):
        plan = fit(req, suggest=False)
        s = plan.shown.setup
        cfg = ds_config(s, plan.shown.grad_accum, req.gpu)
        DeepSpeedConfig(cfg, mpu=DataParallel(s.dp_size))
        d = plan_dict(plan)
        assert (d["tp_size"], d["sp_size"], d["dp_size"]) == (s.tp_size, s.sp_size, s.dp_size)
        assert "bubble of (p - 1)/(m + p - 1)" in d["assumptions"]["parallelism"]


# --- what DeepSpeed refuses, in one line --------------------------------------------------------------------

@pytest.mark.parametrize("kw, message", [
    (dict(tp_size=2, sp_size=2), "does not compose AutoTP with Ulysses SP"),
    (dict(tp_size=2, zero=0), "without a ZeRO optimizer sees only this rank's AutoTP shards"),
    (dict(nodes=2, tp_size=16), r"--tp-size \(16\) must not exceed the GPUs per node \(8\)"),
    (dict(nodes=8, sp_size=64), r"attention heads \(32\) must be divisible by --sp-size \(64\)"),
    (dict(arch="mod", sp_size=2), "MoD routes top-k over the whole sequence"),
    (dict(arch="moe", zero_hpz=8), "native MoE refuses ZeRO-3"),
    (dict(zero=2, zero_quantize="both"), "works only with ZeRO-3"),
    (dict(nodes=2, zero_hpz=3), r"--zero-hpz \(3\) must divide the GPUs per node \(8\)"),
    (dict(nodes=2, tp_size=2, zero_hpz=8), "hpZ groups from consecutive ranks"),
    (dict(nodes=2, tp_size=2, zero_quantize="gradients"), "qgZ with --tp-size 2"),
    (dict(arch="moe", tp_size=8, ep_size=8), r"ep_size \(8\) must divide the data-parallel size 1"),
    (dict(arch="moe", sp_size=2), "an MoE gate's capacity and balancing loss would be per-shard"),
])
def test_combinations_deepspeed_refuses_are_one_line(kw, message):
    with pytest.raises(AdaptiveError, match=message) as err:
        fit(make_request(model="b7", gpu="h100-80gb", gpus=8, **kw))
    assert "\n" not in str(err.value)


def test_kv_heads_must_divide_sp_or_sp_the_kv_heads():
    spec = replace(preset_spec("b7"), num_key_value_heads=6, num_attention_heads=48)
    with pytest.raises(AdaptiveError, match=r"key-value heads \(6\) must divide or be divisible by --sp-size \(4\)"):
        fit(replace(make_request(model="b7", gpu="h100-80gb", gpus=8), spec=spec, sp_size=4))


def test_a_refused_combination_exits_2_in_one_line_from_the_cli():
    import subprocess
    import sys

    from tests.conftest import subprocess_env

    r = subprocess.run([sys.executable, "-m", "cli", "fit", "--model", "b7", "--gpu", "h100", "--gpus", "8",
                        "--tp-size", "2", "--sp-size", "2"], capture_output=True, text=True, env=subprocess_env(),
                       timeout=60)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "AutoTP with Ulysses SP" in r.stderr


# --- the runs issue 12 names --------------------------------------------------------------------------------

def _405b():
    return make_request(model=LLAMA_405B, gpu="h100-80gb", gpus=8, nodes=1024, seq_len=8192,
                        global_batch_tokens=16 * 2**20)


def _llama2_70b():
    return make_request(model="b70", gpu="a100-80gb", gpus=8, nodes=256, seq_len=4096, global_batch_tokens=4 * 2**20)


def test_llama_405b_on_8192_h100_with_a_16m_token_batch_fits_with_model_parallelism():
    plan = fit(_405b())
    s = plan.shown.setup
    assert plan.fits and s.seq_len == 8192 and s.tp_size * s.sp_size > 1
    assert s.dp_size * s.micro_batch_size * plan.shown.grad_accum * 8192 == 16 * 2**20  # each sequence once
    assert plan.shown.memory.peak_gpu_bytes <= get_gpu("h100-80gb").memory_bytes
    with pytest.raises(AdaptiveError, match="less than one sequence of 8192 per GPU"):
        fit(replace(_405b(), tp_size=1, sp_size=1))  # what data parallelism alone said before


def test_llama2_70b_on_2048_a100_with_a_4m_token_batch_fits():
    plan = fit(_llama2_70b())
    s = plan.shown.setup
    assert plan.fits and s.seq_len == 4096 and s.dp_size * s.micro_batch_size * plan.shown.grad_accum * 4096 == 4 * 2**20


def test_b70_moe_on_64_h100_fits_only_with_expert_tensor_parallelism():
    # 464B params: DeepSpeed's native MoE refuses ZeRO-3, so without TP each GPU holds the dense part and 1/ep of
    # the experts in 16-bit, 137 GB whatever the offload. AutoTP shards the experts too (DeepSpeed-MoE's expert
    # tensor parallelism, tests/train/run/test_sequence_tensor_parallel.py), down to 1/(ep x tp) of them.
    req = make_request(model="b70", arch="moe", gpu="h100-80gb", gpus=8, nodes=8)
    without = fit(replace(req, tp_size=1), suggest=False)
    assert not without.fits and without.closest.setup.ep_size == 8
    counts = count_params(without.closest.setup.spec)
    assert without.closest.memory.parts["params"] == int(2 * (counts.total - counts.expert + counts.expert / 8))
    plan = fit(req, suggest=False)
    s = plan.shown.setup
    t = s.tp_size  # the fastest layout that fits (4 or 8 on these 64 GPUs)
    assert plan.fits and t > 1 and s.ep_size == 8 and s.dp_size == 64 // t
    norms = (2 * s.spec.num_hidden_layers + 1) * s.spec.hidden_size  # the only weights AutoTP keeps whole
    sharded = (counts.total - counts.expert - norms) / t + counts.expert / (8 * t)
    assert plan.shown.memory.parts["params"] == pytest.approx(2 * (sharded + norms), rel=1e-9)
    # the host-RAM formula for an offload plan: DeepSpeed's ZeRO-2 offload estimator (max(4 x GPUs, 16) bytes
    # per param, x1.5) applied to what each group replicates: the dense part over all GPUs, the routed experts
    # over world/ep only
    one = replace(without.closest.setup, offload_optimizer=True, zero_stage=2)
    by_hand = 1.5 * ((counts.total - counts.expert) * 4 * 64 + counts.expert * 4 * 8) / 8
    assert estimate_memory(one).host_bytes_per_node == pytest.approx(by_hand, rel=1e-9)


def test_the_oom_ladder_offers_sequence_parallel_before_a_shorter_sequence():
    plan = fit(make_request(model=LLAMA_8B, gpu="h100-80gb", gpus=8, seq_len=131072))
    assert plan.fits and plan.shown.setup.seq_len == 131072 and plan.shown.setup.sp_size > 1
    changes = [st.change for st in plan.ladder]
    sp = next(i for i, c in enumerate(changes) if c.startswith("+ sequence parallel"))
    assert plan.ladder[sp].fits
    shorter = [i for i, c in enumerate(changes) if c.startswith("+ sequence ") and "parallel" not in c]
    assert all(i > sp for i in shorter)
    assert changes.index("+ gradient checkpointing") < sp


def test_data_parallel_plans_stay_data_parallel_and_the_search_stays_bounded():
    # at headroom 0, as the count was taken (the default headroom rules out more candidates, so it searches on)
    plan = fit(make_request(model="b7", gpu="a100-80gb", gpus=8, headroom="0"), suggest=False)
    s = plan.shown.setup
    assert (s.tp_size, s.sp_size, s.zero_hpz) == (1, 1, 1) and plan.searched == 166  # as before issue 12
    kept = fit(make_request(model="b7", gpu="a100-80gb", gpus=8), suggest=False)
    assert (kept.shown.setup.tp_size, kept.shown.setup.sp_size) == (1, 1) and kept.searched < 200
    assert fit(_405b(), suggest=False).searched < 1000


def test_moe_all_to_all_across_nodes_splits_into_nvlink_and_network_shares():
    gpu = get_gpu("h100-80gb")
    spec = preset_spec("b7", "moe")
    s = setup(spec=spec, zero_stage=2, ep_size=16, num_nodes=2, seq_len=2048)
    t = estimate_throughput(s, gpu, 1)
    sent = 4 * 2048 * spec.num_experts_per_tok * spec.hidden_size * 2  # 2 fwd + 2 bwd, per layer
    intra = 7 / 16 * sent / (450e9 * 0.8)
    inter = 8 / 16 * sent / (50e9 * 0.8)  # 8 x 400 Gb/s NDR per 8-GPU node, at 0.8
    assert t.alltoall_seconds == pytest.approx(max(intra, inter) * spec.num_moe_layers)
    # with AutoTP 8 every expert-parallel peer sits in another node, and TP ranks send 1/8 of the tokens each
    tp = estimate_throughput(replace(s, ep_size=2, tp_size=8, num_nodes=2), gpu, 1)
    assert tp.alltoall_seconds == pytest.approx(1 / 2 * sent / 8 / (50e9 * 0.8) * spec.num_moe_layers)


def test_zeropp_pins_are_independent_and_steer_the_layout():
    from adaptive.plan.estimate.parallel import Layout
    from adaptive.plan.search.planner import zeropp_variants

    req = make_request(model="b7", gpu="h100-80gb", gpus=8, nodes=2, zero_quantize="off")
    assert {v.hpz for v in zeropp_variants(req, 3, Layout())} == {1, 8}  # quantization off leaves hpZ free
    assert not any(v.qwz or v.qgz for v in zeropp_variants(req, 3, Layout()))
    assert zeropp_variants(replace(req, zero_hpz=8), 3, Layout(tp=2)) == []  # hpZ pinned: no AutoTP layout
    plan = fit(make_request(model="b7", gpu="h100-80gb", gpus=8, nodes=2, global_batch_tokens=16384, zero_hpz=8),
               suggest=False)
    s = plan.shown.setup
    assert plan.fits and s.zero_hpz == 8 and s.tp_size == 1 and s.sp_size == 2  # 8 sequences on 16 GPUs


def test_a_ds_config_pins_sp_tp_and_zeropp_and_a_contradicting_flag_is_refused(tmp_path):
    import json

    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_micro_batch_size_per_gpu": "auto", "sequence_parallel_size": 2,
                                "zero_optimization": {"stage": 3, "zero_hpz_partition_size": 8,
                                                      "zero_quantized_weights": True}}))
    req = make_request(model="b7", gpu="h100-80gb", gpus=8, nodes=2, ds_config=str(path))
    assert (req.sp_size, req.tp_size, req.zero_hpz) == (2, None, 8)
    assert req.zero_quantized_weights is True and req.zero_quantized_gradients is False
    with pytest.raises(AdaptiveError, match=r"--sp-size 4 contradicts .*sequence_parallel_size = 2"):
        make_request(model="b7", gpu="h100-80gb", gpus=8, nodes=2, ds_config=str(path), sp_size=4)
    path.write_text(json.dumps({"zero_optimization": {"stage": 2, "zero_hpz_partition_size": 8}}))
    stage2 = make_request(model="b7", gpu="h100-80gb", gpus=8, ds_config=str(path))
    assert stage2.zero_hpz is None and "zero_optimization.zero_hpz_partition_size" in stage2.ds_config.ignored
