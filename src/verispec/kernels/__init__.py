"""Native CPU kernels, compiled on first use with the system C compiler and cached.

`gemm.c`, `gemm4.c` and `gemm6.c` hold the quantized matmuls (int8 weights per channel with activations
rounded to 16-bit integers per row; int4 and int6 weights as Q4_K and Q6_K store them with activations
rounded to 8 bits per group of 32; integer dot products), `attention.c` the row-by-row
attention of decode and verify passes (reading a static or paged cache in place), `decoder.c` a whole
pass of a quantized model in one call — its decoder layers, or token ids to logits (see each file's
header; amx.c the int4 and int6 matmuls on AMX tiles). The sources are built into one shared library per
instruction-set variant (`VARIANTS`, best first): `amx` (the next one plus AMX-TILE/AMX-INT8: the int4
and int6 matmuls of passes of 12 and 13 rows and more on tiles; Linux must grant the process the tile state, else the
next variant loads), `avx512bf16` (the next one plus AVX512_BF16: attention over a bfloat16 cache
multiplies with `vdpbf16ps`), `avx512vnni` (AVX-512 F/BW/VL/DQ + VNNI: the int8 matmul on 512-bit
vectors with `vpdpwssd`), `avxvnni` (the next one plus AVX-VNNI, Intel's cores since Alder Lake without
AVX-512: the int4, int6 and int8 matmuls sum with `vpdpbusd` / `vpdpwssd` on 256-bit vectors) and `avx2`
(AVX2 + FMA). At first use the best variant this CPU supports is
built into `$VERISPEC_CACHE/kernels/` (about a second with gcc; the file name hashes the source, the
compiler and the variant's flags) and opened with ctypes; `VERISPEC_KERNEL_ISA=avx2` picks a lower one
(a name that is no variant is refused: InvalidSetting).
In the avx2 and avxvnni variants the int4 and int6 kernels of 1 … 6 rows each have two sweep schedules
with the same bits; the engine times whole passes once per machine and keeps the faster (sweeps.py).
The matmuls give the same bits in every variant (exact integer sums, the same fp32 steps in the same
order; tested); attention sums in 16 lanes on AVX-512 and 8 on AVX2 (and, over a bf16 cache with
AVX512_BF16, rounds the query and the softmax weights to bf16), so whole passes agree to float rounding
across variants — and bit for bit across row counts within one. The OpenMP pool is the one torch
already loaded (same `libgomp.so.1`), so the two never fight for cores. Without a compiler, without
AVX2/FMA, or with VERISPEC_KERNELS=off, `available()` is False and callers use torch's own kernels.
`kernel_status()` says which and why; `machine()` names the CPU and its vector extensions for results files.
This file builds, loads and chooses the variants and calls the one in force; native.py holds a loaded
variant and checks every call's arguments, cpu.py tells which CPU this is, packing.py lays the weights
out, abi.py declares the structures the passes share with C, sweeps.py keeps the sweep schedules.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
from contextlib import contextmanager
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import torch

from verispec.cache import atomic_file, cache_dir
from verispec.errors import InvalidSetting
from verispec.kernels.abi import CacheLayout, DecoderDims, LayerWeights, LinearWeights, PassEnds  # noqa: F401
from verispec.kernels import cpu, packing, sweeps
from verispec.kernels.native import ABI, SWEPT_FORMATS, SWEPT_ROWS, NativeKernels  # noqa: F401
from verispec.kernels.packing import (BLOCK, int6_rows, pack_int4, pack_int6, pack_int8,  # noqa: F401
                                      select_block_rows, unpack_int4, unpack_int6, unpack_int8)

HERE = Path(__file__).parent
SOURCES = [HERE / f for f in ("gemm.c", "gemm4.c", "amx.c", "gemm6.c", "attention.c", "decoder.c")]
HEADER = HERE / "kernels.h"
BASE_FLAGS = ("-O3", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC")
_status = "not loaded"       # why no kernels are in force, or what follows "active (…)" when some are


@dataclass(frozen=True)
class Variant:
    name: str
    flags: tuple[str, ...]        # compiler flags that select the instruction set
    cpu: tuple[str, ...]          # /proc/cpuinfo flags the CPU must have


def _extend(base: Variant, name: str, flags: tuple[str, ...], cpu: tuple[str, ...]) -> Variant:
    """A variant built with everything `base` has and more (each variant below adds to the next one)."""
    return Variant(name, (*base.flags, *flags), (*base.cpu, *cpu))


_AVX2 = Variant("avx2", ("-mavx2", "-mfma", "-mf16c"), ("avx2", "fma", "f16c"))
_AVX512VNNI = _extend(_AVX2, "avx512vnni", ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512vnni"),
                      ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni"))
_AVX512BF16 = _extend(_AVX512VNNI, "avx512bf16", ("-mavx512bf16",), ("avx512_bf16",))
_AVXVNNI = _extend(_AVX2, "avxvnni", ("-mavxvnni",), ("avx_vnni",))
VARIANTS = (_extend(_AVX512BF16, "amx", ("-mamx-tile", "-mamx-int8"), ("amx_tile", "amx_int8")),
            _AVX512BF16, _AVX512VNNI, _AVXVNNI, _AVX2)


def machine() -> dict:
    """The CPU model and core, its vector extensions and the kernel variant (and build) in use, for results
    files."""
    lib = _load()
    return {"cpu_model": cpu.model_and_flags()[0], "cpu_core": cpu.core(),
            "cpu_flags": cpu.extensions(), "kernel": kernel_status(),
            "kernel_variant": None if lib is None else lib.variant,
            "kernel_build": None if lib is None else lib.build,
            "kernel_sweeps": None if lib is None else lib.schedule()}


def supported_variants() -> list[str]:
    """Variants this CPU can run, best first."""
    flags = cpu.model_and_flags()[1]
    return [v.name for v in VARIANTS if all(f in flags for f in v.cpu)]


def builds_with(name: str | None, isa: str) -> bool:
    """Whether variant `name` is compiled for instruction-set extension `isa` (gcc's -m name: "avx512f",
    "avx512bf16", …): 512-bit vectors in amx, avx512bf16 and avx512vnni, vdpbf16ps in amx and avx512bf16."""
    return any(v.name == name and f"-m{isa}" in v.flags for v in VARIANTS)


def kernel_status() -> str:
    _load_best()
    if _chosen:
        return f"active ({_described(_chosen[-1])}, chosen for a measurement)"
    return _status if _best is None else f"active ({_described(_best)})" + _status


def _described(native: NativeKernels) -> str:
    """'avx2; one sweep (first row group / later ones): int4 rows 1-5 / 1-3, …', or the variant's name."""
    schedule = sweeps.describe(native.schedule() if native.defaults is not None else None)
    return f"{native.variant}; {schedule}" if schedule else native.variant


