"""A safetensors file's tensors in 2 MiB pages, its header checked before anything is mapped.

safetensors' own loader maps the file without asking for huge pages, so a file cached in small folios
(as writing it leaves it) streams through 4 KiB pages at every pass. `read_safetensors` maps it with
verispec/huge_pages.py instead: in huge pages where the kernel and filesystem allow, else copied into
anonymous huge-page memory.

Layout: a u64 little-endian header length N, N bytes of JSON — {name: {"dtype", "shape",
"data_offsets": [begin, end]}, optional "__metadata__": {str: str}} — then the data section, where
each tensor's bytes lie at [begin, end) in row-major order. The header is checked first: every entry
well formed, its byte count equal to its shape times its dtype's size, its range inside the data
section and apart from every other one, so nothing is sized from a number the file cannot back.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Collection
from pathlib import Path

import torch

from verispec.errors import InvalidModelFile
from verispec.huge_pages import copy_to_huge, forget_head, map_huge, no_readahead, worth_copying

DTYPES = {"BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16, "U16": torch.uint16,
          "F16": torch.float16, "BF16": torch.bfloat16, "I32": torch.int32, "U32": torch.uint32,
          "F32": torch.float32, "F64": torch.float64, "I64": torch.int64, "U64": torch.uint64,
          "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}
MAX_HEADER = 100_000_000         # safetensors' own limit


def read_header(path: Path) -> tuple[int, dict[str, tuple[torch.dtype, tuple[int, ...], int, int]]]:
    """-> (where the data section starts, {name: (dtype, shape, begin, end)} in the file's order),
    every entry checked against the file's size; InvalidModelFile names the first that is wrong."""
    size = path.stat().st_size
    with path.open("rb") as f:
        no_readahead(f)                         # a header read must not leave the file in small folios
        head = f.read(8)
        if len(head) < 8:
            raise InvalidModelFile(path, f"{size} bytes: too short for a safetensors header")
        n = int.from_bytes(head, "little")
        if not 0 < n <= min(MAX_HEADER, size - 8):
            raise InvalidModelFile(path, f"header length {n} does not fit a file of {size} bytes")
        text = f.read(n)
        forget_head(f, 8 + n)
    try:
        header = json.loads(text.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise InvalidModelFile(path, f"safetensors header is not JSON ({str(exc)[:80]})") from None
    if not isinstance(header, dict):
        raise InvalidModelFile(path, "safetensors header is not a JSON object")
    data_size = size - 8 - n
    entries = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        entries[name] = _entry(path, name, entry, data_size)
    spans = sorted((begin, end, name) for name, (_, _, begin, end) in entries.items() if end > begin)
    for (_, end, first), (begin, _, second) in zip(spans, spans[1:]):
        if begin < end:
            raise InvalidModelFile(path, f"tensors {first!r} and {second!r} share bytes")
    return 8 + n, entries


def _entry(path: Path, name: str, entry: object, data_size: int) -> tuple[torch.dtype, tuple[int, ...], int, int]:
    shown = name[:80].encode("unicode_escape").decode()
    if not isinstance(entry, dict):
        raise InvalidModelFile(path, f"tensor {shown!r}: entry is not an object")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if dtype not in DTYPES:
        raise InvalidModelFile(path, f"tensor {shown!r}: unknown dtype {str(dtype)[:20]!r}")
    if not (isinstance(shape, list) and len(shape) <= 8
            and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)):
        raise InvalidModelFile(path, f"tensor {shown!r}: shape {str(shape)[:60]} is not a list of sizes")
    if not (isinstance(offsets, list) and len(offsets) == 2
            and all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)):
        raise InvalidModelFile(path, f"tensor {shown!r}: data_offsets {str(offsets)[:60]} is not [begin, end]")
    begin, end = offsets
    if not 0 <= begin <= end <= data_size:
        raise InvalidModelFile(path, f"tensor {shown!r}: bytes [{begin}, {end}) lie outside the "
                                     f"{data_size}-byte data section")
    torch_dtype = DTYPES[dtype]
    want = math.prod(shape) * torch_dtype.itemsize
    if end - begin != want:
        raise InvalidModelFile(path, f"tensor {shown!r}: {end - begin} bytes for shape {shape} of {dtype} "
                                     f"({want} expected)")
    return torch_dtype, tuple(shape), begin, end


def read_safetensors(path: Path, by_rows: Collection[str] = ()) -> dict[str, torch.Tensor]:
    """Every tensor of the file, in 2 MiB pages where the machine allows (verispec/huge_pages.py): views
    of the file mapped in huge pages, else of copies in anonymous huge-page memory. The tensors named in
    `by_rows`, of which a pass reads a few rows (the token embedding), stay in the file's plain mapping
    and are read from it on first touch, so that they take memory only for the rows used. A tensor
    whose offset does not suit its dtype gets a copy of its own."""
    if sys.byteorder != "little":
        raise InvalidModelFile(path, "safetensors data is little-endian and this machine is not")
    start, entries = read_header(path)
    end = start + max((e for _, _, _, e in entries.values()), default=0)
    mapped = map_huge(path, _streamed(entries, start, set(by_rows)))
    if mapped.raw.numel() < end:
        raise InvalidModelFile(path, "the file ended inside its data section")
    sources = [(0, mapped.raw.numel(), mapped.raw)]                       # (file offset, end, bytes)
    if worth_copying(mapped):
        sources = [(lo, hi, copy_to_huge(mapped, lo, hi)) for lo, hi in mapped.hot] + sources
    del mapped
    tensors = {}
    for name, (dtype, shape, begin, stop) in entries.items():
        if begin == stop:
            tensors[name] = torch.empty(shape, dtype=dtype)
            continue
        begin, stop = begin + start, stop + start
        lo, data = next((lo, data) for lo, hi, data in sources if lo <= begin and stop <= hi)
        raw = data[begin - lo:stop - lo]
        tensors[name] = (raw if raw.data_ptr() % dtype.itemsize == 0 else raw.clone()).view(dtype).view(shape)
    return tensors


def _streamed(entries: dict, start: int, by_rows: set[str]) -> list[tuple[int, int]]:
    """The file's byte ranges that hold the tensors not in by_rows: runs of them in file order, each
    run ending where a by_rows tensor lies."""
    runs: list[tuple[int, int]] = []
    last_cold = True
    for name, (_, _, begin, stop) in sorted(entries.items(), key=lambda item: item[1][2]):
        if stop == begin:
            continue
        if name in by_rows:
            last_cold = True
        elif last_cold:
            runs.append((start + begin, start + stop))
            last_cold = False
        else:
            runs[-1] = (runs[-1][0], start + stop)
    return runs
