"""Experiment trackers (--report-to): records flattened into scalars, the flag parsed and refused in one line,
the orchestrator's decisions counted; end to end, a debug MoE run with the orchestrator on and
`--report-to tensorboard`, read back with TensorBoard's own event reader, then resumed."""

from __future__ import annotations

import importlib.util
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from adaptive.config.commandline import parse
from adaptive.config.run import TRAIN, to_argv
from adaptive.errors import AdaptiveError
from adaptive.orchestrator.events import EventLog, EventSummary, read_events
from adaptive.train.reporting import trackers
from adaptive.train.run.callbacks import Control, Knobs, TrainerState
from adaptive.train.reporting.metrics import MetricsWriter
from tests.train._launch import REPO, launch_env, records

# ---------------------------------------------------------------------------------------------
# Unit tests


def test_a_train_record_becomes_scalars_per_layer_without_none_nan_or_expert_counts():
    record = {"kind": "train", "step": 4, "time": 1.0, "loss": 2.5, "lr": 1e-3, "mfu": None, "grad_norm": math.nan,
              "tokens_per_s": math.inf, "skipped_steps": 0, "max_vio": [0.5, None, 1.25],
              "expert_counts": [[1, 2], [3, 4]], "memory": None, "knobs": {"seq_len": 64, "gradient_checkpointing": False}}
    assert trackers.flatten_record(record) == {
        "train/loss": 2.5, "train/lr": 1e-3, "train/skipped_steps": 0, "train/max_vio/layer_0": 0.5,
        "train/max_vio/layer_2": 1.25, "train/knobs/seq_len": 64, "train/knobs/gradient_checkpointing": 0}
    assert trackers.flatten_record({"kind": "eval", "step": 5, "eval_loss": 3.0, "eval_tokens": 10}) == {
        "eval/eval_loss": 3.0, "eval/eval_tokens": 10}
    assert trackers.flatten_record({"kind": "start", "step": 0, "max_steps": 6}) == {}


def test_the_run_config_is_flat_scalars_and_strings():
    config = trackers.run_config({"arch": "moe", "knobs": {"seq_len": 64}, "gpu": None, "mfu": math.nan,
                                  "layers": [1, 2]}, {"lr": 1e-3, "report_to": "tensorboard"})
    assert config == {"arch": "moe", "knobs/seq_len": 64, "gpu": None, "mfu": "nan", "layers": "[1, 2]",
                      "options/lr": 1e-3, "options/report_to": "tensorboard"}


class FakeAccelerator:
    def __init__(self) -> None:
        self.logged: list[tuple[dict, int]] = []

    def log(self, values: dict, step: int | None = None) -> None:
        self.logged.append((values, step))


def test_the_metrics_writer_hands_each_record_to_its_sink_at_its_step(tmp_path):
    accelerator = FakeAccelerator()
    writer = MetricsWriter(tmp_path, True, sink=trackers.TrackerSink(accelerator))
    writer.write({"kind": "start", "step": 0, "preset": "debug"})
    writer.write({"kind": "train", "step": 2, "loss": math.nan, "lr": 0.5})
    assert accelerator.logged == [({"train/lr": 0.5}, 2)]
    assert records(tmp_path, "train")[0]["loss"] is None
    MetricsWriter(tmp_path, False, sink=trackers.TrackerSink(accelerator)).write({"kind": "train", "step": 4, "lr": 1.0})
    assert len(accelerator.logged) == 1  # another rank's writer: nothing written, nothing logged


@pytest.mark.parametrize("given, expected", [
    ("none", []), ("tensorboard", ["tensorboard"]), ("wandb,tensorboard", ["wandb", "tensorboard"]),
    ("tensorboard, tensorboard", ["tensorboard"]), ("all", ["tensorboard", "wandb"]),
])
def test_report_to_names_the_trackers(given, expected):
    assert trackers.resolve(given, available=["wandb", "tensorboard"]) == expected


def test_report_to_parses_a_comma_list_and_launch_hands_it_on():
    assert parse(TRAIN, []).output.report_to == "none"
    config = parse(TRAIN, ["--report-to", "tensorboard,wandb"])
    assert config.output.report_to == "tensorboard,wandb"
    assert to_argv(config) == ["--report-to", "tensorboard,wandb"]


