"""The DeepSpeed internals `adaptive.engine` relies on still exist in the installed DeepSpeed.

Each entry of `adaptive.engine.INTERNALS` names a class (or function) and a method, an attribute its
source sets (`self.x`), or a parameter. A DeepSpeed upgrade that moves one fails here, by name, instead
of mid-run in the loop or the orchestrator.
"""

from __future__ import annotations

import importlib
import inspect
import os
import re
import subprocess
import sys

import pytest

from adaptive import engine
from adaptive.engine import INTERNALS


def _source_has(owner: object, name: str) -> bool:
    if name.startswith("self."):  # an attribute its code assigns
        return f"{name} =" in inspect.getsource(owner)
    method = re.fullmatch(r"(\w+)\((\w+)\)", name)
    if method:  # a method's parameter, read from the source (DeepSpeed wraps some methods for NVTX)
        return re.search(rf"def {method[1]}\([^)]*\b{method[2]}\b", inspect.getsource(owner)) is not None
    if inspect.isfunction(owner) and name in inspect.signature(owner).parameters:
        return True
    return hasattr(owner, name)


@pytest.mark.parametrize("module, owner, name", INTERNALS, ids=lambda v: v if isinstance(v, str) else None)
def test_the_deepspeed_internal_we_use_is_still_there(module, owner, name):
    import deepspeed

    target = importlib.import_module(module)
    for part in owner.split("."):
        assert hasattr(target, part), f"deepspeed {deepspeed.__version__}: {module}.{owner} is gone " \
                                      f"(adaptive/engine.py was read against {engine.DEEPSPEED_VERSION_READ})"
        target = getattr(target, part)
    assert _source_has(target, name), (f"deepspeed {deepspeed.__version__}: {module}.{owner} has no {name} "
                                       f"(adaptive/engine.py was read against {engine.DEEPSPEED_VERSION_READ})")


def test_the_check_fails_for_a_name_that_is_not_there():
    from deepspeed.runtime.engine import DeepSpeedEngine

    assert not _source_has(DeepSpeedEngine, "self.no_such_attribute")
    assert not _source_has(DeepSpeedEngine, "no_such_method")
    assert not _source_has(DeepSpeedEngine, "backward(no_such_parameter)")


def test_only_the_engine_module_touches_deepspeed_internals():
    """The private names live in adaptive/engine.py alone (and the MoE block that subclasses MoE)."""
    from pathlib import Path

    root = Path(engine.__file__).parent
    private = ("_get_expert_parallel_rank", "time_falltoall", "get_timers", "set_train_micro_batch_size",
               "set_train_batch_size", "_global_grad_norm", "split_params_into_different_moe_groups",
               "_init_tp_mesh_device", "_gather_tokens", "GatherReplacedLayerParams")
    offenders = [f"{path.relative_to(root)}: {name}" for path in root.rglob("*.py") if path.name != "engine.py"
                 for name in private if name in path.read_text()]
    assert not offenders, offenders


def test_ops_are_built_with_deepspeeds_ninja_whatever_path_the_launcher_gave():
    """ninja 1.11 and 1.13 hash command lines differently, so ops built by one were rebuilt by the other whenever a
    run's PATH changed between launchers; every training process puts the pip package's ninja first."""
    import ninja

    code = "from adaptive.engine import pin_ninja; import shutil; pin_ninja(); print(shutil.which('ninja'))"
    for path in ("/usr/bin:/bin", f"{ninja.BIN_DIR}:/usr/bin:/bin"):
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                              env={**os.environ, "PATH": path})
        assert done.returncode == 0, done.stderr
        assert done.stdout.strip() == os.path.join(ninja.BIN_DIR, "ninja")


