"""The structures a native decoder pass takes (decoder.c, kernels.h), as ctypes mirrors and a dataclass."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

# A bfloat16 KV store pairs its elements in 32-bit words (kernels.h): per block and KV head, keys in
# groups of KV_KEY_GROUP positions, word (p, j) holding dimensions 2p, 2p + 1 of key j; values word
# (m, d) holding dimension d of positions 2m, 2m + 1. The attention kernels then read a key per lane
# and multiply value pairs without rearranging either. A block holds bf16_block_length(n) positions.
KV_KEY_GROUP = 16


def bf16_block_length(positions: int) -> int:
    """Positions a bf16 block stores for `positions`: rounded up to a whole group of keys."""
    return -(-positions // KV_KEY_GROUP) * KV_KEY_GROUP


def paired_keys(t: torch.Tensor) -> torch.Tensor:
    """A view of stored bf16 keys (..., S, D) as (..., S / 16, D / 2, 16, 2): [g, p, i, e] is
    dimension 2p + e of position 16g + i."""
    *lead, s, d = t.shape
    return t.view(*lead, s // KV_KEY_GROUP, d // 2, KV_KEY_GROUP, 2)


def paired_values(t: torch.Tensor) -> torch.Tensor:
    """A view of stored bf16 values (..., S, D) as (..., S / 2, D, 2): [m, d, e] is dimension d of
    position 2m + e."""
    *lead, s, d = t.shape
    return t.view(*lead, s // 2, d, 2)


def keys_from_pairs(t: torch.Tensor) -> torch.Tensor:
    """Stored bf16 keys (..., S, D) -> the keys position by position (..., S, D), a copy."""
    return paired_keys(t).transpose(-3, -2).reshape(t.shape)


def values_from_pairs(t: torch.Tensor) -> torch.Tensor:
    """Stored bf16 values (..., S, D) -> the values position by position (..., S, D), a copy."""
    return paired_values(t).transpose(-2, -1).reshape(t.shape)


def pairs_from_keys(x: torch.Tensor) -> torch.Tensor:
    """Keys position by position (..., S, D), S a multiple of 16 -> as a bf16 store holds them."""
    *lead, s, d = x.shape
    return x.reshape(*lead, s // KV_KEY_GROUP, KV_KEY_GROUP, d // 2, 2).transpose(-3, -2).reshape(x.shape)


def pairs_from_values(x: torch.Tensor) -> torch.Tensor:
    """Values position by position (..., S, D), S even -> as a bf16 store holds them."""
    *lead, s, d = x.shape
    return x.reshape(*lead, s // 2, 2, d).transpose(-2, -1).reshape(x.shape)


class LinearWeights(ctypes.Structure):
    """One linear for decoder.c: format 0 = int8 (w, scale), 1 = int4 (w, scale = the groups' multipliers,
    super = the super-blocks' factors), 2 = int6 (w, scale = the half-groups' int8 scales, super = the
    super-blocks' factors); pointers."""
    _fields_ = [("format", ctypes.c_int64), ("w", ctypes.c_void_p), ("scale", ctypes.c_void_p),
                ("super", ctypes.c_void_p)]


class LayerWeights(ctypes.Structure):
    """One decoder layer's tensors for decoder.c (pointers; the owner keeps the tensors alive)."""
    _fields_ = [("ln1", ctypes.c_void_p), ("ln2", ctypes.c_void_p), ("qkv_bias", ctypes.c_void_p),
                ("qkv", LinearWeights), ("o", LinearWeights), ("gu", LinearWeights), ("down", LinearWeights)]


class PassEnds(ctypes.Structure):
    """The two ends of a whole-model pass for decoder.c's verispec_pass: the token ids and the embedding table
    (embed_format 0 = float32 rows (vocab, C); 1 = int4 in gemm4.c's layout, embed_w / embed_scale /
    embed_super its packed nibbles, groups and super-blocks), the final norm and the LM head (N outputs, no
    bias), rows (Bn, Rn): the rows t whose logits are wanted of each of the first Bn batch rows, and the two
    outputs: states (Bn, Rn, C), those rows final-normed, and logits (Bn, Rn, N). Pointers; the caller keeps
    the tensors alive."""
    _fields_ = [("ids", ctypes.c_void_p), ("embed_format", ctypes.c_int64), ("embed_w", ctypes.c_void_p),
                ("embed_scale", ctypes.c_void_p), ("embed_super", ctypes.c_void_p), ("vocab", ctypes.c_long),
                ("norm", ctypes.c_void_p), ("norm_eps", ctypes.c_float), ("head", LinearWeights),
                ("N", ctypes.c_long), ("rows", ctypes.c_void_p), ("Bn", ctypes.c_long), ("Rn", ctypes.c_long),
                ("states", ctypes.c_void_p), ("logits", ctypes.c_void_p)]


class DecoderDims(ctypes.Structure):
    _fields_ = [(name, ctypes.c_long) for name in ("layers", "C", "H", "Hkv", "D", "I")] + \
               [("eps", ctypes.c_float), ("scale", ctypes.c_float)]


@dataclass(frozen=True)
class CacheLayout:
    """Where the decoder pass reads and writes keys and values (decoder.c, kernels.h's kv_view): position s
    of batch row b, layer l, KV head h at store[l · layer_stride + tables[b, s // block] · block_stride
    + h · head_stride + (s % block) · D] (bf16 stores: at their paired places inside the block, above). k, v float32 or bfloat16 stores, or int8 stores with ks, vs float32 scales,
    one per `group` dimensions, at scale[l · sc_layer_stride + tables[…] · sc_block_stride
    + h · sc_head_stride + (s % block) · D / group + d / group]; tables (B, NB) int64 contiguous."""
    k: torch.Tensor
    v: torch.Tensor
    tables: torch.Tensor
    block: int
    layer_stride: int
    block_stride: int
    head_stride: int
    ks: torch.Tensor | None = None
    vs: torch.Tensor | None = None
    sc_layer_stride: int = 0
    sc_block_stride: int = 0
    sc_head_stride: int = 0
    group: int = 0
