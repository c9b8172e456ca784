"""A recipe trains the shape in a config.json (what `adaptive fit --budget-* --out DIR` writes for its winner):
it plans that shape, builds it with exactly the planner's parameter count, and refuses a bad file in one line."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from adaptive.plan import count_params
from adaptive.plan.architecture.hf_config import adaptive_config_dict
from adaptive.plan.architecture.ladder import rung
from adaptive.plan.architecture.presets import spec_from_shape
from tests.train._launch import REPO, launch_env


def _shape(tmp_path, arch: str):
    spec = spec_from_shape(rung(64, vocab_size=2048), arch)  # the ladder's smallest rung, the builtin vocabulary
    folder = tmp_path / "shape"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(adaptive_config_dict(spec)))
    return spec, folder / "config.json"


def _recipe(tmp_path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "recipes" / "debug_dense.py"), *args], env=launch_env(tmp_path),
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)


@pytest.mark.parametrize("arch", ["dense", "moe"])
def test_a_recipe_plans_the_shape_of_a_config_json(tmp_path, arch):
    spec, config = _shape(tmp_path, arch)
    done = _recipe(tmp_path, "--model", str(config), "--arch", arch, "--dry-run", "--gpu", "a100-80gb")
    assert done.returncode == 0, done.stderr
    plan = json.loads(done.stdout)["plan"]
    assert (plan["model"], plan["arch"], plan["params_total"]) == (spec.name, arch, count_params(spec).total)


def test_a_bad_config_json_is_one_line_and_exit_2(tmp_path):
    (tmp_path / "bad.json").write_text('{"model_type": "adaptive", "hidden_size": 64}')
    done = _recipe(tmp_path, "--model", str(tmp_path / "bad.json"), "--dry-run")
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and "Traceback" not in done.stderr, done.stderr


@pytest.mark.slow  # a real training run
def test_a_recipe_trains_the_shape_and_exports_it(tmp_path):
    from transformers import AutoModelForCausalLM

    import adaptive.models  # noqa: F401 - registers the Auto classes

    spec, config = _shape(tmp_path, "moe")
    done = _recipe(tmp_path, "--model", str(config), "--arch", "moe", "--max-steps", "3", "--seq-len", "64",
                   "--no-progress")
    assert done.returncode == 0, done.stderr[-3000:]
    run = tmp_path / "runs" / "shape_moe"  # named after the config's folder
    losses = [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()
              if '"loss"' in line and '"eval' not in line]
    assert losses and all(x == x for x in losses)
    model = AutoModelForCausalLM.from_pretrained(run / "hf")
    assert sum(p.numel() for p in model.parameters()) == count_params(spec).total
