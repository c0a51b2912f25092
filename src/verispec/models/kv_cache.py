"""A static KV cache owned by the engine: one slot per live sequence, written at explicit positions.

Rollback is a length pointer (DESIGN rule 2): rejected entries stay in place and are overwritten by
the next round. Attention never reads them because a query at position t only sees keys at
positions <= t, and every position <= t of a slot was written by this round or committed earlier.

Keys and values are stored in the model's dtype, or in a KV format of their own (`kv_dtype`):
bfloat16 (rounded to nearest, ties to even; the native pass rounds the same way, kernels.h's
f32_to_bf16; each block's elements paired in 32-bit words as the attention kernels read them —
kernels/abi.py — so a block holds a whole number of 16-position key groups), or int8 with one float32 scale per group of 32 dimensions of each position and head
(max |x| / 127, the group rounded to nearest, ties to even — the native pass writes the same bits,
kernels.h's kv_quantize). Groups of 32 rather than whole head vectors: a few large channels of the
keys would otherwise set the step of all 128 (on the embedded 1.5B, KL against the float cache
0.0062 per head vector, 0.0018 per 32). A
position's stored vector depends on that position's own keys and values only, so a verify row and
a decode step still read identical caches: greedy speculative == greedy plain within a KV format.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from verispec.kernels.abi import (KV_KEY_GROUP, bf16_block_length, keys_from_pairs, paired_keys, paired_values,
                                  values_from_pairs)

KV_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "int8": torch.int8}


KV_GROUP = 32


def kv_group(head_dim: int) -> int:
    """Dimensions per int8 scale: KV_GROUP, or the whole head when it does not divide it."""
    return KV_GROUP if head_dim % KV_GROUP == 0 else head_dim


def kv_quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(..., D) float -> int8 (..., D) and scales (..., D / group) float32 with x ≈ q · scale per group."""
    *lead, d = x.shape
    g = kv_group(d)
    x = x.float().reshape(*lead, d // g, g)
    amax = x.abs().amax(dim=-1)                                                    # (..., D / g)
    inv = torch.where(amax > 0, torch.tensor(127.0, device=x.device) / amax, torch.zeros_like(amax))
    q = torch.round(x * inv[..., None]).clamp(-127, 127).to(torch.int8)
    return q.reshape(*lead, d), amax / 127.0


class KVStore:
    """k, v (num_layers, N, H_kv, S, D) in the KV dtype; for int8 also ks, vs (num_layers, N, H_kv, S,
    D / group) float32. N is slots (static) or blocks (paged), S their length — for bfloat16 rounded up
    to a whole key group, the elements of each (slot or block, head) paired (`paired`, kernels/abi.py)."""

    def __init__(self, shape: tuple[int, ...], kv_dtype: torch.dtype, device: str | torch.device):
        if kv_dtype not in KV_DTYPES.values():
            raise ValueError(f"KV cache dtype must be one of {', '.join(KV_DTYPES)}, got {kv_dtype}")
        self.paired = kv_dtype == torch.bfloat16
        if self.paired:
            if shape[-1] % 2:
                raise ValueError(f"a bfloat16 KV cache needs an even head size, got {shape[-1]}")
            shape = (*shape[:-2], bf16_block_length(shape[-2]), shape[-1])
        self.k = torch.zeros(shape, dtype=kv_dtype, device=device)
        self.v = torch.zeros(shape, dtype=kv_dtype, device=device)
        self.ks = self.vs = None
        if kv_dtype == torch.int8:
            scales = (*shape[:-1], shape[-1] // kv_group(shape[-1]))
            self.ks = torch.zeros(scales, dtype=torch.float32, device=device)
            self.vs = torch.zeros(scales, dtype=torch.float32, device=device)

    @staticmethod
    def bytes_per_position(config, kv_dtype: torch.dtype) -> int:
        """Bytes one position of one sequence takes, keys and values of every layer."""
        d = config.head_dim
        per_head = d * kv_dtype.itemsize + (4 * d // kv_group(d) if kv_dtype == torch.int8 else 0)
        return 2 * config.num_layers * config.num_kv_heads * per_head

    @staticmethod
    def stored_length(positions: int, kv_dtype: torch.dtype) -> int:
        """Positions a slot or block of `positions` takes in storage (bf16: whole key groups)."""
        return bf16_block_length(positions) if kv_dtype == torch.bfloat16 else positions

    def write(self, layer: int, i: torch.Tensor, j: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v (B, H_kv, T, D) into positions [i, :, j] of the layer (i, j broadcast to (B, T))."""
        if self.paired:
            paired_keys(self.k[layer])[i, :, j // KV_KEY_GROUP, :, j % KV_KEY_GROUP] = k.transpose(1, 2).unflatten(-1, (-1, 2)).to(self.k.dtype)
            paired_values(self.v[layer])[i, :, j // 2, :, j % 2] = v.transpose(1, 2).to(self.v.dtype)
            return
        for store, scales, x in ((self.k, self.ks, k), (self.v, self.vs, v)):
            x = x.transpose(1, 2)                                                  # (B, T, H_kv, D)
            if scales is None:
                store[layer][i, :, j] = x.to(store.dtype)
            else:
                q, sc = kv_quantize(x)
                store[layer][i, :, j] = q
                scales[layer][i, :, j] = sc

    def copy(self, src: tuple[torch.Tensor, torch.Tensor], dst: tuple[torch.Tensor, torch.Tensor]) -> None:
        """Copy positions [src_n[i], :, src_s[i]] to [dst_n[i], :, dst_s[i]] in every layer (stored bits,
        scales included): src, dst = (N indices, S indices), 1-D and of one length."""
        if self.paired:
            (sn, ss), (dn, ds) = src, dst
            keys, values = paired_keys(self.k), paired_values(self.v)
            keys[:, dn, :, ds // KV_KEY_GROUP, :, ds % KV_KEY_GROUP] = keys[:, sn, :, ss // KV_KEY_GROUP, :,
                                                                             ss % KV_KEY_GROUP]
            values[:, dn, :, ds // 2, :, ds % 2] = values[:, sn, :, ss // 2, :, ss % 2]
            return
        for t in (self.k, self.v, self.ks, self.vs):
            if t is not None:
                t[:, dst[0], :, dst[1]] = t[:, src[0], :, src[1]]

    def read(self, layer: int, index, dtype: torch.dtype, length: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's k, v (..., H_kv, S, D) at store[layer][index] (an index of the N dimension), position
        by position, the first `length` positions when given, in dtype."""
        out = []
        for store, scales, unpair in ((self.k, self.ks, keys_from_pairs), (self.v, self.vs, values_from_pairs)):
            x = store[layer][index]
            if self.paired:                   # the key groups that hold the first `length` positions only
                x = unpair(x if length is None else x[..., : bf16_block_length(length), :])
            if scales is not None:                                                 # (..., D) · per-group scales
                sc = scales[layer][index]
                x = (x.float().unflatten(-1, (sc.shape[-1], -1)) * sc[..., None]).flatten(-2)
            out.append((x if length is None else x[..., :length, :]).to(dtype))
        return out[0], out[1]

    def logical(self) -> tuple[torch.Tensor, torch.Tensor]:
        """All of k, v (num_layers, N, H_kv, S, D) position by position (for bf16 a copy)."""
        if not self.paired:
            return self.k, self.v
        return keys_from_pairs(self.k), values_from_pairs(self.v)


class StoredKV:
    """A cache's keys and values as tensors (`cache.k`, `cache.v`), whatever holds them."""

    store: KVStore

    @property
    def k(self) -> torch.Tensor:
        """(num_layers, N, H_kv, S, D) position by position (a copy for a bf16 store)."""
        return self.store.logical()[0]

    @property
    def v(self) -> torch.Tensor:
        return self.store.logical()[1]

    def mark_written(self, slot: int, length: int) -> None:
        """This model's entries for the slot's first `length` positions hold its committed tokens
        (what a later sequence sharing those positions may reuse; paged caches only)."""

    def written_prefix(self, slot: int) -> int:
        """Leading positions of the slot whose entries this model already holds from an earlier
        sequence with the same tokens there (paged caches: shared prefix blocks); 0 here."""
        return 0


class KVCache(StoredKV):
    """Per-layer K/V storage of shape (num_layers, num_slots, num_kv_heads, max_len, head_dim)."""

    def __init__(self, num_layers: int, num_slots: int, num_kv_heads: int, max_len: int,
                 head_dim: int, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                 kv_dtype: torch.dtype | None = None):
        self.store = KVStore((num_layers, num_slots, num_kv_heads, max_len, head_dim), kv_dtype or dtype, device)
        self.dtype = dtype                  # what attention reads (the model's dtype)
        self.max_len = max_len
        self.lengths = [0] * num_slots   # committed tokens per slot
        self._layouts: dict[tuple[int, ...], object] = {}    # a native pass's layout per slot list (fixed)

    @classmethod
    def for_model(cls, config, num_slots: int, max_len: int, dtype: torch.dtype,
                  device: str | torch.device = "cpu", kv_dtype: torch.dtype | None = None) -> "KVCache":
        return cls(config.num_layers, num_slots, config.num_kv_heads, max_len, config.head_dim, dtype, device,
                   kv_dtype)

    @property
    def num_slots(self) -> int:
        return self.store.k.shape[1]

    def view(self, slots: list[int], positions: torch.Tensor, kv_len: int | None = None) -> "CacheView":
        """A view for one forward pass over `positions` (B, T) of the sequences in `slots`; kv_len: the
        largest position plus one, when the caller knows it (else read from positions)."""
        kv_len = int(positions.max()) + 1 if kv_len is None else kv_len
        if kv_len > self.max_len:
            raise ValueError(f"position {kv_len - 1} is beyond the cache length {self.max_len}")
        return CacheView(self, slots, positions, kv_len)

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
        """What a view derives from its fields (a paged view: its block tables); nothing here."""

    # Only the torch layers read these; a native pass never builds them (each small torch op costs
    # tens of microseconds right after a pass has streamed the weights through the caches).
    @cached_property
    def _range(self) -> slice | None:
        """Contiguous slots -> plain slicing (no copy when reading); otherwise None (index tensors)."""
        b, first = len(self.slots), self.slots[0]
        return slice(first, first + b) if self.slots == list(range(first, first + b)) else None

    @cached_property
    def _rows(self) -> torch.Tensor:
        return torch.tensor(self.slots, device=self.positions.device)

    @cached_property
    def position_lists(self) -> list[list[int]]:
        return self.positions.tolist()                                     # read once, not per layer

    @cached_property
    def mask(self) -> torch.Tensor:
        """(B, 1, T, kv_len): query at position t sees keys at positions <= t."""
        keys = torch.arange(self.kv_len, device=self.positions.device)
        return (keys[None, None, :] <= self.positions[:, :, None]).unsqueeze(1)

    def layout(self):
        """How a native pass reads and writes this cache in place (`kernels.CacheLayout`): each sequence's
        slot is one block as long as the cache. None where it cannot (not float32, bfloat16 or int8 on the CPU).
        Built once per list of slots (the store never moves)."""
        key = tuple(self.slots)
        layouts = self.cache._layouts
        if key not in layouts:
            if len(layouts) >= 64:                      # batch compositions: a bounded few
                layouts.clear()
            layouts[key] = _layout(self.cache.store, self._rows[:, None], self.cache.max_len)
        return layouts[key]

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k, v (B, H_kv, T, D) at the view's positions; return all keys/values (B, H_kv, kv_len, D)."""
        store = self.cache.store
        store.write(layer, self._rows[:, None], self.positions, k, v)
        rows = self._range if self._range is not None else self._rows
        return store.read(layer, rows, self.cache.dtype, self.kv_len)


def in_place(store: KVStore) -> bool:
    """Whether a native pass can read and write this store in place (float32, bfloat16 or int8 on the CPU)."""
    k, v = store.k, store.v
    return (k.dtype in (torch.float32, torch.bfloat16, torch.int8) and k.device.type == "cpu" and k.is_contiguous()
            and v.is_contiguous())


def _layout(store: KVStore, tables: torch.Tensor, block: int):
    """A `kernels.CacheLayout` over a store (num_layers, blocks, H_kv, block, D), or None."""
    from verispec.kernels import CacheLayout

    k, v = store.k, store.v
    if not in_place(store):
        return None
    scales = {}
    if store.ks is not None:
        ks = store.ks
        scales = dict(ks=ks, vs=store.vs, sc_layer_stride=ks.stride(0), sc_block_stride=ks.stride(1),
                      sc_head_stride=ks.stride(2), group=k.shape[-1] // ks.shape[-1])
    return CacheLayout(k, v, tables.to(torch.int64).contiguous(), block, k.stride(0), k.stride(1), k.stride(2),
                       **scales)
