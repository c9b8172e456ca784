"""The OOM ladder and the NaN guard on the real loop (debug MoE recipe, orchestrator on, accelerate launch).

Two runs start together, 16 steps each, micro-batch 2 x accumulation 2, sequence 64, checkpoint every
10 steps, guard window 5 steps, LR x0.5 for 3 steps after a rollback:
- "clean": NaN losses injected at steps 11, 13 and 14 (a forward hook on the LM head), nothing else;
- "faulty": the same, plus an out-of-memory error injected in step 5 (micro-batch 2) and in step 7
  (micro-batch 1 by then).
The OOM checks compare the two (the clean run never hit an OOM); the NaN checks read both.
The report test (test_report.py) draws the faulty run.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from adaptive.orchestrator import POLICY_NAMES

from tests.orchestrator._launch import read_records, recorded_events

pytestmark = pytest.mark.slow  # two accelerate-launched training runs

LOSS_TOLERANCE = 0.01  # |final loss faulty - clean|; the loss is ~7.1 and moves ~0.02-0.07 per step here


@pytest.fixture(scope="module")
def runs(fault_runs):
    return fault_runs


def step_ends(events):
    return [e for e in events if e["event"] == "on_step_end"]


def test_both_runs_finish_every_optimizer_step(runs):
    for name, out in runs.items():
        end = read_records(out, "end")
        assert end and end[-1]["step"] == 16, name
        assert read_records(out, "train")[-1]["step"] == 16


def test_an_oom_halves_the_micro_batch_and_redoes_the_step_with_the_same_tokens(runs):
    events = recorded_events(runs["faulty"])
    oom = [e for e in events if e["event"] == "on_oom"]
    assert [(e["step"] + 1, e["micro_step"]) for e in oom] == [(5, 1), (7, 1)]
    # tokens per committed step: every step's micro-batches of its final try hold 4 samples of 64 tokens
    rows: dict[int, list] = {}
    current: list = []
    for e in events:
        if e["event"] == "on_step_start" or e["event"] == "on_oom":
            current = []
        elif e["event"] == "on_backward_end":
            current += e["rows"]
        elif e["event"] == "on_step_end":
            rows.setdefault(e["step"], []).append(len(current))
    assert sorted(rows) == list(range(1, 17))
    assert all(n == 4 for runs_ in rows.values() for n in runs_), rows
    ends = step_ends(events)
    knobs = {e["step"]: (e["knobs"]["micro_batch_size"], e["knobs"]["gradient_accumulation_steps"],
                         e["knobs"]["checkpoint_policy"]) for e in ends}
    assert knobs[4] == (2, 2, "off") and knobs[5] == (1, 4, "off") and knobs[7] == (1, 4, "every:4")
    tokens = [e["tokens_seen"] for e in ends[:10]]
    assert tokens == [256 * s for s in range(1, 11)], "4 samples x 64 tokens per optimizer step, OOM or not"
    assert [r["tokens_seen"] for r in read_records(runs["faulty"], "train")][:10] == tokens


def test_the_second_oom_turns_on_checkpointing_and_the_plan_files_record_the_knobs(runs):
    out = runs["faulty"]
    decisions = [e for e in read_records(out, file="events.jsonl") if e["kind"] == "decision" and e["policy"] == "oom"]
    assert [(e["step"], e["action"]) for e in decisions] == [(5, "halve_micro_batch"), (7, "enable_checkpointing")]
    assert decisions[0]["before"]["micro_batch_size"] == 2 and decisions[0]["after"] == {
        "micro_batch_size": 1, "gradient_accumulation_steps": 4, "gradient_checkpointing": False,
        "checkpoint_policy": "off", "seq_len": 64}
    assert decisions[1]["after"]["checkpoint_policy"] == "every:4", "the first rung of the checkpointing ladder"
    plan = json.loads((out / "plan.json").read_text())
    ds = json.loads((out / "ds_config.json").read_text())
    assert (plan["micro_batch_size"], plan["gradient_accumulation_steps"], plan["checkpointing"]) == (1, 4, "every:4")
    assert plan["run"]["knobs"]["checkpoint_policy"] == "every:4" and not plan["gradient_checkpointing"]
    assert (ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"], ds["train_batch_size"]) == \
        (1, 4, 4)
    # a checkpoint right after each change, so --resume starts from the working knobs
    checkpoints = [e["step"] for e in recorded_events(out) if e["event"] == "on_checkpoint"]
    assert checkpoints[:3] == [5, 7, 10]
    saved = json.loads((out / "checkpoints" / "step_00000007" / "trainer_state.json").read_text())
    assert (saved["knobs"]["micro_batch_size"], saved["knobs"]["checkpoint_policy"]) == (1, "every:4")


def test_the_final_loss_is_within_noise_of_the_run_without_oom(runs):
    clean = {r["step"]: r["loss"] for r in read_records(runs["clean"], "train") if r["loss"] is not None}
    faulty = {r["step"]: r["loss"] for r in read_records(runs["faulty"], "train") if r["loss"] is not None}
    print(f"final loss: clean {clean[16]:.5f}, faulty {faulty[16]:.5f}; step 4 (before any OOM): "
          f"{clean[4]:.5f} vs {faulty[4]:.5f}")
    assert faulty[4] == clean[4], "identical until the first OOM"
    assert abs(faulty[16] - clean[16]) < LOSS_TOLERANCE
    evals = [read_records(runs[n], "end")[-1]["eval_loss"] for n in ("clean", "faulty")]
    assert abs(evals[0] - evals[1]) < LOSS_TOLERANCE


def test_a_nan_step_is_skipped_without_touching_the_weights(runs):
    for name, out in runs.items():
        ends = step_ends(recorded_events(out))
        by_step = {}
        for e in ends:
            by_step.setdefault(e["step"], []).append(e)
        assert by_step[11][0]["last_skip"] == "discarded" and by_step[10][0]["last_skip"] is None, name
        assert by_step[11][0]["params"] == by_step[10][0]["params"], "no update in the NaN step"
        assert by_step[12][0]["params"] != by_step[11][0]["params"], "the next step trains again"
        first = next(r for r in read_records(out, "train") if r["step"] == 11)
        assert first["loss"] is None and first["skipped_steps"] == 1, "the NaN is written as null"


def test_three_bad_steps_in_the_window_roll_back_and_lower_the_lr_for_three_steps(runs):
    for name, out in runs.items():
        events = recorded_events(out)
        starts = [e for e in events if e["event"] == "on_step_start"]
        # the step counter goes back once: from 14 to the step-10 checkpoint
        back = [i for i in range(1, len(starts)) if starts[i]["step"] < starts[i - 1]["step"]]
        assert len(back) == 1, name
        restart = starts[back[0]]
        checkpoint10 = next(e for e in events if e["event"] == "on_checkpoint" and e["step"] == 10)
        assert restart["step"] == 10 and restart["params"] == checkpoint10["params"], \
            "training continues from the restored weights"
        after = starts[back[0]:back[0] + 4]  # steps 11-14 of the replay
        scaled = [e["param_lr"] / e["scheduled_lr"] for e in after]
        assert scaled[:3] == pytest.approx([0.5] * 3) and scaled[3] == pytest.approx(1.0), scaled
        rollback = read_records(out, "rollback")
        assert len(rollback) == 1 and (rollback[0]["from_step"], rollback[0]["step"]) == (14, 10)
        guard = [(e["step"], e["action"]) for e in read_records(out, file="events.jsonl")
                 if e["kind"] == "decision" and e["policy"] == "guard"]
        assert guard == [(11, "skip"), (13, "skip"), (14, "skip"), (14, "rollback"), (13, "restore_lr")], guard
        ends = step_ends(events)
        assert [e["step"] for e in ends][-6:] == [11, 12, 13, 14, 15, 16]
        assert all(e["last_skip"] is None for e in ends[-6:]), "the replay is clean"


def test_the_event_log_ends_with_a_summary_of_every_policy(runs):
    records = read_records(runs["faulty"], file="events.jsonl")
    summary = records[-1]
    assert summary["kind"] == "summary" and summary["step"] == 16
    assert summary["policies"] == ["monitor", *POLICY_NAMES]  # every registered policy
    assert summary["decisions"]["oom"] == {"halve_micro_batch": 1, "enable_checkpointing": 1}
    assert summary["decisions"]["guard"] == {"skip": 3, "rollback": 1, "restore_lr": 1}
    assert summary["guard"] == {"skips": 3, "spikes": 0, "rollbacks": 1}
    assert summary["ep"]["recommended_ep_size"] == 1
    for e in records[:-1]:
        assert set(e) == {"kind", "step", "time", "policy", "action", "reason", "signals", "before", "after"}


def test_bad_orchestrator_flags_are_one_line_and_exit_2(tmp_path):
    from tests.train._launch import REPO, launch_env

    for flags, message in ((["--orchestrator-policies", "balanse"], "did you mean balance?"),
                           (["--orchestrator-config", '{"guard": {"bad_step": 3}}'], "did you mean bad_steps?")):
        done = subprocess.run([sys.executable, str(REPO / "recipes" / "debug_moe.py"), "--dry-run", "--gpu", "t4",
                               *flags], env=launch_env(tmp_path), capture_output=True, text=True, timeout=60)
        assert done.returncode == 2 and message in done.stderr and done.stderr.count("\n") == 1, done.stderr

