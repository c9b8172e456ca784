"""The `adaptive` command: one typer app; each command lives in its own module.

A command's module is imported only when that command runs (`adaptive fit` must answer in a fraction of a
second, and the other commands' modules import what fit does not need); `--help`, a bare `adaptive` and an
unknown command get the whole app.
"""

from __future__ import annotations

import gc
import importlib
import os
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imported when the app is built, after main() has set the process up
    import typer

HELP = "Plan, build and train dense, MoE, MoD and hybrid LMs with DeepSpeed on the GPUs you have."
# name -> (module, function, typer's command settings), in --help order
COMMANDS: dict[str, tuple[str, str, dict]] = {
    "fit": ("cli.fit", "fit", {}),
    "models": ("cli.catalog", "models", {}),
    "gpus": ("cli.catalog", "gpus", {}),
    "compare": ("cli.compare", "compare", {}),
    "measure": ("cli.measure", "measure", {}),
    "report": ("cli.report", "report", {}),
    "status": ("cli.status", "status", {}),
    "export": ("cli.export", "export", {}),
    "scale": ("cli.scale", "scale", {}),
    "launch": ("cli.launch", "launch", {"context_settings": {"allow_extra_args": True,
                                                             "ignore_unknown_options": True}}),
}


def build_app(names: list[str] | None = None) -> typer.Typer:
    """The app with the commands `names` (default: all of them)."""
    import typer

    app = typer.Typer(name="adaptive", help=HELP, no_args_is_help=True, pretty_exceptions_enable=False,
                      add_completion=False)
    for name in names or COMMANDS:
        module, function, settings = COMMANDS[name]
        app.command(name, **settings)(getattr(importlib.import_module(module), function))
    if names is not None and len(names) == 1:
        app.callback()(lambda: None)  # typer runs a lone command as the app itself; this keeps `adaptive fit`
    else:
        def root(version: bool = typer.Option(False, "--version", is_eager=True, callback=_print_version,
                                              help="Print adaptive's version and exit.")) -> None:
            """The app's own options: `adaptive --version`."""

        app.callback(help=HELP)(root)
    return app


def _print_version(value: bool) -> None:
    if value:
        import typer

        from adaptive import __version__

        print(f"adaptive {__version__}")
        raise typer.Exit()


def __getattr__(name: str) -> typer.Typer:
    if name == "app":  # the whole app, for tests and tools that inspect it
        return build_app()
    raise AttributeError(f"module 'cli.main' has no attribute {name!r}")


def run(argv: list[str] | None = None) -> int:
    """Run the CLI; bad input is one line on stderr and exit code 2, never a traceback."""
    from adaptive.config.commandline import run_command

    args = sys.argv[1:] if argv is None else list(argv)
    app = build_app([args[0]] if args and args[0] in COMMANDS else None)
    return run_command(app, args, "adaptive")


def main() -> None:
    if sys.argv[1:2] != ["fit"]:
        sys.exit(run())
    # A plan is a short-lived process that leaves little garbage: the cyclic collector would only rescan the
    # objects of the modules it imports, again and again, and the interpreter's teardown would free them one by
    # one (together ~8% of its instructions, docs/BENCHMARKS.md). fit's files are closed when written; once its
    # output is flushed, it exits at once.
    gc.disable()
    code = run()
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except OSError:  # a closed pipe: let the interpreter report it, as it would have
        sys.exit(code)
    os._exit(code)


if __name__ == "__main__":
    main()
