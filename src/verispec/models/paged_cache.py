"""A paged KV cache: fixed-size blocks in one pool, addressed through per-sequence block tables.

The same interface as `KVCache` (`lengths[slot]`, `set_length`, `view`), so runners, proposers and
the speculative round do not know which one they use. Slots are sequence ids; the block tables are
owned by the scheduler's block pool and shared by reference between the target's and the draft's
caches (the draft caches a prefix of the same tokens at the same positions, so one table serves both).

A block shared through the prefix cache holds the target's entries; the draft's are there only if a
draft wrote them. Each cache therefore remembers which blocks it filled (`mark_written`), stamped
with the pool's count of the times each block was handed out afresh (`block_epochs`): a block taken
for new contents gets a new count, and the old stamp no longer matches. A sequence whose prompt
starts with blocks the draft filled (a conversation's history, a document asked about again) then
starts the draft past them (`written_prefix`) instead of prefilling them into it again.

Block 0 is the null block: never allocated, it pads short tables in a batched gather and is always
masked out because a query at position t only sees keys at positions <= t. Padding tokens of a
ragged batch that fall beyond a sequence's table write into it too; nothing real ever reads them.
(The scheduler guarantees every real position has a block before a pass runs.)
"""

from __future__ import annotations

from collections import defaultdict
from functools import cached_property

import torch

from verispec.models.kv_cache import CacheView, KVStore, StoredKV, _layout


class PagedKVCache(StoredKV):
    """K/V storage of shape (num_layers, num_blocks, num_kv_heads, block_size, head_dim), in the model's
    dtype or in kv_dtype (kv_cache.py: bfloat16, or int8 with per position and head scales)."""

    def __init__(self, config, num_blocks: int, block_size: int, block_tables: dict[int, list[int]],
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                 kv_dtype: torch.dtype | None = None, block_epochs: dict[int, int] | None = None):
        shape = (config.num_layers, num_blocks, config.num_kv_heads, block_size, config.head_dim)
        self.store = KVStore(shape, kv_dtype or dtype, device)
        self.dtype = dtype
        self.block_size = block_size
        self.block_tables = block_tables          # slot -> block ids, owned by the block pool
        self.lengths: dict[int, int] = defaultdict(int)   # slot -> committed tokens
        self.block_epochs = block_epochs          # block -> times handed out afresh, owned by the block pool
        self.written: dict[int, int] = {}         # block -> its epoch when this cache's entries filled it
        self.marked: dict[int, int] = {}          # slot -> leading blocks of its table already stamped

    @staticmethod
    def bytes_per_block(config, block_size: int, kv_dtype: torch.dtype) -> int:
        return KVStore.stored_length(block_size, kv_dtype) * KVStore.bytes_per_position(config, kv_dtype)

    def capacity(self, slot: int) -> int:
        return len(self.block_tables.get(slot, ())) * self.block_size

    def set_length(self, slot: int, length: int) -> None:
        if not 0 <= length <= self.capacity(slot):
            raise ValueError(f"length {length} outside the {self.capacity(slot)} positions allocated to slot {slot}")
        self.lengths[slot] = length

    def drop(self, slot: int) -> None:
        self.lengths.pop(slot, None)
        self.marked.pop(slot, None)

    def mark_written(self, slot: int, length: int) -> None:
        if self.block_epochs is None:
            return
        full = length // self.block_size                   # full blocks only; committed ones never change
        table = self.block_tables.get(slot, ())
        for b in table[self.marked.get(slot, 0): full]:     # each round stamps only the blocks it completed
            self.written[b] = self.block_epochs.get(b, 0)
        self.marked[slot] = max(self.marked.get(slot, 0), min(full, len(table)))

    def written_prefix(self, slot: int) -> int:
        if self.block_epochs is None:
            return 0
        n = 0
        for b in self.block_tables.get(slot, ()):
            if self.written.get(b, -1) != self.block_epochs.get(b, 0):
                break
            n += 1
        return n * self.block_size

    def view(self, slots: list[int], positions: torch.Tensor, kv_len: int | None = None) -> "PagedCacheView":
        return PagedCacheView(self, slots, positions, int(positions.max()) + 1 if kv_len is None else kv_len)


class PagedCacheView(CacheView):
    """`update` writes through the block tables and gathers each row's blocks into one contiguous
    (B, H_kv, kv_len, D) tensor, which the attention code reads exactly like the static cache."""

    def __post_init__(self) -> None:
        bs = self.cache.block_size
        num_blocks = (self.kv_len + bs - 1) // bs
        tables = [self.cache.block_tables[s][:num_blocks] for s in self.slots]
        padded = [t + [0] * (num_blocks - len(t)) for t in tables]
        self.tables = torch.tensor(padded, dtype=torch.long, device=self.positions.device)   # (B, NB)

    @cached_property
    def write_block(self) -> torch.Tensor:
        """(B, T) the block each new position goes to (the torch layers' writes)."""
        return torch.gather(self.tables, 1, self.positions // self.cache.block_size)

    @cached_property
    def write_offset(self) -> torch.Tensor:
        return self.positions % self.cache.block_size

    def layout(self):
        """A native pass reads each sequence's blocks in place through its block table."""
        return _layout(self.cache.store, self.tables, self.cache.block_size)

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        store = self.cache.store
        store.write(layer, self.write_block, self.write_offset, k, v)
        kb, vb = store.read(layer, self.tables, self.cache.dtype, self.cache.block_size)   # (B, NB, H_kv, bs, D)
        return self._join(kb), self._join(vb)

    def _join(self, blocks: torch.Tensor) -> torch.Tensor:
        """(B, NB, H_kv, bs, D) -> (B, H_kv, kv_len, D)."""
        b, nb, h, bs, d = blocks.shape
        return blocks.transpose(1, 2).reshape(b, h, nb * bs, d)[:, :, : self.kv_len]
