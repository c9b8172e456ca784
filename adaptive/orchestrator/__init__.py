"""Runtime adaptation: small callbacks the training loop calls (its contract: `adaptive.train.run.callbacks`).

`policies(config)` builds the orchestrator the recipes' entry point adds to the loop when
`--orchestrator` is on (or auto and the plan recommends it), in this order:

    Monitor        monitor.py    router/loss signals on the device, summarised every N steps
    balance        balance.py    aux-loss-free expert balancing (selection bias, all ranks identical)
    capacity       capacity.py   capacity factor follows the dropped fraction, within the memory bound
    oom            oom.py        the OOM ladder: halve micro-batch, then checkpointing, then halve the
                                 sequence (blocks cut into pieces); each time the step is redone
    guard          guard.py      NaN / loss-spike guard: skip, roll back, cool the LR
    ep             ep_advice.py  measured all-to-all share -> ep_size for the next launch
    EventSummary   events.py     events.jsonl and its end summary

A policy is one module ending in `POLICY = Policy(name, config, build)` plus one line in
`registry.POLICIES`. Each has its own frozen settings dataclass, validated on construction, and can be
left out (`--orchestrator-policies`); settings come from `--orchestrator-config` (JSON:
{"guard": {"bad_steps": 3}, "balance": {"rate": 0.001}}), checked by pydantic against the dataclass.
`adaptive.train.hf_trainer.OrchestratorCallback` attaches the same list to a transformers `Trainer`.

This package imports nothing from `adaptive.train` and nothing heavy at import time (the CLI's
`adaptive report` reads it); torch is imported where a policy runs.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from adaptive.errors import AdaptiveError
from adaptive.orchestrator.registry import POLICIES, policy

POLICY_NAMES = tuple(POLICIES)


def _configs() -> dict[str, type]:
    from adaptive.orchestrator.monitor import MonitorConfig

    return {"monitor": MonitorConfig, **{name: policy(name).config for name in POLICIES}}


@dataclass(frozen=True)
class OrchestratorConfig:
    """Which policies run, and each one's settings (None: its defaults)."""

    policies: tuple[str, ...] = POLICY_NAMES
    settings: dict[str, dict[str, Any]] = field(default_factory=dict)

    def config_for(self, name: str) -> Any:
        cls = _configs()[name]
        return cls(**self.settings.get(name, {}))


def _closest(value: str, choices: tuple[str, ...] | list[str]) -> str:
    close = difflib.get_close_matches(value, list(choices), n=1)
    return f"; did you mean {close[0]}?" if close else f"; choose from {', '.join(choices)}"


def parse_policies(text: str | None) -> tuple[str, ...]:
    """'balance,oom' -> ('balance', 'oom'); 'all' or None -> every policy; 'none' -> none."""
    if text is None or text.strip() == "all":
        return POLICY_NAMES
    if text.strip() == "none":
        return ()
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    if not names:
        raise AdaptiveError(f"--orchestrator-policies {text!r} names no policy; give names ({', '.join(POLICY_NAMES)}), "
                            "all or none")
    for name in names:
        if name not in POLICY_NAMES:
            raise AdaptiveError(f"unknown orchestrator policy {name!r}{_closest(name, POLICY_NAMES)}")
    return tuple(n for n in POLICY_NAMES if n in names)


def parse_settings(text: str | None) -> dict[str, dict[str, Any]]:
    """Inline JSON or a JSON file: {policy: {field: value}}; unknown names and fields are refused."""
    if not text:
        return {}
    source = text
    if not text.lstrip().startswith("{"):
        path = Path(text).expanduser()
        if not path.is_file():
            raise AdaptiveError(f"--orchestrator-config {text!r} is neither a JSON object nor a file")
        try:
            source = path.read_text(encoding="utf-8")
        except UnicodeDecodeError as err:
            raise AdaptiveError(f"--orchestrator-config {text!r} is not UTF-8 text (byte {err.start}); give a JSON "
                                "object") from None
    try:
        data = json.loads(source)
    except json.JSONDecodeError as err:
        raise AdaptiveError(f"--orchestrator-config is not valid JSON: {err}") from None
    if not isinstance(data, dict):
        raise AdaptiveError("--orchestrator-config must be a JSON object {policy: {field: value}}")
    configs = _configs()
    out: dict[str, dict[str, Any]] = {}
    for name, values in data.items():
        if name not in configs:
            raise AdaptiveError(f"unknown orchestrator config section {name!r}{_closest(name, tuple(configs))}")
        if not isinstance(values, dict):
            raise AdaptiveError(f"orchestrator config section {name!r} must be an object of fields")
        fields = {f.name for f in dataclasses.fields(configs[name])}
        for key in values:
            if key not in fields:
                raise AdaptiveError(f"unknown {name} setting {key!r}{_closest(key, sorted(fields))}")
        checked = _validate(name, configs[name], values)
        out[name] = {key: getattr(checked, key) for key in values}  # as the dataclass types them
    return out


def _validate(section: str, cls: type, values: dict[str, Any]) -> Any:
    """Types by pydantic against the dataclass's fields, strictly (no NaN or infinity, no `true` or `"3"` for
    a number; an integer is a valid float), ranges by its __post_init__."""
    from pydantic import ConfigDict, TypeAdapter, ValidationError

    try:
        strict = type(cls.__name__, (cls,), {"__pydantic_config__": ConfigDict(allow_inf_nan=False, strict=True)})
        return TypeAdapter(strict).validate_json(json.dumps(values))  # strict JSON: an object is a dataclass
    except ValidationError as err:
        first = err.errors()[0]
        where = ".".join(str(p) for p in (section, *first["loc"]))
        message = first["msg"].removeprefix("Value error, ")
        got = f", got {first['input']!r}" if first["loc"] else ""
        raise AdaptiveError(f"--orchestrator-config {where}: {message}{got}") from None


def orchestrator_config(policies_flag: str | None = None, config_flag: str | None = None) -> OrchestratorConfig:
    """The config from the recipe flags --orchestrator-policies and --orchestrator-config."""
    return OrchestratorConfig(policies=parse_policies(policies_flag), settings=parse_settings(config_flag))


def policies(config: OrchestratorConfig | None = None) -> list[Any]:
    """The orchestrator's callbacks, in the order they run (monitor first, the event summary last)."""
    from adaptive.orchestrator.events import EventLog, EventSummary
    from adaptive.orchestrator.monitor import Monitor

    config = config or OrchestratorConfig()
    events = EventLog()
    monitor = Monitor(config.config_for("monitor"))
    chosen = [monitor, *(policy(name).build(monitor, events, config.config_for(name))
                         for name in POLICY_NAMES if name in config.policies)]
    return [*chosen, EventSummary(events, chosen)]


__all__ = ["OrchestratorConfig", "POLICY_NAMES", "orchestrator_config", "parse_policies", "parse_settings", "policies"]