def test_an_op_counts_as_compiled_only_when_ninja_has_nothing_to_do(tmp_path, monkeypatch):
    """What decides whether a run says "DeepSpeed compiles ... now": the module, this DeepSpeed's sources named in
    build.ninja, and ninja's own dry run (a changed command line rebuilds)."""
    import deepspeed

    from adaptive.engine import op_compiled, pin_ninja

    pin_ninja()
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    assert not op_compiled("ShareMemCommBuilder")
    folder, = tmp_path.rglob("deepspeed_shm_comm")  # torch's build folder for the op, made by the look-up
    (folder / "shm.cpp").write_text("// source\n")

    def build_file(command: str, sources: str) -> None:
        (folder / "build.ninja").write_text(f"# {sources}\nrule link\n  command = {command}\n"
                                            "build deepspeed_shm_comm.so: link shm.cpp\n")

    build_file("cp $in $out", os.path.dirname(deepspeed.__file__))
    assert subprocess.run(["ninja", "-C", str(folder)], capture_output=True).returncode == 0
    assert op_compiled("ShareMemCommBuilder")
    build_file("cp -p $in $out", os.path.dirname(deepspeed.__file__))  # ninja: "command line changed"
    assert not op_compiled("ShareMemCommBuilder")
    build_file("cp $in $out", "/another/venv/site-packages/deepspeed")  # another environment's DeepSpeed
    assert not op_compiled("ShareMemCommBuilder")


def test_which_ops_a_run_loads_follows_its_config():
    from adaptive.engine import ops_a_run_loads

    assert ops_a_run_loads({}) == []
    offload = {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}
    assert ops_a_run_loads(offload) == ["CPUAdamBuilder"]
    nvme = {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme"},
                                  "offload_param": {"device": "nvme"}}}
    assert ops_a_run_loads(nvme) == ["CPUAdamBuilder", "AsyncIOBuilder"]
    params_only = {"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}}}
    assert ops_a_run_loads(params_only) == ["AsyncIOBuilder"]


@pytest.mark.slow  # compiles the shm comm op into an empty extension folder (about 30 s on 2 cores)
def test_an_op_build_is_said_before_it_starts_and_timed(tmp_path, monkeypatch):
    from adaptive.engine import compile_ops, pin_ninja

    pin_ninja()
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    said: list[str] = []
    compile_ops(["ShareMemCommBuilder"], said.append)
    assert len(said) == 2, said
    assert said[0].startswith("DeepSpeed compiles its deepspeed_shm_comm op now, once per machine (about 30 s")
    assert re.fullmatch(r"DeepSpeed's deepspeed_shm_comm op compiled in \d+ s", said[1]), said
    compile_ops(["ShareMemCommBuilder"], said.append)  # compiled: nothing to say
    assert len(said) == 2


def test_the_lines_deepspeed_prints_are_the_ones_held_back():
    """DeepSpeed print()s these two lines (no logger to set a level on); a reworded one would reach users again."""
    import importlib
    import inspect

    from deepspeed.moe.layer import MoE

    from adaptive.engine import expert_group_line, shm_comm_op_built_line

    # by module name: `deepspeed.comm.torch` as an attribute is the torch that deepspeed.comm imports
    shm = inspect.getsource(importlib.import_module("deepspeed.comm.torch").build_shm_op)
    assert "print(f'DeepSpeed {builder.absolute_name()} built successfully')" in shm
    assert shm_comm_op_built_line("DeepSpeed deepspeed.ops.comm.deepspeed_shm_comm_op built successfully\n")
    groups = inspect.getsource(MoE._create_process_groups)
    assert 'print(f"No existing process group found, creating a new group named: {self.expert_group_name}")' in groups
    assert expert_group_line("No existing process group found, creating a new group named: ep_size_2\n")


def test_held_prints_pass_on_every_other_line(capsys, caplog):
    import logging

    from adaptive.engine import expert_group_line, prints_held

    with caplog.at_level(logging.DEBUG, logger="adaptive.engine"), prints_held(expert_group_line):
        print("kept 1")
        print("No existing process group found, creating a new group named: ep_size_1")
        print("kept 2")
    assert capsys.readouterr().out == "kept 1\nkept 2\n"
    assert "creating a new group named: ep_size_1" in caplog.text  # in the debug log, not lost
