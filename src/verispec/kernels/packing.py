"""The packed weight layouts the native matmuls read (gemm.c: int8; gemm4.c: int4), written from and
read back to plain (N, K) tensors."""

from __future__ import annotations

import torch

BLOCK = 16                 # output columns per packed int8 block


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


def pack_int4(q: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q (N, K) integers 0 … 15, scales and mins (N, K/32) -> gemm4.c's layout: packed (ceil(N/16), K/32,
    4, 16) int32 (bit 4i + 16t of word (b, g, j, c) holds q[16b + c, 32g + 8j + 2i + t]) and scales,
    mins (ceil(N/16), K/32, 16) float16; zero past N."""
    n, k = q.shape
    blocks, groups = -(-n // BLOCK), k // 32
    qp = torch.zeros(blocks * BLOCK, k, dtype=torch.int32)
    qp[:n] = q.to(torch.int32)
    qp = qp.view(blocks, BLOCK, groups, 4, 4, 2)                              # (b, c, g, j, i, t)
    shifts = (4 * torch.arange(4)[:, None] + 16 * torch.arange(2)[None, :]).to(torch.int32)   # (i, t)
    words = (qp << shifts).sum(dim=(-2, -1), dtype=torch.int64)              # (b, c, g, j), < 2^32
    words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    packed = words.permute(0, 2, 3, 1).contiguous()                          # (b, g, j, c)

    def per_block(v: torch.Tensor) -> torch.Tensor:                          # (N, G) -> (blocks, G, 16) fp16
        out = torch.zeros(blocks * BLOCK, groups, dtype=torch.float16)
        out[:n] = v.to(torch.float16)
        return out.view(blocks, BLOCK, groups).permute(0, 2, 1).contiguous()

    return packed, per_block(scales), per_block(mins)


def unpack_int4(packed: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, n: int) -> torch.Tensor:
    """The weight pack_int4's arguments describe, (N, K) float32: min + q · scale in fp32."""
    blocks, groups = packed.shape[:2]
    words = packed.to(torch.int64) & 0xFFFFFFFF                              # (b, g, j, c)
    shifts = 4 * torch.arange(4)[:, None] + 16 * torch.arange(2)[None, :]   # (i, t)
    q = (words[..., None, None] >> shifts) & 0xF                             # (b, g, j, c, i, t)
    q = q.permute(0, 3, 1, 2, 4, 5).reshape(blocks * BLOCK, groups, 32).float()
    sc = scales.permute(0, 2, 1).reshape(blocks * BLOCK, groups, 1).float()
    mn = mins.permute(0, 2, 1).reshape(blocks * BLOCK, groups, 1).float()
    return (mn + q * sc).reshape(blocks * BLOCK, groups * 32)[:n]
