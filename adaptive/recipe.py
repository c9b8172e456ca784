"""What a recipe is: a preset and an architecture, and the command line that trains them.

    from adaptive.recipe import Recipe

    recipe = Recipe(model="b1", arch="mod")
    if __name__ == "__main__":
        raise SystemExit(recipe.main())

`recipe.main()` parses the run options (`adaptive.config`, the same definitions as `adaptive fit`
and `adaptive launch`), plans the run with the same planner, and trains it (`adaptive.train.run.entry`)
with the orchestrator's policies as plugins. `adaptive launch` reads the `recipe` a file declares.
`--dry-run` prints the plan as JSON without training; with `--gpu` it imports no torch.

This module composes the layers: it is the one place that knows both `adaptive.train` and
`adaptive.orchestrator`. Exit codes: 0 done, 2 bad input (one line on stderr).
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import json
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import typer

from adaptive.config.commandline import _ClickException, bare_values, run_command, with_run_options
from adaptive.config.run import TRAIN, RunConfig, options_for
from adaptive.errors import AdaptiveError
from adaptive.plan.architecture.presets import ARCHS, PRESETS

DryRun = Annotated[bool, typer.Option("--dry-run", help="Plan and print the run as JSON; do not train.")]


@dataclass(frozen=True)
class Recipe:
    """A preset trained as an architecture. `--model` / `--arch` on its command line override them. A fine-tune
    recipe (`finetune`: its default method) trains the checkpoint --init-from names, as that checkpoint's arch."""

    model: str | None = None
    arch: str = "dense"
    finetune: str | None = None  # lora | qlora | full: a fine-tune recipe's default --finetune

    def __post_init__(self) -> None:
        if self.finetune is not None:
            from adaptive.plan.finetune.method import METHODS

            if self.finetune not in METHODS:
                raise AdaptiveError(f"recipe finetune {self.finetune!r} is not one of {', '.join(METHODS)}")
            return
        if self.model not in PRESETS:
            raise AdaptiveError(f"recipe model {self.model!r} is not a preset ({', '.join(PRESETS)})")
        if self.arch not in ARCHS:
            raise AdaptiveError(f"recipe arch {self.arch!r} is not one of {', '.join(ARCHS)}")

    @property
    def name(self) -> str:
        return "finetune" if self.finetune is not None else f"{self.model}_{self.arch}"

    def with_defaults(self, config: RunConfig) -> RunConfig:
        """A fine-tune recipe's method where --finetune leaves it out."""
        if self.finetune is None or config.finetune.finetune is not None:
            return config
        return config.replace(finetune=self.finetune)

    def resolve(self, config: RunConfig) -> tuple[str, str]:
        """(preset, arch) of a run: the flags', else the recipe's. The "preset" may be a config.json (a shape the
        planner reads: `adaptive fit --budget-* --out DIR` writes one), trained from a fresh start. With
        --init-from the checkpoint's config.json is the shape; the preset still names the run folder and the
        default --lr. A fine-tune (--finetune) is of --init-from's checkpoint, in its own arch: the checkpoint's
        folder names the run."""
        from adaptive.plan.architecture.hf_config import looks_like_path

        if config.model.init_from and config.model.name:
            raise AdaptiveError("give --model or --init-from, not both: --init-from takes the shape from its "
                                "config.json")
        if config.finetune.finetune is not None:
            if not config.model.init_from:
                raise AdaptiveError(f"--finetune {config.finetune.finetune} fine-tunes a checkpoint: give --init-from "
                                    "PATH, a folder with its config.json and weights (and tokenizer)")
            if config.model.arch:
                raise AdaptiveError("--arch does not apply to a fine-tune: it trains the checkpoint's own arch")
            from adaptive.train.run_folder.init_from import check_finetune_source
            from adaptive.plan.request import resolve_model

            check_finetune_source(config.model.init_from)  # one line, before anything starts
            folder = str(Path(config.model.init_from).expanduser())
            return folder, resolve_model(folder).arch
        if self.finetune is not None:
            raise AdaptiveError("recipes/finetune.py fine-tunes a checkpoint: give --init-from PATH")
        preset = config.model.name or self.model
        arch = config.model.arch or self.arch
        if looks_like_path(preset):
            from adaptive.plan.request import resolve_model

            resolve_model(preset, arch)  # a missing or malformed file is one line, before anything starts
            return preset, arch
        if preset not in PRESETS:
            raise AdaptiveError(f"--model {preset!r}: a recipe trains a preset ({', '.join(PRESETS)}) or the shape "
                                "in a config.json")
        return preset, arch

    def main(self, argv: list[str] | None = None, callbacks: list[Any] | None = None) -> int:
        """Parse `argv` (default sys.argv), then plan and train, or print the plan with --dry-run."""

        def act(config: RunConfig, dry_run: bool) -> None:
            config = self.with_defaults(config)
            preset, arch = self.resolve(config)
            if dry_run:
                sys.stdout.write(json.dumps(plan_only(config, preset, arch), indent=2) + "\n")
            else:
                train(config, preset, arch, callbacks)

        return run_command(self._app(act), argv, f"recipes/{self.name}.py")

    def check_args(self, argv: list[str], caller: str, also: Iterable[str] = ()) -> None:
        """Parse `argv` as main() would, running nothing. An option the recipe does not take is an AdaptiveError
        naming the nearest option of the recipe or of `caller`'s own (`also`); a bad value is click's error."""
        try:
            self._app(lambda config, dry_run: None)(args=bare_values(argv), prog_name=f"recipes/{self.name}.py",
                                                    standalone_mode=False)
        except _ClickException as err:
            if type(err).__name__ != "NoSuchOption":
                raise
            option = err.option_name
            known = {*(n for _, _, flag in options_for(TRAIN) for n in flag.names), "--dry-run", *also}
            # compared without the dashes, which every name shares and which would make any two names look alike
            words = {name.lstrip("-"): name for name in known if name.startswith("--")}
            nearest = difflib.get_close_matches(option.lstrip("-"), sorted(words), n=1)
            hint = f" (nearest: {words[nearest[0]]})" if nearest else f" ({caller} --help lists them)"
            raise AdaptiveError(f"{option} is an option of neither {caller} nor recipes/{self.name}.py{hint}") from None

    def _app(self, act: Callable[[RunConfig, bool], None]) -> typer.Typer:
        app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)

        what = (f"Fine-tune the checkpoint --init-from names ({self.finetune} unless --finetune says otherwise)"
                if self.finetune else f"Train the {self.model} preset as {self.arch}")

        @app.command(help=f"{what} on DeepSpeed, sized by the planner. Launch with `accelerate launch` (or torchrun / "
                          "deepspeed); plain python runs one process.")
        @with_run_options(TRAIN)
        def recipe_command(config: RunConfig, dry_run: DryRun = False) -> None:
            act(config, dry_run)

        return app


