"""The packed weight layouts the native matmuls read (gemm.c: int8; gemm4.c: int4; gemm6.c: int6),
written from and read back to plain (N, K) tensors."""

from __future__ import annotations

import torch

BLOCK = 16                 # output columns per packed int8 block
DEQUANT_ROWS = 4096        # rows unpacked at a time: a whole LM head's int64 intermediates would take ~6 GB


def pack_int8(weight: torch.Tensor) -> torch.Tensor:
    """int8 (N, K) -> the kernel's layout (ceil(N/16), ceil(K/2), 32): for each pair of k, a block's
    32 bytes hold columns 0-7 then 8-15, each column's two weights adjacent; zero past N and K."""
    n, k = weight.shape
    blocks, pairs = -(-n // BLOCK), -(-k // 2)
    padded = torch.zeros(blocks * BLOCK, 2 * pairs, dtype=torch.int8)
    padded[:n, :k] = weight
    # (blocks, half, column, pair, t) -> (blocks, pair, half, column, t)
    return padded.view(blocks, 2, 8, pairs, 2).permute(0, 3, 1, 2, 4).reshape(blocks, pairs, 32).contiguous()


def unpack_int8(packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """The inverse of pack_int8: (ceil(N/16), ceil(K/2), 32) -> (N, K)."""
    blocks, pairs, _ = packed.shape
    full = packed.view(blocks, pairs, 2, 8, 2).permute(0, 2, 3, 1, 4).reshape(blocks * BLOCK, 2 * pairs)
    return full[:n, :k].contiguous()


def _nibble_words(q: torch.Tensor) -> torch.Tensor:
    """(N16, K) integers -> (blocks, K/32, 4, 16) int32: bit 4i + 16t of word (b, g, j, c) holds the low
    nibble of q[16b + c, 32g + 8j + 2i + t]."""
    n16, k = q.shape
    qp = (q.to(torch.int32) & 0xF).view(n16 // BLOCK, BLOCK, k // 32, 4, 4, 2)     # (b, c, g, j, i, t)
    shifts = (4 * torch.arange(4)[:, None] + 16 * torch.arange(2)[None, :]).to(torch.int32)   # (i, t)
    words = (qp << shifts).sum(dim=(-2, -1), dtype=torch.int64)              # (b, c, g, j), < 2^32
    words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    return words.permute(0, 2, 3, 1).contiguous()                            # (b, g, j, c)


def _padded(v: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(N, ...) -> (N rounded up to 16, ...) of dtype, zero past N."""
    out = torch.zeros(-(-v.shape[0] // BLOCK) * BLOCK, *v.shape[1:], dtype=dtype)
    out[: v.shape[0]] = v.to(dtype)
    return out


def pack_int4(q: torch.Tensor, sc: torch.Tensor, m: torch.Tensor, d: torch.Tensor,
              dmin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A Q4_K-style weight w[n, k] = d[n, k // 256] · sc[n, k // 32] · q[n, k] − dmin[n, k // 256] ·
    m[n, k // 32] -> gemm4.c's layout. q (N, K) integers 0 … 15 with K a multiple of 32; sc, m (N, K/32)
    integers 0 … 255; d, dmin (N, ceil(K/256)) fp16 values. Returns packed (ceil(N/16), K/32, 4, 16) int32
    (bit 4i + 16t of word (b, g, j, c) holds q[16b + c, 32g + 8j + 2i + t]), groups (ceil(N/16), K/32, 2,
    16) uint8 (sc, m) and supers (ceil(N/16), ceil(K/256), 2, 16) float16 (d, dmin); zero past N."""
    n, k = q.shape
    blocks = -(-n // BLOCK)
    packed = _nibble_words(_padded(q, torch.int32))

    def per_block(parts: tuple[torch.Tensor, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        cols = parts[0].shape[1]                                             # (N, cols) twice -> (blocks, cols, 2, 16)
        out = torch.zeros(blocks * BLOCK, 2, cols, dtype=dtype)
        out[:n] = torch.stack([v.to(dtype) for v in parts], dim=1)
        return out.view(blocks, BLOCK, 2, cols).permute(0, 3, 2, 1).contiguous()

    return packed, per_block((sc, m), torch.uint8), per_block((d, dmin), torch.float16)


def unpack_int4(packed: torch.Tensor, groups: torch.Tensor, supers: torch.Tensor, n: int) -> torch.Tensor:
    """The weight pack_int4's arguments describe, (N, K) float32: (d · sc) · q − (dmin · m) in fp32."""
    per_row = lambda t: t.permute(0, 3, 1, 2).reshape(-1, *t.shape[1:3])     # (b, a, j, 16) -> (N16, a, j)
    return _by_rows(_int4_dequantized, per_row(packed), per_row(groups), per_row(supers))[:n]


def int4_rows(packed: torch.Tensor, groups: torch.Tensor, supers: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Rows `rows` (any shape R) of the weight pack_int4's arguments describe, (*R, K) float32 with
    unpack_int4's values, reading only those rows (an embedding lookup)."""
    flat = rows.reshape(-1)
    pick = lambda t: t[flat // BLOCK, :, :, flat % BLOCK]                     # (n, a, j)
    return _int4_dequantized(pick(packed), pick(groups), pick(supers)).reshape(*rows.shape, -1)


def _by_rows(dequantized, words: torch.Tensor, *fields: torch.Tensor) -> torch.Tensor:
    """dequantized(words, *fields) (per-row fields, words (n, G, …) -> (n, 32 G) float32), DEQUANT_ROWS rows
    at a time into one tensor: each row's values are computed alone either way, so they are the same."""
    n, groups = words.shape[:2]
    out = torch.empty(n, 32 * groups)                                            # (n, K)
    for start in range(0, n, DEQUANT_ROWS):
        rows = slice(start, start + DEQUANT_ROWS)
        out[rows] = dequantized(words[rows], *(f[rows] for f in fields))
    return out


def _int4_dequantized(words: torch.Tensor, groups: torch.Tensor, supers: torch.Tensor) -> torch.Tensor:
    """Per-row fields -> (n, K) float32: words (n, G, 4) int32, groups (n, G, 2) uint8 (sc, m), supers
    (n, S, 2) float16 (d, dmin)."""
    n, ngroups = words.shape[:2]
    shifts = 4 * torch.arange(4)[:, None] + 16 * torch.arange(2)[None, :]   # (i, t)
    q = ((words.to(torch.int64) & 0xFFFFFFFF)[..., None, None] >> shifts) & 0xF   # (n, G, j, i, t)
    q = q.reshape(n, ngroups, 32).float()
    g, s = groups.float(), supers.float().repeat_interleave(8, dim=1)[:, :ngroups]
    scale, low = (s[..., 0] * g[..., 0])[..., None], (s[..., 1] * g[..., 1])[..., None]      # (n, G, 1)
    return (q * scale - low).reshape(n, ngroups * 32)


def pack_int6(q: torch.Tensor, sc: torch.Tensor, d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A Q6_K weight w[n, k] = (d[n, k // 256] · sc[n, k // 16]) · (q[n, k] − 32) -> gemm6.c's layout. q (N, K)
    integers 0 … 63 with K a multiple of 32; sc (N, K/16) int8; d (N, ceil(K/256)) fp16 values. Returns
    packed (ceil(N/16), K/32, 6, 16) int32 (words 0–3 the low nibbles as pack_int4's words, 4–5 the high
    bit pairs, see gemm6.c), scales (ceil(N/16), K/32, 2, 16) int8 and supers (ceil(N/16), ceil(K/256), 16)
    float16; zero past N."""
    n, k = q.shape
    blocks, groups = -(-n // BLOCK), k // 32
    qp = _padded(q, torch.int64)                                              # (N16, K)
    nibbles = _nibble_words(qp)                                               # (b, g, 4, c)
    high = (qp >> 4).view(blocks, BLOCK, groups, 2, 2, 8)                     # (b, c, g, pair, chunk, offset)
    lane_a, lane_b = torch.tensor([0, 4, 1, 5]), torch.tensor([2, 6, 3, 7])   # byte t's weights in the nibble words
    byte = (high[..., lane_a] | (high[..., lane_b] << 2))                     # (b, c, g, pair, chunk, t): 4 bits
    byte = byte[..., 0, :] | (byte[..., 1, :] << 4)                           # (b, c, g, pair, t): 8 bits
    words = (byte << (8 * torch.arange(4))).sum(-1)                          # (b, c, g, pair) < 2^32
    words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32).permute(0, 2, 3, 1)   # (b, g, pair, c)
    packed = torch.cat([nibbles, words], dim=2).contiguous()                 # (b, g, 6, c)
    scales = _padded(sc, torch.int8).view(blocks, BLOCK, groups, 2).permute(0, 2, 3, 1).contiguous()
    supers = _padded(d, torch.float16).view(blocks, BLOCK, -1).permute(0, 2, 1).contiguous()
    return packed, scales, supers


def unpack_int6(packed: torch.Tensor, scales: torch.Tensor, supers: torch.Tensor, n: int) -> torch.Tensor:
    """The weight pack_int6's arguments describe, (N, K) float32: (d · sc) · (q − 32) in fp32."""
    per_row = lambda t: t.permute(0, t.dim() - 1, *range(1, t.dim() - 1)).reshape(-1, *t.shape[1:-1])
    return _by_rows(_int6_dequantized, per_row(packed), per_row(scales), per_row(supers))[:n]


def int6_rows(packed: torch.Tensor, scales: torch.Tensor, supers: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Rows `rows` of the weight pack_int6's arguments describe, (*R, K) float32 (unpack_int6's values)."""
    flat = rows.reshape(-1)
    pick = lambda t: t[flat // BLOCK, ..., flat % BLOCK]
    return _int6_dequantized(pick(packed), pick(scales), pick(supers)).reshape(*rows.shape, -1)


def _int6_dequantized(words: torch.Tensor, scales: torch.Tensor, supers: torch.Tensor) -> torch.Tensor:
    """Per-row fields -> (n, K) float32: words (n, G, 6) int32, scales (n, G, 2) int8, supers (n, S) fp16."""
    n, groups = words.shape[:2]
    w = words.to(torch.int64) & 0xFFFFFFFF
    shifts = 4 * torch.arange(4)[:, None] + 16 * torch.arange(2)[None, :]   # (i, t)
    low = (w[:, :, :4, None, None] >> shifts) & 0xF                          # (n, G, j, i, t): k = 8j + 2i + t
    lane = torch.tensor([0, 2, 0, 2, 1, 3, 1, 3])       # offset o of a chunk -> the byte t holding its high bits
    part = torch.tensor([0, 0, 1, 1, 0, 0, 1, 1])       # ... in its first (A lanes) or second (B lanes) pair
    chunk = torch.arange(4)                                                   # j: pair j // 2, its position j % 2
    shift = (8 * lane[None, :] + 2 * part[None, :] + 4 * (chunk[:, None] % 2))   # (j, offset)
    high = (w[:, :, 4 + chunk // 2][..., None] >> shift) & 0x3               # (n, G, j, offset)
    q = low.reshape(n, groups, 4, 8) | (high << 4)                           # (n, G, j, offset)
    q = q.reshape(n, groups * 32).float()
    scale = supers.float().repeat_interleave(16, dim=1)[:, : groups * 2] * scales.reshape(n, -1).float()   # (n, K/16)
    return (scale[..., None] * (q.view(n, -1, 16) - 32)).reshape(n, groups * 32)


def select_block_rows(tensors: tuple[torch.Tensor, ...], rows: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """A packed layout's tensors (each (blocks, …, 16): pack_int4's, pack_int6's) for the output rows
    `rows` (N' indices) only: every word, multiplier and factor belongs to one column of its block, so
    this moves them without unpacking anything."""
    blocks = -(-len(rows) // BLOCK)

    def pick(t: torch.Tensor) -> torch.Tensor:                               # (b, …, 16) -> (b', …, 16)
        out = torch.zeros(blocks * BLOCK, *t.shape[1:-1], dtype=t.dtype)
        out[: len(rows)] = t[rows // BLOCK, ..., rows % BLOCK]
        inner = tuple(range(2, t.dim()))
        return out.view(blocks, BLOCK, *t.shape[1:-1]).permute(0, *inner, 1).contiguous()

    return tuple(pick(t) for t in tensors)
