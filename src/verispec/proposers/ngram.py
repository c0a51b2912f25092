"""`ngram`: prompt lookup. Match the last n tokens (n from n_max down to n_min) against the earlier
text (prompt + generated) and propose what followed. No probabilities: a point-mass proposal.

Worked example (n_max=3, n_min=1, K=2): tokens = [5 6 7 | 9 6 7 8 | 6 7]
  n=3: suffix [8 6 7] never occurred before -> try n=2: suffix [6 7] occurred at 1 and 4,
  followed by [9 6] and [8 6]; several matches -> the most frequent continuation, ties broken
  by the most recent occurrence: [8 6] (from position 4). Proposal: [8, 6].
"""

from __future__ import annotations

from collections import Counter

import torch

from verispec.proposers.base import Proposal, Proposer, register


def lookup(tokens: list[int], k: int, n_max: int = 3, n_min: int = 1) -> list[int]:
    """Continuation of the longest suffix match (n_max … n_min) in `tokens`, at most k tokens."""
    if k <= 0:
        return []
    length = len(tokens)
    for n in range(min(n_max, length - 1), n_min - 1, -1):
        suffix = tokens[length - n:]
        continuations: Counter[tuple[int, ...]] = Counter()
        latest: dict[tuple[int, ...], int] = {}
        first = suffix[0]
        for start in range(length - n):           # occurrences strictly before the suffix itself
            if tokens[start] != first or tokens[start:start + n] != suffix:
                continue
            cont = tuple(tokens[start + n: start + n + k])
            if cont:
                continuations[cont] += 1
                latest[cont] = start
        if continuations:
            best = max(continuations, key=lambda c: (continuations[c], latest[c]))
            return list(best)
    return []


@register("ngram")
class NgramProposer(Proposer):
    def __init__(self, n_max: int = 3, n_min: int = 1):
        if not 1 <= n_min <= n_max:
            raise ValueError(f"need 1 <= n_min <= n_max, got {n_min}, {n_max}")
        self.n_max, self.n_min = n_max, n_min

    def propose(self, seqs, ks):
        drafts = [lookup(s.tokens, k, self.n_max, self.n_min) for s, k in zip(seqs, ks)]
        k_max = max((len(d) for d in drafts), default=0)
        tokens = torch.zeros(len(seqs), k_max, dtype=torch.long)
        for i, d in enumerate(drafts):
            tokens[i, : len(d)] = torch.tensor(d, dtype=torch.long)
        return Proposal(tokens, torch.tensor([len(d) for d in drafts]), None)
