"""The `adaptive` command as a user runs it: exit codes, one-line errors, JSON, files, no torch."""

import csv
import io
import json
import subprocess
import sys

import pytest

from adaptive.plan import ARCHS, PRESETS, count_params, preset_spec
from tests.conftest import subprocess_env

JSON_KEYS = {"fits", "model", "arch", "gpu", "num_gpus", "params_total", "params_active", "zero_stage",
             "offload_optimizer", "offload_params", "micro_batch_size", "gradient_accumulation_steps", "seq_len",
             "gradient_checkpointing", "ep_size", "memory", "peak_gpu_bytes", "gpu_capacity_bytes", "host_bytes",
             "tokens_per_second", "mfu_assumed", "train_tokens", "train_hours", "cost_usd", "ladder", "orchestrator"}


def adaptive(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cli", *args], capture_output=True, text=True,
                          env=subprocess_env(COLUMNS="200"), timeout=60)


@pytest.mark.parametrize("json_output", [True, False])
def test_fit_imports_no_torch_deepspeed_or_transformers(json_output):
    """Nor, with --json, rich (tables only), nor the other commands' modules (cli/main.py imports the one that runs);
    the tables need neither json nor rich's emoji table (no string shown holds an emoji code)."""
    args = ["fit", "--model", "b7", "--gpu", "a100-40gb", *(["--json"] if json_output else [])]
    not_imported = ("torch", "deepspeed", "transformers", "accelerate", "datasets", "cli.launch", "cli.measure",
                    *(("rich",) if json_output else ("json", "rich._emoji_codes")))
    code = (f"import sys; from cli.main import run; rc = run({args!r});"
            f"heavy = [m for m in {not_imported!r} if m in sys.modules];"
            "print('HEAVY', heavy, rc, file=sys.stderr)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=subprocess_env(), timeout=60)
    assert "HEAVY [] 1" in r.stderr, r.stderr  # b7 dense does not fit one A100-40GB with default host RAM


def test_fit_tables_keep_rich_emoji_codes_where_a_string_holds_one(tmp_path):
    """rich replaces ":name:" codes in what it prints; render skips that only where no string could hold one, so a
    path that holds one prints as it did before (cli/render.py _print_all)."""
    folder = tmp_path / "x:thumbs_up:y"
    folder.mkdir()
    (folder / "ds.json").write_text(json.dumps({"train_micro_batch_size_per_gpu": "auto",
                                                "zero_optimization": {"stage": 2}}))
    r = adaptive("fit", "--model", "b1", "--gpu", "a100-80gb", "--ds-config", str(folder / "ds.json"))
    assert r.returncode == 0, r.stderr
    assert "x\N{THUMBS UP SIGN}y" in r.stdout and ":thumbs_up:" not in r.stdout


def test_fit_json_has_the_documented_schema_and_consistent_numbers():
    r = adaptive("fit", "--model", "b1", "--gpu", "a100-80gb", "--json")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert JSON_KEYS <= set(d)
    assert {"params", "grads", "optimizer", "activations"} <= set(d["memory"])
    phases = d["memory_phases"]
    allowance = d["memory"]["fragmentation"] + d["memory"]["cuda_context"]
    peak = phases["persistent"] + max(phases["backward"], phases["optimizer_step"]) + allowance
    assert peak == d["peak_gpu_bytes"] <= d["gpu_capacity_bytes"]
    assert sum(d["memory"].values()) >= d["peak_gpu_bytes"]  # parts that never coexist are not summed
    assert d["params_total"] == count_params(preset_spec("b1")).total
    assert d["cost_usd"] == pytest.approx(d["train_hours"] * 1.79)
    assert all({"change", "peak_gpu_bytes", "fits"} <= set(step) for step in d["ladder"])
    assert set(d["orchestrator"]) == {"recommended", "reason", "measured_overhead"}
    overhead = d["orchestrator"]["measured_overhead"]
    assert 0 < overhead["time_fraction"] < 0.01 and 0 < overhead["memory_bytes"] < 50 * 2**20
    assert "bench_orchestrator.py" in overhead["source"]


def test_fit_exit_code_is_1_when_nothing_fits_and_says_what_would():
    r = adaptive("fit", "--model", "b70", "--gpu", "t4")
    assert r.returncode == 1
    assert "DOES NOT FIT" in r.stdout and "What would fit" in r.stdout


def test_fit_human_output_shows_plan_breakdown_ladder_cost_and_orchestrator():
    r = adaptive("fit", "--model", "b7", "--gpu", "h100", "--gpus", "8")
    assert r.returncode == 0, r.stderr
    for text in ("FITS", "ZeRO stage", "activations", "optimizer states", "OOM playbook", "cost", "Orchestrator",
                 "measured overhead +"):
        assert text in r.stdout


def test_out_writes_the_three_files(tmp_path):
    r = adaptive("fit", "--model", "debug", "--arch", "moe", "--gpu", "t4", "--out", str(tmp_path))
    assert r.returncode == 0, r.stderr
    assert {p.name for p in tmp_path.iterdir()} == {"ds_config.json", "accelerate_config.yaml", "plan.json"}
    assert "fp16" in json.loads((tmp_path / "ds_config.json").read_text())
    assert "Launch: accelerate launch --config_file" in r.stdout


def test_out_for_a_plan_that_does_not_fit_writes_only_the_plan_and_no_launch_line(tmp_path):
    r = adaptive("fit", "--model", "b7", "--gpu", "a100-40gb", "--out", str(tmp_path))
    assert r.returncode == 1, r.stderr
    assert [p.name for p in tmp_path.iterdir()] == ["plan.json"]
    assert json.loads((tmp_path / "plan.json").read_text())["fits"] is False
    assert "Launch:" not in r.stdout and "Nothing fits, so only plan.json" in r.stdout


@pytest.mark.parametrize("args,message", [
    (["fit", "--model", "b7", "--gpu", "a100-41gb"], "unknown GPU 'a100-41gb'; did you mean a100-40gb?"),
    (["fit", "--model", "b8", "--gpu", "a100"], "unknown model 'b8'; did you mean b7?"),
    (["fit", "--model", "b7", "--gpu", "a100", "--arch", "hybird"], "unknown arch 'hybird'; did you mean hybrid?"),
    (["fit", "--model", "b7", "--gpu", "a100", "--gpus", "0"], "--gpus must be positive, got 0"),
    (["fit", "--model", "b7", "--gpu", "a100", "--seq-len", "-5"], "--seq-len must be positive, got -5"),
    (["fit", "--model", "b7", "--gpu", "a100", "--mfu", "1.5"], "--mfu"),
    (["fit", "--model", "b7", "--gpu", "a100", "--gpus", "two"], "Invalid value for '--gpus'"),
    (["fit", "--model", "b1", "--arch", "moe", "--gpu", "a100", "--zero", "3"], "refuses ZeRO stage 3"),
    (["fit", "--model", "b7", "--gpu-mem", "24"], "--gpu-tflops"),
    (["compare", "--model", "b1", "--gpu", "p100"], "unknown GPU 'p100'"),  # v100 is in the catalog since issue 10
    (["fit", "--model", "b7", "--gpu", "a100", "--host-mem", "inf"], "--host-mem must be a finite number"),
    (["fit", "--model", "b7", "--gpu-mem", "nan", "--gpu-tflops", "300"], "--gpu-mem must be a finite number, got nan"),
    (["fit", "--model", "b7", "--gpu", "a100", "--mfu", "nan"], "--mfu must be a finite number, got nan"),
    (["fit", "--model", "b7", "--gpu", "a100", "--price", "nan"], "--price must be a finite number"),
    (["fit", "--model", "b1", "--gpu", "a100", "--tokens", "1e30"], "--tokens must be <= 1e+15, got 1e+30"),
    (["fit", "--model", "b1", "--gpu", "a100", "--finetune", "lorra"], "is not one of 'full', 'lora', 'qlora'. Did "
                                                                       "you mean 'lora'?"),
    (["compare", "--model", "b1", "--gpu", "a100", "--offload", "nvm"], "Did you mean 'nvme'?"),
])
def test_bad_input_exits_2_with_one_line_and_no_traceback(args, message):
    r = adaptive(*args)
    assert r.returncode == 2, (r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], r.stderr
    assert "Traceback" not in r.stderr + r.stdout


def test_version_is_the_installed_package_s():
    from importlib.metadata import version

    r = adaptive("--version")
    assert r.returncode == 0 and r.stdout == f"adaptive {version('adaptive-training')}\n", r.stderr
    assert "--version" in adaptive("--help").stdout


def test_out_that_is_a_file_exits_2(tmp_path):
    not_a_folder = tmp_path / "plan"
    not_a_folder.write_text("")
    r = adaptive("fit", "--model", "debug", "--gpu", "t4", "--out", str(not_a_folder))
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.strip().splitlines() == [f"error: cannot write the plan files into {str(not_a_folder)!r}: "
                                             "it is a file, not a folder"]


def test_malformed_config_json_exits_2(tmp_path):
    bad = tmp_path / "config.json"
    bad.write_text("{not json")
    r = adaptive("fit", "--model", str(bad), "--gpu", "a100")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1
    assert "malformed config.json" in r.stderr


def test_fit_accepts_an_hf_config_json(tmp_path):
    cfg = dict(model_type="mixtral", vocab_size=32000, hidden_size=1024, intermediate_size=3584,
               num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=4, num_local_experts=8,
               num_experts_per_tok=2)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    r = adaptive("fit", "--model", str(path), "--gpu", "a100-80gb", "--json")
    d = json.loads(r.stdout)
    assert d["arch"] == "moe" and d["zero_stage"] != 3 and d["params_total"] > d["params_active"]


def test_models_json_lists_every_preset_and_arch_with_exact_counts():
    r = adaptive("models", "--json")
    rows = json.loads(r.stdout)
    assert {(x["model"], x["arch"]) for x in rows} == {(m, a) for m in PRESETS for a in ARCHS}
    for x in rows:
        c = count_params(preset_spec(x["model"], x["arch"]))
        assert (x["params_total"], x["params_active"]) == (c.total, c.active)
    table = adaptive("models").stdout
    assert "b70" in table and "hybrid" in table


def test_gpus_lists_the_catalog():
    r = adaptive("gpus")
    for name in ("t4-16gb", "h100-pcie-80gb", "mi300x-192gb", "b200-180gb"):
        assert name in r.stdout
    assert len(json.loads(adaptive("gpus", "--json").stdout)) >= 13


def test_compare_marks_bests_and_prints_csv_and_json():
    r = adaptive("compare", "--model", "b1,b7", "--arch", "dense,mod", "--gpu", "rtx4090,a100-80gb", "--json")
    rows = json.loads(r.stdout)
    assert len(rows) == 8
    fitting = [x for x in rows if x["fits"]]
    assert sum(x["best_cost"] for x in rows) == 1
    cheapest = min(fitting, key=lambda x: x["cost_per_1b_tokens_usd"])
    assert cheapest["best_cost"]
    assert max(fitting, key=lambda x: x["tokens_per_second"])["best_speed"]
    out = adaptive("compare", "--model", "b1", "--arch", "dense", "--gpu", "t4", "--csv").stdout
    assert next(csv.DictReader(io.StringIO(out)))["model"] == "b1"


def test_compare_says_why_a_row_does_not_fit_in_the_table_json_and_csv():
    args = ("compare", "--model", "b1,b7", "--arch", "dense,moe", "--gpu", "t4,a100-40gb")
    rows = {(r["model"], r["arch"], r["gpu"]): r for r in json.loads(adaptive(*args, "--json").stdout)}
    host = rows["b7", "dense", "a100-40gb"]  # fits the GPU with CPU offload, which needs more RAM than the node has
    assert (host["fits"], host["fits_gpu"], host["fits_host"], host["why_not"]) == (False, True, False, "host_ram")
    assert host["host_bytes"] > host["host_capacity_bytes"] and host["why_not_detail"].startswith("host RAM: ")
    gpu = rows["b7", "moe", "t4-16gb"]
    assert (gpu["fits_gpu"], gpu["why_not"]) == (False, "gpu_memory") and gpu["peak_gpu_bytes"] > gpu["gpu_capacity_bytes"]
    assert all(r["why_not"] is None and r["why_not_detail"] == "" for r in rows.values() if r["fits"])
    table = adaptive(*args).stdout
    assert "no: host RAM 162/120G" in table and "no: GPU" in table
    csv_rows = list(csv.DictReader(io.StringIO(adaptive(*args, "--csv").stdout)))
    assert {r["why_not"] for r in csv_rows} == {"", "host_ram", "gpu_memory"}


def test_a_pinned_knob_is_named_as_the_reason():
    from adaptive.plan import fit, make_request
    from adaptive.plan.compare import why_not

    kind, text = why_not(fit(make_request(model="b7", gpu="a100-40gb", zero=0), suggest=False))
    assert kind == "pinned" and text.startswith("GPU memory: ") and text.endswith("with --zero pinned")
    assert why_not(fit(make_request(model="b1", gpu="a100-80gb"), suggest=False)) == (None, "")


@pytest.mark.parametrize("args", [("fit", "--model", "b1", "--gpu", "a100-80gb"), ("fit", "--model", "b7", "--gpu", "a100"),
                                  ("fit", "--model", "b7", "--gpu", "a100", "--json"), ("compare", "--json")])
def test_output_cites_nothing_a_user_does_not_have(args):
    out = adaptive(*args).stdout.lower()
    for phrase in ("the documents", "decision guide", "the user's", "shared/", "design.md", "seed figure"):
        assert phrase not in out, phrase


def test_fit_with_a_calibration_file_says_it_used_it(tmp_path):
    from adaptive.plan.estimate.calibration import Calibration, signature, to_json

    cal = tmp_path / "cal.json"
    cal.write_text(to_json(Calibration(signature(preset_spec("debug")), 64, (5000.0, 900.0), (9000.0, 1500.0),
                                       "test figures")))
    r = adaptive("fit", "--model", "debug", "--gpu", "a100-80gb", "--calibrate", str(cal))
    assert r.returncode == 0, r.stderr
    assert f"Calibrated with calibration file {cal}: activations\n" in r.stdout
    d = json.loads(adaptive("fit", "--model", "debug", "--gpu", "a100-80gb", "--calibrate", str(cal), "--json").stdout)
    assert d["calibration_source"] == f"calibration file {cal}" and d["calibrated"][0].startswith("activations")
    assert json.loads(adaptive("fit", "--model", "debug", "--gpu", "a100-80gb", "--json").stdout)["calibration_source"] is None
