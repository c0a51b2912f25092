"""Forks: short-lived copies of a sequence's target cache, one per alternative branch of a round.

A round that verifies several candidate continuations (sampling/branches.py) scores each
alternative as a sequence of its own in the same batched pass. Its fork shares the sequence's full
blocks (read only: a fork writes at positions ≥ the sequence's length) and gets private blocks for
the rest: a copy of the partly filled last block, then room for the pending token and the branch.
Every row of a fork therefore sees exactly the keys and values the sequence itself would (same bits
at the same positions), so its scores are the ones a chain over that branch would get.

After acceptance the winning branch's new positions are copied into the sequence's own blocks
(`adopt`) and every fork is closed: its private blocks go back to the free list. Forks only take
never-hashed free blocks, so they never evict a cached prefix; with none free, a round verifies
its primary chain alone.
"""

from __future__ import annotations

import itertools

import torch

from verispec.engine.block_pool import BlockPool
from verispec.models.paged_cache import PagedKVCache


class Forks:
    def __init__(self, pool: BlockPool, cache: PagedKVCache):
        self.pool, self.cache = pool, cache
        self._ids = itertools.count(-1, -1)           # fork slots are negative: never a sequence's
        self._private: dict[int, list[int]] = {}       # fork slot -> its own blocks

    def open(self, slot: int, length: int, positions: int) -> int | None:
        """A fork of `slot`'s first `length` cached positions, with blocks up to `positions`; None
        when the pool has too few free blocks."""
        bs = self.pool.block_size
        full = length // bs
        private = self.pool.take_free(self.pool.blocks_for(positions) - full)
        if private is None:
            return None
        fork = next(self._ids)
        table = self.pool.tables[slot]
        self.pool.tables[fork] = table[:full] + private
        if length % bs:                                # the partly filled block: its filled positions
            offsets = torch.arange(full * bs, length) % bs
            self.cache.store.copy((torch.full_like(offsets, table[full]), offsets),
                                  (torch.full_like(offsets, private[0]), offsets))
        self.cache.set_length(fork, length)
        self._private[fork] = private
        return fork

    def adopt(self, fork: int, slot: int, start: int, count: int) -> None:
        """Copy the fork's positions start … start+count-1 into the sequence's blocks."""
        if count <= 0:
            return
        bs = self.pool.block_size
        positions = torch.arange(start, start + count)
        src = torch.tensor(self.pool.tables[fork])[positions // bs]
        dst = torch.tensor(self.pool.tables[slot])[positions // bs]
        self.cache.store.copy((src, positions % bs), (dst, positions % bs))

    def close(self) -> None:
        """Every fork ends: private blocks back to the pool, tables and lengths forgotten."""
        for fork, private in self._private.items():
            self.pool.give_back(private)
            self.pool.tables.pop(fork, None)
            self.cache.drop(fork)
        self._private.clear()
