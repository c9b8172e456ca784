"""Where training text comes from: a hub dataset (C4 by default), local files, or the shipped corpus.

`resolve_source` turns `--dataset` into a `DataSource`; `load_text_dataset` reads it with `datasets`
(`load_dataset`, streaming for the hub) as one "text" column, with one-line errors for a hub that
cannot be reached, a missing file or bad JSON rows (`rows.check_json_rows`). Local rows may be
instruction data instead (`source_format`; chats or prompt/completion pairs, `instructions`), which
`load_instruction_rows` reads with their fields, every row checked.
"""

from __future__ import annotations

import logging
import os
import socket
from dataclasses import dataclass
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal
from urllib.parse import urlparse

from adaptive.errors import AdaptiveError
from adaptive.train.data.instructions import CHAT, TEXT, check_rows, data_format
from adaptive.train.data.rows import check_json_rows, first_json_record, json_records, missing_field_hint
from adaptive.train.data.tokenizer import DEFAULT_CORPUS

if TYPE_CHECKING:
    import datasets

logger = logging.getLogger(__name__)

C4 = "allenai/c4"
_HUB_ALIASES = {"c4": C4}
_HUB_DEFAULT_CONFIGS = {C4: "en"}
_BUILDERS = {".txt": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet"}
SAVED = "saved"  # a folder `Dataset.save_to_disk` / `DatasetDict.save_to_disk` wrote: datasets.load_from_disk
SAVED_MARKERS = ("state.json", "dataset_dict.json")


@dataclass(frozen=True)
class DataConfig:
    """What to train on and how to cut it.

    dataset: None for the shipped corpus; a local .txt/.jsonl/.json/.parquet file or a folder of
        them; or a hub dataset name ("c4" is short for allenai/c4, config "en").
    seq_len: tokens per block (labels are the block itself; the model shifts them).
    eval_fraction: share of blocks (map-style) or documents (streaming without an eval split)
        held out for evaluation.
    max_eval_blocks: cap on eval blocks over all ranks.
    eval_split: the hub split used for eval ("validation" for C4); None holds out documents of the
        train split by a hash of their text (every ~1/eval_fraction-th document).
    txt_sample_by: how .txt files are cut into documents (EOS goes after each): "paragraph"
        (blank-line separated), "line" or "document" (the whole file).
    streaming: None picks streaming for hub datasets and map-style for local files.
    shuffle_buffer: documents per shuffled window on the streaming path (a resume re-reads one window).
    cache_dir: the `datasets` cache (None: its default, ~/.cache/huggingface/datasets).
    workers: streaming only: processes per rank that read, tokenize and pack (0: the training
        process itself); at most the rank's shard count. Map-style data are tokenized up front.
    pin_memory: the loader hands over page-locked batches (CUDA).
    packing: instruction data only: several examples per block (each attending only to itself, through
        position_ids that restart at 0) instead of one padded example per block.
    """

    dataset: str | None
    seq_len: int
    seed: int = 0
    dataset_config: str | None = None
    text_field: str = "text"
    eval_fraction: float = 0.05
    max_eval_blocks: int = 256
    eval_split: str | None = "validation"
    txt_sample_by: Literal["line", "paragraph", "document"] = "paragraph"
    streaming: bool | None = None
    shuffle_buffer: int = 10_000
    cache_dir: str | None = None
    num_proc: int | None = None
    workers: int = 0
    pin_memory: bool = False
    packing: bool = False

    def __post_init__(self) -> None:
        if self.seq_len < 2:
            raise AdaptiveError(f"seq_len must be at least 2 (the model predicts token t+1 from t), got {self.seq_len}")
        if not 0.0 < self.eval_fraction < 1.0:
            raise AdaptiveError(f"eval_fraction must be between 0 and 1, got {self.eval_fraction}")
        if self.max_eval_blocks < 1:
            raise AdaptiveError(f"max_eval_blocks must be positive, got {self.max_eval_blocks}")
        if self.shuffle_buffer < 1:
            raise AdaptiveError(f"shuffle_buffer must be positive, got {self.shuffle_buffer}")
        if self.workers < 0:
            raise AdaptiveError(f"workers must be >= 0, got {self.workers}")
        if self.txt_sample_by not in ("line", "paragraph", "document"):
            raise AdaptiveError(f"txt_sample_by must be line, paragraph or document, got {self.txt_sample_by!r}")


# ---------------------------------------------------------------------------------------------
# Where the text comes from


@dataclass(frozen=True)
class DataSource:
    """A resolved `--dataset`: local files for one `datasets` builder, or a hub dataset."""

    label: str  # for messages: what the user passed, or the shipped corpus' path
    builder: str  # "text" / "json" / "parquet", or the hub repo id
    data_files: tuple[str, ...] = ()
    config_name: str | None = None

    @property
    def is_local(self) -> bool:
        return bool(self.data_files)


def _looks_like_path(name: str) -> bool:
    return name.startswith(("/", ".", "~")) or name.endswith(("/", os.sep)) or Path(name).suffix in _BUILDERS


def resolve_source(cfg: DataConfig) -> DataSource:
    """Decide what `cfg.dataset` names; raises AdaptiveError for missing or unusable paths."""
    if cfg.dataset is None:
        return DataSource(str(DEFAULT_CORPUS), "text", (str(DEFAULT_CORPUS),))
    name = cfg.dataset
    path = Path(name).expanduser()
    if path.is_dir() and any((path / marker).is_file() for marker in SAVED_MARKERS):
        return DataSource(name, SAVED, (str(path),))
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in _BUILDERS and not p.name.startswith("."))
        if not files:
            raise AdaptiveError(f"folder {name!r} has no .txt, .jsonl, .json or .parquet files")
        builders = {_BUILDERS[p.suffix] for p in files}
        if len(builders) > 1:
            kinds = ", ".join(sorted({p.suffix for p in files}))
            raise AdaptiveError(f"folder {name!r} mixes file types ({kinds}); keep one format per folder")
        return DataSource(name, builders.pop(), tuple(str(p) for p in files))
    if path.is_file():
        if path.suffix not in _BUILDERS:
            raise AdaptiveError(f"dataset file {name!r} has an unsupported type; use .txt, .jsonl, .json or .parquet")
        return DataSource(name, _BUILDERS[path.suffix], (str(path),))
    if _looks_like_path(name):
        raise AdaptiveError(f"dataset path {name!r} does not exist; pass an existing file or folder")
    repo = _HUB_ALIASES.get(name, name)
    return DataSource(name, repo, config_name=cfg.dataset_config or _HUB_DEFAULT_CONFIGS.get(repo))


