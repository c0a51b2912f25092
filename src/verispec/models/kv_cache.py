"""A static KV cache owned by the engine: one slot per live sequence, written at explicit positions.

Rollback is a length pointer (DESIGN rule 2): rejected entries stay in place and are overwritten by
the next round. Attention never reads them because a query at position t only sees keys at
positions <= t, and every position <= t of a slot was written by this round or committed earlier.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


class KVCache:
    """Per-layer K/V storage of shape (num_layers, num_slots, num_kv_heads, max_len, head_dim)."""

    def __init__(self, num_layers: int, num_slots: int, num_kv_heads: int, max_len: int,
                 head_dim: int, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
        shape = (num_layers, num_slots, num_kv_heads, max_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.max_len = max_len
        self.lengths = [0] * num_slots   # committed tokens per slot

    @classmethod
    def for_model(cls, config, num_slots: int, max_len: int, dtype: torch.dtype,
                  device: str | torch.device = "cpu") -> "KVCache":
        return cls(config.num_layers, num_slots, config.num_kv_heads, max_len, config.head_dim, dtype, device)

    @property
    def num_slots(self) -> int:
        return self.k.shape[1]

    def view(self, slots: list[int], positions: torch.Tensor) -> "CacheView":
        """A view for one forward pass over `positions` (B, T) of the sequences in `slots`."""
        kv_len = int(positions.max()) + 1
        if kv_len > self.max_len:
            raise ValueError(f"position {kv_len - 1} is beyond the cache length {self.max_len}")
        return CacheView(self, slots, positions, kv_len)

    def copy_prefix(self, src: int, dst: int, length: int) -> None:
        """Give slot dst the first `length` cached positions of slot src (shared prompts)."""
        self.k[:, dst, :, :length] = self.k[:, src, :, :length]
        self.v[:, dst, :, :length] = self.v[:, src, :, :length]
        self.set_length(dst, length)

    def set_length(self, slot: int, length: int) -> None:
        """Commit or roll back a slot by moving its length pointer; no data moves."""
        if not 0 <= length <= self.max_len:
            raise ValueError(f"length {length} outside [0, {self.max_len}]")
        self.lengths[slot] = length


@dataclass
class CacheView:
    """What a model's forward sees: which slots, where to write, how far to attend."""

    cache: KVCache
    slots: list[int]
    positions: torch.Tensor  # (B, T) absolute positions of the new tokens
    kv_len: int              # keys 0 .. kv_len-1 are attended (masked per query)

    def __post_init__(self) -> None:
        b = len(self.slots)
        first = self.slots[0]
        # Contiguous slots -> plain slicing (no copy when reading); otherwise index tensors.
        self._range = slice(first, first + b) if self.slots == list(range(first, first + b)) else None
        self._rows = torch.tensor(self.slots, device=self.positions.device)
        self.position_lists: list[list[int]] = self.positions.tolist()   # read once, not per layer
        # (B, 1, T, kv_len): query at position t sees keys at positions <= t.
        keys = torch.arange(self.kv_len, device=self.positions.device)
        self.mask = (keys[None, None, :] <= self.positions[:, :, None]).unsqueeze(1)

    def layout(self):
        """How a native pass reads and writes this cache in place (`kernels.CacheLayout`): each sequence's
        slot is one block as long as the cache. None where it cannot (not float32 on the CPU)."""
        return _layout(self.cache, self._rows[:, None], self.cache.max_len)

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k, v (B, H_kv, T, D) at the view's positions; return all keys/values (B, H_kv, kv_len, D)."""
        kc, vc = self.cache.k[layer], self.cache.v[layer]          # (S, H_kv, L, D)
        rows = self._rows[:, None]                                   # (B, 1)
        kc[rows, :, self.positions] = k.transpose(1, 2).to(kc.dtype)  # indexed as (B, T, H_kv, D)
        vc[rows, :, self.positions] = v.transpose(1, 2).to(vc.dtype)
        if self._range is not None:
            return kc[self._range, :, : self.kv_len], vc[self._range, :, : self.kv_len]
        return kc[self._rows, :, : self.kv_len], vc[self._rows, :, : self.kv_len]


def _layout(cache, tables: torch.Tensor, block: int):
    """A `kernels.CacheLayout` over cache.k/v (num_layers, blocks, H_kv, block, D), or None."""
    from verispec.kernels import CacheLayout

    k, v = cache.k, cache.v
    if k.dtype != torch.float32 or k.device.type != "cpu" or not (k.is_contiguous() and v.is_contiguous()):
        return None
    return CacheLayout(k, v, tables.to(torch.int64).contiguous(), block, k.stride(0), k.stride(1), k.stride(2))