def active_variant() -> str | None:
    lib = _load()
    return None if lib is None else lib.variant


def _cache_dir() -> Path:
    return cache_dir() / "kernels"


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")


@lru_cache(maxsize=None)
def load_variant(name: str) -> NativeKernels:
    """Build (once, cached on disk) and open one variant, with the sweep schedule kept for this machine
    in force (sweeps.py); raises RuntimeError saying why it cannot."""
    native = build_variant(name)
    sweeps.apply_kept(native, cpu.key())
    return native


def build_variant(name: str, defines: tuple[str, ...] = ()) -> NativeKernels:
    """load_variant's build and checks, with extra preprocessor definitions (`defines`, "NAME" or
    "NAME=VALUE"; the tests build deliberately broken kernels with them), and the compiled default sweep
    schedules. Not cached in memory."""
    variant = next((v for v in VARIANTS if v.name == name), None)
    if variant is None:
        raise RuntimeError(f"unknown kernel variant {name!r}; choose one of {', '.join(v.name for v in VARIANTS)}")
    missing = [f for f in variant.cpu if f not in cpu.model_and_flags()[1]]
    if missing:
        raise RuntimeError(f"the CPU lacks {', '.join(missing)} for the {name} kernels")
    compiler = _compiler()
    if compiler is None:
        raise RuntimeError("no C compiler (install gcc to build the fast int8 kernel)")
    flags = [*BASE_FLAGS, *variant.flags, *(f"-D{d}" for d in defines)]
    text = b"".join(f.read_bytes() for f in (HEADER, *SOURCES))
    key = hashlib.sha256(text + " ".join([compiler, *flags]).encode()).hexdigest()[:16]
    lib_path = _cache_dir() / f"gemm-{name}-{key}.so"
    if not lib_path.exists():
        try:
            with atomic_file(lib_path) as tmp:            # a concurrent build never sees half a file
                subprocess.run([compiler, *flags, *map(str, SOURCES), "-o", str(tmp)], check=True,
                               capture_output=True, timeout=120)
        except (subprocess.SubprocessError, OSError) as err:
            detail = (getattr(err, "stderr", b"") or b"").decode(errors="replace")[:200]
            raise RuntimeError(f"compiling the kernels for {name} failed ({detail or err})") from None
    try:
        lib = ctypes.CDLL(str(lib_path))
        if lib.verispec_kernels_abi() != ABI:
            raise OSError("ABI mismatch")
        lib.verispec_kernels_variant.restype = ctypes.c_char_p
        if lib.verispec_kernels_variant().decode() != name:
            raise OSError("built for another variant")
    except (OSError, AttributeError) as err:
        raise RuntimeError(f"loading {lib_path} failed ({err})") from None
    if "amx_tile" in variant.cpu:
        refused = lib.verispec_amx_enable()          # Linux grants the tile state on request only (amx.c)
        if refused:
            why = os.strerror(refused) if refused > 0 else "no arch_prctl"
            raise RuntimeError(f"the operating system refused the AMX tile state ({why})")
    return NativeKernels(lib, name, key)


