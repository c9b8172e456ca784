"""The `adaptive` command: one typer app; each command lives in its own module."""

from __future__ import annotations

import sys

import typer

from adaptive.config.commandline import run_command
from cli import catalog, compare, fit, launch, measure, report

app = typer.Typer(
    name="adaptive",
    help="Plan, build and train dense, MoE, MoD and hybrid LMs with DeepSpeed on the GPUs you have.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
app.command("fit")(fit.fit)
app.command("models")(catalog.models)
app.command("gpus")(catalog.gpus)
app.command("compare")(compare.compare)
app.command("measure")(measure.measure)
app.command("report")(report.report)
app.command("launch", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})(
    launch.launch
)

def run(argv: list[str] | None = None) -> int:
    """Run the CLI; bad input is one line on stderr and exit code 2, never a traceback."""
    return run_command(app, argv, "adaptive")


def main() -> None:
    sys.exit(run())


if __name__ == "__main__":
    main()
