"""Heads files: which kind a file holds, reading it against its target, and the files that ship."""

from __future__ import annotations

from pathlib import Path

from verispec.errors import InvalidModelFile
from verispec.heads.eagle import EagleHead, load_head
from verispec.heads.medusa import MedusaHeads, load_medusa

KINDS = ("eagle", "medusa")      # a built-in target's shipped file of the first kind found is its default


def load_heads(path: str | Path, hidden_size: int, vocab_size: int) -> MedusaHeads | EagleHead:
    """Read and check a heads file (Medusa or EAGLE, by its `kind`) against the target it drafts for."""
    from safetensors import SafetensorError, safe_open

    path = Path(path)
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            names = set(f.keys())
            kind = meta.get("kind")
            if kind not in KINDS:
                raise InvalidModelFile(path, f"kind {kind!r} is not a heads file ({' or '.join(KINDS)})")
            if meta.get("vocab_size") not in (None, str(vocab_size)):
                raise InvalidModelFile(path, f"made for a vocabulary of {meta.get('vocab_size')} tokens, "
                                       f"but the target has {vocab_size}")
            read = load_head if kind == "eagle" else load_medusa
            return read(path, meta, names, f, hidden_size, vocab_size)
    except SafetensorError as exc:
        raise InvalidModelFile(path, f"not a readable safetensors file ({exc})") from None
    except OSError as exc:
        raise InvalidModelFile(path, f"cannot be read ({exc.strerror or exc})") from None


def shipped_heads(target_name: str) -> Path | None:
    """The heads file that ships with the package for a built-in target, if there is one (EAGLE first)."""
    here = Path(__file__).resolve().parent.parent / "data" / "heads"
    for kind in KINDS:
        path = here / f"{target_name}.{kind}.safetensors"
        if path.is_file():
            return path
    return None
