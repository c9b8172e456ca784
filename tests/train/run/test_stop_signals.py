"""SIGTERM (preemption) and SIGUSR1 (Slurm's `--signal=USR1@SECONDS` before a time limit) ask the loop to
checkpoint after the current step and stop; the handlers are the previous ones again after training."""

from __future__ import annotations

import os
import signal
import threading

import pytest

from adaptive.train.run.loop import _stop_on_sigterm


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1])
def test_a_stop_signal_sets_the_stop_flag_and_the_old_handler_comes_back(sig):
    seen = []
    previous = signal.signal(sig, lambda *_: seen.append("old"))
    try:
        stop = threading.Event()
        with _stop_on_sigterm(stop):
            os.kill(os.getpid(), sig)
            assert stop.wait(5) and seen == []
        os.kill(os.getpid(), sig)
        assert seen == ["old"]
    finally:
        signal.signal(sig, previous)
