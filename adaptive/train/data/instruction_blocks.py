"""Instruction examples as fixed-shape blocks of seq_len, in a map-style dataset with the text blocks' order.

Every example (`instructions`: token ids and which of them are trained) is rendered once (cached by `datasets`),
then cut to seq_len: the truncated ones are counted and said in one line, and an example left with no trained
token is dropped and counted. The last examples are held out for eval, as the last blocks are for text. The
blocks keep the one shape [seq_len] the loop and its OOM ladder rely on:

* **One example per block** (the default): right-padded with the pad token, labels -100 on the pad. No attention
  mask is needed: in a causal model a real token attends only to the tokens before it, never to the pads after it,
  and the pads' own outputs carry no loss.
* **Packed** (`DataConfig.packing`): examples whole, several per block, placed best-fit decreasing (longest first,
  each into the fullest block it fits); the rest of a block is padding. Each block carries `position_ids` that
  restart at 0 with every example (and the padding), and transformers' masking (masking_utils.
  find_packed_sequence_indices: a position that does not follow the one before starts a new sequence) keeps
  attention inside each example, for sdpa and eager. It does so only without a KV cache: the model must run
  with `use_cache=False` (config.use_cache False), in eval too.

`InstructionDataset[i]` is a dict of arrays {"input_ids", "labels"(, "position_ids")}; its order (per-epoch
permutations seeded by (seed, epoch), ranks interleaved, any sample in O(1)) is `order.BlockOrder`'s.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from adaptive.errors import AdaptiveError
from adaptive.train.data.instructions import renderer
from adaptive.train.data.order import BlockOrder, eval_block_count
from adaptive.train.data.sources import DataConfig, DataSource, load_instruction_rows

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Examples:
    """Examples one after another: example k is tokens [starts[k], starts[k + 1])."""

    ids: np.ndarray  # token ids (uint16 when the vocab fits, else int32)
    trained: np.ndarray  # bool, per token: its label is the token itself (else -100)
    starts: np.ndarray  # int64 [n + 1]

    def __len__(self) -> int:
        return len(self.starts) - 1

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.starts)

    def trained_counts(self) -> np.ndarray:
        """Trained tokens per example."""
        cum = np.concatenate([[0], np.cumsum(self.trained, dtype=np.int64)])
        return cum[self.starts[1:]] - cum[self.starts[:-1]]

    def take(self, order: np.ndarray, max_len: int | None = None) -> Examples:
        """The examples `order` names, in that order, each cut to its first `max_len` tokens."""
        order = np.asarray(order, dtype=np.int64)
        lengths = self.lengths[order]
        if max_len is not None:
            lengths = np.minimum(lengths, max_len)
        starts = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        # token t of the result is token (t - starts[k]) of example order[k]
        source = np.repeat(self.starts[order] - starts[:-1], lengths) + np.arange(starts[-1])
        return Examples(self.ids[source], self.trained[source], starts)


def render_examples(cfg: DataConfig, source: DataSource, tokenizer: PreTrainedTokenizerFast) -> tuple[Examples, str]:
    """Every row of the source rendered (`instructions.renderer`), in file order, and the rows' format."""
    import datasets
    import pyarrow.compute as pc

    rows, fmt = load_instruction_rows(cfg, source)
    if rows is None:
        raise AdaptiveError(f"dataset {source.label!r} has no rows; one example is needed for training and one for eval")
    features = datasets.Features({"input_ids": datasets.List(datasets.Value("int32")),
                                  "trained": datasets.List(datasets.Value("bool"))})
    rendered = rows.map(renderer(tokenizer, fmt, source.label), batched=True, with_indices=True,
                        remove_columns=rows.column_names, features=features, num_proc=cfg.num_proc,
                        desc="Rendering examples")
    ids_column = rendered.data.column("input_ids")
    starts = np.concatenate([[0], np.cumsum(pc.list_value_length(ids_column).to_numpy())]).astype(np.int64)
    ids = pc.list_flatten(ids_column).to_numpy().astype(np.uint16 if len(tokenizer) <= 1 << 16 else np.int32)
    trained = pc.list_flatten(rendered.data.column("trained")).to_numpy(zero_copy_only=False).astype(bool)
    return Examples(ids, trained, starts), fmt


def fit_to_length(examples: Examples, seq_len: int) -> Examples:
    """The examples cut to seq_len, without those left with no trained token; each count said in one line."""
    n = len(examples)
    truncated = int((examples.lengths > seq_len).sum())
    if truncated:
        logger.info("%s of %s examples were longer than %d tokens and were truncated", f"{truncated:,}", f"{n:,}",
                    seq_len)
    cut = examples.take(np.arange(n), max_len=seq_len)
    keep = np.flatnonzero(cut.trained_counts() > 0)
    if len(keep) < n:
        logger.info("%s of %s examples had no trained token within %d tokens (no answer, or one that starts past "
                    "the end) and were dropped", f"{n - len(keep):,}", f"{n:,}", seq_len)
    return cut.take(keep)


