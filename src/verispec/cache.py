"""The cache directory and crash-safe writes into it.

Everything verispec derives (assembled GGUFs, prepared model directories, quantized weights, kernel
builds, calibrations, draft vocabularies) is written under a temporary name that carries the writer's
process id and then renamed into place, so a reader sees a whole file or none. A writer killed
mid-write leaves only its temporary, which the next writer in that directory removes once the
process that made it is gone. A write that the disk or the directory refuses (full, over quota,
read-only, forbidden) raises CacheWriteError, which names the file, the reason and the free space,
and leaves an older file in place.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from verispec.errors import CacheWriteError

_TEMP = re.compile(r"^\..+\.(\d+)\.tmp$")


def cache_dir() -> Path:
    """Where assembled models and derived files live: $VERISPEC_CACHE or ~/.cache/verispec."""
    root = os.environ.get("VERISPEC_CACHE")
    return Path(root).expanduser() if root else Path.home() / ".cache" / "verispec"


def temp_path(target: Path) -> Path:
    """This process's temporary name for `target`, in the same directory (so a rename is atomic)."""
    return target.with_name(f".{target.name}.{os.getpid()}.tmp")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep(directory: Path) -> list[Path]:
    """Remove the temporaries that dead writers left in `directory`; returns what was removed."""
    removed = []
    try:
        entries = list(directory.iterdir())
    except OSError:
        return removed
    for entry in entries:
        m = _TEMP.match(entry.name)
        if m and int(m.group(1)) != os.getpid() and not _alive(int(m.group(1))):
            shutil.rmtree(entry, ignore_errors=True) if entry.is_dir() else entry.unlink(missing_ok=True)
            removed.append(entry)
    return removed


# errnos that mean the disk or the directory refuses the write (other OSErrors pass through unchanged)
REFUSED = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS, errno.EACCES, errno.EPERM)


@contextmanager
def _refused_as_error(target: Path) -> Iterator[None]:
    """An OSError whose errno is in REFUSED -> CacheWriteError naming `target`, the reason and the free
    space of its disk (with where to move the cache when `target` is in it)."""
    try:
        yield
    except CacheWriteError:
        raise
    except OSError as err:
        if err.errno not in REFUSED:
            raise
        free = _free_bytes(target)
        room = "" if free is None else f"; {free / 2**30:.1f} GiB free there"
        raise CacheWriteError(err.errno, f"cannot write {target}: {os.strerror(err.errno)}{room}{_where(target)}") from None


def need_room(target: Path, size: int) -> None:
    """CacheWriteError before writing `size` bytes to `target` on a disk with less free space (checked
    before any byte is written; a disk that fills meanwhile still fails cleanly in atomic_file)."""
    free = _free_bytes(target)
    if free is not None and free < size:
        raise CacheWriteError(errno.ENOSPC, f"cannot write {target}: it takes {size / 2**30:.1f} GiB and its disk "
                                            f"has {free / 2**30:.1f} GiB free{_where(target)}")


def _free_bytes(target: Path) -> int | None:
    try:
        return shutil.disk_usage(next(p for p in target.parents if p.exists())).free
    except (OSError, StopIteration):
        return None


def _where(target: Path) -> str:
    """Where to turn when `target` is in the cache."""
    if cache_dir().resolve() in (target.resolve(), *target.resolve().parents):
        return " (set VERISPEC_CACHE to a directory with more room, or free some space)"
    return ""


@contextmanager
def atomic_file(target: Path) -> Iterator[Path]:
    """Yield a temporary path to write; on success it replaces `target` in one rename."""
    with _refused_as_error(target):
        target.parent.mkdir(parents=True, exist_ok=True)
    sweep(target.parent)
    tmp = temp_path(target)
    try:
        with _refused_as_error(target):
            yield tmp
            os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)


def write_json(target: Path, value) -> bool:
    """Atomically write `value` as JSON; False when the cache is not writable (the caller recomputes)."""
    try:
        with atomic_file(target) as tmp:
            tmp.write_text(json.dumps(value, indent=1))
        return True
    except OSError:
        return False


def save_tensors(tensors: dict, path: Path, metadata: dict[str, str] | None = None) -> None:
    """safetensors' save_file, with the I/O error it reports in its message ("… (os error 28)") raised as
    an OSError with that errno, so a full disk inside atomic_file reads as one."""
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    try:
        save_file(tensors, str(path), metadata=metadata)
    except SafetensorError as err:
        code = re.search(r"\(os error (\d+)\)", str(err))
        if code is None:
            raise
        raise OSError(int(code.group(1)), os.strerror(int(code.group(1))), str(path)) from None


@contextmanager
def atomic_directory(target: Path) -> Iterator[Path]:
    """Yield an empty temporary directory to fill; on success it takes `target`'s place (an older
    `target` is moved aside first and removed after, so a reader never sees a half-filled one)."""
    with _refused_as_error(target):
        target.parent.mkdir(parents=True, exist_ok=True)
    sweep(target.parent)
    tmp = temp_path(target)
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        with _refused_as_error(target):
            tmp.mkdir()
            yield tmp
            old = target.with_name(f".{target.name}-old.{os.getpid()}.tmp")
            if target.exists():
                os.replace(target, old)
            os.replace(tmp, target)
        shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
