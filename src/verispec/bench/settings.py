"""Settings of verispec's own tuning constants for one bench mode: an A/B of a policy change inside one
process (`verispec bench --modes 'hybrid,hybrid[engine.acceptance_rates.MODEL_EMA=0.2]'`).

Comparing two builds in separate processes leaves each to the machine's drift: on a shared 2-core
machine plain decoding moved by up to 17 % from one process to the next, so a few per cent between two
K-policy rules took four to eight alternated processes to see, or could not be seen at all. A mode with
settings instead runs beside the unchanged mode and plain decoding, prompt by prompt in the same
process: its LLM is built, warmed up and asked to generate with the named module constants set to the
given values, and every other mode runs with them restored.

A setting names a module of the package and one of its constants, with or without the `verispec.`
prefix: `engine.acceptance_rates.MODEL_EMA=0.2`. Only existing int, float and bool constants can be set,
to a value of the same type, so a typo fails before anything loads. The constant must be the one the code
reads at run time: a name imported elsewhere with `from … import NAME` is a copy there, which must be
set in that module instead.
"""

from __future__ import annotations

import importlib
import math
from contextlib import contextmanager

from verispec.errors import VerispecError

Setting = tuple[str, int | float | bool]          # ("verispec.engine.acceptance_rates.MODEL_EMA", 0.2)


def parse_settings(text: str) -> tuple[Setting, ...]:
    """'module.NAME=value;module.NAME=value' -> settings, each checked against the constant it sets."""
    out = []
    for item in (part.strip() for part in text.split(";")):
        if not item:
            continue
        path, sep, raw = item.partition("=")
        if not sep or not raw.strip():
            raise VerispecError(f"setting {item!r} needs the form module.NAME=value "
                                "(e.g. engine.acceptance_rates.MODEL_EMA=0.2)")
        module, name = _constant(path.strip())
        out.append((f"{module.__name__}.{name}", _value(getattr(module, name), raw.strip(), item)))
    if not out:
        raise VerispecError("empty settings: give module.NAME=value, several separated by ';'")
    return tuple(out)


@contextmanager
def applied(settings: tuple[Setting, ...]):
    """Inside the block every setting's constant holds its value; afterwards what it held before, even
    when the block raises."""
    saved = []
    try:
        for path, value in settings:
            module, name = _constant(path)
            saved.append((module, name, getattr(module, name)))
            setattr(module, name, value)
        yield
    finally:
        for module, name, old in reversed(saved):
            setattr(module, name, old)


def _constant(path: str):
    """'engine.acceptance_rates.MODEL_EMA' (or with 'verispec.') -> (the module, 'MODEL_EMA')."""
    dotted = path if path.startswith("verispec.") else f"verispec.{path}"
    mod_name, _, name = dotted.rpartition(".")
    if not name.isidentifier():
        raise VerispecError(f"setting {path!r}: name a module of verispec and one of its constants")
    try:
        module = importlib.import_module(mod_name)
    except ImportError:
        raise VerispecError(f"setting {path!r}: there is no module {mod_name}") from None
    if not hasattr(module, name):
        raise VerispecError(f"setting {path!r}: {mod_name} has no {name}")
    current = getattr(module, name)
    if not isinstance(current, (int, float)):              # bool is an int
        raise VerispecError(f"setting {path!r}: {name} is a {type(current).__name__}; only int, float and bool "
                            "constants can be set")
    return module, name


def _value(current, raw: str, item: str):
    """raw parsed as the type of the constant it replaces."""
    try:
        if isinstance(current, bool):
            if raw.lower() not in ("true", "false", "1", "0"):
                raise ValueError
            return raw.lower() in ("true", "1")
        if isinstance(current, int):
            return int(raw)
        value = float(raw)
    except ValueError:
        kind = "true or false" if isinstance(current, bool) else "an integer" if isinstance(current, int) else "a number"
        raise VerispecError(f"setting {item!r}: {raw!r} is not {kind}, as the constant it sets") from None
    if not math.isfinite(value):
        raise VerispecError(f"setting {item!r}: the value must be finite")
    return value