def source_format(cfg: DataConfig, source: DataSource | None = None) -> str:
    """What the rows of a local source are (`instructions.data_format`): from the first JSON record, or the
    columns of parquet files or a saved dataset. Text files and the hub are text."""
    source = source or resolve_source(cfg)
    if not source.is_local or source.builder == "text":
        return TEXT
    if source.builder == "json":
        return _json_format(list(source.data_files), cfg.text_field)
    if source.builder == "parquet":
        import pyarrow.parquet as pq

        try:
            return data_format(pq.read_schema(source.data_files[0]).names, cfg.text_field)
        except (OSError, ValueError) as err:
            raise AdaptiveError(f"could not read {source.label!r} as parquet: {_first_line(err)}") from None
    return data_format(_columns(_load_saved(source, streaming=False)), cfg.text_field)


def check_local_rows(dataset: str | None, text_field: str = "text") -> str:
    """Check a local dataset's rows now, before a run starts anything: JSON rows (one line naming file:line),
    and every instruction row of parquet files or a saved dataset (naming its row). Returns what the rows are
    (`instructions.data_format`; TEXT for the hub and the shipped corpus)."""
    if not dataset:
        return TEXT
    cfg = DataConfig(dataset=dataset, seq_len=2, text_field=text_field)  # seq_len: unused here
    source = resolve_source(cfg)
    if not source.is_local:
        return TEXT
    if source.builder == "json":
        _check_json(list(source.data_files), text_field)
        return _json_format(list(source.data_files), text_field)
    fmt = source_format(cfg, source)
    if fmt != TEXT:
        check_rows(_instruction_rows(source, fmt), fmt)
    return fmt


