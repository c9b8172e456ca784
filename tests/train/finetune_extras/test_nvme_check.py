"""Whether ZeRO-Infinity can run here, told before a run writes anything (adaptive/engine.py): a config that swaps to
NVMe on a machine where DeepSpeed's async_io op is neither compiled nor buildable is refused in one line naming
libaio; a compiled op counts only for the DeepSpeed whose sources its build.ninja names (torch's extension folder
is shared by every environment of one Python, and ninja rebuilds the op for another one)."""

from __future__ import annotations

import os

import pytest

from adaptive.engine import async_io_built, async_io_unavailable, nvme_offload, nvme_refusal, ops_a_run_loads

NVME = {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": "/x"},
                              "offload_param": {"device": "nvme", "nvme_path": "/x"}}}
NVME_OPTIMIZER = {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": "/x"}}}
CPU_OFFLOAD = {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"},
                                     "offload_param": {"device": "cpu"}}}


@pytest.fixture
def no_compiled_ops(tmp_path, monkeypatch):
    """An empty torch extension folder: the op is not compiled here."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "torch_extensions"))
    return tmp_path / "torch_extensions"


@pytest.fixture
def no_libaio(no_compiled_ops, monkeypatch):
    """DeepSpeed's libaio check (a program linked with -laio) fails, as it does without libaio-dev."""
    monkeypatch.setenv("LDFLAGS", "-Wl,--no-such-linker-option")
    return no_compiled_ops


def test_the_nvme_sections_of_a_config_are_found():
    assert nvme_offload(NVME) == ["offload_optimizer", "offload_param"]
    assert nvme_offload(NVME_OPTIMIZER) == ["offload_optimizer"]
    assert nvme_offload(CPU_OFFLOAD) == [] and nvme_offload({}) == []


def test_without_libaio_a_config_that_swaps_to_nvme_is_refused_in_one_line_naming_it(no_libaio):
    why = async_io_unavailable()
    assert why is not None and "libaio" in why and "libaio-dev" in why
    line = nvme_refusal(NVME)
    assert line is not None and "\n" not in line
    assert line.startswith("NVMe offload (offload_optimizer, offload_param on nvme) needs DeepSpeed's async_io op, "
                           "which cannot run here: libaio")
    assert "nothing was written" in line and "--dry-run" in line
    assert nvme_refusal(NVME_OPTIMIZER).startswith("NVMe offload (offload_optimizer on nvme)")
    # a config that swaps nothing to NVMe does not ask
    assert nvme_refusal(CPU_OFFLOAD) is None and nvme_refusal({}) is None


def test_a_compiled_op_counts_for_the_deepspeed_its_build_file_names(no_compiled_ops):
    import deepspeed

    assert not async_io_built()
    assert "AsyncIOBuilder" in ops_a_run_loads(NVME)
    assert "AsyncIOBuilder" not in ops_a_run_loads(CPU_OFFLOAD)
    folder = no_compiled_ops / "async_io"  # torch's build folder of the op (created by the look-up)
    assert folder.is_dir()
    (folder / "async_io.so").write_bytes(b"")
    (folder / "build.ninja").write_text("cflags = -I/another/venv/site-packages/deepspeed/ops/csrc/aio/py_lib\n")
    assert not async_io_built()  # another environment's: ninja rebuilds it here
    (folder / "build.ninja").write_text(f"cflags = -I{os.path.dirname(deepspeed.__file__)}/ops/csrc/aio/py_lib\n")
    assert async_io_built()


def test_a_compiled_op_runs_without_libaios_headers(no_libaio):
    """Loading a compiled op needs libaio's runtime library only: the check does not ask for the headers then."""
    import deepspeed

    async_io_built()
    folder = no_libaio / "async_io"
    (folder / "async_io.so").write_bytes(b"")
    (folder / "build.ninja").write_text(f"cflags = -I{os.path.dirname(deepspeed.__file__)}/ops/csrc/aio/py_lib\n")
    assert async_io_unavailable() is None and nvme_refusal(NVME) is None


@pytest.mark.slow  # a recipe process: DeepSpeed's process group, the plan, then the refusal
def test_a_run_with_nvme_offload_where_libaio_is_missing_stops_in_one_line_before_writing_anything(tmp_path):
    """The recipe plans the run, sees it cannot swap here and exits 2 with one line: no run folder, no swap file
    (DeepSpeed itself would fail in deepspeed.initialize, after the model is built and the run folder written)."""
    import subprocess
    import sys

    from torch.utils.cpp_extension import _get_build_directory

    from tests.train.finetune._checkpoints import write_chat, write_llama
    from tests.train._launch import REPO, launch_env

    checkpoint, data = write_llama(tmp_path / "tiny-llama"), write_chat(tmp_path / "chat.jsonl")
    extensions = tmp_path / "torch_extensions"  # no async_io op compiled; DeepSpeed's CPU comm op as it is built here
    extensions.mkdir()
    shm = _get_build_directory("deepspeed_shm_comm", verbose=False)
    if any(name.endswith(".so") for name in os.listdir(shm)):
        (extensions / "deepspeed_shm_comm").symlink_to(shm)
    swap, out = tmp_path / "swap", tmp_path / "run"
    swap.mkdir()
    done = subprocess.run([sys.executable, str(REPO / "recipes" / "finetune.py"), "--init-from", str(checkpoint),
                           "--dataset", str(data), "--seq-len", "64", "--zero", "3", "--offload", "nvme", "--nvme-path",
                           str(swap), "--output-dir", str(out), "--no-progress"], cwd=REPO, capture_output=True,
                          text=True, timeout=300, env=launch_env(tmp_path / "home", TORCH_EXTENSIONS_DIR=str(extensions),
                                                                 LDFLAGS="-Wl,--no-such-linker-option"))
    assert done.returncode == 2, (done.stdout + done.stderr)[-3000:]
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "needs DeepSpeed's async_io op, which cannot run here: libaio" in errors[0], done.stderr
    assert not out.exists() and not any(swap.iterdir())
