"""`adaptive scale`: an isoFLOP sweep on your data, the scaling law fitted on it, law.json and the plot."""

from __future__ import annotations

import copy
import dataclasses
import math
import typing
from pathlib import Path
from typing import Annotated, Any, Callable

import typer

from adaptive.config.commandline import with_run_options
from adaptive.config.run import SCALE, RunConfig
from adaptive.errors import AdaptiveError


# The run options a sweep hands every point, as `adaptive scale` means them: a point is a tiny CPU-sized run, so the
# defaults are not a recipe's (sequence 2048 on a GPU, the preset's learning rate, C4 from the hub). Their help here
# replaces the shared one (adaptive/config/run.py), which speaks of the recipes' defaults.
SCALE_OPTIONS: dict[str, tuple[Any, str]] = {  # field -> (default, help)
    "seq_len": (128, "Sequence length of every point's run; a point's tokens are whole steps of --micro-batch x "
                     "--seq-len."),
    "micro_batch": (4, "Sequences per optimizer step of every point (one process, no accumulation)."),
    "lr": (3e-3, "Peak learning rate of every point, the same at every size (warmup, then cosine decay)."),
    "dataset": ("builtin", "builtin (the shipped corpus), a local .txt/.jsonl/.json/.parquet file or folder, or a "
                           "folder that `Dataset.save_to_disk` wrote; not a hub name (a sweep's many runs should not "
                           "lean on the hub: give a local copy)."),
    "tokenizer": (None, "A local tokenizer folder (what `save_pretrained` wrote); the model's vocabulary is its "
                        "size. Default: the built-in byte-level BPE (2048)."),
}


def _scale_options(command: Callable[..., Any]) -> Callable[..., Any]:
    """`command` (built by with_run_options) with SCALE_OPTIONS' defaults and help in its signature, so that
    `--help` shows what a sweep does and typer hands the defaults in."""
    params = []
    for p in command.__signature__.parameters.values():  # type: ignore[attr-defined]
        if p.name in SCALE_OPTIONS:
            default, help_text = SCALE_OPTIONS[p.name]
            kind, info = typing.get_args(p.annotation)
            info = copy.copy(info)  # the shared OptionInfo: fit's and launch's help stay theirs
            info.help, info.show_default = help_text, default is not None
            p = p.replace(default=default, annotation=Annotated[kind, info])
        params.append(p)
    command.__signature__ = command.__signature__.replace(parameters=params)  # type: ignore[attr-defined]
    command.__annotations__ = {p.name: p.annotation for p in params}
    return command


def _budgets(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(b) for b in text.split(",") if b.strip())
    except ValueError:
        raise AdaptiveError(f"--budgets takes comma-separated FLOP counts such as 1e11,3e11,1e12, got {text!r}") from None


def _dataset(value: str | None) -> str:
    """builtin (the default), or a local file or folder that exists (a hub name needs the hub, which a sweep's many runs should
    not lean on: give a local copy)."""
    if value is None or value == "builtin":
        return "builtin"
    if Path(value).expanduser().exists():
        return value
    raise AdaptiveError(f"--dataset {value!r}: no such file or folder; give builtin or a local .txt/.jsonl/.json/"
                        ".parquet file or folder")


def _tokenizer(value: str | None) -> tuple[str | None, int]:
    """(the tokenizer folder, its vocab size): a local HF tokenizer folder (a sweep's many runs must not lean on
    the hub), or None for the built-in BPE."""
    from adaptive.scaling.sweep import BUILTIN_VOCAB

    if value is None:
        return None, BUILTIN_VOCAB
    folder = Path(value).expanduser()
    if not folder.is_dir():
        raise AdaptiveError(f"--tokenizer {value!r}: no such folder; give a local tokenizer folder (tokenizer.json, "
                            "or vocab and merges files) or omit it for the built-in BPE")
    from adaptive.train.data.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(str(folder.resolve()))
    return str(folder.resolve()), len(tokenizer)


def _check_text(dataset: str, text_field: str) -> None:
    """A local dataset must yield documents in its text field: one line naming what it has, before any point."""
    if dataset == "builtin":
        return
    from adaptive.train.data.sources import DataConfig, load_text_dataset

    ds = load_text_dataset(DataConfig(dataset=dataset, seq_len=2, text_field=text_field), streaming=True)
    if ds is None or next(iter(ds), None) is None:
        raise AdaptiveError(f"--dataset {dataset!r} holds no documents")


