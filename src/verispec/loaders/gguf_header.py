"""A bounded pre-scan of a GGUF header, before the `gguf` package parses it.

The package allocates by the counts a header states (an array of 2⁶⁰ items, a string of 2⁵⁰ bytes)
and so spends gigabytes and minutes on a corrupt or hostile file. `check_header` walks the same
structure with every count and length checked against the bytes that remain in the file first, and
raises `InvalidModelFile` naming the first field that cannot be right. It reads the header once,
in order, without allocating more than one string at a time.

Layout (GGUF v2/v3, little-endian): magic "GGUF", version u32, tensor count u64, metadata count u64;
each metadata entry a string key (u64 length + bytes), a u32 value type and the value (an array is a
u32 item type, a u64 count and the items); each tensor entry a string name, u32 dimension count,
u64 dimensions, u32 type and u64 offset.
"""

from __future__ import annotations

import struct
from pathlib import Path

from verispec.errors import InvalidModelFile

# value type -> fixed size in bytes (8 = string and 9 = array have their own layout)
FIXED = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
STRING, ARRAY = 8, 9
MAX_KEY = 1 << 16            # metadata keys and tensor names are short
MAX_DIMS = 4


class _Cursor:
    """Reads a file in order; every read first checks that the file holds that many more bytes."""

    def __init__(self, f, size: int, path: Path):
        self.f, self.size, self.pos, self.path = f, size, 0, path

    def fail(self, what: str):
        raise InvalidModelFile(self.path, f"{what} (header byte {self.pos})")

    def take(self, n: int, what: str) -> bytes:
        if n < 0 or n > self.size - self.pos:
            self.fail(f"{what} runs past the end of the file")
        out = self.f.read(n)
        self.pos += n
        return out

    def skip(self, n: int, what: str) -> None:
        if n < 0 or n > self.size - self.pos:
            self.fail(f"{what} runs past the end of the file")
        self.f.seek(n, 1)
        self.pos += n

    def u32(self, what: str) -> int:
        return struct.unpack("<I", self.take(4, what))[0]

    def u64(self, what: str) -> int:
        return struct.unpack("<Q", self.take(8, what))[0]

    def string(self, what: str, limit: int | None = None) -> bytes:
        n = self.u64(f"{what} length")
        if limit is not None and n > limit:
            self.fail(f"{what} of {n} bytes (at most {limit})")
        return self.take(n, what)

    def remaining(self) -> int:
        return self.size - self.pos


def _skip_value(c: _Cursor, vtype: int, key: str, depth: int = 0) -> None:
    if vtype in FIXED:
        c.skip(FIXED[vtype], f"value of {key}")
    elif vtype == STRING:
        c.skip(c.u64(f"string length in {key}"), f"string value of {key}")
    elif vtype == ARRAY:
        if depth > 1:
            c.fail(f"arrays nested too deep in {key}")
        item = c.u32(f"array type of {key}")
        count = c.u64(f"array length of {key}")
        smallest = FIXED.get(item, 8 if item in (STRING, ARRAY) else None)
        if smallest is None:
            c.fail(f"unknown array item type {item} in {key}")
        if count * smallest > c.remaining():
            c.fail(f"array {key} claims {count} items, more than the file holds")
        if item in FIXED:
            c.skip(count * FIXED[item], f"array {key}")
        else:
            for _ in range(count):
                _skip_value(c, item, key, depth + 1)
    else:
        c.fail(f"unknown value type {vtype} for {key}")


def check_header(path: Path) -> None:
    """Walk the header of the GGUF file at path; InvalidModelFile at the first impossible field."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        c = _Cursor(f, size, path)
        if c.take(4, "magic") != b"GGUF":
            c.fail("not a GGUF file (bad magic)")
        version = c.u32("version")
        if version not in (2, 3):
            c.fail(f"unsupported GGUF version {version}")
        n_tensors, n_kv = c.u64("tensor count"), c.u64("metadata count")
        if n_kv * 13 > c.remaining() or n_tensors * 24 > c.remaining():
            c.fail(f"{n_kv} metadata entries and {n_tensors} tensors cannot fit in the file")
        for i in range(n_kv):
            key = c.string(f"metadata key {i}", MAX_KEY).decode("utf-8", "replace")
            _skip_value(c, c.u32(f"value type of {key}"), key)
        for i in range(n_tensors):
            c.string(f"tensor name {i}", MAX_KEY)
            dims = c.u32(f"dimension count of tensor {i}")
            if not 1 <= dims <= MAX_DIMS:
                c.fail(f"tensor {i} has {dims} dimensions")
            elements = 1
            for _ in range(dims):
                elements *= c.u64(f"dimension of tensor {i}")
            if elements >= 1 << 40:
                c.fail(f"tensor {i} claims {elements} elements")
            c.u32(f"type of tensor {i}")
            offset = c.u64(f"offset of tensor {i}")
            if offset >= size:
                c.fail(f"tensor {i} starts at offset {offset}, past the end of the file")
