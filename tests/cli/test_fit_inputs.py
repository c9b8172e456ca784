"""`adaptive fit --ds-config / --optimizer / --attention` as a user runs them."""

import json
import subprocess
import sys

from tests.conftest import subprocess_env

ZERO2 = {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
         "bf16": {"enabled": "auto"}, "optimizer": {"type": "AdamW", "params": {"torch_adam": True}},
         "zero_optimization": {"stage": 2, "overlap_comm": True, "reduce_bucket_size": 5e8,
                               "allgather_bucket_size": 5e8, "stage3_gather_16bit_weights_on_model_save": True,
                               "zero_hpz_partition_size": 1}}


def adaptive(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cli", *args], capture_output=True, text=True,
                          env=subprocess_env(COLUMNS="200"), timeout=60)


def test_ds_config_pins_its_knobs_and_says_what_drives_the_peak(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(ZERO2))
    r = adaptive("fit", "--model", "b1", "--gpu", "a100-80gb", "--gpus", "8", "--ds-config", str(path), "--json")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["zero_stage"] == 2 and d["optimizer"] == "adamw_torch"  # torch_adam: torch's AdamW
    drives = {x["part"]: x for x in d["ds_config"]["drives"]}
    assert drives["comm_buckets"]["bytes"] == d["memory"]["comm_buckets"]
    assert "reduce_bucket_size = 5e+08" in drives["comm_buckets"]["from"]
    assert "zero_optimization.zero_hpz_partition_size" in d["ds_config"]["ignored"]  # said, not dropped
    # the micro-batch was "auto": searched, so more than one configuration was evaluated
    table = adaptive("fit", "--model", "b1", "--gpu", "a100-80gb", "--gpus", "8", "--ds-config", str(path))
    assert "reduce_bucket_size = 5e+08 x 2 (double-buffered: overlap_comm on)" in table.stdout


def test_a_flag_contradicting_the_ds_config_is_refused_in_one_line(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(ZERO2))
    r = adaptive("fit", "--model", "b1", "--gpu", "a100-80gb", "--ds-config", str(path), "--zero", "3")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "--zero 3 contradicts" in r.stderr and "zero_optimization.stage = 2" in r.stderr


def test_unknown_optimizer_and_attention_are_refused():
    r = adaptive("fit", "--model", "b1", "--gpu", "a100", "--optimizer", "adamw_torh")
    assert r.returncode == 2 and "did you mean adamw_torch?" in r.stderr
    r = adaptive("fit", "--model", "b1", "--gpu", "a100", "--attention", "flash")
    assert r.returncode == 2 and "--attention must be one of sdpa, eager" in r.stderr
