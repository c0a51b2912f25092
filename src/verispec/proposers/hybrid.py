"""`hybrid`: prompt lookup when the current suffix has a match, another proposer otherwise (the
draft model, or the heads when a heads file is given) — decided per sequence and per round.
Lookup rows are point masses (q = one-hot), which is exactly the point-mass acceptance rule, so one
acceptance call serves a mixed batch.

Where the suffix has a match, both sources are offered (`options`) and the K policy keeps the one
whose best round promises more tokens per second (`prefer`): a 1-token match's first draft is right
~15–20 % of the time, the 0.5B draft's ~75 % on prose, so there the draft drafts even though lookup is
free; a long match inside copied text wins over either. Without a preference (fixed K) a match is used
whenever there is one."""

from __future__ import annotations

import time

import torch

from verispec.models import Transformer
from verispec.proposers.base import Proposal, Proposer, register
from verispec.proposers.draft import DraftModelProposer
from verispec.proposers.ngram import Lookups, match_source


@register("hybrid")
class HybridProposer(Proposer):
    def __init__(self, draft: Transformer | Proposer, target_vocab: int, n_max: int = 3, n_min: int = 1,
                 k_max: int = 64, vocab: torch.Tensor | None = None, stop_below: float | None = None):
        """draft: the draft model (with its truncated vocabulary `vocab` and early stop `stop_below`,
        proposers/draft.py), or a ready proposer to fall back on (the heads proposer)."""
        self.draft = draft if isinstance(draft, Proposer) else DraftModelProposer(draft, target_vocab, vocab,
                                                                                   stop_below)
        self.fallback = self.draft.name
        self.wants_states = self.draft.wants_states
        self.state_window = self.draft.state_window
        self.target_vocab = target_vocab
        self.lookups = Lookups(n_max, n_min, k_max)
        self._prefer: dict[int, tuple[int, str]] = {}   # slot -> (its token count then, source preferred)

    def _lookup(self, seq) -> tuple[int, list[int]]:
        preferred = self._prefer.get(seq.slot)
        if preferred is not None and preferred == (len(seq.tokens), self.fallback):
            return 0, []                         # the K policy values the fallback's round more
        return self.lookups.find(seq)

    def options(self, seq) -> list[tuple[str, int]]:
        """The match's source (nothing to catch up on), then the fallback's — when there is a match and
        the fallback can draft for seq; else the fallback's alone."""
        n, found = self.lookups.find(seq)
        own = self.draft.source_for(seq)
        fallback = (own, self.draft.backlog(seq) if own == self.fallback else 0)
        if not found:
            return [fallback]
        return [(match_source(n), 0)] + ([fallback] if own == self.fallback else [])

    def prefer(self, seq, source: str) -> None:
        self._prefer[seq.slot] = (len(seq.tokens), source)

    def source_for(self, seq) -> str:
        """'ngram:<match length>' when the suffix has a match (see ngram.py) and the fallback is not
        preferred, else the fallback's source ('none' when it cannot draft for this sequence now)."""
        n, found = self._lookup(seq)
        return match_source(n) if found else self.draft.source_for(seq)

    def backlog(self, seq) -> int:
        return self.draft.backlog(seq) if self.source_for(seq) == self.fallback else 0

    def start(self, make_runner):
        self.draft.start(make_runner)

    def propose(self, seqs, ks):
        t0 = time.perf_counter()
        b = len(seqs)
        matches = [self._lookup(s) for s in seqs]
        found = [cont[:k] for (_, cont), k in zip(matches, ks)]
        sources = [match_source(n) if cont else self.fallback for n, cont in matches]
        t1 = time.perf_counter()
        draft_ks = [k if src == self.fallback else 0 for k, src in zip(ks, sources)]
        from_draft = self.draft.propose(seqs, draft_ks)
        k_max = max([len(f) for f in found] + [from_draft.tokens.shape[1]])
        tokens = torch.zeros(b, k_max, dtype=torch.long)
        # Probabilities only when the fallback sampled some of its rows; else every row is a point mass
        # or greedy (None: (B, K, V) floats per round are not free when lookups run 64 tokens long).
        q = torch.zeros(b, k_max, self.target_vocab) if from_draft.q is not None else None
        num = torch.zeros(b, dtype=torch.long)
        kd = from_draft.tokens.shape[1]
        for i, src in enumerate(sources):
            if src != self.fallback:
                n = len(found[i])
                tokens[i, :n] = torch.tensor(found[i], dtype=torch.long)
                if q is not None:
                    q[i, torch.arange(n), tokens[i, :n]] = 1.0      # point mass
                num[i] = n
            elif draft_ks[i]:
                tokens[i, :kd] = from_draft.tokens[i]
                if q is not None:
                    q[i, :kd] = from_draft.q[i]
                num[i] = from_draft.num_draft[i]
        branches = [self.lookups.branches(s, len(f)) if src != self.fallback and f else []
                    for s, f, src in zip(seqs, found, sources)]           # lookup rows only: point masses
        steps = {src: (1, t1 - t0) for src in set(sources) if src != self.fallback}
        if max(draft_ks, default=0):
            steps[self.fallback] = from_draft.steps[self.fallback]   # drafting time without the catch-up
        return Proposal(tokens, num, q, sources, steps, from_draft.catchup,
                        branches=branches if any(branches) else None)

    def observe(self, seqs, num_accepted):
        self.draft.observe(seqs, num_accepted)

    def release(self, slots):
        self.draft.release(slots)
        self.lookups.release(slots)
        for slot in slots:
            self._prefer.pop(slot, None)

    def reset(self):
        self.draft.reset()
        self.lookups.reset()
        self._prefer.clear()
