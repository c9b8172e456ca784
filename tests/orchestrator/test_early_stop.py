"""Early stopping: a stop after `patience` evals without improvement, state kept across a resume, and a
real run that ends before --max-steps."""

from __future__ import annotations

import json

import pytest

from adaptive.errors import AdaptiveError
from adaptive.orchestrator import orchestrator_config
from adaptive.orchestrator.early_stop import EarlyStopConfig, EarlyStopPolicy
from adaptive.orchestrator.events import EventLog, read_events
from adaptive.train.run.callbacks import Control, TrainerState
from tests.orchestrator._harness import knobs
from tests.orchestrator._launch import run_one


def _evals(policy: EarlyStopPolicy, losses: list[float]) -> list[bool]:
    stops = []
    for step, loss in enumerate(losses, 1):
        control = Control()
        policy.on_eval(TrainerState(max_steps=100, knobs=knobs(), output_dir=None, step=step), control,
                       metrics={"eval_loss": loss})
        stops.append(control.should_stop)
    return stops


def test_it_stops_after_patience_evals_without_an_improvement_of_min_delta():
    policy = EarlyStopPolicy(EventLog(), EarlyStopConfig(patience=2, min_delta=0.05))
    #                         best  better by 0.1  by 0.01: stale  worse: stale -> stop
    assert _evals(policy, [3.0, 2.9, 2.89, 2.95]) == [False, False, False, True]
    assert policy.events.decisions[-1]["action"] == "stop" and policy.best == 2.9


def test_nan_evals_neither_improve_nor_count():
    policy = EarlyStopPolicy(EventLog(), EarlyStopConfig(patience=1))
    assert _evals(policy, [3.0, float("nan"), 2.0, 2.5]) == [False, False, False, True]


def test_its_state_survives_a_resume():
    first = EarlyStopPolicy(EventLog(), EarlyStopConfig(patience=2))
    _evals(first, [3.0, 3.1])
    resumed = EarlyStopPolicy(EventLog(), EarlyStopConfig(patience=2))
    resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))
    assert _evals(resumed, [3.2]) == [True]


@pytest.mark.parametrize("settings, message", [
    ({"early_stop": {"patience": 0}}, "patience must be >= 1"),
    ({"early_stop": {"min_delta": -0.1}}, "min_delta must be >= 0"),
    ({"early_stop": {"patience": "soon"}}, "early_stop.patience"),
])
def test_bad_settings_are_one_line_errors(settings, message):
    with pytest.raises(AdaptiveError, match=message):
        orchestrator_config(None, json.dumps(settings))


@pytest.mark.slow
def test_a_real_run_stops_early_and_says_why(tmp_path):
    out = tmp_path / "run"
    flags = ["--max-steps", "40", "--log-every", "2", "--eval-every", "2", "--seq-len", "32", "--micro-batch", "2",
             "--checkpoint-every", "0", "--no-progress", "--orchestrator", "on", "--orchestrator-policies", "early_stop",
             "--orchestrator-config", json.dumps({"early_stop": {"patience": 1, "min_delta": 100.0}})]
    run_one({}, out, tmp_path, [], flags=flags)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["eval_loss"] < 100 for r in records if r["kind"] == "eval"] == [True, True]
    # the second eval (after step 4) did not improve by 100: the loop stops at its next stop point, checkpointed
    assert (out / "checkpoints" / "latest").read_text().strip() == "step_00000005"
    assert max(r["step"] for r in records if r["kind"] == "train") <= 5
    stops = [e for e in read_events(out / "events.jsonl") if e.get("policy") == "early_stop"]
    assert [(e["step"], e["action"]) for e in stops] == [(4, "stop")]
