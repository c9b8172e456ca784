"""The checkpoint protocol without DeepSpeed: a crash at any point of a save leaves `latest` on a checkpoint that
verifies; resume falls back past incomplete ones; old checkpoints are pruned; the HF export is replaced whole."""

from __future__ import annotations

import json
import os

import pytest

from adaptive.errors import AdaptiveError
from adaptive.train.run_folder import checkpoint as ckpt
from tests.train._fake_accelerator import FakeAccelerator


@pytest.fixture(autouse=True)
def accelerate_state():
    """accelerate's logger needs its (here: single, CPU, not distributed) process state."""
    from accelerate import PartialState

    PartialState(cpu=True)


def save(tmp_path, step, keep=3, **kw):
    return ckpt.save_checkpoint(FakeAccelerator(**kw), tmp_path, step, {"step": step}, keep)


def test_a_save_is_renamed_into_place_with_a_manifest_and_latest(tmp_path):
    path = save(tmp_path, 5)
    root = tmp_path / "checkpoints"
    assert path == root / "step_00000005" and ckpt.is_complete(path)
    assert (root / "latest").read_text() == "step_00000005\n"
    manifest = json.loads((path / "COMPLETE.json").read_text())
    assert manifest["step"] == 5 and set(manifest["files"]) == {
        "pytorch_model/mp_rank_00_model_states.pt", "scheduler.bin", "trainer_state.json"}
    assert json.loads((path / "trainer_state.json").read_text()) == {"step": 5}
    assert not list(root.glob(".tmp-*")) and not list(root.glob(".*tmp*"))


def test_a_crash_during_a_save_leaves_latest_on_the_previous_complete_checkpoint(tmp_path):
    save(tmp_path, 5)
    with pytest.raises(KeyboardInterrupt):
        save(tmp_path, 10, crash_after_first_file=True)
    root = tmp_path / "checkpoints"
    assert (root / ".tmp-step_00000010").is_dir() and not (root / "step_00000010").exists()
    assert ckpt.find_checkpoint("auto", tmp_path) == root / "step_00000005"
    save(tmp_path, 10)  # the next save clears the half-written folder
    assert not (root / ".tmp-step_00000010").exists() and ckpt.find_checkpoint("auto", tmp_path).name == "step_00000010"


def test_resume_falls_back_past_a_checkpoint_whose_files_changed(tmp_path):
    save(tmp_path, 5)
    newest = save(tmp_path, 10)
    (newest / "scheduler.bin").write_bytes(b"short")  # truncated after the manifest was written
    assert not ckpt.is_complete(newest)
    assert ckpt.find_checkpoint("auto", tmp_path).name == "step_00000005"
    (newest / "COMPLETE.json").write_text("{not json")
    assert ckpt.find_checkpoint(str(tmp_path / "checkpoints"), tmp_path).name == "step_00000005"
    with pytest.raises(AdaptiveError, match="incomplete"):
        ckpt.find_checkpoint(str(newest), tmp_path)
    with pytest.raises(AdaptiveError, match="does not exist"):
        ckpt.find_checkpoint(str(tmp_path / "nowhere"), tmp_path)
    assert ckpt.find_checkpoint("auto", tmp_path / "empty") is None


def test_only_the_newest_checkpoints_are_kept(tmp_path):
    for step in (1, 2, 3, 4):
        save(tmp_path, step, keep=2)
    assert sorted(p.name for p in (tmp_path / "checkpoints").glob("step_*")) == ["step_00000003", "step_00000004"]
    save(tmp_path, 4, keep=2)  # the same step again (after a rollback) replaces it
    assert ckpt.is_complete(tmp_path / "checkpoints" / "step_00000004")


def test_atomic_write_replaces_whole_files(tmp_path):
    target = tmp_path / "latest"
    ckpt.atomic_write_text(target, "a\n")
    ckpt.atomic_write_text(target, "b\n")
    assert target.read_text() == "b\n" and os.listdir(tmp_path) == ["latest"]