def orchestrator_settings(config: RunConfig) -> Any:
    """The orchestrator's config from the run options (--min-seq-len is also the OOM ladder's floor)."""
    from adaptive.orchestrator import orchestrator_config

    options = config.orchestrator
    settings = orchestrator_config(options.orchestrator_policies, options.orchestrator_config)
    floor = config.data.min_seq_len
    if floor is None:
        return settings
    oom = settings.settings.get("oom", {})
    if oom.get("min_seq_len") not in (None, floor):
        raise AdaptiveError(f"--min-seq-len {floor} contradicts oom.min_seq_len {oom['min_seq_len']} in "
                            "--orchestrator-config; give one of them")
    return dataclasses.replace(settings, settings={**settings.settings, "oom": {**oom, "min_seq_len": floor}})


def train(config: RunConfig, preset: str, arch: str, callbacks: list[Any] | None = None) -> Any:
    """Train with the orchestrator's policies as the loop's plugins; returns the final TrainerState."""
    from adaptive.extras import require
    from adaptive.orchestrator import policies

    require("training")  # before torch is imported: one line in a planner-only install
    from adaptive.engine import name_cpu_accelerator

    name_cpu_accelerator()  # before DeepSpeed is imported: no "Setting accelerator to CPU" warning on a CPU
    from adaptive.train.run.entry import run

    orchestrator = orchestrator_settings(config)  # bad settings fail before anything starts
    return run(config, preset, arch, callbacks, plugins=lambda: policies(orchestrator))


def plan_only(config: RunConfig, preset: str, arch: str) -> dict[str, Any]:
    """The run as --dry-run prints it: the run section, the plan (adaptive fit's schema), the DeepSpeed config."""
    from adaptive.plan.ds_config.emit import plan_dict
    from adaptive.train.run.runplan import World, detect_device, launcher_world, plan_run

    launched = launcher_world()
    per_node = config.hardware.gpus or launched.per_node
    world = World(per_node * (config.hardware.nodes or launched.nodes), per_node)
    device = detect_device(config.hardware.gpu, assume_gpu=True)
    plan = plan_run(config, preset, arch, world, device)
    orchestrator = orchestrator_settings(config)
    return {"run": plan.summary(), "plan": plan_dict(plan.plan), "ds_config": plan.ds_config,
            "orchestrator": {"policies": list(orchestrator.policies), "settings": orchestrator.settings},
            "options": config.flat()}


def load_recipe(path: str | Path) -> Recipe:
    """The `recipe = Recipe(model=..., arch=...)` a recipe file declares, read from its source without
    running it (launch must not execute a file to learn what it trains)."""
    path = Path(path)
    if not path.is_file():
        raise AdaptiveError(f"recipe {str(path)!r} does not exist")
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    except (SyntaxError, UnicodeDecodeError, ValueError) as err:
        raise AdaptiveError(f"recipe {str(path)!r} cannot be read as Python: {err}") from None
    for node in tree.body:
        if (isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == ["recipe"]
                and isinstance(node.value, ast.Call) and getattr(node.value.func, "id", None) == "Recipe"):
            try:
                fields = {k.arg: ast.literal_eval(k.value) for k in node.value.keywords}
                return Recipe(**fields)
            except (ValueError, TypeError):
                break
    raise AdaptiveError(f"cannot tell the preset and arch of {path.name}: it declares no "
                        "`recipe = Recipe(model=\"...\", arch=\"...\")`")


def main(preset: str, arch: str, argv: list[str] | None = None, callbacks: list[Any] | None = None) -> int:
    """`Recipe(preset, arch).main(argv, callbacks)`: for scripts and tests that build a recipe on the fly."""
    return Recipe(preset, arch).main(argv, callbacks)


__all__ = ["Recipe", "load_recipe", "main", "orchestrator_settings", "plan_only", "train"]