def _json_format(files: list[str], text_field: str) -> str:
    first = first_json_record([f for f in files if os.path.getsize(f) > 0])
    return data_format(first if isinstance(first, dict) else (), text_field)


def _check_json(files: list[str], text_field: str) -> None:
    """Check every row as what the first one is: file:line for a bad row, before pyarrow's "in row 3"."""
    fmt = _json_format(files, text_field)
    if fmt == TEXT:
        check_json_rows(files, text_field)
    else:
        check_rows(json_records(files), fmt)


def _instruction_rows(source: DataSource, fmt: str) -> Iterator[tuple[str, dict[str, Any]]]:
    """(where, row) for each row of parquet files or a saved dataset, with the fields `fmt` reads; read
    directly (pyarrow, or the saved dataset's memory map), so a check writes no cache."""
    fields = ["messages"] if fmt == CHAT else ["prompt", "completion"]
    if source.builder == "parquet":
        import pyarrow.parquet as pq

        for name in source.data_files:
            table = pq.ParquetFile(name)
            present = [f for f in fields if f in table.schema_arrow.names]
            rows = (row for batch in table.iter_batches(batch_size=1000, columns=present) for row in batch.to_pylist())
            yield from ((f"{name} row {k}", row) for k, row in enumerate(rows, 1))
    else:
        ds = _load_saved(source, streaming=False)
        present = [f for f in fields if f in ds.column_names]
        for lo in range(0, len(ds), 1000):
            batch = ds.select_columns(present)[lo:lo + 1000]
            for k in range(len(batch[present[0]])):
                yield f"{source.label} row {lo + k + 1}", {f: batch[f][k] for f in present}


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def _hub_unreachable_reason() -> str | None:
    """Why the hub cannot be reached, or None if it may be (or offline mode will say so itself).

    `datasets` retries an unreachable hub several times, logging each retry; a plain TCP connect
    answers at once. Skipped in offline mode (`datasets` fails at once, or uses its cache)
    and behind a proxy, which a direct connect cannot judge.
    """
    import datasets

    proxies = ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy")
    if datasets.config.HF_HUB_OFFLINE or any(os.environ.get(v) for v in proxies):
        return None
    url = urlparse(datasets.config.HF_ENDPOINT)
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        socket.create_connection((url.hostname, port), timeout=5).close()
    except OSError as err:
        return f"cannot connect to {datasets.config.HF_ENDPOINT}: {getattr(err, 'strerror', None) or err}"
    return None


def _hub_error(source: DataSource, reason: str) -> AdaptiveError:
    return AdaptiveError(
        f"dataset {source.label!r} is on the hub, which is unreachable ({reason}); "
        "pass --dataset PATH with local .txt/.jsonl/.parquet files instead"
    )


def _load_hub(source: DataSource, split: str, cfg: DataConfig) -> datasets.IterableDataset:
    import datasets

    reason = _hub_unreachable_reason()
    if reason:
        raise _hub_error(source, reason)
    try:
        return datasets.load_dataset(source.builder, source.config_name, split=split, streaming=True, cache_dir=cfg.cache_dir)
    except datasets.exceptions.DatasetNotFoundError as err:
        raise AdaptiveError(
            f"dataset {source.label!r} was not found on the hub ({_first_line(err)}); check the name, or pass --dataset PATH"
        ) from None
    except ConnectionError as err:  # what `datasets` raises when offline or the hub does not answer
        offline = "offline mode is on, HF_DATASETS_OFFLINE/HF_HUB_OFFLINE: " if datasets.config.HF_HUB_OFFLINE else ""
        raise _hub_error(source, offline + _first_line(err)) from None
    except ValueError as err:
        if "split" in str(err).lower():
            raise AdaptiveError(
                f"dataset {source.label!r} has no split {split!r} ({_first_line(err)}); "
                "set eval_split=None to hold out training documents instead"
            ) from None
        raise


