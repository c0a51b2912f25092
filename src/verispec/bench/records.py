"""JSON-lines files of records (prompt suites, recorded answers): one record per non-blank line, each
turned into an item by the caller's `build`, every failure a `VerispecError` that names the file and
the line."""

from __future__ import annotations

import json
from typing import Callable, TypeVar

from verispec.errors import VerispecError

T = TypeVar("T")


class Invalid(Exception):
    """Raised by a `build` for a well-formed record whose values cannot stand (the message says why)."""


def parse_records(text: str, source: str, what: str, build: Callable[[dict], T]) -> list[T]:
    """build(record) for each line of text that is not blank. A line that is not JSON, or whose record
    lacks a field or holds one of the wrong type, is "<source>, line <n>: not a <what> (…)"; an
    `Invalid` from build is "<source>, line <n>: <its message>"."""
    items = []
    for n, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            items.append(build(json.loads(line)))
        except Invalid as exc:
            raise VerispecError(f"{source}, line {n}: {exc}") from None
        except (KeyError, TypeError, ValueError) as exc:          # JSONDecodeError is a ValueError
            raise VerispecError(f"{source}, line {n}: not a {what} ({exc})") from None
    return items
