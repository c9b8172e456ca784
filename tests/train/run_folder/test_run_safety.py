"""A run folder is owned and nothing untrusted is run: the faults of issue 14, injected.

Unit tests (no training): the lock, the fresh-start refusal, `latest` that points out of the run or
holds bytes, digests that catch a same-size corruption, a pickle payload that is never unpickled, a
failed write that names the newest checkpoint, and replacing a folder whole.

End-to-end (real recipes, `python recipes/x.py` as one process and `adaptive launch`): each fault exits 2
with one line, and every file that was there before is byte-identical afterwards.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from adaptive.errors import AdaptiveError
from adaptive.train.run_folder import checkpoint as ckpt
from tests.train._fake_accelerator import FakeAccelerator
from adaptive.train.run_folder.ownership import LOCK_FILE, RunLock, check_fresh_start, clear_run, run_files
from tests.train._launch import DRIVER, REPO, launch_env, records, train_losses

# ---------------------------------------------------------------------------------------------
# Helpers


class Payload:
    """What a crafted checkpoint holds: unpickling it runs a command that leaves a marker file."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def snapshot(root: Path) -> dict[str, str]:
    """Every file under `root` with its SHA-256; not the lock file, which names its latest holder."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(Path(root).rglob("*")) if p.is_file() and p.name != LOCK_FILE}


def one_error_line(done: subprocess.CompletedProcess) -> str:
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-3000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    errors = [line for line in lines if line.startswith("error: ")]
    assert len(errors) == 1, lines[-10:]
    return errors[0]


@pytest.fixture(autouse=True)
def accelerate_state():
    """accelerate's logger needs its (here: single, CPU) process state."""
    from accelerate import PartialState

    PartialState(cpu=True)


def fake_save(run: Path, step: int, **kw) -> Path:
    return ckpt.save_checkpoint(FakeAccelerator(**kw), run, step, {"step": step}, keep=5)


# ---------------------------------------------------------------------------------------------
# The run folder


def test_a_fresh_start_is_refused_where_a_run_exists_and_overwrite_clears_only_the_run(tmp_path):
    check_fresh_start(tmp_path / "new", None, False)  # nothing there: fine
    (tmp_path / "plan.json").write_text("{}")  # launch's configs are not a run
    check_fresh_start(tmp_path, None, False)
    (tmp_path / "metrics.jsonl").write_text("{}\n")
    (tmp_path / "checkpoints" / "step_00000002").mkdir(parents=True)
    (tmp_path / "hf-step_00000002").mkdir()
    with pytest.raises(AdaptiveError, match="already holds a run .*--resume.*--overwrite"):
        check_fresh_start(tmp_path, None, False)
    check_fresh_start(tmp_path, "auto", False)
    check_fresh_start(tmp_path, None, True)
    assert clear_run(tmp_path) == ["metrics.jsonl", "checkpoints", "hf-step_00000002"]
    assert run_files(tmp_path) == [] and (tmp_path / "plan.json").read_text() == "{}"


