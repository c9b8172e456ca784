"""`adaptive launch recipes/finetune.py`: the fine-tune recipe's method applies (it used to be refused: "give
--init-from" although it was given), the GPU plan is the fine-tune's (it used to be a full training of the
checkpoint with adaptive's lean kernels: another micro-batch and memory, handed to the recipe in ds_config.json), the
recipe re-derives it, and the Slurm batch script carries it; a fine-tune's length comes from its data, so the job
gets no time limit from the plan's nominal dataset. Dry runs only: nothing trains here."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys

import pytest

from tests.conftest import REPO_ROOT, subprocess_env
from tests.train.finetune._checkpoints import write_chat, write_llama

RECIPE = str(REPO_ROOT / "recipes" / "finetune.py")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("launch_finetune")
    return write_llama(root / "tiny-llama"), write_chat(root / "chat.jsonl")


def adaptive(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cli", *args], capture_output=True, text=True,
                          env=subprocess_env(COLUMNS="200"), timeout=120, cwd=REPO_ROOT)


def launch_json(*args: str) -> dict:
    done = adaptive("launch", RECIPE, *args, "--dry-run", "--json")
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def recipe_dry_run(command: str, *extra: str) -> dict:
    """The recipe's own --dry-run of the command launch printed."""
    args = shlex.split(command)[4:]  # after `accelerate launch --config_file FILE`
    done = subprocess.run([sys.executable, *args, "--dry-run", *extra], capture_output=True, text=True,
                          env=subprocess_env(), timeout=120, cwd=REPO_ROOT)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_the_fine_tune_recipes_default_method_reaches_the_cpu_plan_and_the_command(tiny, tmp_path):
    checkpoint, data = tiny
    out = launch_json("--init-from", str(checkpoint), "--dataset", str(data), "--seq-len", "64",
                      "--run-dir", str(tmp_path))
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert plan["finetune"]["method"] == "lora" and plan["kernels"] == "plain"
    command = shlex.split(out["commands"][0])
    assert command[command.index("--finetune") + 1] == "lora"
    assert command[command.index("--init-from") + 1] == str(checkpoint)
    recipe = recipe_dry_run(out["commands"][0])
    assert recipe["run"]["finetune"] == "lora" and recipe["run"]["device"] == "cpu"
    ds = json.loads((tmp_path / "ds_config.json").read_text())
    assert (recipe["run"]["knobs"]["micro_batch_size"], recipe["run"]["knobs"]["seq_len"]) == (
        ds["train_micro_batch_size_per_gpu"], 64)


@pytest.mark.parametrize("method", ["lora", "qlora", "full"])
def test_a_gpu_launch_plans_the_fine_tune_the_recipe_rederives(tiny, tmp_path, method):
    checkpoint, data = tiny
    out = launch_json("--init-from", str(checkpoint), "--dataset", str(data), "--finetune", method, "--gpu", "h100",
                      "--gpus", "2", "--optimizer", "adamw_8bit", "--run-dir", str(tmp_path))
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert plan["finetune"]["method"] == method and plan["kernels"] == "plain"
    assert plan["finetune"]["base_bits"] == (4 if method == "qlora" else 16)
    recipe = recipe_dry_run(out["commands"][0], "--gpus", "2")
    for key in ("zero_stage", "micro_batch_size", "gradient_accumulation_steps", "seq_len", "gradient_checkpointing",
                "offload_optimizer", "kernels", "finetune", "peak_gpu_bytes"):
        assert recipe["plan"][key] == plan[key], key
    assert recipe["run"]["finetune"] == method


def test_nvme_offload_reaches_the_launched_ds_config(tiny, tmp_path):
    checkpoint, data = tiny
    swap = tmp_path / "swap"
    swap.mkdir()
    run = tmp_path / "run"
    out = launch_json("--init-from", str(checkpoint), "--dataset", str(data), "--gpu", "h100", "--zero", "3",
                      "--offload", "nvme", "--nvme-path", str(swap), "--run-dir", str(run))
    zero = json.loads((run / "ds_config.json").read_text())["zero_optimization"]
    assert zero["offload_param"]["device"] == zero["offload_optimizer"]["device"] == "nvme"
    assert zero["offload_param"]["nvme_path"] == str(swap) and zero["stage3_prefetch_bucket_size"] == 0  # LoRA
    command = shlex.split(out["commands"][0])
    assert command[command.index("--nvme-path") + 1] == str(swap)


def test_a_slurm_fine_tune_carries_its_method_and_takes_its_time_from_the_flags_not_a_nominal_dataset(tiny, tmp_path):
    checkpoint, data = tiny
    common = ["--init-from", str(checkpoint), "--dataset", str(data), "--gpu", "h100", "--gpus", "8", "--nodes", "2",
              "--scheduler", "slurm", "--max-restarts", "2"]
    out = launch_json(*common, "--run-dir", str(tmp_path / "epochs"))
    script = (tmp_path / "epochs" / "job.sbatch").read_text()
    args = next(line for line in script.splitlines() if line.startswith("ARGS=("))
    assert f"--init-from {checkpoint}" in args and "--finetune lora" in args
    assert "--max_restarts 2" in script
    assert "#SBATCH --time" not in script
    assert any("a fine-tune runs whole epochs of its data" in note for note in out["notes"])
    out = launch_json(*common, "--max-steps", "500", "--run-dir", str(tmp_path / "steps"))
    script = (tmp_path / "steps" / "job.sbatch").read_text()
    assert "#SBATCH --time=" in script and not any("whole epochs" in note for note in out["notes"])


def test_max_restarts_reaches_the_single_node_command(tiny, tmp_path):
    checkpoint, data = tiny
    out = launch_json("--init-from", str(checkpoint), "--dataset", str(data), "--gpu", "h100", "--max-restarts", "1",
                      "--run-dir", str(tmp_path))
    assert "--max_restarts 1" in out["commands"][0]
