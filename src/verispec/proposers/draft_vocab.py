"""A truncated draft vocabulary: the N token ids a draft model may propose (`--draft-vocab N`).

A coder model writes mostly the same few thousand tokens; a draft whose LM head reads only those N
rows spends less per step (the 0.5B's head is 136M of its 494M parameters). Which N: the most
frequent tokens of a built-in text collection that every machine with Python has — the standard
library's sources (code, docstrings, comments) — plus the bundled benchmark prompts, tokenized with
the model's own tokenizer, and the tokens that stop generation (a draft must be able to propose the
end). Counted once per tokenizer and N, kept in `$VERISPEC_CACHE/draft-vocab/`.

Lossless by construction: q is zero off the subset and the target still verifies over its whole
vocabulary (see `DraftModelProposer`).
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter

import torch

from verispec.cache import cache_dir, write_json
from verispec.text_collection import bundled_prompts, stdlib_sources

COLLECTION_BYTES = 4 << 20        # how much of the standard library to count (sources in sorted order)
# The default N (`--draft-vocab auto`). The embedded 0.5B in int4-all, teacher-forced on the bundled
# suite's greedy answers: top-1 agreement with the 1.5B 0.824 (full) / 0.815 (32k) / 0.786 (16k) for a
# step of 0.35 / 0.29 / 0.28 c_p(1) — 32k drafts more tokens per unit of cost (docs/PERFORMANCE_LOG.md).
DEFAULT_DRAFT_VOCAB = 32768


def collection() -> list[str]:
    """The texts counted: the bundled prompts, then standard-library sources up to COLLECTION_BYTES."""
    return bundled_prompts() + list(stdlib_sources(COLLECTION_BYTES))


def frequent_tokens(tokenizer, n: int, vocab_size: int) -> torch.Tensor:
    """The n most frequent token ids (sorted, int64), stop tokens included, all below vocab_size."""
    if not 1 <= n < vocab_size:
        raise ValueError(f"a draft vocabulary of {n} tokens must be in 1 … {vocab_size - 1}")

    fingerprint = hashlib.sha256(tokenizer.tokenizer.to_str().encode()).hexdigest()[:16]
    path = cache_dir() / "draft-vocab" / f"{fingerprint}-{n}.json"
    try:
        ids = json.loads(path.read_text())
        if isinstance(ids, list) and len(ids) == n and all(isinstance(i, int) and 0 <= i < vocab_size for i in ids):
            return torch.tensor(sorted(ids), dtype=torch.long)
    except (OSError, ValueError):
        pass
    counts: Counter[int] = Counter()
    for enc in tokenizer.tokenizer.encode_batch(collection(), add_special_tokens=False):
        counts.update(enc.ids)
    keep = [t for t in tokenizer.stop_token_ids if 0 <= t < vocab_size]
    for t, _ in counts.most_common():
        if len(keep) >= n:
            break
        if t < vocab_size and t not in keep:
            keep.append(t)
    for t in range(vocab_size):                       # a collection with fewer distinct tokens than n
        if len(keep) >= n:
            break
        if t not in counts:
            keep.append(t)
    ids = sorted(keep[:n])
    write_json(path, ids)
    return torch.tensor(ids, dtype=torch.long)
