"""Built-in text every machine with Python already has: the standard library's sources (code,
docstrings, comments), requests made from its documented names, and the bundled benchmark prompts.
Counted for a truncated draft vocabulary (proposers/draft_vocab.py) and read as training text for
drafting heads (heads/train.py; the requests are answered by the target, cli/train_head.py)."""

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


TASK_SKIP = ("test", "tests", "idlelib", "lib2to3", "ensurepip", "site-packages", "turtledemo", "__phello__")


def stdlib_tasks(count: int, seed: int = 0) -> list[tuple[str, str, str]]:
    """`count` requests made from the standard library's documented public functions and classes, as
    (id, kind, prompt): three in four ask for the code ("Write a Python function `name(args)` that
    <its docstring's summary>"), one in four for an explanation of it. Parsed, never imported; seeded."""
    import ast
    import random

    root = Path(sysconfig.get_paths()["stdlib"])
    found: dict[str, tuple[str, str, str, bool]] = {}           # name -> (module, signature, summary, is_class)
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if any(part in TASK_SKIP for part in rel.parts) or any(p.startswith("_") for p in rel.with_suffix("").parts
                                                                 if p != "__init__"):
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, SyntaxError, ValueError):
            continue
        module = ".".join(rel.with_suffix("").parts).removesuffix(".__init__")
        for node in tree.body:
            if not isinstance(node, (ast.FunctionDef, ast.ClassDef)) or node.name.startswith("_"):
                continue
            doc = ast.get_docstring(node) or ""
            summary = " ".join(doc.split("\n\n")[0].split())
            if not 24 <= len(summary) <= 300 or node.name in found:
                continue
            sig = "" if isinstance(node, ast.ClassDef) else ", ".join(a.arg for a in node.args.args)
            found[node.name] = (module, sig, summary, isinstance(node, ast.ClassDef))
    rng = random.Random(seed)
    names = sorted(found)
    rng.shuffle(names)
    tasks = []
    for i, name in enumerate(names[:count]):
        module, sig, summary, is_class = found[name]
        what = summary if summary[1:2].isupper() else summary[0].lower() + summary[1:]    # "URL…" stays
        if i % 4 == 3:
            tasks.append((f"explain-{module}.{name}", "explanation",
                          f"Explain what `{module}.{name}` in Python's standard library does, with a short example."))
        elif is_class:
            tasks.append((f"class-{module}.{name}", "code_writing", f"Implement a Python class `{name}`. {summary}"))
        else:
            tasks.append((f"function-{module}.{name}", "code_writing",
                          f"Write a Python function `{name}({sig})` that does this: {what}"))
    return tasks
