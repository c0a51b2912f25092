"""The structures a native decoder pass takes (decoder.c, kernels.h), as ctypes mirrors and a dataclass."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

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


class DecoderDims(ctypes.Structure):
    _fields_ = [(name, ctypes.c_long) for name in ("layers", "C", "H", "Hkv", "D", "I")] + \
               [("eps", ctypes.c_float), ("scale", ctypes.c_float)]


@dataclass(frozen=True)
class CacheLayout:
    """Where the decoder pass reads and writes keys and values (decoder.c, kernels.h's kv_view): position s
    of batch row b, layer l, KV head h at store[l · layer_stride + tables[b, s // block] · block_stride
    + h · head_stride + (s % block) · D]. k, v float32 or bfloat16 stores, or int8 stores with ks, vs float32 scales,
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
