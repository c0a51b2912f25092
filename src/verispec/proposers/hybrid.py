"""`hybrid`: prompt lookup when the current suffix has a match, another proposer otherwise (the
draft model, or Medusa heads when a heads file is given) — decided per sequence and per round.
Lookup rows are point masses (q = one-hot), which is exactly the point-mass acceptance rule, so one
acceptance call serves a mixed batch."""

from __future__ import annotations

import time

import torch

from verispec.models import Transformer
from verispec.proposers.base import Proposal, Proposer, register
from verispec.proposers.draft import DraftModelProposer
from verispec.proposers.ngram import Lookups, match_source


# First-draft acceptance of lookup by match-length bucket on the bundled suite (ngram.py), and the
# weight (in rounds) of these priors against what this proposer sees.
LOOKUP_PRIOR = {"ngram:1": 0.21, "ngram:2": 0.5, "ngram:3": 0.7, "ngram:4-7": 0.8, "ngram:8-15": 0.9,
                "ngram:16+": 0.95}
PRIOR_ROUNDS = 8


@register("hybrid")
class HybridProposer(Proposer):
    def __init__(self, draft: Transformer | Proposer, target_vocab: int, n_max: int = 3, n_min: int = 1,
                 k_max: int = 64, vocab: torch.Tensor | None = None, compare: float | None = None,
                 stop_below: float | None = None):
        """draft: the draft model (with its truncated vocabulary `vocab`), or a ready proposer to fall
        back on (the heads proposer). compare: for a fallback as cheap as lookup (heads), its prior
        first-draft acceptance — then a match is used only when its bucket's first drafts are accepted
        at least as often as the fallback's (both learned from the rounds, pooled over sequences);
        None: every match is used (a draft model costs far more than a lookup). stop_below: the draft
        model's early stop (proposers/draft.py)."""
        self.draft = draft if isinstance(draft, Proposer) else DraftModelProposer(draft, target_vocab, vocab,
                                                                                   stop_below)
        self.fallback = self.draft.name
        self.wants_states = self.draft.wants_states
        self.state_window = self.draft.state_window
        self.target_vocab = target_vocab
        self.lookups = Lookups(n_max, n_min, k_max)
        self.compare = compare
        # source -> [rounds with a first draft, first drafts accepted], priors included
        self._first: dict[str, list[float]] = {s: [PRIOR_ROUNDS, PRIOR_ROUNDS * a] for s, a in LOOKUP_PRIOR.items()}
        if compare is not None:
            self._first[self.fallback] = [PRIOR_ROUNDS, PRIOR_ROUNDS * compare]
        self._used: dict[int, str] = {}          # slot -> source of its last round's drafts

    def _rate(self, source: str) -> float:
        n, a = self._first.get(source, (1, 1))
        return a / n

    def _lookup(self, seq) -> tuple[int, list[int]]:
        n, cont = self.lookups.find(seq)
        if (self.compare is not None and cont and self.draft.source_for(seq) == self.fallback
                and self._rate(match_source(n)) < self._rate(self.fallback)):
            return 0, []                         # the fallback's first draft is right more often
        return n, cont

    def source_for(self, seq) -> str:
        """'ngram:<match length>' when the suffix has a match (see ngram.py), else the fallback's
        source ('none' when it cannot draft for this sequence now)."""
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
        self._used = {s.slot: src for s, src, k in zip(seqs, sources, num.tolist()) if k}
        steps = {src: (1, t1 - t0) for src in set(sources) if src != self.fallback}
        if max(draft_ks, default=0):
            steps[self.fallback] = from_draft.steps[self.fallback]   # drafting time without the catch-up
        return Proposal(tokens, num, q, sources, steps, from_draft.catchup,
                        branches=branches if any(branches) else None)

    def observe(self, seqs, num_accepted):
        if self.compare is not None:
            for s, n in zip(seqs, num_accepted):
                src = self._used.get(s.slot)
                if src is not None:
                    counts = self._first.setdefault(src, [PRIOR_ROUNDS, PRIOR_ROUNDS * 0.5])
                    counts[0] += 1
                    counts[1] += n > 0
        self.draft.observe(seqs, num_accepted)

    def release(self, slots):
        self.draft.release(slots)
        self.lookups.release(slots)

    def reset(self):
        self.draft.reset()
        self.lookups.reset()
