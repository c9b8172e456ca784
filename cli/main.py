"""The `adaptive` command: one typer app; each command lives in its own module."""

from __future__ import annotations

import sys

import typer

from adaptive.errors import AdaptiveError
from cli import catalog, compare, export, fit, launch, measure, report

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
app.command("export")(export.export)
app.command("launch", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})(
    launch.launch
)

# typer vendors click in new versions and depends on it in older ones; find its base error either way.
_ClickException = next(c for c in typer.BadParameter.__mro__ if c.__name__ == "ClickException")


def _fail(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return 2


def run(argv: list[str] | None = None) -> int:
    """Run the CLI; bad input is one line on stderr and exit code 2, never a traceback."""
    try:
        rv = app(args=argv, prog_name="adaptive", standalone_mode=False)
    except AdaptiveError as e:
        return _fail(str(e))
    except _ClickException as e:
        return _fail(e.format_message().replace("\n", " "))
    except typer.Abort:
        return 130
    return rv if isinstance(rv, int) else 0


def main() -> None:
    sys.exit(run())


if __name__ == "__main__":
    main()
