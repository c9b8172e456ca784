"""Which block each rank-local sample of a map-style split is, and how many blocks eval holds out.

The order is the one `packing`'s module docstring gives for map-style data: rank-local sample i is global
sample g = i * world_size + rank, and global sample g is block perm_e[g mod n] of epoch e = g // n, perm_e a
permutation seeded by (seed, e). Text blocks (`packing.PackedDataset`) and instruction blocks
(`instruction_blocks.InstructionDataset`) share it.
"""

from __future__ import annotations

import numpy as np

from adaptive.train.data.sources import DataConfig


def eval_block_count(n_blocks: int, cfg: DataConfig) -> int:
    """Blocks held out for eval: ~eval_fraction of them, at least one, at most max_eval_blocks.

    Independent of the world size, so the training split (and its order) is the same on any
    number of ranks.
    """
    return max(1, min(cfg.max_eval_blocks, round(cfg.eval_fraction * n_blocks)))


class BlockOrder:
    """Which block each rank-local sample of a map-style split is (the order of the module docstring).

    Indexed by the rank-local sample index i >= 0, without end: i past one epoch continues into the
    next.
    `len()` is the number of samples per rank in one epoch: num_blocks // world_size, at least 1
    (eval uses it: every rank gets the same count; the remainder blocks are not evaluated, and with
    fewer eval blocks than ranks the high ranks wrap around to block 0). Subclasses hold the blocks
    (`num_blocks` of them) and index them with `block_index`.
    """

    def __init__(self, *, rank: int, world_size: int, seed: int, shuffle: bool) -> None:
        self.rank, self.world_size, self.seed, self.shuffle = rank, world_size, seed, shuffle
        self._perms: dict[int, np.ndarray] = {}

    @property
    def num_blocks(self) -> int:
        """Blocks in this split over all ranks (one global epoch)."""
        raise NotImplementedError

    @property
    def samples_per_epoch(self) -> int:
        """Samples (blocks) one epoch has over all ranks: an epoch is this / (micro-batch x accumulation x
        data-parallel ranks) optimizer steps. Sample g of the run is in epoch g // samples_per_epoch."""
        return self.num_blocks

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


__all__ = ["BlockOrder", "eval_block_count"]
