"""Experiment trackers (`--report-to`), through accelerate's tracker API.

`--report-to tensorboard,wandb` (or `mlflow`, `trackio`; `all`: every one of them accelerate finds installed;
`none`, the default) builds the Accelerator with `log_with` and `project_dir` = the run folder, and
`logging_dir` = `<output-dir>/trackers/`, so the run folder holds everything TensorBoard writes (wandb's files
go there too; mlflow and trackio keep their own stores: MLFLOW_TRACKING_URI, trackio's cache). What each
tracker gets:

    the run's configuration   once, at the start: `init_trackers(<run folder name>, config)` with the plan's
                              run section (preset, arch, knobs/..., orchestrator/...) and every option as
                              `options/<name>`, flattened to scalars and strings (what TensorBoard's hparams take)
    metrics.jsonl's numbers   every record the run writes (`MetricsWriter(sink=TrackerSink(...))`), at its step:
                              `train/loss`, `train/lr`, `train/tokens_per_s`, `train/mfu`, `eval/eval_loss`, ...;
                              per-layer lists as `train/max_vio/layer_<i>` (i: the list position); dicts as
                              `train/knobs/seq_len`; null, NaN, inf, strings and the per-expert counts are left out
    the orchestrator's        `orchestrator/<policy>/<action>` = how many times that decision was taken so far, at
    decisions                 the step it was taken

The orchestrator imports nothing from `adaptive.train`, so its decisions reach the trackers through the loop's
contract: `TrainerState.log(values, step)` hands scalars to `TrainerState.trackers` (this module's `TrackerSink`,
or None), and the event log (`adaptive.orchestrator.events.EventLog`) is given that hook when it opens.

Only the main process logs (accelerate's `init_trackers` and `log` run on the main process only). Steps are
absolute, so a resumed run continues its curves at the checkpoint's step. A named tracker that is not installed
is refused before anything starts, in one line naming its pip package.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any, Iterable

from adaptive.errors import AdaptiveError

logger = logging.getLogger(__name__)  # plain logging: it must work on an error path, whatever state accelerate is in

TRACKERS_DIR = "trackers"
PIP = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow", "trackio": "trackio"}  # name -> package
LOGGED_KINDS = ("train", "eval", "end")  # the metrics.jsonl records whose numbers go to the trackers
SKIPPED_KEYS = ("kind", "step", "time", "expert_counts")  # the step is the x axis; expert counts are E per layer


def installed() -> list[str]:
    """The supported trackers accelerate finds installed."""
    from accelerate.tracking import get_available_trackers

    found = {str(t.value if hasattr(t, "value") else t) for t in get_available_trackers()}
    return [name for name in PIP if name in found]


def resolve(report_to: str | None, available: Iterable[str] | None = None) -> list[str]:
    """The trackers `--report-to` names: [] for none, the installed ones for all; AdaptiveError for an unknown
    name (the run configuration refuses those first), `none` beside a tracker, or one that is not installed."""
    names = [n.strip() for n in (report_to or "none").split(",")]
    for name in names:
        if name not in (*PIP, "all", "none"):
            raise AdaptiveError(f"--report-to: unknown tracker {name!r}; choose from {', '.join([*PIP, 'all', 'none'])}")
    if "none" in names:
        if len(names) > 1:
            raise AdaptiveError(f"--report-to {report_to}: 'none' cannot be combined with trackers")
        return []
    have = installed() if available is None else list(available)
    if "all" in names:
        found = [name for name in PIP if name in have]
        if not found:
            logger.warning("--report-to all: no tracker is installed, so none logs (pip install %s)", " | ".join(PIP))
        return found
    chosen = list(dict.fromkeys(names))  # in order, once each
    missing = [name for name in chosen if name not in have]
    if missing:
        raise AdaptiveError(f"--report-to {missing[0]}: the tracker is not installed; pip install {PIP[missing[0]]}")
    return chosen


def _number(value: Any) -> float | int | None:
    """A finite int or float (a bool as 0/1); None for anything else."""
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, int):
        return value
    if isinstance(value, float) and math.isfinite(value):
        return value
    return None


def flatten_record(record: dict[str, Any]) -> dict[str, float | int]:
    """A metrics.jsonl record as tracker scalars, `<kind>/<field>` (see the module docstring); {} for the kinds
    not logged (start, rollback, ...)."""
    kind = record.get("kind")
    if kind not in LOGGED_KINDS:
        return {}
    out: dict[str, float | int] = {}

    def add(key: str, value: Any) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                add(f"{key}/{k}", v)
        elif isinstance(value, (list, tuple)):
            for i, v in enumerate(value):
                if not isinstance(v, (list, tuple, dict)):  # one number per layer; nested lists are left out
                    add(f"{key}/layer_{i}", v)
        else:
            number = _number(value)
            if number is not None:
                out[key] = number

    for key, value in record.items():
        if key not in SKIPPED_KEYS:
            add(f"{kind}/{key}", value)
    return out


def run_config(summary: dict[str, Any], options: dict[str, Any]) -> dict[str, bool | int | float | str | None]:
    """What `init_trackers` stores as the run's configuration: the plan's run section and every option
    (`options/<name>`), nested values flattened with '/', lists and other values as strings (TensorBoard's
    hparams take bool, int, float, str and None; mlflow stores strings)."""
    out: dict[str, Any] = {}

    def add(key: str, value: Any) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                add(f"{key}/{k}", v)
        elif value is None or isinstance(value, (bool, int, str)):
            out[key] = value
        elif isinstance(value, float):
            out[key] = value if math.isfinite(value) else str(value)
        elif isinstance(value, (list, tuple)):
            out[key] = json.dumps(value, default=str)
        else:
            out[key] = str(value)

    for key, value in summary.items():
        add(key, value)
    for key, value in options.items():
        add(f"options/{key}", value)
    return out


def logging_dir(output_dir: Path) -> Path:
    return Path(output_dir) / TRACKERS_DIR


def init_kwargs(output_dir: Path, resumed_at: int | None = None) -> dict[str, dict[str, Any]]:
    """Each tracker's own arguments: wandb keeps its files in the run folder too; a resumed TensorBoard run
    drops what the run logged after its checkpoint (`purge_step`), as metrics.jsonl does."""
    kwargs: dict[str, dict[str, Any]] = {"wandb": {"dir": str(logging_dir(output_dir))}}
    if resumed_at is not None:
        kwargs["tensorboard"] = {"purge_step": resumed_at + 1}
    return kwargs


class TrackerSink:
    """Hands records and scalars to the Accelerator's trackers. `MetricsWriter` calls it with every record it
    writes; `TrainerState.log` with the scalars a callback logs."""

    def __init__(self, accelerator: Any) -> None:
        self.accelerator = accelerator

    def __call__(self, record: dict[str, Any]) -> None:
        values = flatten_record(record)
        if values:
            self.log(values, int(record["step"]))

    def log(self, values: dict[str, Any], step: int) -> None:
        finite = {k: v for k, v in values.items() if _number(v) is not None}
        if finite:
            self.accelerator.log(finite, step=step)


def start(accelerator: Any, output_dir: Path, summary: dict[str, Any], options: dict[str, Any],
          resumed_at: int | None = None) -> TrackerSink | None:
    """Start the Accelerator's trackers (main process) with the run's configuration; None when it has none.
    `resumed_at`: the step a resumed run continues from."""
    if not accelerator.log_with:
        return None
    if accelerator.is_main_process:
        logging_dir(output_dir).mkdir(parents=True, exist_ok=True)
    accelerator.init_trackers(Path(output_dir).resolve().name, config=run_config(summary, options),
                              init_kwargs=init_kwargs(output_dir, resumed_at))
    return TrackerSink(accelerator)


def finish(accelerator: Any) -> None:
    """Finish the trackers after an error (the error is what the user must see: a failure here is logged only).
    The normal end goes through `accelerator.end_training()`."""
    for tracker in list(getattr(accelerator, "trackers", [])):
        try:
            tracker.finish()
        except Exception as err:  # noqa: BLE001 - never hide the run's own error
            logger.warning("tracker %s did not finish: %s", getattr(tracker, "name", tracker), err)
    accelerator.trackers = []


__all__ = ["PIP", "TRACKERS_DIR", "TrackerSink", "finish", "flatten_record", "init_kwargs", "installed",
           "logging_dir", "resolve", "run_config", "start"]
