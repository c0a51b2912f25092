"""Built-in text every machine with Python already has: the standard library's sources (code,
docstrings, comments), and the bundled benchmark prompts. Counted for a truncated draft vocabulary
(proposers/draft_vocab.py) and read as training text for drafting heads (heads/train.py)."""

from __future__ import annotations

import json
import sysconfig
from importlib import resources
from pathlib import Path
from typing import Iterator


def bundled_prompts() -> list[str]:
    """The bundled suite's prompts as plain text (chat messages joined)."""
    texts = []
    for line in resources.files("verispec.data").joinpath("prompts.jsonl").read_text().splitlines():
        if line.strip():
            rec = json.loads(line)
            texts.append(rec.get("prompt") or " ".join(m["content"] for m in rec["messages"]))
    return texts


def stdlib_sources(max_bytes: int) -> Iterator[str]:
    """Standard-library sources in sorted path order (tests left out), up to max_bytes characters."""
    used = 0
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py")):
        if used >= max_bytes:
            return
        if "test" in path.parts or "site-packages" in path.parts:
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        used += len(text)
        yield text
