"""`--resume` from an older checkpoint of a finished run (the clean fault run, tests/orchestrator/_launch.py:
debug MoE, 16 steps, checkpoints at 10 and 16, NaN losses at 11, 13 and 14 that roll it back to 10).

The orchestrator's state comes back with the checkpoint (the capacity factor in force, the balancing
update count), the rollback goes to the checkpoint the run resumed from (not to the newer one of the
abandoned history), and events.jsonl is trimmed to the checkpoint's step and marked: the resumed run
makes the same decisions as the original did after step 10, and each is logged once.
"""

from __future__ import annotations

import json
import shutil

import pytest

from tests.orchestrator._launch import SPECS, read_records, run_one

pytestmark = pytest.mark.slow  # accelerate-launched runs, one resumed

RESUME_AT = 10


@pytest.fixture(scope="module")
def resumed(fault_runs, tmp_path_factory):
    root = tmp_path_factory.mktemp("resumed")
    out = root / "run"
    shutil.copytree(fault_runs["clean"], out, ignore=shutil.ignore_patterns("recorded", "hf"))
    run_one(SPECS["clean"], out, root, ["--resume", str(out / "checkpoints" / f"step_{RESUME_AT:08d}")])
    return fault_runs["clean"], out


def test_the_checkpoint_holds_the_capacity_factor_in_force(fault_runs):
    clean = fault_runs["clean"]
    saved = json.loads((clean / "checkpoints" / f"step_{RESUME_AT:08d}" / "trainer_state.json").read_text())
    raised = [e for e in read_records(clean, "decision", "events.jsonl")
              if e["policy"] == "capacity" and e["step"] <= RESUME_AT]
    assert raised, "the debug MoE drops routes at factor 1.0: the factor was raised before step 10"
    assert saved["callbacks"]["capacity"]["capacity_factor"] == raised[-1]["after"]["capacity_factor"] > 1.0
    assert saved["callbacks"]["balance"]["updates"] > 0


def test_the_resumed_run_makes_the_original_decisions_after_the_checkpoint(resumed):
    original, out = resumed
    records = read_records(out, file="events.jsonl")
    mark = next(i for i, r in enumerate(records) if r["kind"] == "resume")
    first, *after = [r for r in records[mark + 1:] if r["kind"] == "decision"]
    saved = json.loads((out / "checkpoints" / f"step_{RESUME_AT:08d}" / "trainer_state.json").read_text())
    assert (first["action"], first["step"]) == ("restore_capacity", RESUME_AT)
    assert first["after"]["capacity_factor"] == saved["callbacks"]["capacity"]["capacity_factor"]
    assert first["before"]["capacity_factor"] == 1.0, "the model's configured factor"
    source = read_records(original, file="events.jsonl")
    start = next(i for i, r in enumerate(source) if r["step"] > RESUME_AT)
    expected = [r for r in source[start:] if r["kind"] == "decision"]
    print("original:", [(e["step"], e["policy"], e["action"]) for e in expected])
    print("resumed: ", [(e["step"], e["policy"], e["action"]) for e in after])
    key = lambda e: (e["step"], e["policy"], e["action"], json.dumps(e["after"].get("capacity_factor")))  # noqa: E731
    assert [key(e) for e in after] == [key(e) for e in expected], "same capacity factors, same rollback"
    rollback = [e for e in after if e["action"] == "rollback"]
    assert [e["after"]["step"] for e in rollback] == [RESUME_AT], "back to the checkpoint resumed from"
    loaded = [r for r in read_records(out, "rollback") if r["checkpoint"].startswith(str(out))]
    assert loaded and all(r["checkpoint"].endswith(f"step_{RESUME_AT:08d}") for r in loaded), \
        "the loop loaded the checkpoint the run resumed from, not the newer step_16 of the first history"


def test_the_event_log_is_trimmed_to_the_checkpoint_and_marks_the_resume(resumed):
    original, out = resumed
    records = read_records(out, file="events.jsonl")
    marks = [i for i, r in enumerate(records) if r["kind"] == "resume"]
    assert len(marks) == 1 and records[marks[0]]["step"] == RESUME_AT
    before = records[:marks[0]]
    source = read_records(original, file="events.jsonl")
    kept = source[:next(i for i, r in enumerate(source) if r["step"] > RESUME_AT)]
    assert before == kept, "the records up to the checkpoint, as they were"
    assert records[marks[0]]["dropped"] == len(source) - len(kept)
    summaries = [r for r in records if r["kind"] == "summary"]
    assert len(summaries) == 1, "the first history's summary went with its steps"
    counted = sum(n for actions in summaries[0]["decisions"].values() for n in actions.values())
    assert counted == len([r for r in records if r["kind"] == "decision"]), "the summary counts the whole run"
