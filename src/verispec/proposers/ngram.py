"""`ngram`: prompt lookup. Find the longest earlier occurrence of the current suffix in the text so
far (prompt + generated) and propose what followed it — a point-mass proposal, no probabilities.
`MatchIndex` (match_index.py) keeps that search incremental and bounded: a 4-token-or-longer match
proposes the continuation of its longest occurrence, as far as the earlier text goes (up to K, which
`auto` may take to 64 when an answer copies its input); a 1–3-token match proposes the most frequent
continuation among recent occurrences. A copy with a systematic change (a rename) teaches the index
the edit, which it then applies to what it proposes (match_index.py, "Edits").

The length of the matched suffix predicts acceptance: on the bundled suite (greedy, the 1.5B's own
continuations) the first proposed token was right 21 % of the time after a 1-token match, 50 %
after 2 and 70 % after 3, and long matches inside copied text are right nearly always. So each
match-length bucket — 1, 2, 3, 4–7, 8–15, 16+ tokens — is its own source for the K policy
("ngram:1" … "ngram:16+"; "none" when nothing matches), with its own acceptance estimate.
"""

from __future__ import annotations

import time

import torch

from verispec.proposers.base import Proposal, Proposer, register
from verispec.proposers.match_index import MatchIndex

BUCKETS = ((16, "16+"), (8, "8-15"), (4, "4-7"), (3, "3"), (2, "2"), (1, "1"))   # (shortest match, label)


def match_source(n: int) -> str:
    """The K policy's source for a match of n tokens ('none': nothing to propose)."""
    for shortest, label in BUCKETS:
        if n >= shortest:
            return f"ngram:{label}"
    return "none"


def lookup_match(tokens: list[int], k: int, n_max: int = 3, n_min: int = 1) -> tuple[int, list[int]]:
    """(match length, continuation of at most k tokens) for tokens' current end, from a fresh index
    (n_max: the n-gram order indexed, n_min: shorter matches count as none)."""
    n, cont = MatchIndex(n_max).find(tokens, k)
    return (n, cont) if n >= n_min and cont else (0, [])


def lookup(tokens: list[int], k: int, n_max: int = 3, n_min: int = 1) -> list[int]:
    """The continuation lookup_match proposes (at most k tokens)."""
    return lookup_match(tokens, k, n_max, n_min)[1] if k > 0 else []


class Lookups:
    """Per sequence: its MatchIndex, extended as tokens are committed, and the latest answer (a round
    asks for the source first, then for the proposal). alternatives: how many other continuations
    to keep beside the best one (candidate branches for a round's token tree)."""

    def __init__(self, n_max: int = 3, n_min: int = 1, k_max: int = 64, alternatives: int = 2):
        if not 1 <= n_min <= n_max:
            raise ValueError(f"need 1 <= n_min <= n_max, got {n_min}, {n_max}")
        if alternatives < 0:
            raise ValueError(f"alternatives must be >= 0, got {alternatives}")
        self.n_max, self.n_min, self.k_max, self.alternatives = n_max, n_min, k_max, alternatives
        self._index: dict[int, MatchIndex] = {}
        self._answer: dict[int, tuple[int, list[tuple[int, list[int]]]]] = {}   # slot -> (tokens seen, candidates)

    def _candidates(self, seq) -> list[tuple[int, list[int]]]:
        key = len(seq.tokens)
        cached = self._answer.get(seq.slot)
        if cached is None or cached[0] != key:
            index = self._index.setdefault(seq.slot, MatchIndex(self.n_max))
            found = index.candidates(seq.tokens, self.k_max, 1 + self.alternatives)
            cached = self._answer[seq.slot] = (key, found if found and found[0][0] >= self.n_min else [])
        return cached[1]

    def find(self, seq) -> tuple[int, list[int]]:
        """(match length, continuation up to k_max tokens) after seq.tokens; (0, []) without a match."""
        found = self._candidates(seq)
        return found[0] if found else (0, [])

    def branches(self, seq, k: int) -> list[list[int]]:
        """Other continuations than find's, each cut to k tokens (distinct from the best one and from
        each other, none a prefix of another)."""
        found = self._candidates(seq)
        if not found or k <= 0:
            return []
        out = [found[0][1][:k]]
        for _, cont in found[1:]:
            cut = cont[:k]
            if not any(c[: len(cut)] == cut for c in out):
                out.append(cut)
        return out[1:]

    def release(self, slots) -> None:
        for slot in slots:
            self._index.pop(slot, None)
            self._answer.pop(slot, None)

    def reset(self) -> None:
        self._index.clear()
        self._answer.clear()


@register("ngram")
class NgramProposer(Proposer):
    def __init__(self, n_max: int = 3, n_min: int = 1, k_max: int = 64, alternatives: int = 2):
        self.lookups = Lookups(n_max, n_min, k_max, alternatives)

    def source_for(self, seq) -> str:
        return match_source(self.lookups.find(seq)[0])

    def propose(self, seqs, ks):
        t0 = time.perf_counter()
        found = [self.lookups.find(s) if k > 0 else (0, []) for s, k in zip(seqs, ks)]
        found = [(n, cont[:k]) for (n, cont), k in zip(found, ks)]
        k_max = max((len(d) for _, d in found), default=0)
        tokens = torch.zeros(len(seqs), k_max, dtype=torch.long)
        for i, (_, d) in enumerate(found):
            tokens[i, : len(d)] = torch.tensor(d, dtype=torch.long)
        sources = [match_source(n) if d else "none" for n, d in found]
        branches = [self.lookups.branches(s, len(d)) if d else [] for s, (_, d) in zip(seqs, found)]
        seconds = time.perf_counter() - t0
        steps = {src: (1, seconds) for src in set(sources) if src != "none"}
        return Proposal(tokens, torch.tensor([len(d) for _, d in found]), None, sources, steps,
                        branches=branches if any(branches) else None)

    def release(self, slots):
        self.lookups.release(slots)

    def reset(self):
        self.lookups.reset()
