"""`adaptive measure` and calibration as a user runs them."""

import json
import subprocess
import sys

import pytest

from adaptive.fidelity.calibrate import measure_calibration
from adaptive.fidelity.measure import measure_step
from adaptive.plan import fit, make_request
from adaptive.plan.estimate.calibration import to_json
from adaptive.plan.estimate.memory import reduce_bucket_bytes
from tests.conftest import REPO_ROOT, subprocess_env

QWEN2_MOE = dict(model_type="qwen2_moe", vocab_size=5003, hidden_size=256, intermediate_size=640,
                 num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4, num_experts=6,
                 num_experts_per_tok=3, moe_intermediate_size=96, shared_expert_intermediate_size=384,
                 decoder_sparse_step=2)


def adaptive(*args):
    return subprocess.run([sys.executable, "-m", "cli", *args], capture_output=True, text=True,
                          env=subprocess_env(COLUMNS="200"), timeout=300)


def test_measure_json_reports_each_part_with_its_error():
    r = adaptive("measure", "--model", "debug", "--arch", "mod", "--seq-len", "256", "--micro-batch", "2",
                 "--json")
    assert r.returncode == 0, r.stderr[-2000:]
    d = json.loads(r.stdout)
    names = [p["name"] for p in d["parts"]]
    assert names[0].startswith("activations") and names[-1].startswith("peak")
    assert all(abs(p["error"]) < 0.05 and p["measured_bytes"] > 0 for p in d["parts"])
    assert "fake tensors" in d["method"] and d["layers"] == 5


def test_measure_bad_input_exits_2_with_one_line():
    r = adaptive("measure", "--model", "debg", "--gpu", "a100")
    assert r.returncode == 2 and r.stderr.strip().splitlines() == ["error: unknown model 'debg'; did you mean debug?"]
    r = adaptive("measure", "--model", "debug", "--arch", "moe", "--zero", "3")  # a layout no MoE plan has
    assert r.returncode == 2 and r.stderr.strip().splitlines()[0].startswith("error: --zero 3 is impossible for MoE")


def test_config_transformers_refuses_exits_2_with_one_line(tmp_path):
    cfg = tmp_path / "config.json"  # head_dim given, but transformers' Llama wants hidden % heads == 0
    cfg.write_text(json.dumps(dict(model_type="llama", vocab_size=1000, hidden_size=384, intermediate_size=1000,
                                   num_hidden_layers=2, num_attention_heads=9, num_key_value_heads=3, head_dim=64)))
    r = adaptive("measure", "--model", str(cfg), "--seq-len", "64")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr[-2000:]
    assert r.stderr.startswith("error: transformers cannot build this llama config.json")


def test_unwritable_calibration_path_is_refused_before_measuring(tmp_path):
    r = adaptive("measure", "--model", "debug", "--seq-len", "64", "--save-calibration",
                 str(tmp_path / "missing" / "c.json"))
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "does not exist" in r.stderr


def test_measure_takes_the_mod_capacity(tmp_path):
    r = adaptive("measure", "--model", "debug", "--arch", "mod", "--mod-capacity", "0.25", "--seq-len", "256",
                 "--checkpointing", "--json")
    assert r.returncode == 0, r.stderr[-2000:]
    d = json.loads(r.stdout)
    assert "MoD capacity 0.25" in d["method"] and abs(d["worst_error"]) < 0.05


def test_calibration_replaces_the_formula_for_a_model_it_does_not_cover(tmp_path):
    """Qwen2-MoE's shared expert is not in our formula; a calibration measured at micro-batch 1 makes
    the plan for micro-batch 2 match a measurement at micro-batch 2."""
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(QWEN2_MOE))
    request = make_request(model=str(cfg), gpu="a100-80gb", seq_len=512)
    calibration = tmp_path / "calibration.json"
    calibration.write_text(to_json(measure_calibration(request, str(cfg), micro_batch=1)))
    measured = measure_step(request.spec, 512, 2, False, zero_stage=2, hf_config=QWEN2_MOE, bucket_elements=1)

    calibrated = fit(make_request(model=str(cfg), gpu="a100-80gb", seq_len=512, micro_batch=2, zero=2,
                                  checkpointing=False, calibrate=str(calibration)), suggest=False)
    parts = calibrated.shown.memory.parts
    assert parts["activations"] + parts["logits_and_loss"] == pytest.approx(measured.activation_bytes, rel=0.02)
    # the plan's backward phase holds its ZeRO-2 reduce buckets; the measurement ran with 1-element ones
    buckets = reduce_bucket_bytes(calibrated.shown.setup)
    assert calibrated.shown.memory.backward_bytes - buckets == pytest.approx(measured.phases.backward, rel=0.02)


def test_calibration_for_another_model_is_refused(tmp_path):
    r = adaptive("measure", "--model", "debug", "--seq-len", "128", "--save-calibration", str(tmp_path / "c.json"))
    assert r.returncode == 0, r.stderr[-2000:]
    bad = adaptive("fit", "--model", "debug", "--arch", "moe", "--gpu", "t4", "--calibrate", str(tmp_path / "c.json"))
    assert bad.returncode == 2 and "measured for another model" in bad.stderr
    good = adaptive("fit", "--model", "debug", "--gpu", "t4", "--calibrate", str(tmp_path / "c.json"), "--json")
    assert good.returncode in (0, 1), good.stderr[-2000:]
    assert json.loads(good.stdout)["assumptions"]["activations"].startswith("measured")


@pytest.mark.slow  # DeepSpeed engines for every configuration of the GPU check
def test_gpu_check_runs_on_the_cpu_in_dry_run(tmp_path):
    out = tmp_path / "table.md"
    r = subprocess.run([sys.executable, str(REPO_ROOT / "bench/gpu_check.py"), "--dry-run",
                        "--only", "b1_hybrid,b7_dense", "--out", str(out)],
                       capture_output=True, text=True, env=subprocess_env(), timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = out.read_text().splitlines()
    assert sum(line.startswith("| b1 | hybrid |") for line in rows) == 2  # MoE + MoD + dense layers, 2 micro-batches
    offload = [line for line in rows if line.startswith("| b7 | dense | 2 / optimizer |")]
    assert len(offload) == 2 and all(line.endswith("| torch AdamW (CPU) |") for line in offload)


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_gpu_check_without_cuda_says_so_in_one_line():
    r = subprocess.run([sys.executable, str(REPO_ROOT / "bench/gpu_check.py")], capture_output=True, text=True,
                       env=subprocess_env(), timeout=300)
    lines = [line for line in r.stderr.strip().splitlines() if "[WARNING]" not in line]
    assert r.returncode == 1 and lines == [line for line in lines if line.startswith("gpu_check: no CUDA GPU")]
    assert len(lines) == 1 and "Traceback" not in r.stderr


def test_calibration_measured_at_another_capacity_factor_is_refused(tmp_path):
    from adaptive.errors import AdaptiveError
    from adaptive.plan.estimate.calibration import Calibration, signature

    spec = make_request(model="debug", arch="moe", gpu="t4").spec
    path = tmp_path / "c.json"
    path.write_text(to_json(Calibration(signature(spec), 512, (100.0, 10.0), (200.0, 20.0), "by hand", 1.0)))
    assert make_request(model="debug", arch="moe", gpu="t4", calibrate=str(path)).calibration.capacity_factor == 1.0
    with pytest.raises(AdaptiveError, match="capacity factor 1, not 2"):
        make_request(model="debug", arch="moe", gpu="t4", capacity_factor=2.0, calibrate=str(path))
