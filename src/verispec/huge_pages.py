"""Weights in 2 MiB pages: a file mapped so that the kernel maps it in huge pages, else a copy in
anonymous memory advised for them.

A decode pass streams every weight once, so each 4 KiB page of them costs the CPU a TLB miss, and in a
virtual machine a miss walks two sets of page tables. Linux maps a file in 2 MiB pages when its page
cache holds the file in 2 MiB folios (filesystems with large folios, such as ext4 and xfs on recent
kernels) and the mapping is advised with MADV_HUGEPAGE; the kernel reads a file into such folios for a
mapping so advised, but a file cached before in small folios (as writing it leaves it) stays in them.
`map_file` maps, advises and faults the file in, and the loader drops each prepared or quantized weights
file it writes from the page cache (`drop_page_cache`) so that the first load reads it back in huge
folios. Where the mapping is still in small pages (an older kernel, a filesystem without large folios, a
file cached by another reader), `copy_to_huge` places the bytes in an anonymous mapping advised for huge
pages, which transparent huge pages back wherever they are on (`always` or `madvise`): the same speed,
at the cost of a copy at load and of memory not shared with the page cache. Not Linux: the plain file
mapping, as before.

Measured on a 2-core Xeon VM (docs/PERFORMANCE_LOG.md): plain decode of the 1.5B 1.15x faster, and the
first pass after a second of idling about half as slow as before.
"""

from __future__ import annotations

import mmap
import os
import sys
from dataclasses import dataclass
from pathlib import Path

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


def _advise(area: mmap.mmap) -> None:
    if hasattr(mmap, "MADV_HUGEPAGE"):
        area.madvise(mmap.MADV_HUGEPAGE)


def _populate(area: mmap.mmap, raw: torch.Tensor) -> None:
    try:
        if sys.platform != "linux":
            raise OSError("MADV_POPULATE_READ is Linux's")
        area.madvise(MADV_POPULATE_READ)
    except (OSError, ValueError):             # elsewhere, and before Linux 5.14: touch one byte per page
        if raw.numel():
            int(raw[::4096].sum())


@dataclass
class MappedFile:
    raw: torch.Tensor            # (size,) uint8 over the whole file
    area: mmap.mmap              # the mapping raw views (kept alive by raw too)
    huge: float                  # huge_fraction(raw)


def map_file(path: Path) -> MappedFile:
    """The whole file over a private mapping (copy-on-write: a stray write never reaches the file)
    advised for huge pages and faulted in."""
    with open(path, "rb") as f:
        area = mmap.mmap(f.fileno(), 0, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    _advise(area)
    raw = torch.frombuffer(area, dtype=torch.uint8)           # holds `area` alive
    _populate(area, raw)
    return MappedFile(raw, area, huge_fraction(raw))


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
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


def huge_fraction(t: torch.Tensor) -> float:
    """The fraction of the 2 MiB-aligned span of the mapping holding t that the kernel maps in 2 MiB pages
    (FilePmdMapped + AnonHugePages in /proc/self/smaps); 1.0 for a mapping with no such span (under
    4 MiB: nothing to gain), 0.0 where smaps cannot tell."""
    address, inside, lo, hi = t.data_ptr(), False, 0, 0
    huge = 0
    try:
        with open("/proc/self/smaps") as f:
            for line in f:
                first = line.split(maxsplit=1)[0]
                if "-" in first and ":" not in first:
                    if inside:
                        break
                    lo, hi = (int(x, 16) for x in first.split("-"))
                    inside = lo <= address < hi
                elif inside and line.startswith(("FilePmdMapped:", "AnonHugePages:")):
                    huge += int(line.split()[1]) * 1024
    except OSError:
        return 0.0
    if not inside:
        return 0.0
    span = (hi // HUGE_PAGE - -(-lo // HUGE_PAGE)) * HUGE_PAGE
    return 1.0 if span <= 0 else min(1.0, huge / span)


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