@pytest.mark.parametrize("given, message", [
    ("tensorbord", "--report-to takes a comma-separated list of tensorboard, wandb, mlflow, trackio, all, none, got "
                   "'tensorbord'; did you mean tensorboard?"),
    ("tensorboard,mlfow", "got 'mlfow'; did you mean mlflow?"),
])
def test_an_unknown_tracker_is_one_line_with_the_closest_name(given, message):
    with pytest.raises(AdaptiveError, match=None) as err:
        parse(TRAIN, ["--report-to", given])
    assert message in str(err.value) and "\n" not in str(err.value)


def test_an_uninstalled_tracker_or_none_beside_one_is_refused_in_one_line():
    with pytest.raises(AdaptiveError) as err:
        trackers.resolve("tensorboard,mlflow", available=["tensorboard"])
    assert str(err.value) == "--report-to mlflow: the tracker is not installed; pip install mlflow"
    with pytest.raises(AdaptiveError, match="'none' cannot be combined"):
        trackers.resolve("none,tensorboard", available=["tensorboard"])
    assert trackers.resolve("all", available=[]) == []


def test_trackers_finish_after_an_error_without_hiding_it():
    class Broken:
        name = "broken"

        def finish(self):
            raise RuntimeError("cannot finish")

    class Fine:
        name = "fine"
        finished = False

        def finish(self):
            Fine.finished = True

    accelerator = FakeAccelerator()
    accelerator.trackers = [Broken(), Fine()]
    trackers.finish(accelerator)  # logs a warning, raises nothing
    assert Fine.finished and accelerator.trackers == []


def test_a_resumed_tensorboard_run_drops_what_was_logged_after_its_checkpoint(tmp_path):
    assert "tensorboard" not in trackers.init_kwargs(tmp_path)
    assert trackers.init_kwargs(tmp_path, resumed_at=4)["tensorboard"] == {"purge_step": 5}


def _state(tmp_path: Path, sink: object, step: int = 0, resumed_from: Path | None = None) -> TrainerState:
    knobs = Knobs(micro_batch_size=2, gradient_accumulation_steps=1, seq_len=64, gradient_checkpointing=False,
                  zero_stage=0, offload_optimizer=False, offload_params=False, ep_size=1)
    return TrainerState(max_steps=10, knobs=knobs, output_dir=tmp_path, trackers=sink, step=step,
                        resumed_from=resumed_from)


def test_each_decision_is_logged_as_its_count_so_far_at_its_step(tmp_path):
    accelerator = FakeAccelerator()
    events = EventLog()
    events.record(0, "oom", "halve_micro_batch", "decided before the log opened")
    EventSummary(events, []).on_train_start(_state(tmp_path, trackers.TrackerSink(accelerator)), Control())
    events.record(2, "balance", "bias_update", "routine")
    events.record(4, "balance", "bias_update", "routine")
    events.record(4, "capacity", "raise_capacity", "dropped tokens")
    assert accelerator.logged == [({"orchestrator/oom/halve_micro_batch": 1}, 0),
                                  ({"orchestrator/balance/bias_update": 1}, 2),
                                  ({"orchestrator/balance/bias_update": 2}, 4),
                                  ({"orchestrator/capacity/raise_capacity": 1}, 4)]

    resumed = FakeAccelerator()  # a resume at step 2 keeps the decisions up to it and counts on
    events = EventLog()
    EventSummary(events, []).on_train_start(_state(tmp_path, trackers.TrackerSink(resumed), step=2,
                                                   resumed_from=tmp_path / "checkpoints" / "step_2"), Control())
    events.record(4, "balance", "bias_update", "routine")
    assert resumed.logged == [({"orchestrator/balance/bias_update": 2}, 4)]

    other_rank = FakeAccelerator()
    events = EventLog()
    state = _state(tmp_path, trackers.TrackerSink(other_rank))
    state.accelerator = type("Rank1", (), {"is_main_process": False})()
    EventSummary(events, []).on_train_start(state, Control())
    events.record(6, "guard", "rollback", "bad steps")
    assert other_rank.logged == []


# ---------------------------------------------------------------------------------------------
# End to end: a real recipe, TensorBoard's own reader

FLAGS = ["--seq-len", "64", "--micro-batch", "2", "--grad-accum", "2", "--max-steps", "6", "--log-every", "2",
         "--eval-every", "3", "--checkpoint-every", "2", "--orchestrator", "on", "--no-progress"]


def recipe(name: str, *args: str, home: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "recipes" / f"{name}.py"), *args], cwd=REPO,
                          env=launch_env(home, ADAPTIVE_CACHE=str(home / "cache")), capture_output=True, text=True,
                          timeout=300)