def pack_best_fit(lengths: np.ndarray, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """Examples (each at most seq_len tokens) into as few blocks as best-fit decreasing finds:
    (example order with each block's examples together, block b's examples at [bounds[b], bounds[b + 1]))."""
    import bisect

    assert len(lengths) == 0 or lengths.max() <= seq_len
    bins: list[list[int]] = []
    spaces: list[int] = []  # the distinct free spaces of open blocks, sorted
    by_space: dict[int, list[int]] = {}  # free space -> blocks with that much
    for k in np.argsort(-lengths, kind="stable"):
        need = int(lengths[k])
        at = bisect.bisect_left(spaces, need)
        if at < len(spaces):
            space = spaces[at]
            block = by_space[space].pop()
            if not by_space[space]:
                del by_space[space], spaces[at]
        else:
            space, block = seq_len, len(bins)
            bins.append([])
        bins[block].append(int(k))
        left = space - need
        if left:
            if left not in by_space:
                by_space[left] = []
                bisect.insort(spaces, left)
            by_space[left].append(block)
    order = np.array([k for b in bins for k in b], dtype=np.int64)
    bounds = np.concatenate([[0], np.cumsum([len(b) for b in bins])]).astype(np.int64)
    return order, bounds


class InstructionDataset(BlockOrder):
    """One rank's view of instruction blocks (map-style): block b holds examples [bounds[b], bounds[b + 1]),
    padded to seq_len; a dict of arrays per sample (see the module docstring)."""

    def __init__(self, examples: Examples, bounds: np.ndarray, *, seq_len: int, pad_id: int, packed: bool,
                 rank: int, world_size: int, seed: int, shuffle: bool) -> None:
        assert len(bounds) >= 2, "a split needs at least one block"
        super().__init__(rank=rank, world_size=world_size, seed=seed, shuffle=shuffle)
        self.examples, self.bounds = examples, bounds
        self.seq_len, self.pad_id, self.packed = seq_len, pad_id, packed

    @property
    def num_blocks(self) -> int:
        return len(self.bounds) - 1

    def __getitem__(self, sample: int) -> dict[str, np.ndarray]:
        b = self.block_index(sample)
        first, last = self.bounds[b], self.bounds[b + 1]
        starts = self.examples.starts[first:last + 1]
        lo, hi = starts[0], starts[-1]
        used = hi - lo
        input_ids = np.full(self.seq_len, self.pad_id, dtype=np.int64)
        input_ids[:used] = self.examples.ids[lo:hi]
        labels = np.full(self.seq_len, -100, dtype=np.int64)
        labels[:used] = np.where(self.examples.trained[lo:hi], input_ids[:used], -100)
        block = {"input_ids": input_ids, "labels": labels}
        if self.packed:
            # each example's positions from 0, then the padding's from 0: no sequence sees another
            lengths = np.append(np.diff(starts), self.seq_len - used)
            block["position_ids"] = np.arange(self.seq_len) - np.repeat(np.cumsum(lengths) - lengths, lengths)
        return block


def _blocks(examples: Examples, cfg: DataConfig) -> tuple[Examples, np.ndarray]:
    """The examples in block order and each block's bounds: one per block, or packed."""
    if not cfg.packing:
        return examples, np.arange(len(examples) + 1, dtype=np.int64)
    order, bounds = pack_best_fit(examples.lengths, cfg.seq_len)
    return examples.take(order), bounds


def build_instruction_datasets(cfg: DataConfig, source: DataSource, tokenizer: PreTrainedTokenizerFast,
                               rank: int, world_size: int) -> tuple[InstructionDataset, InstructionDataset]:
    """(train, eval) instruction blocks for one data-parallel rank; `packing.build_datasets` calls it."""
    if cfg.streaming:
        logger.warning("streaming ignored: instruction data in %s are rendered once up front (map-style)", source.label)
    examples, fmt = render_examples(cfg, source, tokenizer)
    n_rows = len(examples)
    examples = fit_to_length(examples, cfg.seq_len)
    n_eval = eval_block_count(len(examples), cfg)
    if len(examples) < n_eval + world_size:
        raise AdaptiveError(
            f"dataset {source.label!r} has {len(examples)} usable {fmt} examples of {n_rows}, too few: training and "
            f"eval on {world_size} rank(s) need {n_eval + world_size}; use more examples or a longer seq_len")
    splits = [_blocks(examples.take(np.arange(a, b)), cfg)
              for a, b in ((0, len(examples) - n_eval), (len(examples) - n_eval, len(examples)))]
    (train_examples, train_bounds), (eval_examples, eval_bounds) = splits
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    common = {"seq_len": cfg.seq_len, "pad_id": pad, "packed": cfg.packing, "rank": rank, "world_size": world_size,
              "seed": cfg.seed}
    train = InstructionDataset(train_examples, train_bounds, shuffle=True, **common)
    evaluation = InstructionDataset(eval_examples, eval_bounds, shuffle=False, **common)
    logger.info(
        "data %s: %d %s examples -> %d train + %d eval blocks of %d (%s; %d of %d tokens trained); rank %d of %d",
        source.label, n_rows, fmt, train.num_blocks, evaluation.num_blocks, cfg.seq_len,
        "packed" if cfg.packing else "one example each", int(examples.trained.sum()), len(examples.ids),
        rank, world_size)
    if train.num_blocks < world_size:
        raise AdaptiveError(f"dataset {source.label!r} packs into {train.num_blocks} training block(s), fewer than "
                            f"the {world_size} rank(s); use more examples, or no --packing")
    return train, evaluation


__all__ = ["Examples", "InstructionDataset", "build_instruction_datasets", "fit_to_length", "pack_best_fit",
           "render_examples"]
