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
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
from contextlib import contextmanager
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import torch

from verispec.cache import atomic_file, cache_dir
from verispec.errors import InvalidSetting
from verispec.kernels.abi import (CacheLayout, DecoderDims, LayerWeights, LinearWeights, PassEnds,  # noqa: F401
                                  bf16_block_length, pairs_from_keys, pairs_from_values)
from verispec.kernels import packing, sweeps
from verispec.kernels.packing import (BLOCK, int6_rows, pack_int4, pack_int6, pack_int8,  # noqa: F401
                                      select_block_rows, unpack_int4, unpack_int6, unpack_int8)

HERE = Path(__file__).parent
SOURCES = [HERE / f for f in ("gemm.c", "gemm4.c", "amx.c", "gemm6.c", "attention.c", "decoder.c")]
HEADER = HERE / "kernels.h"
ABI = 22
SWEPT_FORMATS = ("int4", "int6")     # matmuls whose row counts 1 … SWEPT_ROWS choose a sweep schedule
SWEPT_ROWS = 6
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
# Vector extensions worth naming in a results file.
ISA_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni", "avx_vnni",
             "avx512_bf16", "amx_int8")


def _first_cpu(text: str) -> dict[str, str]:
    """The fields of the first CPU's block of /proc/cpuinfo's text (it ends at the first blank line)."""
    fields: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if not sep and fields:
            break
        fields.setdefault(key.strip(), value.strip())
    return fields


@lru_cache(maxsize=1)
def _cpu_fields() -> dict[str, str] | None:
    """The first CPU's fields of /proc/cpuinfo, read once; None where there is no such file."""
    try:
        return _first_cpu(Path("/proc/cpuinfo").read_text())
    except OSError:
        return None


def _cpuinfo() -> tuple[str, frozenset[str]]:
    """(model name, flags) of the first CPU in /proc/cpuinfo; ('', {}) where it names none."""
    fields = _cpu_fields()
    if fields is None:
        return platform.processor() or platform.machine(), frozenset()
    return fields.get("model name", ""), frozenset(fields.get("flags", "").split())


# AMD cores by (family, first model, last model): a virtual machine's model name often says only "AMD
# EPYC", while a Zen/Zen+ core does one 256-bit integer multiply every other cycle and a Zen 2 every cycle.
AMD_CORES = ((23, 0x00, 0x2F, "Zen/Zen+"), (23, 0x30, 0xAF, "Zen 2"), (25, 0x00, 0x0F, "Zen 3"),
             (25, 0x10, 0x1F, "Zen 4"), (25, 0x20, 0x5F, "Zen 3"), (25, 0x60, 0xAF, "Zen 4"),
             (26, 0x00, 0xFF, "Zen 5"))


def cpu_core(text: str) -> str:
    """'<vendor> family F model M' from /proc/cpuinfo's text, with the core's name for AMD's Zen
    families ('AMD family 23 model 1 (Zen/Zen+)'); '' when the text does not say."""
    return _core_name(_first_cpu(text))


def _core_name(fields: dict[str, str]) -> str:
    vendor = fields.get("vendor_id", "")
    vendor = {"AuthenticAMD": "AMD", "GenuineIntel": "Intel"}.get(vendor, vendor)
    try:
        family, model = int(fields["cpu family"]), int(fields["model"])
    except (KeyError, ValueError):
        return ""
    name = next((n for f, lo, hi, n in AMD_CORES if vendor == "AMD" and f == family and lo <= model <= hi), "")
    return f"{vendor} family {family} model {model}" + (f" ({name})" if name else "")


def machine() -> dict:
    """The CPU model and core, its vector extensions and the kernel variant (and build) in use, for results
    files."""
    model, flags = _cpuinfo()
    lib = _load()
    return {"cpu_model": model, "cpu_core": _core_name(_cpu_fields() or {}),
            "cpu_flags": [f for f in ISA_FLAGS if f in flags], "kernel": kernel_status(),
            "kernel_variant": None if lib is None else lib.variant,
            "kernel_build": None if lib is None else lib.build,
            "kernel_sweeps": None if lib is None else lib.schedule()}


def supported_variants() -> list[str]:
    """Variants this CPU can run, best first."""
    flags = _cpuinfo()[1]
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


@lru_cache(maxsize=None)
def load_variant(name: str) -> NativeKernels:
    """Build (once, cached on disk) and open one variant, with the sweep schedule kept for this machine
    in force (sweeps.py); raises RuntimeError saying why it cannot."""
    native = build_variant(name)
    sweeps.apply_kept(native, _cpu_key())
    return native


def _cpu_key() -> str:
    """The CPU as a key of kept measurements: model, core and vector extensions."""
    model, flags = _cpuinfo()
    return " ".join([model, _core_name(_cpu_fields() or {}), *sorted(f for f in ISA_FLAGS if f in flags)])


def build_variant(name: str, defines: tuple[str, ...] = ()) -> NativeKernels:
    """load_variant's build and checks, with extra preprocessor definitions (`defines`, "NAME" or
    "NAME=VALUE"; the tests build deliberately broken kernels with them), and the compiled default sweep
    schedules. Not cached in memory."""
    variant = next((v for v in VARIANTS if v.name == name), None)
    if variant is None:
        raise RuntimeError(f"unknown kernel variant {name!r}; choose one of {', '.join(v.name for v in VARIANTS)}")
    missing = [f for f in variant.cpu if f not in _cpuinfo()[1]]
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
    wanted = os.environ.get("VERISPEC_KERNEL_ISA", "").strip().lower()
    if wanted and wanted not in (names := [v.name for v in VARIANTS]):      # a misspelt setting is refused,
        raise InvalidSetting(f"VERISPEC_KERNEL_ISA={wanted!r} names no kernel build; "  # not run slowly
                             f"choose one of {', '.join(names)}, or leave it unset for the best this CPU runs")
    sweeps.fixed()                                         # refuses a VERISPEC_KERNEL_SWEEPS it does not take
    if os.environ.get("VERISPEC_KERNELS", "").lower() in ("0", "off", "false", "no"):
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


def available() -> bool:
    return _load() is not None


def untuned_sweeps() -> dict[str, tuple[int, ...]] | None:
    """The compiled default sweep schedules of the kernels in force when this machine has none kept for
    them (engine/calibrate.py then times whole passes and keeps one); None when there is nothing to
    choose, one is kept, or VERISPEC_KERNEL_SWEEPS=default."""
    lib = _load()
    if lib is None or lib.defaults is None or sweeps.fixed() or sweeps.kept(lib, _cpu_key()) is not None:
        return None
    return lib.defaults


def set_sweeps(schedule: dict[str, tuple[int, ...]]) -> None:
    """Put a sweep schedule in force in the kernels in force (for timing it; the bits do not change)."""
    for fmt, one in schedule.items():
        _load().set_schedule(fmt, one)


def keep_sweeps(schedule: dict[str, tuple[int, ...]]) -> None:
    """Put a sweep schedule in force and keep it for this machine, kernel build and thread count."""
    sweeps.keep(_load(), _cpu_key(), schedule)


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
    """A whole decoder pass in place on x (see decoder.c and `_decoder`)."""
    _load().decoder(x, weights, dims, cos, sin, positions, layout, keep)


def model_pass(ends: PassEnds, weights, dims, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
               layout: "CacheLayout") -> None:
    """A whole model's pass, embeddings to logits, in one call (see decoder.c's verispec_pass and
    `_model_pass`)."""
    _load().model_pass(ends, weights, dims, cos, sin, positions, layout)


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
