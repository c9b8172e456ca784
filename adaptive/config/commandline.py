"""The run configuration on the command line, through typer (which `adaptive` already uses for its CLI).

`with_run_options(command)` turns a function `f(config: RunConfig, ...own options)` into a typer
command that takes every run option of that command, with the flag names, help text and help panel
that `adaptive.config.run` declares, builds the validated `RunConfig` and calls `f`. `fit`, `launch`
and the recipes are built this way, so a shared option is defined once.

Why typer and not tyro: the CLI is typer already (`adaptive fit` must start in a fraction of a
second, and tyro's import and nested-dataclass parsing cost more); our flags are flat while tyro
nests them by default; and a typer signature built from the dataclass fields is all we need.
"""

from __future__ import annotations

import functools
import inspect
import os
import re
import sys
import typing
from enum import Enum
from typing import Annotated, Any, Callable, Optional

import typer

from adaptive.config.run import Flag, RunConfig, options_for, run_fields
from adaptive.errors import AdaptiveError

_CHOICES: dict[tuple[str, ...], type[Enum]] = {}
MAX_CHOICES_SHOWN = 13  # characters of "a|b|c" shown as the metavar; longer lists are in the help text


def _choice_type(flag: Flag) -> type[Enum]:
    if flag.choices not in _CHOICES:
        name = flag.name.strip("-").title().replace("-", "")
        _CHOICES[flag.choices] = Enum(name, {c: c for c in flag.choices}, type=str)
    return _CHOICES[flag.choices]


def _base_type(annotation: str) -> type:
    # the fields' annotations are strings (from __future__ import annotations): "int | None", "bool", ...
    for name, kind in (("bool", bool), ("int", int), ("float", float), ("str", str)):
        if annotation.split(" |")[0] == name:
            return kind
    raise TypeError(f"run option of unsupported type {annotation!r}")


def _parameter(field: Any, flag: Flag) -> inspect.Parameter:
    kind = _choice_type(flag) if flag.choices and not flag.many else _base_type(field.type)
    if flag.unit:  # "20B", "256GB": RunConfig.from_options reads the suffix
        kind = str
    names = (f"{flag.name}/{flag.negative}", *flag.names[1:]) if flag.negative else flag.names
    # a long list of choices is shown as <name> (the help lists them): at 80 columns rich would cut option names
    metavar = {"count": "NUMBER", "gib": "GIB"}.get(flag.unit or "")
    if flag.choices and len("|".join(flag.choices)) > MAX_CHOICES_SHOWN:
        metavar = "<list>" if flag.many else "<choice>"
    info = typer.Option(*names, help=flag.help, rich_help_panel=flag.panel, show_default=field.default is not None,
                        metavar=metavar)
    return inspect.Parameter(field.name, inspect.Parameter.KEYWORD_ONLY, default=field.default,
                             annotation=Annotated[Optional[kind], info])


def with_run_options(command: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorate `f(config, *, own options...)`: the typer command gets `command`'s run options too."""
    fields = options_for(command)
    names = {f.name for _, f, _ in fields}

    def decorate(func: Callable[..., Any]) -> Callable[..., Any]:
        hints = typing.get_type_hints(func, include_extras=True)  # the annotations as objects, not strings
        own = [p.replace(annotation=hints.get(name, p.annotation))
               for name, p in inspect.signature(func).parameters.items() if name != "config"]
        clash = names & {p.name for p in own}
        assert not clash, f"{func.__name__} redefines run options {sorted(clash)}"

        @functools.wraps(func)
        def command_function(*args: Any, **kwargs: Any) -> Any:
            values = {name: kwargs.pop(name) for name in names if name in kwargs}
            values = {k: v.value if isinstance(v, Enum) else v for k, v in values.items()}
            return func(RunConfig.from_options(values), *args, **kwargs)

        positional = [p for p in own if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        keyword = [p.replace(kind=p.KEYWORD_ONLY) for p in own if p not in positional]
        params = [*positional, *(_parameter(f, flag) for _, f, flag in fields), *keyword]
        command_function.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
        command_function.__annotations__ = {p.name: p.annotation for p in params}
        del command_function.__wrapped__  # typer must read the new signature, not func's
        return command_function

    return decorate


# typer vendors click in new versions and depends on it in older ones; find its base error either way.
_ClickException = next(c for c in typer.BadParameter.__mro__ if c.__name__ == "ClickException")


def bare_values(argv: list[str]) -> list[str]:
    """`argv` with the value of an option given alone filled in (`--resume` means `--resume auto`):
    typer's click has no options whose value is optional."""
    bare = {name: flag.bare for _, _, flag in run_fields() if flag.bare for name in flag.names}
    out: list[str] = []
    for i, arg in enumerate(argv):
        out.append(arg)
        if arg in bare and (i + 1 == len(argv) or argv[i + 1].startswith("-")):
            out.append(bare[arg])
    return out


def run_command(app: typer.Typer, argv: list[str] | None, prog_name: str) -> int:
    """Run a typer app; bad input is one line on stderr and exit code 2, never a traceback."""
    try:
        rv = app(args=bare_values(sys.argv[1:] if argv is None else list(argv)), prog_name=prog_name,
                 standalone_mode=False)
    except AdaptiveError as err:
        return fail(str(err))
    except _ClickException as err:
        if type(err).__name__ == "NoArgsIsHelpError":  # a bare `adaptive`: its help (rich has printed it already)
            if err.format_message():
                sys.stdout.write(err.format_message() + "\n")
            return 0
        return fail(err.format_message().replace("\n", " ") + _nearest_choice(err))
    except typer.Abort:
        return 130
    except typer.Exit as done:
        return done.exit_code
    return rv if isinstance(rv, int) else 0


def _nearest_choice(err: Exception) -> str:
    """" Did you mean 'lora'?" after click's "'lorra' is not one of ...", where one choice is close."""
    choices = getattr(getattr(getattr(err, "param", None), "type", None), "choices", None)
    bad = re.search(r"'(.+?)' is not one of", getattr(err, "message", "") or "")
    if not choices or bad is None:
        return ""
    import difflib  # only on an error: fit's start stays lean

    names = [str(getattr(c, "value", c)) for c in choices]
    close = difflib.get_close_matches(bad[1], names, n=1, cutoff=0.6)
    return f" Did you mean {close[0]!r}?" if close else ""


ERROR_FILE_ENV = "ADAPTIVE_ERROR_FILE"  # set by `adaptive launch`: where a recipe under the launcher leaves its error


def fail(message: str) -> int:
    """One line on stderr, exit code 2. Under a launcher every rank meets the same bad input: the first
    rank says it, and leaves it for `adaptive launch` to report in place of the launcher's traceback."""
    line = f"error: {message}\n"
    if os.environ.get("RANK", "0") == "0":
        sys.stderr.write(line)
        if os.environ.get(ERROR_FILE_ENV):
            with open(os.environ[ERROR_FILE_ENV], "a", encoding="utf-8") as f:
                f.write(line)
    return 2


def parse(command: str, argv: list[str]) -> RunConfig:
    """The RunConfig that `command` builds from `argv` (AdaptiveError or click's error on bad input)."""
    app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)
    app.command()(with_run_options(command)(lambda config: config))
    return app(args=bare_values(argv), prog_name=command, standalone_mode=False)

__all__ = ["ERROR_FILE_ENV", "fail", "parse", "run_command", "with_run_options"]
