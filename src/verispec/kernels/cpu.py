"""Which CPU this is, from /proc/cpuinfo: its model, its core (a virtual machine's model name may say only
"AMD EPYC") and its vector extensions. The kernels pick their variant by the extensions; results files
and kept measurements (the K policy's costs, the sweep schedules) name the machine by all three."""

from __future__ import annotations

import platform
from functools import lru_cache
from pathlib import Path

# Vector extensions worth naming in a results file.
ISA_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni", "avx_vnni",
             "avx512_bf16", "amx_int8")

# AMD cores by (family, first model, last model): a virtual machine's model name often says only "AMD
# EPYC", while a Zen/Zen+ core does one 256-bit integer multiply every other cycle and a Zen 2 every cycle.
AMD_CORES = ((23, 0x00, 0x2F, "Zen/Zen+"), (23, 0x30, 0xAF, "Zen 2"), (25, 0x00, 0x0F, "Zen 3"),
             (25, 0x10, 0x1F, "Zen 4"), (25, 0x20, 0x5F, "Zen 3"), (25, 0x60, 0xAF, "Zen 4"),
             (26, 0x00, 0xFF, "Zen 5"))


def first_cpu(text: str) -> dict[str, str]:
    """The fields of the first CPU's block of /proc/cpuinfo's text (it ends at the first blank line)."""
    fields: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if not sep and fields:
            break
        fields.setdefault(key.strip(), value.strip())
    return fields


@lru_cache(maxsize=1)
def fields() -> dict[str, str] | None:
    """The first CPU's fields of /proc/cpuinfo, read once; None where there is no such file."""
    try:
        return first_cpu(Path("/proc/cpuinfo").read_text())
    except OSError:
        return None


def model_and_flags() -> tuple[str, frozenset[str]]:
    """(model name, flags) of the first CPU in /proc/cpuinfo; ('', {}) where it names none."""
    found = fields()
    if found is None:
        return platform.processor() or platform.machine(), frozenset()
    return found.get("model name", ""), frozenset(found.get("flags", "").split())


def core() -> str:
    """This CPU's core as `core_name` gives it."""
    return core_name(fields() or {})


def cpu_core(text: str) -> str:
    """'<vendor> family F model M' from /proc/cpuinfo's text, with the core's name for AMD's Zen
    families ('AMD family 23 model 1 (Zen/Zen+)'); '' when the text does not say."""
    return core_name(first_cpu(text))


def core_name(found: dict[str, str]) -> str:
    vendor = found.get("vendor_id", "")
    vendor = {"AuthenticAMD": "AMD", "GenuineIntel": "Intel"}.get(vendor, vendor)
    try:
        family, model = int(found["cpu family"]), int(found["model"])
    except (KeyError, ValueError):
        return ""
    name = next((n for f, lo, hi, n in AMD_CORES if vendor == "AMD" and f == family and lo <= model <= hi), "")
    return f"{vendor} family {family} model {model}" + (f" ({name})" if name else "")


def extensions() -> list[str]:
    """The vector extensions of ISA_FLAGS this CPU has, in that order."""
    flags = model_and_flags()[1]
    return [f for f in ISA_FLAGS if f in flags]


def key() -> str:
    """The CPU as a key of kept measurements: model, core and vector extensions."""
    return " ".join([model_and_flags()[0], core(), *sorted(extensions())])
