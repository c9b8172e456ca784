"""Check local JSON rows before `datasets` reads them: every record an object whose text field is a string
(instruction rows are checked by `instructions.check_rows` over `json_records`).

`datasets`' json builder (pyarrow) reports a bad line as "JSON parse error ... in row 3" without the
file, fills a missing field with null, and lets an integer or a list through to the tokenizer, which
fails mid-run. One pass over the files here turns each of those into one line naming the file, the
line and the field. The pass reads every byte once (the tokenizer reads them again, more slowly), for
streaming local files too: a bad row would otherwise stop the run hours in.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from adaptive.errors import AdaptiveError


def _records(path: Path) -> Iterator[tuple[str, Any]]:
    """(where, record) for each record: JSON lines, or a `.json` file holding one array of records."""
    if path.suffix == ".json":
        try:
            whole = json.loads(path.read_bytes().decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError):
            whole = None  # JSON lines under a .json name, or broken: the line pass says where
        if isinstance(whole, list):
            yield from ((f"{path}: item {i}", record) for i, record in enumerate(whole, 1))
            return
    with path.open("rb") as lines:
        for number, raw in enumerate(lines, 1):
            where = f"{path}:{number}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                raise AdaptiveError(f"{where} is not UTF-8 text (byte {err.start}); a .jsonl dataset holds one JSON "
                                    "object per line") from None
            if not line.strip():
                continue
            try:
                yield where, json.loads(line)
            except json.JSONDecodeError as err:
                raise AdaptiveError(f"{where} is not JSON ({err.msg} at column {err.colno}); a .jsonl dataset holds one "
                                    "JSON object per line") from None


def _kind(value: Any) -> str:
    """JSON's name for a value's type."""
    if isinstance(value, bool):
        return "boolean"
    return {dict: "object", list: "array", str: "string", int: "number", float: "number"}.get(type(value), "value")


def json_records(files: list[str]) -> Iterator[tuple[str, Any]]:
    """(where, record) for every record of the files, in order; `where` is "file:line" (or "file: item i")."""
    for name in files:
        yield from _records(Path(name))


def first_json_record(files: list[str]) -> Any:
    """The first record of the files (None when they hold none): what kind of rows they are."""
    return next((record for _, record in json_records(files)), None)


_CHECKED: set[tuple[str, int, int, str]] = set()  # (file, size, mtime_ns, field): read once per process


def missing_field_hint(field: str) -> str:
    """What rows need when they lack `field`: under the default, the three layouts a run reads."""
    if field != "text":
        return "pass --text-field NAME"
    return ("a row needs 'text' (documents), 'messages' (chats) or 'prompt' and 'completion'; for documents in "
            "another field pass --text-field NAME")


def check_json_rows(files: list[str], field: str) -> None:
    """AdaptiveError at the first record that is not an object with a string `field` ("" is a blank
    document, skipped like blank text)."""
    for name in files:
        stat = Path(name).stat()
        key = (str(Path(name).resolve()), stat.st_size, stat.st_mtime_ns, field)
        if key in _CHECKED:
            continue
        for where, record in _records(Path(name)):
            if not isinstance(record, dict):
                raise AdaptiveError(f"{where} is a JSON {_kind(record)}, not an object like "
                                    f'{{"{field}": "..."}}')
            if field not in record:
                fields = ", ".join(list(record)[:8]) or "none"
                if "conversations" in record:  # ShareGPT's layout: a chat, in fields no chat template reads
                    raise AdaptiveError(f"{where} has 'conversations' (ShareGPT's from/value turns): chats are read "
                                        'from "messages": [{"role": ..., "content": ...}]; rename them')
                raise AdaptiveError(f"{where} has no {field!r} field (fields: {fields}); {missing_field_hint(field)}")
            value = record[field]
            if not isinstance(value, str):
                got = "null" if value is None else f"{_kind(value)} {json.dumps(value)[:40]}"
                raise AdaptiveError(f"{where}: {field!r} must be a string of text, got {got}")
        _CHECKED.add(key)


__all__ = ["check_json_rows", "first_json_record", "json_records"]