_chosen: list[NativeKernels] = []        # variants put in force by `using`, innermost last
_best: NativeKernels | None = None        # the best variant that loaded (_load_best)


@contextmanager
def using(native: NativeKernels):
    """Inside the block every kernel call (and machine(), kernel_status()) goes to `native`, a variant from
    load_variant, instead of the best one: for measurements that compare variants on one model in one
    process. Packed weights are the same in every variant."""
    _chosen.append(native)
    try:
        yield native
    finally:
        _chosen.pop()


def _load() -> NativeKernels | None:
    return _chosen[-1] if _chosen else _load_best()


@lru_cache(maxsize=1)
def _load_best() -> NativeKernels | None:
    global _status, _best
    _best = None
    off, wanted = settings()
    if off:
        _status = "off (VERISPEC_KERNELS)"
        return None
    candidates = [wanted] if wanted else supported_variants()
    if not candidates:
        _status = "unavailable: the CPU lacks AVX2/FMA"
        return None
    skipped = []
    for name in candidates:                      # the best that builds and loads; a forced one or nothing
        try:
            native = load_variant(name)
        except RuntimeError as err:
            skipped.append(f"{name}: {err}")
            continue
        _status = f"; skipped {'; '.join(skipped)}" if skipped else ""
        _best = native
        return native
    _status = f"unavailable: {'; '.join(skipped)}"
    return None


SWITCH_OFF, SWITCH_ON = ("0", "off", "false", "no"), ("", "1", "on", "true", "yes")


def settings() -> tuple[bool, str]:
    """(switched off, the build VERISPEC_KERNEL_ISA asks for or ''), with all three kernel settings
    checked: a value a setting does not take is refused (InvalidSetting) — not read as unset, which ran a
    misspelt build on torch's slower path — so LLM calls this before it loads anything."""
    wanted = os.environ.get("VERISPEC_KERNEL_ISA", "").strip().lower()
    if wanted and wanted not in (names := [v.name for v in VARIANTS]):
        raise InvalidSetting(f"VERISPEC_KERNEL_ISA={wanted!r} names no kernel build; "
                             f"choose one of {', '.join(names)}, or leave it unset for the best this CPU runs")
    sweeps.fixed()                                         # VERISPEC_KERNEL_SWEEPS
    return switched_off(), wanted


def switched_off() -> bool:
    """VERISPEC_KERNELS=off (or 0, false, no): torch's kernels and layers instead of the native ones. A
    value that is neither off nor on is refused (InvalidSetting), not taken as on."""
    value = os.environ.get("VERISPEC_KERNELS", "").strip().lower()
    if value not in SWITCH_OFF + SWITCH_ON:
        raise InvalidSetting(f"VERISPEC_KERNELS={value!r} is not a setting: 'off' (or 0, false, no) runs on "
                             "torch's kernels; unset (or on, 1, true, yes) on the native ones")
    return value in SWITCH_OFF


