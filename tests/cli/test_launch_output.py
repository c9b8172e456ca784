"""What `adaptive launch` prints on a CPU machine: the plan, the command and the run's own log, without the
launchers' and DeepSpeed's noise (accelerate's "values were not passed" block, DeepSpeed's accelerator guess,
its "built successfully" for a comm op it only loaded, its expert-group creation, torch's deprecation of the
gather DeepSpeed's ZeRO calls)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.train._launch import REPO, launch_env

NOISE = ("were not passed to `accelerate launch`", "Setting accelerator to CPU",
         "No existing process group found, creating a new group", "`torch.distributed.all_gather_into_tensor` is deprecated")


@pytest.mark.slow  # a real two-step run under accelerate's launcher
@pytest.mark.parametrize("processes", ["1", "2"])  # 2: ZeRO-2 over gloo, DeepSpeed's gathers
def test_adaptive_launch_on_a_cpu_prints_no_launcher_noise(tmp_path, processes):
    import torch

    if torch.cuda.is_available():
        pytest.skip("the CPU run's output; with CUDA the run plans for the GPU")
    done = subprocess.run([sys.executable, "-m", "cli", "launch", str(REPO / "recipes" / "debug_moe.py"), "--gpus",
                           processes, "--max-steps", "2", "--seq-len", "64", "--no-progress", "--run-dir",
                           str(tmp_path / "run")], cwd=REPO, env=launch_env(tmp_path / "home"), capture_output=True,
                          text=True, timeout=600)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-4000:]
    assert "accelerate launch --config_file" in out and "step 2 | loss" in out, out[-4000:]
    for noise in NOISE:
        assert noise not in out, out[-4000:]
    # DeepSpeed says it "built" the op when it only loaded it: held back; a compile is said by the run, and timed
    assert "deepspeed_shm_comm_op built successfully" not in out, out[-4000:]
    assert ("DeepSpeed compiles" in out) == ("op compiled in" in out), out[-4000:]
