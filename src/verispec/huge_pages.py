"""Weights in 2 MiB pages: a file mapped so that the kernel maps it in huge pages, else a copy in
anonymous memory advised for them.

A decode pass streams every weight once, so each 4 KiB page of them costs the CPU a TLB miss, and in a
virtual machine a miss walks two sets of page tables. Linux maps a file in 2 MiB pages when its page
cache holds the file in 2 MiB folios (filesystems with large folios, such as ext4 and xfs on recent
kernels) and the mapping is advised with MADV_HUGEPAGE; the kernel reads a file into such folios for a
mapping so advised, but a file cached before in small folios (as writing it, a plain read or reclaim
under memory pressure leaves it) stays in them. `map_file` maps, advises and faults in the byte ranges a
pass streams; the loader drops each prepared or quantized weights file it writes from the page cache
(`drop_page_cache`), and `map_huge` drops and maps again a file it finds in small folios, so that it is
read back in huge ones. Where the mapping is still in small pages (an older kernel, a filesystem without
large folios, pages another process maps), `copy_to_huge` places the bytes in an anonymous mapping advised
for huge pages, which transparent huge pages back wherever they are on (`always` or `madvise`): the same
speed, at the cost of a copy at load and of memory not shared with the page cache. What a pass reads a
few rows of (the token embedding) stays in plain pages, resident only where a lookup touched it. Not
Linux: the plain file mapping, as before.

Measured on a 2-core Xeon VM (docs/PERFORMANCE_LOG.md): plain decode of the 1.5B 1.15x faster, and the
first pass after a second of idling about half as slow as before.
"""

from __future__ import annotations

import mmap
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import torch

HUGE_PAGE = 2 << 20
MADV_POPULATE_READ = 22          # Linux 5.14: fault a range in without touching it from Python
HUGE_ENOUGH = 0.75               # of the 2 MiB-aligned span of a mapping: below it, copy into huge pages
COPY_CHUNK = 64 << 20


def thp_mode() -> str | None:
    """The kernel's transparent-huge-page mode (always / madvise / never), or None where there is none."""
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return None
    start, end = text.find("["), text.find("]")
    return text[start + 1:end] if 0 <= start < end else None


def _advise(area: mmap.mmap, start: int = 0, length: int | None = None) -> None:
    if hasattr(mmap, "MADV_HUGEPAGE"):
        area.madvise(mmap.MADV_HUGEPAGE, start, len(area) - start if length is None else length)


def _populate(area: mmap.mmap, raw: torch.Tensor, start: int, length: int) -> None:
    try:
        if sys.platform != "linux":
            raise OSError("MADV_POPULATE_READ is Linux's")
        area.madvise(MADV_POPULATE_READ, start, length)
    except (OSError, ValueError):             # elsewhere, and before Linux 5.14: touch one byte per page
        if length:
            int(raw[start:start + length:4096].sum())


@dataclass
class MappedFile:
    raw: torch.Tensor            # (size,) uint8 over the whole file
    area: mmap.mmap              # the mapping raw views (kept alive by raw too)
    hot: list[tuple[int, int]]   # the byte ranges advised and faulted in, on 2 MiB boundaries of the file
    huge: float                  # the fraction of them the kernel maps in 2 MiB pages (huge_fraction)


def hot_ranges(spans: list[tuple[int, int]], size: int) -> list[tuple[int, int]]:
    """Byte ranges [lo, hi) of a file widened to 2 MiB boundaries (the last one ends with the file) and
    merged where they meet, in order."""
    out: list[tuple[int, int]] = []
    for lo, hi in sorted(spans):
        if hi <= lo:
            continue
        lo, hi = lo // HUGE_PAGE * HUGE_PAGE, min(-(-hi // HUGE_PAGE) * HUGE_PAGE, size)
        if out and lo <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return out


