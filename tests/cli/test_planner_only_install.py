"""docs/install.md's "planner only" install row in a real virtual environment: a fresh venv that can import the planner's
dependencies and nothing else (no torch), as `pip install .` would leave it, built without the network.

The venv is made by `python -m venv --without-pip`; a .pth file in it points at a folder of symlinks to exactly
the distributions pyproject.toml's `dependencies` need (followed through their own requirements), taken from the
environment running the tests. tests/safety/test_inputs_fuzz.py blocks modules in sys.modules instead; this one
checks what a new user's machine sees.
"""

from __future__ import annotations

import importlib.metadata as metadata
import json
import re
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from adaptive.extras import TRAIN_INSTALL
from tests.conftest import REPO_ROOT


def _name(requirement: str) -> str:
    return re.match(r"[A-Za-z0-9_.-]+", requirement).group(0)


def planner_requirements() -> list[str]:
    """pyproject.toml's [project] dependencies (no extras)."""
    text = (REPO_ROOT / "pyproject.toml").read_text()
    block = re.search(r"^dependencies = \[(.*?)^\]", text, flags=re.S | re.M).group(1)
    return [_name(r) for r in re.findall(r'^\s*"([^"]+)"', block, flags=re.M)]


def closure(names: list[str]) -> list[metadata.Distribution]:
    """The installed distributions `names` need, their own requirements followed (extras left out)."""
    seen: dict[str, metadata.Distribution] = {}
    todo = list(names)
    while todo:
        name = todo.pop()
        key = re.sub(r"[-_.]+", "-", name).lower()
        if key in seen:
            continue
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:  # a requirement for another Python or platform
            continue
        seen[key] = dist
        todo += [_name(r) for r in dist.requires or [] if "extra ==" not in r]
    return list(seen.values())


@pytest.fixture(scope="module")
def planner_venv(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("planner-only")
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    deps = root / "deps"
    deps.mkdir()
    site = Path(sysconfig.get_paths()["purelib"])
    dists = closure(planner_requirements())
    assert {re.sub(r"[-_.]+", "-", d.metadata["Name"]).lower() for d in dists} >= {"typer", "rich", "pydantic"}
    for dist in dists:
        for top in {Path(str(f)).parts[0] for f in dist.files or []} - {"..", "__pycache__"}:
            if (site / top).exists() and not (deps / top).exists() and not top.endswith(".pth"):
                (deps / top).symlink_to(site / top)
    venv_site = next(venv.glob("lib/python*/site-packages"))
    (venv_site / "planner_deps.pth").write_text(f"{deps}\n{REPO_ROOT}\n")
    return venv


def run(venv: Path, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {"PATH": f"{venv / 'bin'}:/usr/bin:/bin", "HOME": str(cwd), "COLUMNS": "120"}  # nothing of ours inherited
    return subprocess.run([str(venv / "bin" / "python"), *args], capture_output=True, text=True, env=env, cwd=cwd,
                          timeout=120)


def test_the_venv_has_the_planner_and_no_torch(planner_venv, tmp_path):
    done = run(planner_venv, "-c", "import typer, rich, pydantic, adaptive.plan; import torch", cwd=tmp_path)
    assert done.returncode == 1 and "No module named 'torch'" in done.stderr, done.stderr


@pytest.mark.parametrize("args, exits", [
    (["fit", "--model", "b7", "--gpu", "a100-40gb"], 1),  # as the README says: nothing fits one A100-40GB
    (["fit", "--model", "b7", "--gpu", "a100-40gb", "--host-mem", "162", "--json"], 0),
    (["models"], 0),
    (["gpus", "--json"], 0),
    (["compare", "--model", "b1", "--arch", "dense,moe", "--gpu", "t4"], 0),
    (["launch", str(REPO_ROOT / "recipes" / "b1_mod.py"), "--gpu", "a100-80gb", "--dry-run", "--run-dir", "RUN"], 0),
])
def test_the_planner_commands_work_without_torch(planner_venv, tmp_path, args, exits):
    args = [a.replace("RUN", str(tmp_path / "run")) for a in args]
    done = run(planner_venv, "-m", "cli", *args, cwd=tmp_path)
    assert done.returncode == exits, done.stderr
    assert done.stdout and "Traceback" not in done.stderr
    if "--json" in args:
        json.loads(done.stdout)


@pytest.mark.parametrize("args", [["measure", "--model", "debug"], ["report", "RUN"], ["export", "RUN"]])
def test_measure_report_and_export_exit_2_with_the_install_command(planner_venv, tmp_path, args):
    (tmp_path / "run").mkdir()
    done = run(planner_venv, "-m", "cli", *[a.replace("RUN", str(tmp_path / "run")) for a in args], cwd=tmp_path)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1, done.stderr
    assert f"adaptive {args[0]} needs" in lines[0] and TRAIN_INSTALL in lines[0]
    assert not done.stdout
