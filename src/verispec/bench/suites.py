"""Prompt suites for benchmarks: the bundled default suite, or a user's JSONL file.

Each record: {"id", "category", "prompt"} or {"id", "category", "messages"}, or
{"id", "category", "prompt_ids"} (token ids, for models without a tokenizer).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from verispec.errors import VerispecError


@dataclass
class BenchPrompt:
    id: str
    category: str
    prompt: str | None = None
    messages: list[dict] | None = None
    prompt_ids: list[int] | None = None

    def render(self, llm) -> str | list[int]:
        """What is sent to the model: the chat template for messages (and for plain prompts when the
        model has one), or the token ids as given."""
        if self.prompt_ids is not None:
            return self.prompt_ids
        msgs = self.messages or [{"role": "user", "content": self.prompt}]
        if llm.tokenizer is not None and llm.tokenizer.chat_template:
            return llm.chat_prompt(msgs)
        return self.prompt if self.prompt is not None else "\n".join(m["content"] for m in msgs)


def load_suite(path: str | Path | None = None, limit: int | None = None, seed: int = 0) -> list[BenchPrompt]:
    if path is None:
        text = resources.files("verispec.data").joinpath("prompts.jsonl").read_text()
        source = "bundled suite"
    else:
        try:
            text = Path(path).read_text()
        except OSError as exc:
            raise VerispecError(f"cannot read prompt file {path}: {exc.strerror}") from None
        source = str(path)
    prompts = []
    for n, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            item = BenchPrompt(str(rec["id"]), str(rec.get("category", "default")), rec.get("prompt"),
                               rec.get("messages"), rec.get("prompt_ids"))
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise VerispecError(f"{source}, line {n}: not a prompt record ({exc})") from None
        if item.prompt is None and not item.messages and not item.prompt_ids:
            raise VerispecError(f"{source}, line {n}: needs 'prompt', 'messages' or 'prompt_ids'")
        prompts.append(item)
    if limit is not None and limit < len(prompts):
        prompts = sorted(random.Random(seed).sample(prompts, limit), key=prompts.index)
    return prompts
