"""`adaptive fit --calibrate RUN_DIR`: plan with a real run's measured speed and peak.

The run folder is written by the real training loop (recipes/debug_dense.py under accelerate +
DeepSpeed on the CPU). A CPU has no catalog GPU, so the test fills in what a GPU run records: the
GPU's name in the start record, and per train record the peak allocated bytes and tokens/s.
"""

import json
import shutil
import subprocess
import sys

import pytest

from adaptive.errors import AdaptiveError
from adaptive.plan import fit, make_request
from adaptive.plan.ds_config.emit import plan_dict
from adaptive.plan.search.planner import evaluate, host_mem_for
from tests.conftest import subprocess_env
from tests.train._launch import REPO, accelerate_launch, records, tail

pytestmark = pytest.mark.slow  # real recipe runs

GPU = "a100-80gb"
SPEED_FACTOR = 0.8  # the "GPU" ran at 80% of the speed the model predicts
PEAK_FACTOR = 1.25  # and peaked 25% above the predicted allocated peak


@pytest.fixture(scope="module")
def real_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("run")
    home = tmp_path_factory.mktemp("home")
    done = accelerate_launch(REPO / "recipes" / "debug_dense.py",
                             ["--max-steps", "6", "--seq-len", "64", "--output-dir", str(out), "--log-every", "2",
                              "--no-progress"], home=home, ADAPTIVE_CACHE=str(home / "cache"))
    assert done.returncode == 0, tail(done)
    return out


def predicted_at_run_knobs(start: dict):
    """What the uncalibrated model says for the run's own knobs on GPU."""
    k = start["knobs"]
    req = make_request(model="debug", gpu=GPU)
    tokens = k["micro_batch_size"] * k["gradient_accumulation_steps"] * k["seq_len"]
    return evaluate(req, req.spec, k["seq_len"], k["micro_batch_size"], k["zero_stage"], "none",
                    k["gradient_checkpointing"], 1, tokens, host_mem_for(req))


@pytest.fixture(scope="module")
def gpu_run(real_run, tmp_path_factory):
    """The real run's metrics with the GPU fields filled in."""
    run = tmp_path_factory.mktemp("gpu_run")
    lines = records(real_run)
    start = [r for r in lines if r["kind"] == "start"][-1]
    assert start["gpu"] is None and start["device"] == "cpu"  # what the CPU run really wrote
    c = predicted_at_run_knobs(start)
    start["gpu"] = GPU
    for r in lines:
        if r["kind"] == "train":
            r["tokens_per_s"] = c.throughput.tokens_per_second * SPEED_FACTOR
            peak = int(c.memory.allocated_peak_bytes * PEAK_FACTOR)
            r["memory"] = {"allocated_bytes": peak // 2, "peak_allocated_bytes": peak, "reserved_bytes": peak}
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    return run, c


def test_calibrated_plan_reproduces_the_runs_measured_speed_and_peak(gpu_run):
    run, c = gpu_run
    req = make_request(model="debug", gpu=GPU, calibrate=str(run))
    # one GPU, no communication: the step is all compute, so the measured compute is the modelled one / 0.8
    assert req.mfu is None and req.compute_scale == pytest.approx(1 / SPEED_FACTOR, rel=1e-6)
    assert req.peak_correction == pytest.approx(PEAK_FACTOR, rel=1e-6)
    s = c.setup
    again = evaluate(req, req.spec, s.seq_len, s.micro_batch_size, s.zero_stage, "none", s.gradient_checkpointing, 1,
                     s.tokens_per_micro_batch * c.grad_accum, host_mem_for(req))
    assert again.throughput.tokens_per_second == pytest.approx(c.throughput.tokens_per_second * SPEED_FACTOR, rel=1e-6)
    assert again.memory.allocated_peak_bytes + again.memory.parts["calibration_correction"] == pytest.approx(
        c.memory.allocated_peak_bytes * PEAK_FACTOR, rel=1e-6)


def test_fit_says_which_figures_are_calibrated(gpu_run):
    run, _ = gpu_run
    plan = fit(make_request(model="debug", gpu=GPU, calibrate=str(run)))
    d = plan_dict(plan)
    assert len(d["calibrated"]) == 2
    assert d["calibrated"][0].startswith("compute time x1.250") and str(run) in d["calibrated"][0]
    assert d["calibrated"][1].startswith("peak memory x1.250")
    assert d["hfu_assumed"] == pytest.approx(plan.shown.throughput.utilisation)
    plain = fit(make_request(model="debug", gpu=GPU))
    assert plan.shown.memory.peak_gpu_bytes > plain.shown.memory.peak_gpu_bytes  # the correction is applied
    out = subprocess.run([sys.executable, "-m", "cli", "fit", "--model", "debug", "--gpu", GPU, "--calibrate", str(run)],
                         capture_output=True, text=True, env=subprocess_env(), timeout=120)
    assert out.returncode == 0, out.stderr
    assert "Calibrated: compute time x1.250" in out.stdout and "Calibrated: peak memory x1.250" in out.stdout
    assert f"Calibrated with run folder {run}: compute time " in out.stdout


def test_a_cpu_run_and_a_run_on_another_gpu_are_refused(real_run, gpu_run, tmp_path):
    with pytest.raises(AdaptiveError, match="not measured on a catalog GPU"):
        make_request(model="debug", gpu=GPU, calibrate=str(real_run))
    run, _ = gpu_run
    with pytest.raises(AdaptiveError, match="measured on a100-80gb, not h100-80gb"):
        make_request(model="debug", gpu="h100", calibrate=str(run))
    with pytest.raises(AdaptiveError, match="trained a model of"):
        make_request(model="b1", gpu=GPU, calibrate=str(run))


def test_a_run_folder_with_an_activation_calibration_file_uses_it_too(gpu_run, tmp_path):
    run, _ = gpu_run
    folder = tmp_path / "run"
    shutil.copytree(run, folder)
    from adaptive.plan.estimate.calibration import Calibration, signature, to_json
    from adaptive.plan.architecture.presets import preset_spec

    spec = preset_spec("debug")
    (folder / "calibration.json").write_text(to_json(Calibration(signature(spec), 64, (5000.0, 900.0),
                                                                 (9000.0, 1500.0), "test figures")))
    req = make_request(model="debug", gpu=GPU, calibrate=str(folder))
    assert req.calibration is not None and req.calibration.method == "test figures"
    assert req.calibrated[0].startswith("activations (measured at seq 64")
    assert len(req.calibrated) == 3
