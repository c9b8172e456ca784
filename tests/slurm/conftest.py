"""A real one-node Slurm cluster for the tests of `adaptive launch --scheduler slurm` (never a mock).

`.ci/run` starts it with `.ci/slurm-up` before the tests; here the `slurm` fixture checks that `sinfo`
answers with the node up, starts it with the same script where Slurm is installed but not running (as
root), and skips, naming why, only where no cluster can run (no slurm-wlm, or not root).
"""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from tests.conftest import REPO_ROOT

SLURM_UP = REPO_ROOT / ".ci" / "slurm-up"


def _node_state() -> str | None:
    """The test node's state as `sinfo` reports it; None when sinfo does not answer."""
    if shutil.which("sinfo") is None:
        return None
    done = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, timeout=20)
    return done.stdout.strip().splitlines()[0] if done.returncode == 0 and done.stdout.strip() else None


@pytest.fixture(scope="session")
def slurm() -> str:
    """The cluster's node state (idle, mixed or allocated), after starting the cluster if it is installed."""
    state = _node_state()
    if state not in ("idle", "mixed", "allocated"):
        if shutil.which("slurmctld") is None or os.geteuid() != 0:
            pytest.skip("no Slurm cluster here: `.ci/slurm-up` (as root) installs slurm-wlm and munge and starts one")
        done = subprocess.run([str(SLURM_UP)], capture_output=True, text=True, timeout=180)
        assert done.returncode == 0, done.stdout + done.stderr
        state = _node_state()
    assert state in ("idle", "mixed", "allocated"), f"sinfo: {state}"
    return state
