"""Mutants of a valid GGUF file for the fuzz tests: byte-level damage (flips, extreme fields,
truncation, splices) and structure-aware changes that a byte flip rarely reaches (a metadata value of
the wrong type or an extreme value, invalid UTF-8, a hostile chat template, broken tokenizer arrays,
duplicated or reshaped tensors). Structured mutants are written by `write_gguf`, a serializer of our
own that writes whatever it is given, valid or not."""

from __future__ import annotations

import random
import struct
from dataclasses import dataclass, field

# GGUF value types
U8, I8, U16, I16, U32, I32, F32, BOOL, STR, ARR, U64, I64, F64 = range(13)
_SCALAR = {U8: "<B", I8: "<b", U16: "<H", I16: "<h", U32: "<I", I32: "<i", F32: "<f", BOOL: "<?",
           U64: "<Q", I64: "<q", F64: "<d"}


@dataclass
class Tensor:
    name: bytes
    dims: list[int]          # as stored (fastest-varying first)
    ggml_type: int
    data: bytes


@dataclass
class Gguf:
    """A GGUF file as values: metadata (key, type, value; arrays as (element type, [values])) and tensors."""
    kv: list[tuple[bytes, int, object]] = field(default_factory=list)
    tensors: list[Tensor] = field(default_factory=list)
    alignment: int = 32

    @classmethod
    def read(cls, path) -> "Gguf":
        from gguf import GGUFReader
        r = GGUFReader(str(path))
        g = cls()
        for key, f in r.fields.items():
            if key.startswith("GGUF."):
                continue
            t = int(f.types[0])
            if t == STR:
                value = bytes(f.parts[f.data[0]])
            elif t == ARR:
                et = int(f.types[1])
                value = (et, [bytes(f.parts[i]) if et == STR else f.parts[i][0].item() for i in f.data])
            else:
                value = f.parts[f.data[0]][0].item()
            g.kv.append((key.encode(), t, value))
        raw = open(path, "rb").read()
        for t in r.tensors:
            start = int(t.data_offset)
            g.tensors.append(Tensor(t.name.encode(), [int(d) for d in t.field.parts[3]], int(t.tensor_type),
                                    raw[start:start + int(t.n_bytes)]))
        return g


def _value(vtype: int, value) -> bytes:
    if vtype == STR:
        return struct.pack("<Q", len(value)) + value
    if vtype == ARR:
        et, items = value
        return struct.pack("<IQ", et, len(items)) + b"".join(_value(et, v) for v in items)
    return struct.pack(_SCALAR[vtype], value)