def map_file(path: Path, hot: list[tuple[int, int]] | None = None) -> MappedFile:
    """The whole file over a private mapping (copy-on-write: a stray write never reaches the file), its
    `hot` byte ranges (default: all of it) advised for huge pages and faulted in. The rest (what a pass
    reads a few rows of, such as the token embedding) stays in plain pages mapped on first touch, and is
    read ahead into the page cache, so that a first lookup does not wait for the disk: the page cache
    holds it, the process only the pages it touches."""
    with open(path, "rb") as f:
        area = mmap.mmap(f.fileno(), 0, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    raw = torch.frombuffer(area, dtype=torch.uint8)           # holds `area` alive
    ranges = hot_ranges([(0, len(area))] if hot is None else hot, len(area))
    for lo, hi in ranges:
        _advise(area, lo, hi - lo)
        _populate(area, raw, lo, hi - lo)
    ends = [0, *(x for r in ranges for x in r), len(area)]
    for lo, hi in zip(ends[::2], ends[1::2]):     # the gaps between hot ranges
        if hi > lo and hasattr(mmap, "MADV_NOHUGEPAGE"):
            area.madvise(mmap.MADV_NOHUGEPAGE, lo, hi - lo)   # a lookup maps 4 KiB, not a 2 MiB folio
        if hi > lo and hasattr(mmap, "MADV_WILLNEED"):
            area.madvise(mmap.MADV_WILLNEED, lo, hi - lo)
    return MappedFile(raw, area, ranges, _huge_fraction_of(raw.data_ptr(), ranges))


def map_huge(path: Path, hot: list[tuple[int, int]] | None = None) -> MappedFile:
    """map_file; where the mapping comes out mostly in small pages and transparent huge pages are on,
    the file is dropped from the page cache and mapped again, which reads it from disk into 2 MiB folios
    where the filesystem has them. A page cache holds a file in small folios after a plain read or a
    write, or after reclaim split and evicted parts of it under memory pressure; reading the 1.5B's
    1.1 GB back took 0.6 s on a 2-core Xeon guest, copy_to_huge 3-4 s. Pages that another process maps
    stay cached, and then the mapping stays small: the caller copies (worth_copying)."""
    mapped = map_file(path, hot)
    if not worth_copying(mapped):
        return mapped
    del mapped                                  # unmapped: its pages may leave the page cache
    with open(path, "rb") as f:                 # nothing to write out: only read, so no fsync
        _fadvise(f, 0, 0, "POSIX_FADV_DONTNEED")
    return map_file(path, hot)


def forget_head(f: BinaryIO, nbytes: int) -> None:
    """Drop from the page cache what a read of the first nbytes of f left there (f opened with
    no_readahead), so that those small folios do not keep the file's first 2 MiB out of a huge page."""
    _fadvise(f, 0, -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE,   # whole pages: the kernel keeps a page
             "POSIX_FADV_DONTNEED")                                 # the range ends inside


def no_readahead(f: BinaryIO) -> None:
    """Read f without readahead (only the pages read enter the page cache, in small folios)."""
    _fadvise(f, 0, 0, "POSIX_FADV_RANDOM")


def _fadvise(f: BinaryIO, offset: int, length: int, advice: str) -> None:
    """posix_fadvise where the OS has it; advice only, so a filesystem that refuses it changes nothing
    else (the file still reads, in whatever pages the kernel gives it)."""
    if hasattr(os, "posix_fadvise"):
        try:
            os.posix_fadvise(f.fileno(), offset, length, getattr(os, advice))
        except OSError:
            pass


def worth_copying(mapped: MappedFile) -> bool:
    """Whether copy_to_huge would put the file in huge pages that its mapping does not have: on Linux,
    with transparent huge pages on, for a mapping mostly in small pages."""
    return sys.platform == "linux" and thp_mode() in ("always", "madvise") and mapped.huge < HUGE_ENOUGH


def drop_page_cache(path: Path) -> None:
    """Write the file out and drop it from the page cache (other processes keep what they have mapped),
    so that its first reader through map_file has it read into 2 MiB folios rather than mapping the
    small ones its writing left. Nothing where the OS has no such call."""
    if not hasattr(os, "posix_fadvise"):
        return
    with open(path, "rb") as f:
        os.fsync(f.fileno())
        _fadvise(f, 0, 0, "POSIX_FADV_DONTNEED")


def huge_fraction(t: torch.Tensor) -> float:
    """The fraction of the 2 MiB-aligned span of the mapping holding t that the kernel maps in 2 MiB pages
    (FilePmdMapped + AnonHugePages in /proc/self/smaps); 1.0 for a mapping with no such span (under
    4 MiB: nothing to gain), 0.0 where smaps cannot tell."""
    address = t.data_ptr()
    mapping = next(((lo, hi) for lo, hi, _ in _mappings() if lo <= address < hi), None)
    if mapping is None:
        return 0.0
    return _huge_fraction_of(0, [mapping])


def _huge_fraction_of(base: int, ranges: list[tuple[int, int]]) -> float:
    """huge_fraction over the address ranges [base + lo, base + hi): the mappings inside them."""
    span = sum(max(0, (base + hi) // HUGE_PAGE - -(-(base + lo) // HUGE_PAGE)) * HUGE_PAGE for lo, hi in ranges)
    if span <= 0:
        return 1.0
    mappings = _mappings()
    if not mappings:
        return 0.0
    page = mmap.PAGESIZE
    huge = sum(h for lo, hi, h in mappings
               if any(base + a <= lo and hi <= base + -(-b // page) * page for a, b in ranges))
    return min(1.0, huge / span)


def _mappings() -> list[tuple[int, int, int]]:
    """(start, end, bytes in 2 MiB pages) of each of the process's mappings; [] where smaps cannot tell."""
    out: list[tuple[int, int, int]] = []
    try:
        with open("/proc/self/smaps") as f:
            for line in f:
                first = line.split(maxsplit=1)[0]
                if "-" in first and ":" not in first:
                    lo, hi = (int(x, 16) for x in first.split("-"))
                    out.append((lo, hi, 0))
                elif out and line.startswith(("FilePmdMapped:", "AnonHugePages:")):
                    lo, hi, huge = out[-1]
                    out[-1] = (lo, hi, huge + int(line.split()[1]) * 1024)
    except OSError:
        return []
    return out


def huge_bytes(nbytes: int) -> torch.Tensor:
    """A uint8 tensor of nbytes (zeros) starting on a 2 MiB boundary, in an anonymous mapping advised
    to use huge pages; the mapping is released when the last tensor viewing it is freed."""
    if nbytes <= 0 or not hasattr(mmap, "MAP_ANONYMOUS"):
        return torch.zeros(max(nbytes, 0), dtype=torch.uint8)
    area = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    _advise(area)
    raw = torch.frombuffer(area, dtype=torch.uint8)          # holds `area` alive
    start = -raw.data_ptr() % HUGE_PAGE
    return raw[start:start + nbytes]


def copy_to_huge(mapped: MappedFile, start: int, end: int) -> torch.Tensor:
    """The file's bytes [start, end) copied into huge_bytes chunk by chunk, each chunk's pages of the
    mapping released once copied (MADV_DONTNEED: the page cache keeps them), so that the process never
    holds both copies whole."""
    block = huge_bytes(end - start)
    for lo in range(start, end, COPY_CHUNK):
        hi = min(lo + COPY_CHUNK, end)
        block[lo - start:hi - start].copy_(mapped.raw[lo:hi])
        first, last = -(-lo // mmap.PAGESIZE) * mmap.PAGESIZE, hi // mmap.PAGESIZE * mmap.PAGESIZE
        if last > first and hasattr(mmap, "MADV_DONTNEED"):
            mapped.area.madvise(mmap.MADV_DONTNEED, first, last - first)
    return block
