"""Kill and resume: a run killed (SIGKILL) right after its step-10 checkpoint and resumed with --resume gives
steps 11-20 the exact losses, learning rates and data of an uninterrupted 20-step run (same seed, CPU, fp32,
ZeRO-2, hybrid MoE+MoD). A checkpoint corrupted on disk, next to a half-written one, is skipped: resume
uses the newest complete checkpoint."""

from __future__ import annotations

import json
import shutil

import pytest

from tests.train._launch import REPO, accelerate_launch, driver, records, tail, train_losses

pytestmark = pytest.mark.slow  # accelerate-launched runs, one killed and resumed

RECIPE = REPO / "recipes" / "debug_hybrid.py"
COMMON = ["--max-steps", "20", "--log-every", "1", "--checkpoint-every", "5", "--keep-checkpoints", "3",
          "--seq-len", "64", "--micro-batch", "2", "--grad-accum", "2", "--zero", "2", "--no-progress"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    home = tmp_path_factory.mktemp("home")
    env = {"ADAPTIVE_CACHE": str(home / "cache")}
    full = tmp_path_factory.mktemp("full")
    killed = tmp_path_factory.mktemp("killed")
    done = {
        "full": accelerate_launch(RECIPE, [*COMMON, "--output-dir", str(full)], home=home, **env),
        "killed": driver("debug", "hybrid", {"kill_after_checkpoint": 10}, [*COMMON, "--output-dir", str(killed)],
                         home=home, **env),
    }
    done["resumed"] = accelerate_launch(RECIPE, [*COMMON, "--output-dir", str(killed), "--resume"], home=home, **env)
    return {"full": full, "killed": killed, "done": done, "home": home, "env": env}


def test_the_killed_run_died_after_its_step_10_checkpoint(runs):
    done = runs["done"]["killed"]
    assert done.returncode != 0 and "SIGKILL" in tail(done)
    # what the resumed run found (it rewrote metrics.jsonl after step 10, so read the checkpoint's state)
    saved = json.loads((runs["killed"] / "checkpoints" / "step_00000010" / "trainer_state.json").read_text())
    assert saved["step"] == 10 and saved["samples_seen"] == [10 * 2 * 2] and saved["tokens_seen"] == 10 * 4 * 64


def test_resume_continues_with_the_same_losses_lr_and_data_as_an_uninterrupted_run(runs):
    for name in ("full", "resumed"):
        assert runs["done"][name].returncode == 0, tail(runs["done"][name])
    full, resumed = records(runs["full"], "train"), records(runs["killed"], "train")
    assert [r["step"] for r in resumed] == list(range(1, 21)), "steps after the checkpoint are not duplicated"
    for a, b in zip(full[10:], resumed[10:]):
        assert (a["step"], a["loss"], a["lr"], a["tokens_seen"], a["expert_counts"]) == \
               (b["step"], b["loss"], b["lr"], b["tokens_seen"], b["expert_counts"])
    assert train_losses(runs["full"]) == train_losses(runs["killed"])
    starts = records(runs["killed"], "start")
    assert [s["step"] for s in starts] == [0, 10] and starts[1]["resumed_from"].endswith("step_00000010")
    assert records(runs["full"], "eval")[-1]["eval_loss"] == records(runs["killed"], "eval")[-1]["eval_loss"]
    assert (runs["killed"] / "hf" / "model.safetensors").is_file()


def test_resume_skips_a_corrupted_checkpoint_and_a_half_written_one(runs, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(runs["full"], run)
    ckpts = run / "checkpoints"
    assert (ckpts / "latest").read_text().strip() == "step_00000020"
    assert sorted(p.name for p in ckpts.glob("step_*")) == ["step_00000010", "step_00000015", "step_00000020"]
    # the newest checkpoint loses the tail of its largest file; a crash left a half-written one behind
    victim = max((p for p in (ckpts / "step_00000020").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])
    half = ckpts / ".tmp-step_00000025"
    (half / "pytorch_model").mkdir(parents=True)
    (half / "pytorch_model" / "mp_rank_00_model_states.pt").write_bytes(b"\0" * 100)

    done = accelerate_launch(RECIPE, [*COMMON, "--output-dir", str(run), "--resume"], home=runs["home"], **runs["env"])
    assert done.returncode == 0, tail(done)
    assert "step_00000020 cannot be resumed (incomplete" in done.stderr
    start = records(run, "start")[-1]
    assert start["step"] == 15 and start["resumed_from"].endswith("step_00000015")
    assert {s: loss for s, loss in train_losses(run).items() if s > 15} == \
           {s: loss for s, loss in train_losses(runs["full"]).items() if s > 15}
    assert (ckpts / "latest").read_text().strip() == "step_00000020"
    assert not half.exists(), "the next save clears half-written checkpoints"
