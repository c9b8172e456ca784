"""Training data: load text, tokenize, pack into fixed-length blocks, shard across ranks, hold out eval.

Two paths share one contract:

* **Map-style** (local files and the shipped corpus; the default for them). The whole corpus is
  tokenized once (cached by `datasets`), documents are joined with EOS into one token stream, and
  the stream is cut into blocks of `seq_len` (only the last partial block is dropped). The last
  blocks are held out for eval. Any sample is reachable in O(1), so resuming is free.
* **Streaming** (hub datasets, C4 by default; local files with `streaming=True`). Documents are
  split across ranks with `datasets.distributed.split_dataset_by_node`, read in windows of
  `shuffle_buffer` documents, each window permuted by a generator seeded by (seed, epoch, window,
  worker), then tokenized and packed on the fly, in `workers` processes per rank (torchdata's
  `StatefulDataLoader`, `adaptive.train.loader`; the shards of a rank are dealt to its workers).
  The stream's position is a small state: where the current window starts (`datasets`'
  `IterableDataset.state_dict()`), the next document in it, and the tokens not yet in a block.
  Resuming loads it, re-reads one window (no tokenizing) and continues: the cost does not grow with
  the position (`datasets` itself skips to a position inside a shard by whole Arrow tables, reading
  at most that shard up to the position; nothing skipped is tokenized).

The sample order, for a rank, is a pure function of (data, seed, rank, world_size):

* Map-style: this rank's sample i is global sample g = i * world_size + rank; global sample g is
  block perm_e[g mod n] of epoch e = g // n, where perm_e is a permutation seeded by (seed, e).
  So ranks are disjoint within an epoch and together cover every training block, and every epoch
  has a fresh deterministic order. The split does not depend on world_size, so the global order is
  the same on any number of ranks (a resume on another world size continues it when the global
  sample count divides evenly).
* Streaming: this rank's documents in the order `datasets` gives for epoch e (shards reordered per
  epoch), each window permuted as above, each worker packing its own shards; the loader takes one
  block from each worker in turn. So the order depends on the number of workers too: keep
  `--data-workers` on `--resume`.

Resume contract: `SampleIterator.state_dict()` (after `commit()`) is JSON: the rank-local `position`
(samples consumed) and, when streaming, the loader's state. `SampleIterator(train, start=position,
state=that dict)` gives exactly the samples an uninterrupted iterator would have given from there on,
in the same micro-batches. Map-style data need only the position (any sample is reachable in O(1));
streaming data need the state.
"""

from __future__ import annotations

import copy
import itertools
import json
import logging
import os
import socket
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Union
from urllib.parse import urlparse

import numpy as np

from adaptive.errors import AdaptiveError
from adaptive.train.data_rows import check_json_rows
from adaptive.train.tokenizer import DEFAULT_CORPUS

if TYPE_CHECKING:
    import datasets
    import torch
    from transformers import PreTrainedTokenizerFast

logger = logging.getLogger(__name__)

