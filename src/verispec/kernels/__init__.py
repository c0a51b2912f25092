"""Native CPU kernels, compiled on first use with the system C compiler and cached.

`gemm.c` holds the quantized matmuls (int8 weights per channel with activations rounded to 16-bit
integers per row and integer dot products; int4 per group of 32) and row-by-row attention for
decode and verify passes, for AVX2 + FMA CPUs (see its header). It is
built once into `$VERISPEC_CACHE/kernels/` (about a second with gcc) and opened with ctypes; its
OpenMP pool is the one torch already loaded (same `libgomp.so.1`), so the two never fight for
cores. Without a compiler, without AVX2/FMA, or with VERISPEC_KERNELS=off, `int8_gemm()` is None
and callers use torch's own kernels. `kernel_status()` says which and why.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from functools import lru_cache
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("gemm.c")
FLAGS = ["-O3", "-mavx2", "-mfma", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC"]
_status = "not loaded"


def kernel_status() -> str:
    _load()
    return _status


def _cpu_has_avx2_fma() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")
    return " avx2" in flags and " fma" in flags


def _cache_dir() -> Path:
    from verispec.loaders.builtin import cache_dir

    return cache_dir() / "kernels"


@lru_cache(maxsize=1)
def _load():
    global _status
    if os.environ.get("VERISPEC_KERNELS", "").lower() in ("0", "off", "false", "no"):
        _status = "off (VERISPEC_KERNELS)"
        return None
    if not _cpu_has_avx2_fma():
        _status = "unavailable: the CPU lacks AVX2/FMA"
        return None
    compiler = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if compiler is None:
        _status = "unavailable: no C compiler (install gcc to build the fast int8 kernel)"
        return None
    source = SOURCE.read_bytes()
    key = hashlib.sha256(source + " ".join([compiler, *FLAGS]).encode()).hexdigest()[:16]
    lib_path = _cache_dir() / f"gemm-{key}.so"
    if not lib_path.exists():
        lib_path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=lib_path.parent)
        os.close(fd)
        try:
            subprocess.run([compiler, *FLAGS, str(SOURCE), "-o", tmp], check=True, capture_output=True, timeout=120)
            os.replace(tmp, lib_path)                     # atomic: a concurrent build never sees half a file
        except (subprocess.SubprocessError, OSError) as err:
            detail = getattr(err, "stderr", b"") or b""
            _status = f"unavailable: compiling {SOURCE.name} failed ({detail.decode(errors='replace')[:200] or err})"
            Path(tmp).unlink(missing_ok=True)
            return None
    try:
        lib = ctypes.CDLL(str(lib_path))
        if lib.verispec_kernels_abi() != 8:
            raise OSError("ABI mismatch")
    except OSError as err:
        _status = f"unavailable: loading {lib_path} failed ({err})"
        return None
    lib.verispec_int8_gemm.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_long] * 3 + [ctypes.c_int]
    lib.verispec_int4_gemm.argtypes = [ctypes.c_void_p] * 6 + [ctypes.c_long] * 3 + [ctypes.c_int]
    lib.verispec_attend_rows.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_long] * 8 + [ctypes.c_float, ctypes.c_int]
    lib.verispec_int8_gemm.restype = lib.verispec_int4_gemm.restype = lib.verispec_attend_rows.restype = ctypes.c_int
    _status = f"active ({lib_path.name})"
    return lib


def available() -> bool:
    return _load() is not None


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


def int8_gemm(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x (M, K) float32 contiguous, packed weight from pack_int8, scales (N,) float32 -> (M, N) float32.

    Each row of x is rounded to 16-bit integers with its own scale inside the kernel (see gemm.c)."""
    lib = _load()
    m, k = x.shape
    n = scales.shape[0]
    if packed.shape != (-(-n // BLOCK), -(-k // 2), 32) or packed.dtype != torch.int8:
        raise ValueError(f"int8_gemm: packed weight {tuple(packed.shape)} does not fit N={n}, K={k}")
    y = torch.empty(m, n, dtype=torch.float32)
    if lib.verispec_int8_gemm(x.data_ptr(), packed.data_ptr(), scales.data_ptr(), y.data_ptr(), m, n, k,
                              torch.get_num_threads()):
        raise MemoryError("int8_gemm: no memory for the rounded activations")
    return y


def int4_gemm(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor) -> torch.Tensor:
    """x (M, K) float32 contiguous; packed (N, K/2) uint8, scales and mins (N, K/32) float32 (see
    gemm.c for the layout) -> (M, N) float32."""
    lib = _load()
    m, k = x.shape
    n = packed.shape[0]
    y = torch.empty(m, n, dtype=torch.float32)
    sums = torch.empty(m, k // 32, dtype=torch.float32)
    if lib.verispec_int4_gemm(x.data_ptr(), packed.data_ptr(), scales.data_ptr(), mins.data_ptr(), sums.data_ptr(),
                              y.data_ptr(), m, n, k, torch.get_num_threads()):
        raise ValueError(f"int4_gemm needs K divisible by 32, got {k}")
    return y


def attend_rows(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor,
                scale: float) -> torch.Tensor | None:
    """Each query row attends over exactly its own prefix (see gemm.c), or None when the tensors do not
    fit the kernel (not float32, or keys/values not contiguous along the head dimension) and the
    caller should use its own loop.

    q (B, H, T, D), keys and values (B, H_kv, S, D) sharing strides, positions (B, T) int64 ->
    out (B, T, H, D) float32 contiguous."""
    b, h, t, d = q.shape
    hkv, s = keys.shape[1], keys.shape[2]
    if (q.dtype != torch.float32 or keys.dtype != torch.float32 or values.dtype != torch.float32
            or keys.stride() != values.stride() or keys.stride(3) != 1 or keys.stride(2) != d or h % hkv):
        return None
    q = q.contiguous()
    positions = positions.to(torch.int64).contiguous()
    if int(positions.max()) >= s or int(positions.min()) < 0:
        raise ValueError(f"attend_rows: positions outside the {s} cached keys")
    out = torch.empty(b, t, h, d, dtype=torch.float32)
    if _load().verispec_attend_rows(q.data_ptr(), keys.data_ptr(), values.data_ptr(), positions.data_ptr(),
                                    out.data_ptr(), b, h, hkv, t, d, s, keys.stride(0), keys.stride(1), scale,
                                    torch.get_num_threads()):
        raise MemoryError("attend_rows: no memory for the scores")
    return out