def _load_local(source: DataSource, cfg: DataConfig, streaming: bool) -> datasets.Dataset | datasets.IterableDataset | None:
    """The files through their `datasets` builder; None when every file is empty."""
    import datasets

    if source.builder == SAVED:
        return _load_saved(source, streaming)
    files = [f for f in source.data_files if os.path.getsize(f) > 0]
    if len(files) < len(source.data_files):
        logger.warning("skipping %d empty file(s) in %s", len(source.data_files) - len(files), source.label)
    if not files:
        return None
    if source.builder == "json":
        _check_json(files, cfg.text_field)
    kwargs = {"sample_by": cfg.txt_sample_by, "keep_linebreaks": True} if source.builder == "text" else {}
    try:
        return datasets.load_dataset(
            source.builder, data_files=files, split="train", streaming=streaming, cache_dir=cfg.cache_dir, **kwargs
        )
    except (datasets.exceptions.DatasetGenerationError, ValueError, OSError, UnicodeDecodeError) as err:
        cause = err.__cause__ or err
        raise AdaptiveError(f"could not read {source.label!r} as {source.builder}: {_first_line(cause)}") from None


def _load_saved(source: DataSource, streaming: bool) -> datasets.Dataset | datasets.IterableDataset:
    """A saved dataset; of a DatasetDict, its train split (the only one a local source has)."""
    import datasets

    try:
        ds = datasets.load_from_disk(source.data_files[0])
    except (FileNotFoundError, ValueError, OSError) as err:
        raise AdaptiveError(f"could not read {source.label!r} as a saved dataset: {_first_line(err)}") from None
    if isinstance(ds, datasets.DatasetDict):
        if "train" not in ds:
            raise AdaptiveError(f"saved dataset {source.label!r} has no train split (splits: {', '.join(ds)})")
        ds = ds["train"]
    return ds.to_iterable_dataset() if streaming else ds


def _columns(ds: datasets.Dataset | datasets.IterableDataset) -> list[str]:
    if ds.column_names is not None:
        return list(ds.column_names)
    first = next(iter(ds), None)  # streaming json knows its columns only after reading a row
    return list(first) if first is not None else []


def load_text_dataset(cfg: DataConfig, split: str = "train", streaming: bool | None = None):
    """The raw documents as a `datasets` Dataset/IterableDataset with one column, "text".

    Local files have only a "train" split (eval is carved out later). Returns None for a local
    source whose files are all empty.
    """
    source = resolve_source(cfg)
    if streaming is None:
        streaming = cfg.streaming if cfg.streaming is not None else not source.is_local
    if source.is_local:
        if split != "train":
            raise AdaptiveError(f"local dataset {source.label!r} has only a train split, not {split!r}")
        ds = _load_local(source, cfg, streaming)
    else:
        if not streaming:
            raise AdaptiveError(f"hub dataset {source.label!r} is read streaming; set streaming=None or True")
        ds = _load_hub(source, split, cfg)
    if ds is None:
        return None
    field = "text" if source.builder == "text" else cfg.text_field  # a saved dataset's too: --text-field
    columns = _columns(ds)
    if field not in columns:
        if not columns:
            return None  # no rows at all: reported as an empty corpus
        raise AdaptiveError(
            f"{source.label!r} has no {field!r} field (fields: {', '.join(columns)}); {missing_field_hint(field)}"
        )
    ds = ds.select_columns([field])
    return ds.rename_column(field, "text") if field != "text" else ds


def load_instruction_rows(cfg: DataConfig, source: DataSource | None = None) -> tuple[datasets.Dataset | None, str]:
    """A local source's instruction rows (map-style, with their fields) and their format (chat or
    prompt/completion), every row checked: JSON rows by file:line, the others by row number. None for no rows."""
    source = source or resolve_source(cfg)
    fmt = source_format(cfg, source)
    assert fmt != TEXT and source.is_local, "instruction rows come from local files"
    ds = _load_local(source, cfg, streaming=False)
    if ds is None or len(ds) == 0:
        return None, fmt
    if source.builder != "json":  # JSON rows were checked line by line before datasets read them
        check_rows(_instruction_rows(source, fmt), fmt)
    return ds, fmt


__all__ = ["C4", "DEFAULT_CORPUS", "DataConfig", "DataSource", "check_local_rows", "load_instruction_rows",
           "load_text_dataset", "resolve_source", "source_format"]
