"""`adaptive export RUN_DIR --format ...`: rewrite a run's HF export in the most portable format (or a named one).

An export that exists already is said to in one line, and nothing is written (`--force` writes it).
"""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

RunDir = Annotated[Path, typer.Argument(help="A run's --output-dir (its hf/ export is read), or an HF model folder.")]
Format = Annotated[str, typer.Option("--format", "-f", help="auto (most portable: llama for dense, mixtral for "
                                     "plain MoE, else adaptive), llama, mixtral or adaptive. A fine-tune's export of "
                                     "another transformers family (qwen3, gemma2, ...) is its own class: nothing "
                                     "to convert.")]
Out = Annotated[Optional[Path], typer.Option("--out", "-o", help="Target folder (default: beside the source, "
                                             "named <source>-<format>).")]
Json = Annotated[bool, typer.Option("--json", help="Print {path, format, reason, written} as JSON.")]
Force = Annotated[bool, typer.Option("--force", help="Write the export even where it exists already (the source "
                                     "is in that format, or the target holds its conversion of the same files).")]


def export(run_dir: RunDir, export_format: Format = "auto", out: Out = None, json_output: Json = False,
           force: Force = False) -> None:
    """Convert a run's HF export to llama / mixtral / adaptive, saying why a portable format was not possible."""
    from adaptive.extras import require

    require("adaptive export")
    from transformers.utils import logging as hf_logging

    from adaptive.train.run_folder.export import convert_export

    hf_logging.disable_progress_bar()  # the loading bar is noise on a one-line command
    # loading imports DeepSpeed (through accelerate), whose logger prints to stdout: keep stdout for our output
    with contextlib.redirect_stdout(sys.stderr):
        path, chosen, written = convert_export(run_dir, export_format, out, force)
    if json_output:
        print(json.dumps({"path": str(path), "format": chosen.format, "reason": chosen.reason, "written": written}))
        return
    from rich.console import Console

    if not written:
        Console().print(f"{path}: {chosen.reason}", soft_wrap=True)
        return
    Console().print(f"Wrote {path} as [bold]{chosen.format}[/bold]: {chosen.reason}", soft_wrap=True)