C4 = "allenai/c4"
_HUB_ALIASES = {"c4": C4}
_HUB_DEFAULT_CONFIGS = {C4: "en"}
_BUILDERS = {".txt": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet"}
_ENCODE_BATCH = 256  # documents per tokenizer call on the streaming path


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


def check_local_rows(dataset: str | None, text_field: str = "text") -> None:
    """Check a local JSON dataset's rows now (one line naming file:line), before a run starts anything."""
    if dataset:
        source = resolve_source(DataConfig(dataset=dataset, seq_len=2, text_field=text_field))  # seq_len: unused here
        if source.is_local and source.builder == "json":
            check_json_rows(list(source.data_files), text_field)


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

    files = [f for f in source.data_files if os.path.getsize(f) > 0]
    if len(files) < len(source.data_files):
        logger.warning("skipping %d empty file(s) in %s", len(source.data_files) - len(files), source.label)
    if not files:
        return None
    if source.builder == "json":
        check_json_rows(files, cfg.text_field)  # file:line for a bad row, before pyarrow's "in row 3"
    kwargs = {"sample_by": cfg.txt_sample_by, "keep_linebreaks": True} if source.builder == "text" else {}
    try:
        return datasets.load_dataset(
            source.builder, data_files=files, split="train", streaming=streaming, cache_dir=cfg.cache_dir, **kwargs
        )
    except (datasets.exceptions.DatasetGenerationError, ValueError, OSError, UnicodeDecodeError) as err:
        cause = err.__cause__ or err
        raise AdaptiveError(f"could not read {source.label!r} as {source.builder}: {_first_line(cause)}") from None


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
    field = "text" if source.builder == "text" else cfg.text_field
    columns = _columns(ds)
    if field not in columns:
        if not columns:
            return None  # no rows at all: reported as an empty corpus
        raise AdaptiveError(
            f"{source.label!r} has no {field!r} field (fields: {', '.join(columns)}); pass --text-field NAME"
        )
    ds = ds.select_columns([field])
    return ds.rename_column(field, "text") if field != "text" else ds


# ---------------------------------------------------------------------------------------------
# Tokenize and pack


def _encode(tokenizer: PreTrainedTokenizerFast, texts: list[str | None]) -> list[list[int]]:
    """Token ids per non-blank document, each followed by EOS (so EOS separates documents)."""
    eos = tokenizer.eos_token_id
    keep = [t for t in texts if t and not t.isspace()]
    # The Rust backend directly: no special tokens added, no max-length warnings for long documents.
    return [enc.ids + [eos] for enc in tokenizer.backend_tokenizer.encode_batch(keep, add_special_tokens=False)]


def _encode_each(tokenizer: PreTrainedTokenizerFast, texts: list[str | None]) -> list[list[int]]:
    """Like `_encode`, one entry per document: [] for a blank one (so positions stay aligned)."""
    kept = iter(_encode(tokenizer, texts))
    return [next(kept) if t and not t.isspace() else [] for t in texts]


def tokenize_to_array(texts: datasets.Dataset, tokenizer: PreTrainedTokenizerFast, num_proc: int | None = None) -> np.ndarray:
    """All documents of a map-style text dataset as one token stream (uint16 when the vocab fits)."""
    import datasets
    import pyarrow.compute as pc

    features = datasets.Features({"input_ids": datasets.List(datasets.Value("int32"))})
    tokenized = texts.map(
        lambda batch: {"input_ids": _encode(tokenizer, batch["text"])},
        batched=True,
        remove_columns=texts.column_names,  # rows may disappear (blank documents)
        features=features,
        num_proc=num_proc,
        desc="Tokenizing",
    )
    flat = pc.list_flatten(tokenized.data.column("input_ids")).to_numpy()
    return flat.astype(np.uint16 if len(tokenizer) <= 1 << 16 else np.int32, copy=False)


def pack(tokens: np.ndarray, seq_len: int) -> np.ndarray:
    """Cut a token stream into [n, seq_len] blocks; only the final partial block is dropped."""
    n = len(tokens) // seq_len
    return tokens[: n * seq_len].reshape(n, seq_len)


def eval_block_count(n_blocks: int, cfg: DataConfig) -> int:
    """Blocks held out for eval: ~eval_fraction of them, at least one, at most max_eval_blocks.

    Independent of the world size, so the training split (and its order) is the same on any
    number of ranks.
    """
    return max(1, min(cfg.max_eval_blocks, round(cfg.eval_fraction * n_blocks)))


def _too_small(label: str, n_tokens: int, seq_len: int, detail: str = "") -> AdaptiveError:
    return AdaptiveError(
        f"dataset {label!r} has {n_tokens} tokens, too few: one block needs {seq_len} tokens{detail}; "
        "use more text or a shorter seq_len"
    )


# ---------------------------------------------------------------------------------------------
# Datasets the loop reads


class PackedDataset:
    """One rank's view of packed blocks held in memory (map-style).

    Indexed by the rank-local sample index i >= 0, without end: i past one epoch continues into the
    next. Rank-local sample i is global sample i * world_size + rank (see the module docstring).
    `len()` is the number of samples per rank in one epoch: num_blocks // world_size, at least 1
    (eval uses it: every rank gets the same count; the remainder blocks are not evaluated, and with
    fewer eval blocks than ranks the high ranks wrap around to block 0).
    """

    def __init__(self, blocks: np.ndarray, *, rank: int, world_size: int, seed: int, shuffle: bool) -> None:
        assert blocks.ndim == 2 and len(blocks) >= 1, "a split needs at least one block"
        self.blocks = blocks
        self.rank, self.world_size, self.seed, self.shuffle = rank, world_size, seed, shuffle
        self.seq_len = blocks.shape[1]
        self._perms: dict[int, np.ndarray] = {}

    @property
    def num_blocks(self) -> int:
        """Blocks in this split over all ranks (one global epoch)."""
        return len(self.blocks)

    def __len__(self) -> int:
        return max(1, self.num_blocks // self.world_size)

    def _permutation(self, epoch: int) -> np.ndarray:
        if epoch not in self._perms:
            if len(self._perms) >= 2:  # keep the current epoch and the next, around a boundary
                self._perms.pop(next(iter(self._perms)))
            self._perms[epoch] = np.random.default_rng([self.seed, epoch]).permutation(self.num_blocks)
        return self._perms[epoch]

    def block_index(self, sample: int) -> int:
        """Which block rank-local sample `sample` is."""
        if sample < 0:
            raise IndexError(sample)
        epoch, pos = divmod(sample * self.world_size + self.rank, self.num_blocks)
        return int(self._permutation(epoch)[pos]) if self.shuffle else pos

    def __getitem__(self, sample: int) -> np.ndarray:
        return self.blocks[self.block_index(sample)]


class StreamingPackedDataset:
    """One rank's packed blocks from a streamed text dataset (already split by node).

    `stream(state)` yields (block, state after it) from a saved state on (None: the start); the state
    is small and JSON (see the module docstring). Training streams repeat, epoch e reordered by
    `datasets` (set_epoch) and each window permuted; eval streams make one pass, in order, of at most
    `max_blocks` blocks (`blocks()`). `adaptive.train.loader` runs training streams in worker
    processes.
    """

    def __init__(
        self,
        texts: datasets.IterableDataset,
        tokenizer: PreTrainedTokenizerFast,
        *,
        seq_len: int,
        label: str,
        repeat: bool,
        max_blocks: int | None = None,
        seed: int = 0,
        window: int = 1,
        shuffle: bool = False,
        workers: int = 0,
        pin_memory: bool = False,
    ) -> None:
        self.texts, self.tokenizer, self.seq_len, self.label = texts, tokenizer, seq_len, label
        self.repeat, self.max_blocks = repeat, max_blocks
        self.seed, self.window, self.shuffle = seed, window, shuffle
        self.workers, self.pin_memory = workers, pin_memory

    def documents(self, epoch: int = 0) -> Iterator[str]:
        """This rank's documents for one epoch, in the order they are packed (with no loader workers)."""
        for _, docs, _ in self._windows(epoch, None, 0, 0):
            yield from docs

    def _windows(self, epoch: int, texts_state: dict[str, Any] | None, window: int,
                 worker: int) -> Iterator[tuple[int, list[str | None], dict[str, Any]]]:
        """(window index, its documents in packing order, the `datasets` state after them) from the window
        that starts at `texts_state` (None: the epoch's start) on."""
        texts = copy.deepcopy(self.texts)  # set_epoch / load_state_dict must not leak into other streams
        texts.set_epoch(epoch)
        if texts_state is not None:
            texts.load_state_dict(texts_state)
        rows = iter(texts)
        while docs := [row["text"] for row in itertools.islice(rows, self.window)]:
            if self.shuffle:
                order = np.random.default_rng([self.seed, epoch, window, worker]).permutation(len(docs))
                docs = [docs[i] for i in order]
            yield window, docs, texts.state_dict()
            window += 1

    def stream(self, state: dict[str, Any] | None = None, worker: int = 0) -> Iterator[tuple[np.ndarray, dict[str, Any]]]:
        """(block, the state after it), from `state` on. Resuming re-reads the current window's
        documents (at most `window` of them) and tokenizes only those not yet packed."""
        s = state or {"epoch": 0, "window": 0, "texts": None, "doc": 0, "carry": [], "blocks": 0}
        epoch, window, texts_state, doc, produced = s["epoch"], s["window"], s["texts"], s["doc"], s["blocks"]
        buffer = list(s["carry"])
        while True:
            seen_tokens = 0
            for window, docs, texts_after in self._windows(epoch, texts_state, window, worker):
                for lo in range(doc, len(docs), _ENCODE_BATCH):
                    for offset, ids in enumerate(_encode_each(self.tokenizer, docs[lo:lo + _ENCODE_BATCH])):
                        seen_tokens += len(ids)
                        buffer.extend(ids)
                        while len(buffer) >= self.seq_len:
                            block, buffer = buffer[: self.seq_len], buffer[self.seq_len:]
                            produced += 1
                            yield np.asarray(block, dtype=np.int64), {
                                "epoch": epoch, "window": window, "texts": texts_state, "doc": lo + offset + 1,
                                "carry": list(buffer), "blocks": produced}
                            if self.max_blocks is not None and produced >= self.max_blocks:
                                return
                doc, texts_state = 0, texts_after
            if produced == 0 and epoch == 0:  # otherwise a repeating stream would spin forever
                raise _too_small(self.label, seen_tokens, self.seq_len, " (on this rank)")
            if not self.repeat:
                return
            epoch, window, doc, texts_state = epoch + 1, 0, 0, None

    def blocks(self) -> Iterator[np.ndarray]:
        """The blocks from the start, in order (eval streams; training goes through `adaptive.train.loader`)."""
        return (block for block, _ in self.stream())


TrainData = Union[PackedDataset, StreamingPackedDataset]


def _rank_args(rank: int, world_size: int) -> None:
    if world_size < 1 or not 0 <= rank < world_size:
        raise AdaptiveError(f"rank {rank} is not in a world of {world_size} process(es)")


def _held_out(text: str | None, every: int) -> bool:
    # A hash of the content, not the position: stable under shuffling, epochs and sharding.
    return zlib.crc32((text or "").encode("utf-8")) % every == 0


def _build_map_style(cfg: DataConfig, source: DataSource, tokenizer, rank: int, world_size: int):
    texts = load_text_dataset(cfg, streaming=False)
    tokens = tokenize_to_array(texts, tokenizer, cfg.num_proc) if texts is not None else np.zeros(0, np.int32)
    blocks = pack(tokens, cfg.seq_len)
    n_eval = eval_block_count(len(blocks), cfg)
    if len(blocks) < n_eval + world_size:
        need = n_eval + world_size
        detail = f", and training plus eval on {world_size} rank(s) need {need} blocks ({need * cfg.seq_len} tokens)"
        raise _too_small(source.label, len(tokens), cfg.seq_len, detail)
    train_blocks, eval_blocks = blocks[:-n_eval], blocks[-n_eval:]
    logger.info(
        "data %s: %d tokens -> %d train + %d eval blocks of %d (dropped a %d-token tail); rank %d of %d",
        source.label, len(tokens), len(train_blocks), n_eval, cfg.seq_len, len(tokens) % cfg.seq_len, rank, world_size,
    )
    train = PackedDataset(train_blocks, rank=rank, world_size=world_size, seed=cfg.seed, shuffle=True)
    evaluation = PackedDataset(eval_blocks, rank=rank, world_size=world_size, seed=cfg.seed, shuffle=False)
    return train, evaluation


def _build_streaming(cfg: DataConfig, source: DataSource, tokenizer, rank: int, world_size: int):
    from datasets.distributed import split_dataset_by_node

    train_texts = load_text_dataset(cfg, "train", streaming=True)
    if train_texts is None:
        raise _too_small(source.label, 0, cfg.seq_len)
    every = max(2, round(1 / cfg.eval_fraction))
    if source.is_local or cfg.eval_split is None:
        eval_texts = train_texts.filter(lambda row: _held_out(row["text"], every))
        train_texts = train_texts.filter(lambda row: not _held_out(row["text"], every))
    else:
        eval_texts = load_text_dataset(cfg, cfg.eval_split, streaming=True)
    # No `datasets` shuffle buffer: its contents are not part of its state_dict, so a resume would
    # not continue the same order. The training stream permutes windows of documents itself.
    shards = train_texts.num_shards
    train_texts = split_dataset_by_node(train_texts, rank=rank, world_size=world_size)
    eval_texts = split_dataset_by_node(eval_texts, rank=rank, world_size=world_size)
    # split_dataset_by_node hands each rank whole shards when they divide evenly, else every
    # world_size-th document of all of them; the loader deals a rank's shards to its workers.
    rank_shards = shards // world_size if shards % world_size == 0 else shards
    workers = min(cfg.workers, rank_shards)
    if workers < cfg.workers:
        logger.warning("data %s: %d loader workers asked for, %d used: each reads whole shards and this rank has %d",
                       source.label, cfg.workers, workers, rank_shards)
    per_rank_eval = max(1, cfg.max_eval_blocks // world_size)
    logger.info("data %s: streaming, rank %d of %d, %d loader worker(s), eval up to %d blocks per rank",
                source.label, rank, world_size, workers, per_rank_eval)
    train = StreamingPackedDataset(train_texts, tokenizer, seq_len=cfg.seq_len, label=source.label, repeat=True,
                                   seed=cfg.seed, window=cfg.shuffle_buffer, shuffle=True, workers=workers,
                                   pin_memory=cfg.pin_memory)
    evaluation = StreamingPackedDataset(
        eval_texts, tokenizer, seq_len=cfg.seq_len, label=f"{source.label} (eval)", repeat=False, max_blocks=per_rank_eval
    )
    return train, evaluation


def build_datasets(
    cfg: DataConfig, tokenizer: PreTrainedTokenizerFast, rank: int = 0, world_size: int = 1
) -> tuple[TrainData, TrainData]:
    """(train, eval) for one data-parallel rank. Raises AdaptiveError for unusable data.

    Map-style builds read and tokenize everything here (cached by `datasets` in cfg.cache_dir);
    call it under `accelerator.main_process_first()` so rank 0 fills the cache and the others reuse
    it. Streaming builds only resolve the dataset here; text is read while iterating.
    """
    _rank_args(rank, world_size)
    if tokenizer.eos_token_id is None:
        raise AdaptiveError("the tokenizer has no eos token; packing needs one to separate documents")
    source = resolve_source(cfg)
    streaming = cfg.streaming if cfg.streaming is not None else not source.is_local
    build = _build_streaming if streaming else _build_map_style
    return build(cfg, source, tokenizer, rank, world_size)


# ---------------------------------------------------------------------------------------------
# Batches


class SampleIterator:
    """This rank's training samples from `start` on, in micro-batches of any size.

    `position` is the rank-local index of the next sample. The micro-batch size may change between
    calls (the OOM ladder does this) without changing which samples come next. Streaming data come
    from a `StatefulDataLoader` (worker processes; `adaptive.train.loader`).

    Checkpointing: `commit()` marks the samples drawn so far as consumed (the loop calls it when a
    step completes; a retried step reuses the batch it drew once), and `state_dict()` is the JSON
    state as of the last commit: pass it back as `state` (with `start` = its position) to resume.
    """

    def __init__(self, data: TrainData, start: int = 0, state: dict[str, Any] | None = None) -> None:
        if start < 0:
            raise AdaptiveError(f"start sample must be >= 0, got {start}")
        self.data, self.position = data, start
        self._loader = self._stream = None
        loader_state = None
        if isinstance(data, StreamingPackedDataset):
            from adaptive.train.loader import stateful_loader

            loader_state = _check_loader_state(data, start, state)
            self._loader = stateful_loader(data, loader_state)
            self._stream = iter(self._loader)
        self._drawn = self._committed = self._state(loader_state)

    def _state(self, loader_state: dict[str, Any] | None) -> dict[str, Any]:
        workers = self.data.workers if self._loader is not None else None
        return {"position": self.position, "workers": workers, "loader": loader_state}

    def next_batch(self, micro_batch_size: int) -> dict[str, torch.Tensor]:
        if micro_batch_size < 1:
            raise AdaptiveError(f"micro_batch_size must be positive, got {micro_batch_size}")
        if self._stream is not None:
            blocks = [next(self._stream) for _ in range(micro_batch_size)]
        else:
            blocks = [self.data[i] for i in range(self.position, self.position + micro_batch_size)]
        self.position += micro_batch_size
        # the loader's state right after this batch was drawn (a copy: JSON round trip, so it stays JSON)
        self._drawn = self._state(json.loads(json.dumps(self._loader.state_dict())) if self._loader is not None else None)
        return _as_batch(blocks)

    def commit(self) -> None:
        """The samples drawn so far are consumed: `state_dict()` moves past them."""
        self._committed = self._drawn

    def state_dict(self) -> dict[str, Any]:
        return self._committed


def _check_loader_state(data: StreamingPackedDataset, start: int, state: dict[str, Any] | None) -> dict[str, Any] | None:
    loader_state = (state or {}).get("loader")
    if loader_state is None:
        if start:
            raise AdaptiveError(f"resuming streamed data at sample {start} needs the loader state a checkpoint saves "
                                "(data_state_<rank>.json), and there is none; resume from a checkpoint that has it")
        return None
    if state.get("position") != start or state.get("workers") != data.workers:
        raise AdaptiveError(f"the saved data state is at sample {state.get('position')} with {state.get('workers')} "
                            f"loader worker(s), this run at sample {start} with {data.workers}: resume with "
                            f"--data-workers {state.get('workers')} (the sample order depends on it)")
    return loader_state


def _as_batch(blocks: list[np.ndarray] | list[torch.Tensor]) -> dict[str, torch.Tensor]:
    import torch

    input_ids = torch.stack([torch.as_tensor(b) for b in blocks]).to(torch.int64)
    # Labels are the inputs: HF causal-LM models shift them by one inside. A separate tensor, so the
    # loop may mask labels in place without touching the inputs.
    return {"input_ids": input_ids, "labels": input_ids.clone()}


def batches(train: TrainData, micro_batch_size: int, start_sample: int = 0,
            state: dict[str, Any] | None = None) -> Iterator[dict[str, torch.Tensor]]:
    """Endless training micro-batches {"input_ids", "labels"}: LongTensor [micro_batch_size, seq_len].

    Starts at this rank's sample `start_sample`; streaming data past the start also need the
    `state` a `SampleIterator` saved there (see the resume contract in the module docstring).
    """
    samples = SampleIterator(train, start_sample, state)
    while True:
        yield samples.next_batch(micro_batch_size)


def eval_batches(evaluation: TrainData, micro_batch_size: int) -> Iterator[dict[str, torch.Tensor]]:
    """One pass over this rank's eval blocks, in order; the last batch may be smaller.

    Map-style eval gives every rank the same number of blocks, so per-batch collectives line up.
    """
    if micro_batch_size < 1:
        raise AdaptiveError(f"micro_batch_size must be positive, got {micro_batch_size}")
    if isinstance(evaluation, StreamingPackedDataset):
        stream: Iterator[np.ndarray] = evaluation.blocks()
    else:
        stream = (evaluation[i] for i in range(len(evaluation)))
    pending: list[np.ndarray] = []
    for block in stream:
        pending.append(block)
        if len(pending) == micro_batch_size:
            yield _as_batch(pending)
            pending = []
    if pending:
        yield _as_batch(pending)


def samples_before_step(step: int, micro_batch_size: int, gradient_accumulation_steps: int) -> int:
    """Rank-local samples consumed by `step` optimizer steps, when micro-batch and accumulation never changed."""
    return step * micro_batch_size * gradient_accumulation_steps


__all__ = [
    "C4",
    "DEFAULT_CORPUS",
    "DataConfig",
    "DataSource",
    "PackedDataset",
    "SampleIterator",
    "StreamingPackedDataset",
    "batches",
    "build_datasets",
    "eval_batches",
    "eval_block_count",
    "load_text_dataset",
    "pack",
    "resolve_source",
    "samples_before_step",
    "tokenize_to_array",
]
