"""What the heads proposers share: they draft from the target's states that the round keeps on each
sequence, so a sequence has nothing to draft from before its first round."""

from __future__ import annotations

import time
from abc import abstractmethod

import torch

from verispec.proposers.base import Proposal, Proposer


class StateDrafter(Proposer):
    name = "head"
    wants_states = True
    depth: int = 1                  # most drafts per round
    vocab_size: int                 # the target's

    def has_state(self, seq) -> bool:
        return seq.pending_state is not None

    def source_for(self, seq) -> str:
        """'none' before the sequence's first round (no state to draft from): `auto` then spends
        neither a probe nor its first try on a round that cannot draft."""
        return self.name if self.has_state(seq) else "none"

    @torch.inference_mode()
    def propose(self, seqs, ks):
        t0 = time.perf_counter()
        ks = [min(k, self.depth) if self.has_state(s) else 0 for s, k in zip(seqs, ks)]
        k_max = max(ks, default=0)
        tokens = torch.zeros(len(seqs), k_max, dtype=torch.long)
        sampling = any(k and not s.params.greedy for s, k in zip(seqs, ks))
        q = torch.zeros(len(seqs), k_max, self.vocab_size) if sampling else None     # None: point masses
        if k_max:
            self.draft(seqs, ks, [j for j in range(len(seqs)) if ks[j]], tokens, q)
        return Proposal(tokens, torch.tensor(ks), q, steps={self.name: (k_max, time.perf_counter() - t0)})

    @abstractmethod
    def draft(self, seqs, ks: list[int], active: list[int], tokens: torch.Tensor, q: torch.Tensor | None) -> None:
        """Fill tokens[j, :ks[j]] (B, K) for each active row j, and q[j, :ks[j]] (B, K, V) — the warped
        distribution each draft was sampled from — for its sampled rows (greedy rows leave q unused; q is
        None when every row is greedy)."""