def available() -> bool:
    return _load() is not None


def untuned_sweeps() -> dict[str, tuple[int, ...]] | None:
    """The compiled default sweep schedules of the kernels in force when this machine has none kept for
    them (engine/calibrate.py then times whole passes and keeps one); None when there is nothing to
    choose, one is kept, or VERISPEC_KERNEL_SWEEPS=default."""
    lib = _load()
    if lib is None or lib.defaults is None or sweeps.fixed() or sweeps.kept(lib, cpu.key()) is not None:
        return None
    return lib.defaults


def set_sweeps(schedule: dict[str, tuple[int, ...]]) -> None:
    """Put a sweep schedule in force in the kernels in force (for timing it; the bits do not change)."""
    for fmt, one in schedule.items():
        _load().set_schedule(fmt, one)


def keep_sweeps(schedule: dict[str, tuple[int, ...]]) -> None:
    """Put a sweep schedule in force and keep it for this machine, kernel build and thread count."""
    sweeps.keep(_load(), cpu.key(), schedule)


def int8_gemm(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x (M, K) float32 contiguous, packed weight from pack_int8, scales (N,) float32 -> (M, N) float32.

    Each row of x is rounded to 16-bit integers with its own scale inside the kernel (see gemm.c)."""
    return _load().int8_gemm(x, packed, scales)


def int4_gemm(x: torch.Tensor, packed: torch.Tensor, groups: torch.Tensor, supers: torch.Tensor) -> torch.Tensor:
    """x (M, K) float32 contiguous, K a multiple of 32; packed, groups and supers from pack_int4 -> (M, N16)
    float32 with N16 = N rounded up to 16 (the caller drops the padding columns). See gemm4.c."""
    return _load().int4_gemm(x, packed, groups, supers)


def int6_gemm(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, supers: torch.Tensor) -> torch.Tensor:
    """x (M, K) float32 contiguous, K a multiple of 32; packed, scales and supers from pack_int6 -> (M, N16)
    float32 (the caller drops the padding columns). See gemm6.c."""
    return _load().int6_gemm(x, packed, scales, supers)


def int4_rows(packed: torch.Tensor, groups: torch.Tensor, supers: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Rows `rows` (any shape R) of the weight pack_int4's arguments describe, (*R, K) float32 with
    unpack_int4's values bit for bit, reading only those rows (an embedding lookup): natively when the
    kernels are available (a few microseconds where the torch version takes ~15 small ops), else
    `packing.int4_rows`."""
    lib = _load()
    if lib is None:
        return packing.int4_rows(packed, groups, supers, rows)
    return lib.int4_rows(packed, groups, supers, rows)


def rmsnorm_rows(x: torch.Tensor, rows: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x (B, T, C) float32, rows (B, R) indices into T -> RMSNorm(x[b, rows[b]]) · weight, (B, R, C): the
    final norm on the rows whose logits a pass needs, with the native decoder's per-row arithmetic (one
    call where torch takes ~8 small ops). Needs the native kernels (`available()`)."""
    return _load().rmsnorm_rows(x, rows, weight, eps)


def attend_rows(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor,
                scale: float) -> torch.Tensor | None:
    """Each query row attends over exactly its own prefix (see gemm.c), or None when the tensors do not
    fit the kernel (not float32, or keys/values not contiguous along the head dimension) and the
    caller should use its own loop.

    q (B, H, T, D), keys and values (B, H_kv, S, D) sharing strides, positions (B, T) int64 ->
    out (B, T, H, D) float32 contiguous."""
    return _load().attend_rows(q, keys, values, positions, scale)


def decoder(x: torch.Tensor, weights, dims, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
            layout: "CacheLayout", keep: torch.Tensor | None = None) -> None:
    """A whole decoder pass in place on x (see decoder.c and native.py's `_decoder`)."""
    _load().decoder(x, weights, dims, cos, sin, positions, layout, keep)


def model_pass(ends: PassEnds, weights, dims, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
               layout: "CacheLayout") -> None:
    """A whole model's pass, embeddings to logits, in one call (see decoder.c's verispec_pass and
    native.py's `_model_pass`)."""
    _load().model_pass(ends, weights, dims, cos, sin, positions, layout)


