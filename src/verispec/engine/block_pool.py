"""The block pool: which KV blocks are free, who holds which, and which hold a known prefix.

Counting only — no tensors. Block 0 is the null block and is never handed out.

Prefix caching: a *full* block is identified by a hash chain, h_i = sha256(h_{i-1} ‖ tokens of block i),
so equal hashes mean equal tokens at equal positions (a collision-resistant hash: a false match
would silently change outputs). Full committed blocks are registered under
their hash; a new sequence whose prompt starts with registered blocks shares them (reference
counts) instead of prefilling them again. A block whose last holder leaves keeps its contents and
its hash and waits in an LRU list: it is revived by a later hit or evicted when space runs out.
`epochs` counts the times each block was handed out for new contents, so a cache that stamped a
block when it filled it can tell later whether its entries are still there (paged_cache.py).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict


def block_hashes(tokens: list[int], block_size: int) -> list[bytes]:
    """Hash chain of the full blocks of `tokens` (a trailing partial block has none)."""
    hashes, parent = [], b""
    for i in range(len(tokens) // block_size):
        parent = hashlib.sha256(parent + array("q", tokens[i * block_size:(i + 1) * block_size]).tobytes()).digest()
        hashes.append(parent)
    return hashes


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 2:
            raise ValueError(f"a block pool needs at least 2 blocks (one is the null block), got {num_blocks}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.free: list[int] = list(range(num_blocks - 1, 0, -1))    # unhashed, unheld; pop() from the end
        self.cached: OrderedDict[int, None] = OrderedDict()           # hashed, unheld, LRU first
        self.refs: dict[int, int] = {}                                # block -> holders
        self.by_hash: dict[bytes, int] = {}
        self.hash_of: dict[int, bytes] = {}
        self.tables: dict[int, list[int]] = {}                        # slot -> block ids (shared with caches)
        self.registered: dict[int, int] = {}                          # slot -> leading blocks already hashed
        self.epochs: dict[int, int] = {}                              # block -> times handed out afresh
        self.hits = 0                                                 # prompt blocks served from the prefix cache
        self.queries = 0

    # -- capacity -------------------------------------------------------------------------
    @property
    def usable(self) -> int:
        return self.num_blocks - 1

    def available(self) -> int:
        return len(self.free) + len(self.cached)

    def usage(self) -> float:
        """Fraction of usable blocks held by live sequences."""
        return 1.0 - self.available() / self.usable

    def blocks_for(self, positions: int) -> int:
        return (positions + self.block_size - 1) // self.block_size

    # -- prefix cache ---------------------------------------------------------------------
    def lookup_prefix(self, tokens: list[int]) -> list[int]:
        """Registered blocks that start `tokens`, longest chain first-to-last (not yet held)."""
        found = []
        for h in block_hashes(tokens, self.block_size):
            block = self.by_hash.get(h)
            if block is None:
                break
            found.append(block)
        return found

    def admit(self, slot: int, cacheable: list[int], positions: int) -> int | None:
        """Give `slot` a table covering `positions`, sharing the registered prefix of `cacheable`.
        Returns how many leading tokens are already cached, or None (nothing changed) if the
        pool cannot hold it now."""
        shared = self.lookup_prefix(cacheable)
        needed = self.blocks_for(positions) - len(shared)
        revived = sum(1 for b in shared if b in self.cached)
        if needed > self.available() - revived:
            return None
        self.queries += len(cacheable) // self.block_size
        self.hits += len(shared)
        for b in shared:
            self._hold(b)
        self.tables[slot] = list(shared)
        self.registered[slot] = len(shared)
        self.grow(slot, positions)
        return len(shared) * self.block_size

    def register(self, slot: int, tokens: list[int], committed: int) -> None:
        """Hash the slot's full blocks that lie inside its committed cache (`committed` positions
        of `tokens`), so later prompts can share them."""
        table = self.tables[slot]
        full = min(committed // self.block_size, len(table))
        start = self.registered.get(slot, 0)
        if full <= start:
            return
        hashes = block_hashes(tokens[: full * self.block_size], self.block_size)
        for i in range(start, full):
            h, b = hashes[i], table[i]
            if h not in self.by_hash and b not in self.hash_of:
                self.by_hash[h], self.hash_of[b] = b, h
        self.registered[slot] = full

    # -- holding and releasing ------------------------------------------------------------
    def grow(self, slot: int, positions: int) -> bool:
        """Extend the slot's table to cover `positions`; False (and nothing taken) if it cannot."""
        table = self.tables[slot]
        more = self.blocks_for(positions) - len(table)
        if more <= 0:
            return True
        if more > self.available():
            return False
        for _ in range(more):
            table.append(self._take())
        return True

    def release(self, slot: int) -> None:
        """The slot leaves: its blocks lose a holder; hashed ones stay findable until evicted."""
        for b in self.tables.pop(slot, []):
            self.refs[b] -= 1
            if self.refs[b] == 0:
                del self.refs[b]
                if b in self.hash_of:
                    self.cached[b] = None
                else:
                    self.free.append(b)
        self.registered.pop(slot, None)

    def take_free(self, n: int) -> list[int] | None:
        """n blocks for a temporary holder (a fork of one round), only from the never-hashed free list,
        so no cached prefix is evicted for it; None (nothing taken) when there are fewer."""
        if n > len(self.free):
            return None
        blocks = [self.free.pop() for _ in range(n)]
        for b in blocks:
            self.refs[b] = 1
            self.epochs[b] = self.epochs.get(b, 0) + 1
        return blocks

    def give_back(self, blocks: list[int]) -> None:
        """Return blocks from take_free."""
        for b in blocks:
            del self.refs[b]
            self.free.append(b)

    def evict_cached(self) -> None:
        """Forget every registered block no sequence holds (they become plain free blocks)."""
        while self.cached:
            b, _ = self.cached.popitem(last=False)
            del self.by_hash[self.hash_of.pop(b)]
            self.free.append(b)

    def _take(self) -> int:
        if self.free:
            b = self.free.pop()
        else:
            b, _ = self.cached.popitem(last=False)                    # evict the least recently used
            del self.by_hash[self.hash_of.pop(b)]
        self.refs[b] = 1
        self.epochs[b] = self.epochs.get(b, 0) + 1
        return b

    def _hold(self, b: int) -> None:
        if b in self.cached:
            del self.cached[b]
        self.refs[b] = self.refs.get(b, 0) + 1