def scalars(folder: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def hparams(folder: Path) -> dict[str, object]:
    """The run configuration TensorBoard's hparams plugin holds (add_hparams writes it into a subfolder)."""
    from tensorboard.backend.event_processing.plugin_event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import plugin_data_pb2

    found: dict[str, object] = {}
    for sub in sorted(p for p in folder.iterdir() if p.is_dir()):
        events = EventAccumulator(str(sub))
        events.Reload()
        for content in events.PluginTagToContent("hparams").values() if "hparams" in events.ActivePlugins() else []:
            data = plugin_data_pb2.HParamsPluginData.FromString(content)
            if data.HasField("session_start_info"):
                for key, value in data.session_start_info.hparams.items():
                    found[key] = value.string_value if value.HasField("string_value") else value.number_value
    return found


@pytest.fixture(scope="module")
def moe_run(tmp_path_factory):
    pytest.importorskip("tensorboard")
    home = tmp_path_factory.mktemp("home")
    run = tmp_path_factory.mktemp("fresh") / "run"
    done = recipe("debug_moe", *FLAGS, "--report-to", "tensorboard", "--output-dir", str(run), home=home)
    assert done.returncode == 0, done.stderr[-3000:]
    return {"run": run, "home": home}


@pytest.mark.slow
def test_tensorboard_gets_the_metrics_the_decisions_and_the_run_config(moe_run):
    run = moe_run["run"]
    logged = scalars(run / "trackers" / "run")
    train = records(run, "train")
    assert [step for step, _ in logged["train/loss"]] == [r["step"] for r in train] == [2, 4, 6]
    for (_, value), record in zip(logged["train/loss"], train):
        assert value == pytest.approx(record["loss"], rel=1e-6)  # float32 in the event file
    assert [s for s, _ in logged["train/max_vio/layer_0"]] == [2, 4, 6]
    assert {"train/lr", "train/tokens_per_s", "train/aux_loss"} <= set(logged)
    assert "train/mfu" not in logged  # null on a CPU
    evals = records(run, "eval")
    assert [s for s, _ in logged["eval/eval_loss"]] == [r["step"] for r in evals] == [3, 6]
    assert logged["eval/eval_loss"][-1][1] == pytest.approx(evals[-1]["eval_loss"], rel=1e-6)
    decisions = [(e["step"], e["policy"], e["action"]) for e in read_events(run / "events.jsonl") if e["kind"] == "decision"]
    assert logged["orchestrator/balance/bias_update"] == [(2, 1.0), (4, 2.0), (6, 3.0)]
    for step, policy, action in decisions:  # every decision, at its step (bias_update, raise_capacity, ...)
        assert step in [s for s, _ in logged[f"orchestrator/{policy}/{action}"]]
    config = hparams(run / "trackers" / "run")
    assert config["preset"] == "debug" and config["arch"] == "moe" and config["knobs/micro_batch_size"] == 2
    assert config["options/report_to"] == "tensorboard" and config["max_steps"] == 6


@pytest.mark.slow
def test_a_resumed_run_continues_its_curves_at_the_checkpoint_step(moe_run, tmp_path):
    run = tmp_path / "run"  # the same folder name: the same TensorBoard project
    shutil.copytree(moe_run["run"], run)
    done = recipe("debug_moe", *FLAGS, "--report-to", "tensorboard", "--output-dir", str(run), "--resume",
                  str(run / "checkpoints" / "step_00000004"), home=moe_run["home"])
    assert done.returncode == 0, done.stderr[-3000:]
    logged = scalars(run / "trackers" / "run")
    train = records(run, "train")
    assert [s for s, _ in logged["train/loss"]] == [r["step"] for r in train] == [2, 4, 6]  # step 6 once: the new one
    assert logged["train/loss"][-1][1] == pytest.approx(train[-1]["loss"], rel=1e-6)
    assert [s for s, _ in logged["orchestrator/balance/bias_update"]] == [2, 4, 6]


def test_an_uninstalled_tracker_is_one_line_naming_its_pip_package(tmp_path):
    if importlib.util.find_spec("mlflow") is not None:
        pytest.skip("mlflow is installed")
    done = recipe("debug_dense", "--report-to", "mlflow", "--output-dir", str(tmp_path / "run"), home=tmp_path)
    assert done.returncode == 2, done.stderr[-3000:]
    errors = [line for line in done.stderr.splitlines() if line.strip()]
    assert errors == ["error: --report-to mlflow: the tracker is not installed; pip install mlflow"]
    assert not (tmp_path / "run").exists()