def _default(value: Any, name: str) -> Any:
    return SCALE_OPTIONS[name][0] if value is None else value


def sweep_settings(config: RunConfig, archs: tuple[str, ...], budgets: tuple[float, ...], sizes: int,
                   seeds: int) -> Any:
    """The sweep the options ask for (the built-in BPE's vocabulary until the tokenizer is read)."""
    from adaptive.scaling.grid import SweepSettings
    from adaptive.scaling.sweep import BUILTIN_VOCAB

    d, opt = config.data, config.optimizer
    return SweepSettings(archs=archs, budgets=budgets, sizes=sizes, dataset=_dataset(d.dataset),
                         seq_len=_default(d.seq_len, "seq_len"), seed=opt.seed, lr=_default(opt.lr, "lr"),
                         micro_batch=_default(config.parallelism.micro_batch, "micro_batch"),
                         vocab_size=BUILTIN_VOCAB, seeds=seeds, text_field=d.text_field)


@_scale_options
@with_run_options(SCALE)
def scale(
    config: RunConfig,
    out: Annotated[Path, typer.Option("--out", help="Sweep folder: sweep.json, points/ (one run folder each), "
                                                    "law.json, isoflop.png. Rerun into it to continue a sweep.")],
    arch: Annotated[str, typer.Option("--arch", help="Architectures swept, comma-separated: dense, moe, mod, "
                                                     "hybrid; one law across them (a multiplier k per arch, dense's "
                                                     "1).")] = "dense",
    budgets: Annotated[str, typer.Option("--budgets", help="Compute budgets in FLOPs (the planner's count), "
                                                           "comma-separated; every point trains one.")]
    = "1e11,2e11,4e11",
    sizes: Annotated[int, typer.Option("--sizes", help="Model sizes per budget (the ladder's tiny widths, around "
                                                       "~20 tokens per parameter).")] = 3,
    jobs: Annotated[int, typer.Option("--jobs", help="Points trained side by side (give each a core).", min=1)] = 1,
    bootstrap: Annotated[int, typer.Option("--bootstrap", help="Bootstrap refits for the law's confidence band.",
                                           min=10)] = 100,
    seeds: Annotated[int, typer.Option("--seeds", help="Runs per point (seeds --seed, --seed + 1, ...): the fit "
                                                       "sees their mean, the band their spread.", min=1)] = 1,
) -> int:
    """Fit scaling laws on your own data: train an isoFLOP sweep of small models (one recipe run per point,
    checkpointed; Ctrl-C and rerun continues it), fit one law across the architectures, L(N, D) = E + A/(k N)^alpha +
    B/D^beta with a multiplier k per arch, as Chinchilla's approach 3 did, say which archs the data separates, write
    law.json for `adaptive fit --loss-law` and draw the curves. Every point is a recipe run with the same --dataset,
    --text-field, --tokenizer, --seq-len, --micro-batch, --lr and --seed; its width and steps are the sweep's."""
    from adaptive.extras import require
    from adaptive.scaling.grid import plan_grid
    from adaptive.scaling.fit_law import MIN_POINTS, MIN_POINTS_PER_ARCH

    archs = tuple(a.strip() for a in arch.split(",") if a.strip())
    probe = sweep_settings(config, archs, _budgets(budgets), sizes, seeds)
    plan_grid(probe)  # every bad value of the grid: one line, before anything is loaded or written
    per_arch = len(probe.budgets) * sizes
    need = max(MIN_POINTS_PER_ARCH, math.ceil((MIN_POINTS + len(archs) - 1) / len(archs)))
    if per_arch < need:  # one law: 5 shared coefficients and a multiplier per arch beyond the first
        raise AdaptiveError(f"--budgets x --sizes gives {per_arch} points per architecture; one law over "
                            f"{len(archs)} arch(s) has {MIN_POINTS + len(archs) - 1} coefficients: give at least "
                            f"{need} per architecture")
    require("adaptive scale")
    tokenizer, vocab = _tokenizer(config.data.tokenizer)
    _check_text(probe.dataset, probe.text_field)
    settings = dataclasses.replace(probe, tokenizer=tokenizer, vocab_size=vocab)
    points = plan_grid(settings)
    from cli.scale_view import SweepView, show_result

    from adaptive.scaling.sweep import scale as run_scale

    view = SweepView(points, out, jobs)
    try:
        with view:
            done = run_scale(settings, out, view, jobs=jobs, samples=bootstrap)
    except KeyboardInterrupt:
        view.interrupted(out)
        return 130
    show_result(done)
    return 0
