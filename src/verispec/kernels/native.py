"""One built variant of the native kernels, opened with ctypes: the argument types of its exported
functions, and the checks and marshalling of every call (shapes, dtypes and ranges are checked here
before a pointer reaches C; the C side checks what only it can see, and its status codes become
exceptions). kernels/__init__.py builds, loads and chooses the variants; this file only calls one."""

from __future__ import annotations

import ctypes

import torch

from verispec.kernels.abi import (CacheLayout, DecoderDims, PassEnds, bf16_block_length, pairs_from_keys,
                                  pairs_from_values)
from verispec.kernels.packing import BLOCK

ABI = 22                             # verispec_kernels_abi() of a library whose functions match these types
SWEPT_FORMATS = ("int4", "int6")     # matmuls whose row counts 1 … SWEPT_ROWS choose a sweep schedule
SWEPT_ROWS = 6


class NativeKernels:
    """One built variant of gemm.c, opened with ctypes; the module-level functions call the active one."""

    def __init__(self, lib: ctypes.CDLL, variant: str, build: str = ""):
        self.lib, self.variant, self.build = lib, variant, build      # build: hash of sources, compiler, flags
        lib.verispec_int8_gemm.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_long] * 3 + [ctypes.c_int]
        lib.verispec_int4_gemm.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_long] * 3 + [ctypes.c_int]
        lib.verispec_int6_gemm.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_long] * 3 + [ctypes.c_int]
        lib.verispec_attend_rows.argtypes = ([ctypes.c_void_p] * 4 + [ctypes.c_long] * 4 + [ctypes.c_void_p] * 2
                                             + [ctypes.c_long] * 5 + [ctypes.c_float, ctypes.c_int, ctypes.c_int])
        # Both passes: (x or ends), weights, dims, cos, sin, P, pos, B, T, then the cache (_cache_arguments).
        pass_args = ([ctypes.c_void_p] * 5 + [ctypes.c_long, ctypes.c_void_p] + [ctypes.c_long] * 2
                     + [ctypes.c_void_p] * 2 + [ctypes.c_long, ctypes.c_void_p] + [ctypes.c_long] * 4
                     + [ctypes.c_void_p] * 2 + [ctypes.c_long] * 4 + [ctypes.c_int])
        lib.verispec_decoder.argtypes = pass_args + [ctypes.c_void_p, ctypes.c_long, ctypes.c_int]   # keep, threads
        lib.verispec_pass.argtypes = pass_args + [ctypes.c_int]                                    # threads
        lib.verispec_int4_rows.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_long] * 3 + [ctypes.c_void_p]
        lib.verispec_rmsnorm_rows.argtypes = ([ctypes.c_void_p] * 2 + [ctypes.c_long] * 4
                                              + [ctypes.c_void_p, ctypes.c_float, ctypes.c_void_p])
        lib.verispec_int4_sweeps.argtypes = lib.verispec_int6_sweeps.argtypes = [ctypes.c_void_p, ctypes.c_int]
        for fn in (lib.verispec_int8_gemm, lib.verispec_int4_gemm, lib.verispec_int6_gemm, lib.verispec_attend_rows,
                   lib.verispec_decoder, lib.verispec_pass, lib.verispec_int4_rows, lib.verispec_rmsnorm_rows,
                   lib.verispec_int4_sweeps, lib.verispec_int6_sweeps):
            fn.restype = ctypes.c_int
        self.defaults = self.schedule()        # the compiled sweep schedules (kernels' NH4 / NH6), or None

    def schedule(self) -> dict[str, tuple[int, ...]] | None:
        """Each row count's sweep schedule in the int4 and int6 matmuls, {"int4": (rows 1 … 6 of a pass's first
        group of rows, then rows 1 … 6 of the groups after it), "int6": …}: 1 = a block's two 8-column halves
        in one sweep, 0 = a sweep per half (see sweeps.py). None for a variant whose 16-column block is one
        vector (nothing to choose)."""
        out = {}
        for fmt in SWEPT_FORMATS:
            one = (ctypes.c_int * (2 * SWEPT_ROWS))()
            if getattr(self.lib, f"verispec_{fmt}_sweeps")(one, 0):
                return None
            out[fmt] = tuple(one)
        return out

    def set_schedule(self, fmt: str, one: tuple[int, ...]) -> None:
        """Put one format's schedule in force (as `schedule` gives it: 12 values, each 0 or 1), never while
        kernels run. The bits do not change with it."""
        if fmt not in SWEPT_FORMATS or len(one) != 2 * SWEPT_ROWS or any(v not in (0, 1) for v in one):
            raise ValueError(f"a sweep schedule is one of {SWEPT_FORMATS} and {2 * SWEPT_ROWS} values of 0 or 1, "
                             f"not {fmt!r} {one!r}")
        if getattr(self.lib, f"verispec_{fmt}_sweeps")((ctypes.c_int * (2 * SWEPT_ROWS))(*one), 1):
            raise ValueError(f"the {self.variant} kernels have no sweep schedule to choose")

    def int8_gemm(self, x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        return _int8_gemm(self.lib, x, packed, scales)

    def int4_gemm(self, x: torch.Tensor, packed: torch.Tensor, groups: torch.Tensor,
                  supers: torch.Tensor) -> torch.Tensor:
        return _int4_gemm(self.lib, x, packed, groups, supers)

    def int6_gemm(self, x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor,
                  supers: torch.Tensor) -> torch.Tensor:
        return _int6_gemm(self.lib, x, packed, scales, supers)

    def int4_rows(self, packed: torch.Tensor, groups: torch.Tensor, supers: torch.Tensor,
                  rows: torch.Tensor) -> torch.Tensor:
        return _int4_rows(self.lib, packed, groups, supers, rows)

    def rmsnorm_rows(self, x: torch.Tensor, rows: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return _rmsnorm_rows(self.lib, x, rows, weight, eps)

    def attend_rows(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor,
                    scale: float) -> torch.Tensor | None:
        return _attend_rows(self.lib, q, keys, values, positions, scale)

    def decoder(self, x: torch.Tensor, weights, dims, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                layout: "CacheLayout", keep: torch.Tensor | None = None) -> None:
        _decoder(self.lib, x, weights, dims, cos, sin, positions, layout, keep)

    def model_pass(self, ends: PassEnds, weights, dims, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                   layout: "CacheLayout") -> None:
        _model_pass(self.lib, ends, weights, dims, cos, sin, positions, layout)


def _int8_gemm(lib, x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    m, k = x.shape
    n = scales.shape[0]
    if packed.shape != (-(-n // BLOCK), -(-k // 2), 32) or packed.dtype != torch.int8:
        raise ValueError(f"int8_gemm: packed weight {tuple(packed.shape)} does not fit N={n}, K={k}")
    y = torch.empty(m, n, dtype=torch.float32)
    if lib.verispec_int8_gemm(x.data_ptr(), packed.data_ptr(), scales.data_ptr(), y.data_ptr(), m, n, k,
                              torch.get_num_threads()):
        raise MemoryError("int8_gemm: no memory for the rounded activations")
    return y


def _int4_gemm(lib, x: torch.Tensor, packed: torch.Tensor, groups: torch.Tensor, supers: torch.Tensor) -> torch.Tensor:
    k, b = x.shape[1], BLOCK
    return _block_gemm(lib.verispec_int4_gemm, "int4_gemm", x, (packed, groups, supers),
                       (((k // 32, 4, b), torch.int32), ((k // 32, 2, b), torch.uint8), ((-(-k // 256), 2, b), torch.float16)))


def _int6_gemm(lib, x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, supers: torch.Tensor) -> torch.Tensor:
    k, b = x.shape[1], BLOCK
    return _block_gemm(lib.verispec_int6_gemm, "int6_gemm", x, (packed, scales, supers),
                       (((k // 32, 6, b), torch.int32), ((k // 32, 2, b), torch.int8), ((-(-k // 256), b), torch.float16)))


def _int4_rows(lib, packed: torch.Tensor, groups: torch.Tensor, supers: torch.Tensor,
               rows: torch.Tensor) -> torch.Tensor:
    blocks, ngroups = packed.shape[:2]
    k = 32 * ngroups
    expected = (((ngroups, 4, BLOCK), torch.int32), ((ngroups, 2, BLOCK), torch.uint8),
                ((-(-k // 256), 2, BLOCK), torch.float16))
    if any(t.shape != (blocks, *shape) or t.dtype != dtype or not t.is_contiguous()
           for t, (shape, dtype) in zip((packed, groups, supers), expected)):
        raise ValueError(f"int4_rows: packed weight {tuple(packed.shape)} is not in pack_int4's layout")
    ids = rows.reshape(-1).to(torch.int64).contiguous()
    out = torch.empty(ids.numel(), k, dtype=torch.float32)
    if lib.verispec_int4_rows(packed.data_ptr(), groups.data_ptr(), supers.data_ptr(), ids.data_ptr(), ids.numel(),
                              blocks * BLOCK, k, out.data_ptr()):
        raise IndexError(f"int4_rows: a row outside 0 … {blocks * BLOCK - 1}")
    return out.reshape(*rows.shape, k)


def _rmsnorm_rows(lib, x: torch.Tensor, rows: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.dim() != 3 or x.dtype != torch.float32 or not x.is_contiguous():
        raise ValueError(f"rmsnorm_rows: x must be a contiguous (B, T, C) float32 tensor, not {tuple(x.shape)} {x.dtype}")
    b, t, c = x.shape
    if rows.dim() != 2 or rows.shape[0] != b or weight.shape != (c,) or weight.dtype != torch.float32:
        raise ValueError(f"rmsnorm_rows: rows {tuple(rows.shape)} / weight {tuple(weight.shape)} do not fit x {(b, t, c)}")
    rows = rows.to(torch.int64).contiguous()
    weight = weight.contiguous()
    out = torch.empty(b, rows.shape[1], c, dtype=torch.float32)
    if lib.verispec_rmsnorm_rows(x.data_ptr(), rows.data_ptr(), b, rows.shape[1], t, c, weight.data_ptr(), eps,
                                 out.data_ptr()):
        raise IndexError(f"rmsnorm_rows: a row outside 0 … {t - 1}")
    return out


def _block_gemm(fn, name: str, x: torch.Tensor, tensors: tuple, expected: tuple) -> torch.Tensor:
    """x (M, K) through a packed block layout whose three tensors must be (blocks, *shape) of dtype,
    contiguous, as `expected` lists them -> (M, blocks · 16) float32."""
    m, k = x.shape
    blocks = tensors[0].shape[0]
    if k % 32 or any(t.shape != (blocks, *shape) or t.dtype != dtype or not t.is_contiguous()
                     for t, (shape, dtype) in zip(tensors, expected)):
        raise ValueError(f"{name}: packed weight {tuple(tensors[0].shape)} does not fit K={k}")
    y = torch.empty(m, blocks * BLOCK, dtype=torch.float32)
    if fn(x.data_ptr(), *(t.data_ptr() for t in tensors), y.data_ptr(), m, blocks * BLOCK, k, torch.get_num_threads()):
        raise MemoryError(f"{name}: no memory for the rounded activations")
    return y


def _attend_rows(lib, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor,
                 scale: float) -> torch.Tensor | None:
    b, h, t, d = q.shape
    hkv, s = keys.shape[1], keys.shape[2]
    if (q.dtype != torch.float32 or keys.dtype not in (torch.float32, torch.bfloat16) or values.dtype != keys.dtype
            or keys.stride() != values.stride() or keys.stride(3) != 1 or keys.stride(2) != d or h % hkv):
        return None
    if keys.dtype == torch.bfloat16 and d % 2:
        return None
    q = q.transpose(1, 2).contiguous()                                       # (B, T, H, D)
    positions = positions.to(torch.int64).contiguous()
    if int(positions.max()) >= s or int(positions.min()) < 0:
        raise ValueError(f"attend_rows: positions outside the {s} cached keys")
    if keys.dtype == torch.bfloat16:                     # the kernels read bf16 as a store holds it (abi.py)
        pad = (0, 0, 0, bf16_block_length(s) - s)
        keys = pairs_from_keys(torch.nn.functional.pad(keys, pad))          # (B, H_kv, S', D) paired
        values = pairs_from_values(torch.nn.functional.pad(values, pad))
    rows = torch.arange(b, dtype=torch.int64)                                # each row one block: its own keys
    out = torch.empty(b, t, h, d, dtype=torch.float32)
    if lib.verispec_attend_rows(q.data_ptr(), keys.data_ptr(), values.data_ptr(), rows.data_ptr(), 1, s,
                                keys.stride(0), keys.stride(1), positions.data_ptr(), out.data_ptr(), b, h, hkv, t, d,
                                scale, int(keys.dtype == torch.bfloat16), torch.get_num_threads()):
        raise MemoryError("attend_rows: no memory for the scores")
    return out


def _decoder(lib, x: torch.Tensor, weights, dims: DecoderDims, cos: torch.Tensor, sin: torch.Tensor,
             positions: torch.Tensor, layout: CacheLayout, keep: torch.Tensor | None = None) -> None:
    """x (B, T, C) float32 contiguous, updated in place; cos, sin (P, D) float32 contiguous, the rotary
    angles of positions 0 … P-1; positions (B, T) int64 contiguous, each below P and below the cache
    table's reach (checked by the caller's cache view).
    keep: the rows of x (flat indices b · T + t, strictly ascending) the caller will read, or None for
    all; the others come back holding no meaningful values (the last layer skips them after writing
    their keys and values)."""
    b, t, _ = x.shape
    if keep is not None:
        keep = keep.to(torch.int64).contiguous()
        if keep.dim() != 1 or (keep.numel() and (int(keep[0]) < 0 or int(keep[-1]) >= b * t
                                                 or not bool((keep[1:] > keep[:-1]).all()))):
            raise ValueError(f"decoder pass: keep must hold strictly ascending row indices below {b * t}")
    _check_tables(cos, sin, dims)
    status = lib.verispec_decoder(
        x.data_ptr(), ctypes.addressof(weights), ctypes.addressof(dims), cos.data_ptr(), sin.data_ptr(),
        cos.shape[0], positions.data_ptr(), b, t, *_cache_arguments(layout),
        keep.data_ptr() if keep is not None and keep.numel() else None,
        keep.numel() if keep is not None else -1,
        torch.get_num_threads())
    _raise_for(status, "decoder pass", cos)


def _model_pass(lib, ends: PassEnds, weights, dims: DecoderDims, cos: torch.Tensor, sin: torch.Tensor,
                positions: torch.Tensor, layout: CacheLayout) -> None:
    """ends: the ids (B · T int64), the embedding table, final norm and LM head, the rows whose logits
    are wanted and the two outputs (abi.PassEnds; the caller sizes them and keeps them alive); the rest
    as `_decoder`'s. A token id or a row out of range raises IndexError before anything is computed."""
    b, t = positions.shape
    _check_tables(cos, sin, dims)
    status = lib.verispec_pass(
        ctypes.addressof(ends), ctypes.addressof(weights), ctypes.addressof(dims), cos.data_ptr(), sin.data_ptr(),
        cos.shape[0], positions.data_ptr(), b, t, *_cache_arguments(layout), torch.get_num_threads())
    if status == -3:
        raise IndexError(f"model pass: a token id outside the embedding table's 0 … {ends.vocab - 1}")
    if status == -4:
        raise IndexError(f"model pass: rows ({ends.Bn}, {ends.Rn}) of a pass of ({b}, {t}): a batch row "
                         f"past {b - 1} or a row outside 0 … {t - 1}")
    _raise_for(status, "model pass", cos)


def _check_tables(cos: torch.Tensor, sin: torch.Tensor, dims: DecoderDims) -> None:
    if cos.shape != sin.shape or cos.dim() != 2 or cos.shape[1] != dims.D or not cos.is_contiguous() \
            or not sin.is_contiguous() or cos.dtype != torch.float32 or sin.dtype != torch.float32:
        raise ValueError(f"decoder pass: cos {tuple(cos.shape)} and sin {tuple(sin.shape)} must be contiguous "
                         f"(P, {dims.D}) float32 tables")


def _cache_arguments(layout: CacheLayout) -> tuple:
    """decoder.c's cache arguments, kstore … bf16, from a layout."""
    return (layout.k.data_ptr(), layout.v.data_ptr(), layout.layer_stride,
            layout.tables.data_ptr(), layout.tables.shape[1], layout.block, layout.block_stride, layout.head_stride,
            layout.ks.data_ptr() if layout.ks is not None else None,
            layout.vs.data_ptr() if layout.vs is not None else None,
            layout.sc_layer_stride, layout.sc_block_stride, layout.sc_head_stride, layout.group,
            int(layout.k.dtype == torch.bfloat16))


def _raise_for(status: int, what: str, cos: torch.Tensor) -> None:
    if status == -2:
        raise IndexError(f"{what}: a position outside the rotary table's 0 … {cos.shape[0] - 1}")
    if status:
        raise MemoryError(f"{what}: no memory for its buffers")