def test_the_lock_refuses_a_second_writer_and_dies_with_its_holder(tmp_path):
    first = RunLock(tmp_path).acquire()
    with pytest.raises(AdaptiveError, match=f"in use by another run \\(pid {os.getpid()} on "):
        RunLock(tmp_path).acquire()
    first.release()
    RunLock(tmp_path).acquire().release()
    # a holder killed with SIGKILL leaves the file, not the lock
    code = ("import sys, time; sys.path.insert(0, sys.argv[2]); from adaptive.train.run_folder.ownership import RunLock;"
            "RunLock(sys.argv[1]).acquire(); print('held', flush=True); time.sleep(60)")
    holder = subprocess.Popen([sys.executable, "-c", code, str(tmp_path), str(REPO)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(AdaptiveError, match=f"pid {holder.pid}"):
            RunLock(tmp_path).acquire()
    finally:
        holder.kill()
        holder.wait()
    RunLock(tmp_path).acquire().release()


def test_an_unwritable_run_folder_is_one_line(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    with pytest.raises(AdaptiveError, match="cannot write to the run folder"):
        RunLock(blocker / "run").acquire()


# ---------------------------------------------------------------------------------------------
# Checkpoints: latest, digests, failed writes, whole-folder replacement


def test_latest_is_never_followed_out_of_the_run_nor_read_as_garbage(tmp_path):
    other, run = tmp_path / "other", tmp_path / "run"
    fake_save(other, 9)
    fake_save(run, 2)
    root = run / "checkpoints"
    for content in ("../../other/checkpoints/step_00000009\n", "/etc\n", "step_00000002/../../x\n"):
        (root / "latest").write_text(content)
        assert ckpt.read_latest(root) is None
        assert ckpt.find_checkpoint("auto", run) == root / "step_00000002"
    (root / "latest").write_bytes(b"\xff\xfe\x00garbage")
    assert ckpt.find_checkpoint("auto", run) == root / "step_00000002"


def test_a_same_size_corruption_is_caught_by_its_digest_and_resume_falls_back(tmp_path):
    fake_save(tmp_path, 2)
    newest = fake_save(tmp_path, 4)
    state = newest / "pytorch_model" / "mp_rank_00_model_states.pt"
    state.write_bytes(b"\0" * state.stat().st_size)  # zeroed in place: sizes still match
    assert ckpt.is_complete(newest) and "SHA-256" in ckpt.verify(newest)
    assert ckpt.find_checkpoint("auto", tmp_path).name == "step_00000002"
    with pytest.raises(AdaptiveError, match="cannot be resumed: .*SHA-256"):
        ckpt.find_checkpoint(str(newest), tmp_path)


def test_past_latest_resume_falls_back_to_older_checkpoints_never_to_an_abandoned_newer_one(tmp_path):
    for step in (2, 4, 8):
        fake_save(tmp_path, step)
    root = tmp_path / "checkpoints"
    fake_save(tmp_path, 6)  # a run resumed from step 4 wrote step 6: latest; step 8 is the abandoned history
    assert ckpt.read_latest(root).name == "step_00000006"
    (root / "step_00000006" / "scheduler.bin").write_bytes(b"X" * len(b"schedule"))  # same size, other bytes
    assert ckpt.find_checkpoint("auto", tmp_path).name == "step_00000004"
    (root / "latest").write_text("../elsewhere\n")  # no usable latest: the newest that verifies
    assert ckpt.find_checkpoint("auto", tmp_path).name == "step_00000008"


def test_a_failed_write_leaves_no_partial_folder_and_names_the_newest_checkpoint(tmp_path):
    fake_save(tmp_path, 2)
    before = snapshot(tmp_path)
    with pytest.raises(AdaptiveError, match="No space left on device.*newest complete checkpoint is .*step_00000002"):
        fake_save(tmp_path, 4, error=OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(tmp_path / "x")))
    assert snapshot(tmp_path) == before and not list((tmp_path / "checkpoints").glob(".tmp-*"))


def test_a_step_saved_again_replaces_the_old_folder_whole(tmp_path):
    first = fake_save(tmp_path, 4)
    (first / "only-in-the-old-one").write_text("old")
    again = fake_save(tmp_path, 4)
    assert again == first and ckpt.verify(again) is None
    assert not (again / "only-in-the-old-one").exists()
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["latest", "step_00000004"]


# ---------------------------------------------------------------------------------------------
# Trust: resume unpickles tensors only


def test_torch_load_inside_tensors_only_refuses_a_payload_even_when_asked_for_weights_only_false(tmp_path):
    import torch

    marker = tmp_path / "pwned"
    path = tmp_path / "random_states_0.pkl"
    torch.save({"rng": torch.zeros(3), "evil": Payload(marker)}, path)
    with ckpt.tensors_only(), pytest.raises(pickle.UnpicklingError):
        torch.load(path, weights_only=False)  # what DeepSpeed's checkpoint engine passes
    assert not marker.exists()
    assert "TORCH_FORCE_WEIGHTS_ONLY_LOAD" not in os.environ  # the context restores the environment
    torch.save({"step": torch.ones(2)}, tmp_path / "ok.pt")
    with ckpt.tensors_only():
        assert torch.load(tmp_path / "ok.pt", weights_only=False)["step"].tolist() == [1.0, 1.0]


def test_a_checkpoint_that_pickles_a_command_is_refused_before_anything_is_loaded(tmp_path):
    import torch

    marker = tmp_path / "pwned"
    step = fake_save(tmp_path, 2)
    torch.save({"module": {"w": torch.zeros(2)}}, step / "pytorch_model" / "mp_rank_00_model_states.pt")
    torch.save({"evil": Payload(marker)}, step / "random_states_0.pkl")

    class Loads(FakeAccelerator):
        def load_state(self, path):
            raise AssertionError("load_state must not be reached")

    with pytest.raises(AdaptiveError, match="random_states_0.pkl pickles posix.system.*--trust-checkpoint"):
        ckpt.load_checkpoint(Loads(), step)
    assert not marker.exists()

    class Records(FakeAccelerator):
        loaded = None

        def load_state(self, path):
            Records.loaded = path

    ckpt.load_checkpoint(Records(), step, trusted=True)  # --trust-checkpoint: DeepSpeed's own loading, unscanned
    assert Records.loaded == str(step)


# ---------------------------------------------------------------------------------------------
# End to end: real recipes

FLAGS = ["--seq-len", "64", "--micro-batch", "2", "--grad-accum", "2", "--zero", "2", "--log-every", "4",
         "--checkpoint-every", "2", "--keep-checkpoints", "3", "--no-progress"]


def recipe(name: str, *args: str, home: Path, timeout: int = 300, preexec=None) -> subprocess.CompletedProcess:
    """`python recipes/NAME.py ARGS`: one process, as plain python runs it."""
    return subprocess.run([sys.executable, str(REPO / "recipes" / f"{name}.py"), *args], cwd=REPO,
                          env=launch_env(home, ADAPTIVE_CACHE=str(home / "cache")), capture_output=True, text=True,
                          timeout=timeout, preexec_fn=preexec)


def drive(spec: dict, *args: str, home: Path) -> subprocess.CompletedProcess:
    """The test driver (a recipe with fault-injecting callbacks), as one plain python process."""
    return subprocess.run([sys.executable, str(DRIVER), "debug", "dense", json.dumps(spec), "--", *args], cwd=REPO,
                          env=launch_env(home, ADAPTIVE_CACHE=str(home / "cache")), capture_output=True, text=True,
                          timeout=300)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """One complete 8-step run: checkpoints 4, 6, 8; train records at 4 and 8; hf/."""
    home = tmp_path_factory.mktemp("home")
    run = tmp_path_factory.mktemp("base") / "run"
    done = recipe("debug_dense", *FLAGS, "--max-steps", "8", "--output-dir", str(run), home=home)
    assert done.returncode == 0, done.stderr[-3000:]
    return {"run": run, "home": home}


def rehash(step: Path) -> None:
    """Rewrite a checkpoint's manifest to match its files, as whoever edits the folder can."""
    manifest = json.loads((step / "COMPLETE.json").read_text())
    manifest["files"] = {k: v for k, v in ckpt._manifest_files(step).items() if k != "COMPLETE.json"}
    (step / "COMPLETE.json").write_text(json.dumps(manifest))


def copy_of(base: dict, tmp_path: Path) -> Path:
    run = tmp_path / "run"
    shutil.copytree(base["run"], run)
    return run


@pytest.mark.slow
def test_a_second_fresh_run_into_a_run_folder_is_refused_and_changes_nothing(base, tmp_path):
    run = copy_of(base, tmp_path)
    before = snapshot(run)
    line = one_error_line(recipe("debug_dense", *FLAGS, "--max-steps", "8", "--output-dir", str(run), home=base["home"]))
    assert "already holds a run" in line and "--resume" in line and "--overwrite" in line
    assert snapshot(run) == before


@pytest.mark.slow
def test_resume_auto_with_nothing_to_resume_starts_fresh_saying_so_and_a_missing_path_is_refused(tmp_path):
    home, run = tmp_path / "home", tmp_path / "never-ran"
    done = recipe("debug_dense", *FLAGS, "--max-steps", "4", "--output-dir", str(run), "--resume", home=home)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"--resume auto: no checkpoint in {run / 'checkpoints'}; starting fresh" in done.stdout + done.stderr
    assert [s["step"] for s in records(run, "start")] == [0] and (run / "checkpoints" / "step_00000004").is_dir()
    again = recipe("debug_dense", *FLAGS, "--max-steps", "6", "--output-dir", str(run), "--resume", "auto", home=home)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "starting fresh" not in again.stdout + again.stderr
    starts = records(run, "start")
    assert [s["step"] for s in starts] == [0, 4] and starts[1]["resumed_from"].endswith("step_00000004")
    nowhere = tmp_path / "nowhere"
    line = one_error_line(recipe("debug_dense", *FLAGS, "--output-dir", str(tmp_path / "other"), "--resume",
                                 str(nowhere), home=home))
    assert f"--resume {str(nowhere)!r} does not exist" in line and not (tmp_path / "other").exists()


@pytest.mark.slow
def test_resume_of_a_run_whose_checkpoints_are_all_broken_is_refused_and_changes_nothing(base, tmp_path):
    # a run whose every checkpoint is broken: its metrics and hf/ are the only intact artefacts, and stay so
    run = copy_of(base, tmp_path)
    for manifest in (run / "checkpoints").glob("step_*/COMPLETE.json"):
        manifest.unlink()
    before = snapshot(run)
    one_error_line(recipe("debug_dense", *FLAGS, "--output-dir", str(run), "--resume", home=base["home"]))
    assert snapshot(run) == before


@pytest.mark.slow
def test_a_second_writer_is_refused_while_the_first_holds_the_folder(base, tmp_path):
    run = copy_of(base, tmp_path)
    lock = RunLock(run).acquire()  # the first run, still training
    before = snapshot(run)
    try:
        line = one_error_line(recipe("debug_dense", *FLAGS, "--max-steps", "10", "--output-dir", str(run), "--resume",
                                     home=base["home"]))
    finally:
        lock.release()
    assert "in use by another run" in line
    assert snapshot(run) == before


@pytest.mark.slow
def test_another_recipes_checkpoint_is_refused_before_it_is_loaded(base, tmp_path):
    before = snapshot(base["run"])
    line = one_error_line(recipe("debug_moe", *FLAGS, "--output-dir", str(tmp_path / "moe"),
                                 "--resume", str(base["run"] / "checkpoints"), home=base["home"]))
    assert "is of debug dense" in line and "this run trains debug moe" in line
    assert snapshot(base["run"]) == before


@pytest.mark.slow
def test_a_pickle_payload_checkpoint_is_never_unpickled(base, tmp_path):
    """The attacker controls the folder: the manifest's digests are rewritten to match the payload."""
    import torch

    run = copy_of(base, tmp_path)
    marker = tmp_path / "pwned"
    newest = run / "checkpoints" / "step_00000008"
    torch.save({"evil": Payload(marker)}, newest / "random_states_0.pkl")
    rehash(newest)
    assert ckpt.verify(newest) is None
    before = snapshot(run)
    line = one_error_line(recipe("debug_dense", *FLAGS, "--max-steps", "10", "--output-dir", str(run), "--resume",
                                 home=base["home"]))
    assert "pickles posix.system" in line
    assert not marker.exists() and snapshot(run) == before


@pytest.mark.slow
def test_a_corrupted_newest_checkpoint_falls_back_and_lr_given_with_resume_is_used(base, tmp_path):
    """Zeroed model states and a garbage trainer_state.json, both at their old sizes: resume warns and takes
    step 6; the --lr given with --resume (twice the preset's) is the peak from then on."""
    run = copy_of(base, tmp_path)
    newest = run / "checkpoints" / "step_00000008"
    for name in ("pytorch_model/mp_rank_00_model_states.pt", "trainer_state.json"):
        path = newest / name
        path.write_bytes(b"\0" * path.stat().st_size)
    done = recipe("debug_dense", *FLAGS, "--max-steps", "8", "--output-dir", str(run), "--resume", "--lr", "6e-3",
                  home=base["home"])
    assert done.returncode == 0, done.stderr[-3000:]
    assert "step_00000008 cannot be resumed" in done.stderr and "SHA-256" in done.stderr
    assert "--lr 0.006 replaces the checkpoint's peak learning rate 0.003" in done.stderr
    start = records(run, "start")[-1]
    assert start["resumed_from"].endswith("step_00000006")
    ours, theirs = records(run, "train")[-1], records(base["run"], "train")[-1]
    assert ours["step"] == theirs["step"] == 8 and ours["lr"] == pytest.approx(2 * theirs["lr"], rel=1e-9)


@pytest.mark.slow
def test_sigterm_then_resume_logs_every_step_once_and_the_same_losses(base, tmp_path):
    """Stopped by SIGTERM after step 3 (record 1-3), resumed: records 4 (step 4 alone) and 8 (steps 5-8), the
    latter equal to the uninterrupted run's record at 8."""
    run = tmp_path / "run"
    done = drive({"sigterm_at": 3}, *FLAGS, "--max-steps", "8", "--output-dir", str(run), home=base["home"])
    assert done.returncode == 0, done.stderr[-3000:]
    assert [(r["step"], r["interval_steps"]) for r in records(run, "train")] == [(3, 3)]
    done = recipe("debug_dense", *FLAGS, "--max-steps", "8", "--output-dir", str(run), "--resume", home=base["home"])
    assert done.returncode == 0, done.stderr[-3000:]
    assert [(r["step"], r["interval_steps"]) for r in records(run, "train")] == [(3, 3), (4, 1), (8, 4)]
    assert train_losses(run)[8] == train_losses(base["run"])[8]


@pytest.mark.slow
def test_non_finite_weights_are_never_checkpointed_or_exported(base, tmp_path):
    run = tmp_path / "run"
    done = drive({"nan_weights_at": 3}, *FLAGS, "--max-steps", "8", "--output-dir", str(run), home=base["home"])
    line = one_error_line(done)
    assert "step 4: the weights hold NaN or inf, so nothing was checkpointed" in line
    assert line.endswith("step_00000002: resume from it with a lower --lr")
    assert sorted(p.name for p in (run / "checkpoints").glob("step_*")) == ["step_00000002"]
    assert not (run / "hf").exists()


@pytest.mark.slow
def test_a_full_disk_during_a_checkpoint_is_one_line_naming_the_newest_checkpoint(base, tmp_path):
    """The first checkpoint outgrows the file-size limit (EFBIG, where a full disk gives ENOSPC)."""
    import resource

    run = tmp_path / "run"
    limit = max(p.stat().st_size for p in (base["run"] / "checkpoints").rglob("*.pt")) - 1

    def small_files():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    done = recipe("debug_dense", *FLAGS, "--max-steps", "8", "--output-dir", str(run), home=base["home"],
                  preexec=small_files)
    line = one_error_line(done)
    assert "checkpoint" in line and "could not be written (" in line and "newest complete checkpoint is none" in line
    assert not list((run / "checkpoints").glob(".tmp-*"))


@pytest.mark.slow
def test_adaptive_launch_reports_a_recipes_error_in_one_line_without_the_launchers_traceback(base, tmp_path):
    run = copy_of(base, tmp_path)
    for manifest in (run / "checkpoints").glob("step_*/trainer_state.json"):
        manifest.write_text(manifest.read_text().replace('"world_size": 1', '"world_size": 3'))
    for step in (run / "checkpoints").glob("step_*"):  # the digests follow, so only the world size differs
        rehash(step)
    done = subprocess.run([sys.executable, "-m", "cli", "launch", str(REPO / "recipes" / "debug_dense.py"), "--gpu",
                           "a100", "--run-dir", str(run), "--resume", *FLAGS, "--max-steps", "10"], cwd=REPO,
                          env=launch_env(base["home"], ADAPTIVE_CACHE=str(base["home"] / "cache")),
                          capture_output=True, text=True, timeout=300)
    line = one_error_line(done)
    assert "was written by 3 processes, this run has 1" in line
    assert "ChildFailedError" not in done.stderr and "failed (exitcode" not in done.stderr
