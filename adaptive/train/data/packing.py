"""Training blocks: tokenize, pack into fixed-length blocks, shard across ranks, hold out eval.

Two paths share one contract:

* **Map-style** (local files and the shipped corpus; the default for them). The whole corpus is
  tokenized once (cached by `datasets`), documents are joined with EOS into one token stream, and
  the stream is cut into blocks of `seq_len` (only the last partial block is dropped). The last
  blocks are held out for eval. Any sample is reachable in O(1), so resuming is free.
* **Streaming** (hub datasets, C4 by default; local files with `streaming=True`). Documents are
  split across ranks with `datasets.distributed.split_dataset_by_node`, read in windows of
  `shuffle_buffer` documents, each window permuted by a generator seeded by (seed, epoch, window,
  worker), then tokenized and packed on the fly, in `workers` processes per rank (torchdata's
  `StatefulDataLoader`, `adaptive.train.data.loader`; the shards of a rank are dealt to its workers).
  The stream's position is a small state: where the current window starts (`datasets`'
  `IterableDataset.state_dict()`), the next document in it, and the tokens not yet in a block.
  Resuming loads it, re-reads one window (no tokenizing) and continues: the cost does not grow with
  the position (`datasets` itself skips to a position inside a shard by whole Arrow tables, reading
  at most that shard up to the position; nothing skipped is tokenized).
* **Instruction data** (local rows of chats or prompt/completion pairs, `instructions`): rendered once,
  one example per block or packed, map-style, in the same order (`instruction_blocks`).

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

The resume contract is `adaptive.train.data.batches.batches.batches`'.
"""

from __future__ import annotations

import copy
import itertools
import logging
import zlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Union

import numpy as np

from adaptive.errors import AdaptiveError
from adaptive.train.data.instruction_blocks import build_instruction_datasets
from adaptive.train.data.instructions import TEXT
from adaptive.train.data.order import BlockOrder, eval_block_count
from adaptive.train.data.sources import DataConfig, DataSource, load_text_dataset, resolve_source, source_format

if TYPE_CHECKING:
    import datasets
    from transformers import PreTrainedTokenizerFast

logger = logging.getLogger(__name__)

_ENCODE_BATCH = 256  # documents per tokenizer call on the streaming path

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


def _too_small(label: str, n_tokens: int, seq_len: int, detail: str = "") -> AdaptiveError:
    return AdaptiveError(
        f"dataset {label!r} has {n_tokens} tokens, too few: one block needs {seq_len} tokens{detail}; "
        "use more text or a shorter seq_len"
    )


# ---------------------------------------------------------------------------------------------
# Datasets the loop reads


class PackedDataset(BlockOrder):
    """One rank's view of packed text blocks held in memory (map-style), in `BlockOrder`."""

    def __init__(self, blocks: np.ndarray, *, rank: int, world_size: int, seed: int, shuffle: bool) -> None:
        assert blocks.ndim == 2 and len(blocks) >= 1, "a split needs at least one block"
        super().__init__(rank=rank, world_size=world_size, seed=seed, shuffle=shuffle)
        self.blocks = blocks
        self.seq_len = blocks.shape[1]

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    def __getitem__(self, sample: int) -> np.ndarray:
        return self.blocks[self.block_index(sample)]


class StreamingPackedDataset:
    """One rank's packed blocks from a streamed text dataset (already split by node).

    `stream(state)` yields (block, state after it) from a saved state on (None: the start); the state
    is small and JSON (see the module docstring). Training streams repeat, epoch e reordered by
    `datasets` (set_epoch) and each window permuted; eval streams make one pass, in order, of at most
    `max_blocks` blocks (`blocks()`). `adaptive.train.data.loader` runs training streams in worker
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
        """The blocks from the start, in order (eval streams; training goes through `adaptive.train.data.loader`)."""
        return (block for block, _ in self.stream())


TrainData = Union[BlockOrder, StreamingPackedDataset]  # PackedDataset, or instruction_blocks.InstructionDataset


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
    it. Streaming builds only resolve the dataset here; text is read while iterating. Local rows of
    chats or prompt/completion pairs are instruction data (`instruction_blocks`; always map-style).
    """
    _rank_args(rank, world_size)
    if tokenizer.eos_token_id is None:
        raise AdaptiveError("the tokenizer has no eos token; packing needs one to separate documents")
    source = resolve_source(cfg)
    if source_format(cfg, source) != TEXT:
        return build_instruction_datasets(cfg, source, tokenizer, rank, world_size)
    if cfg.packing:
        logger.warning("packing ignored: %s is text, which is always packed into blocks", source.label)
    streaming = cfg.streaming if cfg.streaming is not None else not source.is_local
    build = _build_streaming if streaming else _build_map_style
    return build(cfg, source, tokenizer, rank, world_size)


__all__ = ["BlockOrder", "PackedDataset", "StreamingPackedDataset", "TrainData", "build_datasets", "eval_block_count",
           "pack", "tokenize_to_array"]
