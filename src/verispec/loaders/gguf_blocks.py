"""The block-quantized tensors of a GGUF file as the file stores them (Q4_K, Q6_K), for the int4 format.

A Q4_K tensor keeps, per row and super-block of 256 weights, fp16 factors d and dmin, and per group of
32 six-bit integers sc and m: w = d · sc · q − dmin · m with q in 0 … 15. A Q6_K tensor keeps per
super-block an fp16 factor d and per group of 16 an int8 scale sc: w = d · sc · (q − 32) with q in
0 … 63. `Q4Fields` and `Q6Fields` hold those numbers for a whole (N, K) weight; `block_fields` reads
them from a file without dequantizing, so the int4 format (models/quant.py, kernels/gemm4.c and
gemm6.c) multiplies by exactly the file's weights.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from verispec.errors import InvalidModelFile
from verispec.loaders.checkpoint import expected_shapes, fuse_projections
from verispec.loaders.gguf_loader import Q, unpermute, hf_name, open_reader, read_config

GROUP, SUPER = 32, 256


@dataclass
class Q4Fields:
    """w[n, k] = d[n, k // 256] · sc[n, k // 32] · q[n, k] − dmin[n, k // 256] · m[n, k // 32].

    q (N, K) uint8 in 0 … 15; sc, m (N, K/32) uint8; d, dmin (N, ceil(K/256)) float32 holding fp16 values."""
    q: torch.Tensor
    sc: torch.Tensor
    m: torch.Tensor
    d: torch.Tensor
    dmin: torch.Tensor

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.q.shape)

    def dequantized(self) -> torch.Tensor:
        """(N, K) float32, each product in fp32 as the kernel forms it."""
        n, k = self.q.shape
        per_group = lambda v: v.repeat_interleave(SUPER // GROUP, dim=1)[:, : k // GROUP]
        scale = (per_group(self.d) * self.sc.float())[..., None]                # (N, G, 1)
        low = (per_group(self.dmin) * self.m.float())[..., None]
        return (self.q.float().view(n, k // GROUP, GROUP) * scale - low).reshape(n, k)

    @staticmethod
    def cat(parts: list["Q4Fields"]) -> "Q4Fields":
        """Fields of row-stacked weights (a fused projection)."""
        return Q4Fields(*(torch.cat([getattr(p, f) for p in parts]) for f in ("q", "sc", "m", "d", "dmin")))


def parse_q4k(blocks: np.ndarray, n: int, k: int) -> Q4Fields:
    """Raw Q4_K rows (N, K/256 · 144) uint8 -> fields. A block is fp16 d, fp16 dmin, 12 bytes of packed
    6-bit sc and m for its 8 groups, then 128 bytes of nibbles: byte l of chunk c (32 bytes) holds
    group 2c's weight l in its low nibble and group 2c + 1's weight l in its high nibble."""
    import gguf

    nb = k // SUPER
    b = np.ascontiguousarray(blocks, dtype=np.uint8).reshape(n * nb, 144)
    d = b[:, 0:2].copy().view(np.float16).astype(np.float32).reshape(n, nb)
    dmin = b[:, 2:4].copy().view(np.float16).astype(np.float32).reshape(n, nb)
    sc, m = gguf.quants.Q4_K.get_scale_min(b[:, 4:16])                        # (n · nb, 8) each
    qs = b[:, 16:].reshape(n * nb, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    q = (qs & 0x0F).reshape(n, k)
    return Q4Fields(torch.from_numpy(np.ascontiguousarray(q)), torch.from_numpy(sc.reshape(n, nb * 8).astype(np.uint8)),
                    torch.from_numpy(m.reshape(n, nb * 8).astype(np.uint8)), torch.from_numpy(d), torch.from_numpy(dmin))


@dataclass
class Q6Fields:
    """w[n, k] = (d[n, k // 256] · sc[n, k // 16]) · (q[n, k] − 32), the product d · sc formed in fp32.

    q (N, K) uint8 in 0 … 63; sc (N, K/16) int8; d (N, K/256) float32 holding fp16 values."""
    q: torch.Tensor
    sc: torch.Tensor
    d: torch.Tensor

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.q.shape)

    def dequantized(self) -> torch.Tensor:
        """(N, K) float32 as the gguf package dequantizes Q6_K."""
        n, k = self.q.shape
        scale = (self.d.repeat_interleave(SUPER // 16, dim=1)[:, : k // 16] * self.sc.float())[..., None]   # (N, K/16, 1)
        return (scale * (self.q.float().view(n, k // 16, 16) - 32)).reshape(n, k)

    @staticmethod
    def cat(parts: list["Q6Fields"]) -> "Q6Fields":
        return Q6Fields(*(torch.cat([getattr(p, f) for p in parts]) for f in ("q", "sc", "d")))


def parse_q6k(blocks: np.ndarray, n: int, k: int) -> Q6Fields:
    """Raw Q6_K rows (N, K/256 · 210) uint8 -> fields. A block is 128 bytes of low nibbles, 64 bytes of
    high bit pairs, 16 int8 scales (one per 16 weights), then fp16 d; within each half of 128 weights,
    byte l of the nibbles holds weights l (low) and l + 64 (high) of the first 64 bytes' quarter order,
    as `gguf.quants.Q6_K` unpacks them."""
    nb = k // SUPER
    b = np.ascontiguousarray(blocks, dtype=np.uint8).reshape(n * nb, 210)
    ql = (b[:, :128].reshape(-1, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)) & 0x0F
    qh = (b[:, 128:192].reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)) & 0x03
    q = (ql.reshape(-1, 8, 32) | (qh.reshape(-1, 8, 32) << 4)).reshape(n, k)
    sc = b[:, 192:208].copy().view(np.int8).reshape(n, nb * 16)
    d = b[:, 208:210].copy().view(np.float16).astype(np.float32).reshape(n, nb)
    return Q6Fields(torch.from_numpy(np.ascontiguousarray(q)), torch.from_numpy(sc), torch.from_numpy(d))


# The block formats read as they are stored: GGUF type -> (bytes per super-block, parser, fields class).
BLOCK_FORMATS = {Q.Q4_K: (144, parse_q4k, Q4Fields), Q.Q6_K: (210, parse_q6k, Q6Fields)}


def block_fields(path: str | Path, types=(Q.Q4_K, Q.Q6_K)) -> dict[str, Q4Fields | Q6Fields]:
    """Every linear of a GGUF model stored in one of `types` (the LM head and the token embeddings
    included), as that type's fields under the model's fused names (q/k/v and gate/up as one weight
    when all of their parts share a type), plus the unfused parts; other tensors are absent."""
    path = Path(path)
    reader = open_reader(path)
    cfg = read_config(reader, path)
    want = expected_shapes(cfg)
    by_type: dict = {t: {} for t in types}
    for t in reader.tensors:
        name = hf_name(t.name)
        linear = name is not None and (name.endswith("proj.weight")
                                       or name in ("model.embed_tokens.weight", "lm_head.weight"))
        if not linear or t.tensor_type not in by_type or name not in want:
            continue
        size, parse, kind = BLOCK_FORMATS[t.tensor_type]
        n, k = want[name]
        if k % SUPER or t.data.size != n * (k // SUPER) * size:
            raise InvalidModelFile(path, f"tensor {t.name} does not hold {n} rows of {k} {t.tensor_type.name} weights")
        f = parse(t.data, n, k)
        if cfg.architecture == "llama" and ("q_proj" in name or "k_proj" in name):
            heads = cfg.num_heads if "q_proj" in name else cfg.num_kv_heads
            f = kind(*(torch.from_numpy(unpermute(getattr(f, a).numpy(), heads)).contiguous()
                       for a in f.__dataclass_fields__))
        by_type[t.tensor_type][name] = f
    fields: dict = {}
    for t, found in by_type.items():
        fuse_projections(found, combine=BLOCK_FORMATS[t][2].cat)
        fields |= found
    return fields


def q4k_fields(path: str | Path) -> dict[str, Q4Fields]:
    """The Q4_K linears (and token embeddings) alone (`block_fields`)."""
    return block_fields(path, (Q.Q4_K,))