def write_gguf(g: Gguf) -> bytes:
    """Serialize as given: offsets follow the tensors' order, each aligned to g.alignment."""
    out = [b"GGUF", struct.pack("<IQQ", 3, len(g.tensors), len(g.kv))]
    for key, vtype, value in g.kv:
        out += [_value(STR, key), struct.pack("<I", vtype), _value(vtype, value)]
    offsets, at = [], 0
    for t in g.tensors:
        offsets.append(at)
        at += -(-len(t.data) // g.alignment) * g.alignment
    for t, off in zip(g.tensors, offsets):
        out += [_value(STR, t.name), struct.pack("<I", len(t.dims)), *(struct.pack("<Q", d) for d in t.dims),
                struct.pack("<IQ", t.ggml_type, off)]
    head = b"".join(out)
    head += b"\0" * (-len(head) % g.alignment)
    body = b"".join(t.data + b"\0" * (-len(t.data) % g.alignment) for t in g.tensors)
    return head + body


# ---- byte-level damage ----

def mutate_bytes(data: bytes, rng: random.Random) -> tuple[bytes, str]:
    """Flip bytes, overwrite an 8-byte field with an extreme value, write an odd float, truncate, or
    splice. Most land in the header (the first few KB), where parsers go wrong; a quarter anywhere."""
    b = bytearray(data)
    region = len(b) if rng.random() < 0.25 else min(len(b), 4096)
    kind = rng.choice(["flip", "u64", "f32", "truncate", "splice"])
    if kind == "flip":
        for _ in range(rng.randint(1, 8)):
            b[rng.randrange(region)] = rng.randrange(256)
    elif kind == "u64":
        at = rng.randrange(8, region - 8)
        value = rng.choice([0, 1, 2**31, 2**32 - 1, 2**63, 2**64 - 1, rng.randrange(2**64)])
        b[at:at + 8] = struct.pack("<Q", value)
    elif kind == "f32":
        at = rng.randrange(8, region - 4)
        b[at:at + 4] = struct.pack("<f", rng.choice([float("nan"), float("inf"), -1.0, 0.0, 1e30]))
    elif kind == "truncate":
        b = b[:rng.randrange(len(b))]
    else:
        at, n = rng.randrange(region), rng.randint(1, 64)
        b[at:at] = bytes(rng.randrange(256) for _ in range(n))
    return bytes(b), kind


# ---- structure-aware changes ----

HOSTILE_TEMPLATES = [
    b"{% for m in messages %}{{ m",                                   # does not compile
    b"{{ undefined_function() }}",                                    # undefined name
    b"{{ raise_exception('roles must alternate') }}",                 # rejects every conversation
    b"{{ ''.__class__.__mro__[1].__subclasses__() }}",               # sandbox violation
    b"{% for i in range(10**9) %}x{% endfor %}",                      # a long loop
    b"{{ 'x' * 10**10 }}",                                            # a huge string
    b"{{ messages[0]['content'] * 10**9 }}",
    b"{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",        # unbounded recursion
    b"{{ messages | tojson }}",                                       # harmless
    b"\xff\xfe{{ messages }}",                                        # invalid UTF-8
    b"",
]

HOSTILE_VALUES = [
    (STR, b"x"), (STR, b"\xff\xfe\xfd"), (STR, b"a" * 100_000), (U32, 0), (U32, 2**32 - 1), (I32, -1),
    (U64, 2**63), (U64, 2**64 - 1), (I64, -(2**63)), (F32, float("nan")), (F32, float("inf")), (F32, -1.0),
    (F32, 0.0), (F64, 1e300), (BOOL, True), (ARR, (STR, [b"a", b"b"])), (ARR, (U32, [])), (ARR, (I32, [1] * 3)),
    (U8, 255), (I8, -128),
]


def mutate_structure(g: Gguf, rng: random.Random) -> tuple[bytes, str]:
    """One structure-aware change of a parsed file; returns the serialized mutant and its kind."""
    g = Gguf(list(g.kv), [Tensor(t.name, list(t.dims), t.ggml_type, t.data) for t in g.tensors], g.alignment)
    kind = rng.choice(["value", "drop-key", "duplicate-key", "template", "tokens", "tensor"])
    keys = [k for k, _, _ in g.kv]
    if kind == "value":
        i = rng.randrange(len(g.kv))
        vtype, value = rng.choice(HOSTILE_VALUES)
        g.kv[i] = (g.kv[i][0], vtype, value)
    elif kind == "drop-key":
        del g.kv[rng.randrange(len(g.kv))]
    elif kind == "duplicate-key":
        i = rng.randrange(len(g.kv))
        vtype, value = rng.choice(HOSTILE_VALUES)
        g.kv.append((g.kv[i][0], vtype, value))
    elif kind == "template":
        g.kv = [kv for kv in g.kv if kv[0] != b"tokenizer.chat_template"]
        g.kv.append((b"tokenizer.chat_template", STR, rng.choice(HOSTILE_TEMPLATES)))
    elif kind == "tokens" and b"tokenizer.ggml.tokens" in keys:
        key = rng.choice([b"tokenizer.ggml.tokens", b"tokenizer.ggml.merges", b"tokenizer.ggml.token_type"])
        at = next((i for i, k in enumerate(keys) if k == key), None)
        if at is None:
            return write_gguf(g), kind
        et, items = g.kv[at][2]
        items = list(items)
        how = rng.choice(["drop", "duplicate", "garble", "empty", "no-space", "huge"])
        if how == "drop" and items:
            del items[rng.randrange(len(items))]
        elif how == "duplicate" and items:
            items.insert(rng.randrange(len(items)), rng.choice(items))
        elif how == "garble" and items:
            j = rng.randrange(len(items))
            items[j] = b"\xc3\x28" if et == STR else rng.choice([-1, 99, 2**31 - 1])
        elif how == "empty" and items:
            items[rng.randrange(len(items))] = b"" if et == STR else 0
        elif how == "no-space" and et == STR and items:
            items[rng.randrange(len(items))] = b"abc"
        elif how == "huge":
            items = items * 50
        g.kv[at] = (key, ARR, (et, items))
    elif kind == "tensor":
        t = rng.randrange(len(g.tensors))
        how = rng.choice(["duplicate", "drop", "dims", "type", "rename", "empty-name"])
        if how == "duplicate":
            g.tensors.append(g.tensors[t])
        elif how == "drop":
            del g.tensors[t]
        elif how == "dims":
            g.tensors[t].dims = [rng.choice([0, 1, 2, 31, 2**32, 2**40]) for _ in g.tensors[t].dims]
        elif how == "type":
            g.tensors[t].ggml_type = rng.choice([1, 2, 3, 6, 8, 12, 14, 30, 39, 1000])
        elif how == "rename":
            g.tensors[t].name = rng.choice([b"blk.0", b"blk.99.attn_q.weight", b"output.weight", b"\xff\x00"])
        else:
            g.tensors[t].name = b""
    return write_gguf(g), kind
