"""Each row count's sweep schedule in the int4 and int6 matmuls, chosen once per machine.

In the avx2 and avxvnni variants a 16-column block of weights is two 8-lane vectors, and the kernel for M
rows (1 … 6; wider passes run in groups of up to 6 rows) either takes both halves in one sweep over the
block's groups — two accumulator chains per row, each group's weights and scales read once — or one half
per sweep, with half the accumulators live and the block read twice (the second time from cache, while
memory waits). Every column lane sees the same operations in the same order either way, so the bits are
the same (tested) and the choice is speed only. Which is faster depends on the core (how many
accumulators fit in its 16 vector registers before the compiler spills them, how many multiplies it
issues per cycle) and on its memory: timed alone with the weights in cache, one sweep of 5 or 6 int4 rows
ran 1.06–1.22x slower than two on a Golden Cove core, yet in whole 1.5B passes, where the weights stream
from memory, one sweep was faster at every row count (6 rows: 80.5 against 86.2 ms).

So the engine times whole passes of the model it runs (engine/calibrate.py: `tune_sweeps`) and keeps the
result here, per kernel build, CPU and thread count, in `$VERISPEC_CACHE/kernels/sweeps.json`;
`load_variant` puts a kept schedule in force. `choose` keeps the compiled default (kernels' NH4 / NH6)
unless the other schedule is faster by more than MARGIN. VERISPEC_KERNEL_SWEEPS=default keeps the
compiled defaults and times nothing.
"""

from __future__ import annotations

import json
import os

import torch

from verispec.cache import cache_dir, write_json
from verispec.errors import InvalidSetting

MARGIN = 0.03           # a schedule replaces the compiled default only when this much faster


def describe(schedule: dict[str, tuple[int, ...]] | None) -> str:
    """'one sweep (first row group / later ones): int4 rows 1-5 / 1-3, int6 rows 1-4 / none' for a schedule
    (NativeKernels.schedule); '' for none."""
    if schedule is None:
        return ""

    def rows(one: tuple[int, ...]) -> str:
        ms = [m for m, v in enumerate(one, 1) if v]
        if not ms:
            return "none"
        return f"1-{ms[-1]}" if ms == list(range(1, ms[-1] + 1)) and len(ms) > 1 else ",".join(map(str, ms))
    half = len(next(iter(schedule.values()))) // 2
    return "one sweep (first row group / later ones): " + ", ".join(
        f"{fmt} rows {rows(one[:half])} / {rows(one[half:])}" for fmt, one in schedule.items())


def fixed() -> bool:
    """VERISPEC_KERNEL_SWEEPS=default: the compiled defaults, nothing timed or kept. Unset or empty: the
    kept schedule, or one timed once. Any other value is refused (InvalidSetting) rather than read as
    unset, so that a misspelt setting does not time and keep what it meant to avoid."""
    value = os.environ.get("VERISPEC_KERNEL_SWEEPS", "").strip().lower()
    if value not in ("", "default"):
        raise InvalidSetting(f"VERISPEC_KERNEL_SWEEPS={value!r} is not a setting: 'default' keeps the compiled "
                         "sweep schedules; unset, they are timed once per machine and kept")
    return value == "default"


def _path():
    return cache_dir() / "kernels" / "sweeps.json"


def _key(native, cpu: str) -> str:
    """variant|build|where: a kept schedule's key."""
    return f"{native.variant}|{native.build}|{_where(cpu)}"


def _where(cpu: str) -> str:
    return f"{cpu}|{torch.get_num_threads()} threads"


def _stored() -> dict:
    try:
        stored = json.loads(_path().read_text())
    except (OSError, ValueError):
        return {}
    return stored if isinstance(stored, dict) else {}


def kept(native, cpu: str) -> dict[str, tuple[int, ...]] | None:
    """The schedule kept for this build, CPU and thread count, or None (none kept, a variant without a
    choice, VERISPEC_KERNEL_SWEEPS=default, or an entry that is not a schedule: timed again)."""
    defaults = native.defaults
    if fixed() or defaults is None:
        return None
    entry = _stored().get(_key(native, cpu))
    if not isinstance(entry, dict) or set(entry) != set(defaults):
        return None
    out = {}
    for fmt, one in entry.items():
        if not isinstance(one, list) or len(one) != len(defaults[fmt]) or any(v not in (0, 1) for v in one):
            return None
        out[fmt] = tuple(int(v) for v in one)
    return out


def keep(native, cpu: str, schedule: dict[str, tuple[int, ...]]) -> None:
    """Put `schedule` in force in `native` and keep it for this build, CPU and thread count, in place of
    any kept for another build of the variant on this CPU (other entries stay; a read-only cache keeps
    nothing, and the next process times again)."""
    for fmt, one in schedule.items():
        native.set_schedule(fmt, one)
    stored = {k: v for k, v in _stored().items()            # another build of this variant here: stale
              if not (k.startswith(f"{native.variant}|") and k.endswith(f"|{_where(cpu)}"))}
    stored[_key(native, cpu)] = {fmt: list(one) for fmt, one in schedule.items()}
    write_json(_path(), stored)


def apply_kept(native, cpu: str) -> None:
    """Put the kept schedule, if any, in force in `native`."""
    for fmt, one in (kept(native, cpu) or {}).items():
        native.set_schedule(fmt, one)


def choose(times: dict[str, dict[int, tuple[float, float]]], defaults: dict[str, tuple[int, ...]],
           margin: float = MARGIN) -> dict[str, tuple[int, ...]]:
    """The compiled defaults, with each timed entry (times[format][index]: seconds with a sweep per half,
    with one sweep) set to the other schedule where that is faster by more than `margin` (a tie on a noisy
    machine keeps the default)."""
    out = {}
    for fmt, one in defaults.items():
        chosen = list(one)
        for i, t in times.get(fmt, {}).items():
            d = one[i]
            chosen[i] = 1 - d if t[1 - d] < (1 - margin) * t[d] else d
        out[fmt] = tuple(chosen)
    return out
