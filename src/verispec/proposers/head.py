"""`head`: drafting heads on the target's own state — Medusa heads here (heads/medusa.py), the
EAGLE-style layer in eagle.py; `head_proposer` picks by the file's kind.

The round keeps, for each sequence, the target's final-normed state at the row that scored its
pending token (`Sequence.pending_state`). Head i turns it into a guess at the token i places after
the pending one, scored by the target's LM head over the heads' N-token vocabulary: H drafts for H
small products and one LM-head pass over H rows, no model of its own and no cache to roll back.
A sequence's first round (right after its prefill) has no state yet and drafts nothing.
"""

from __future__ import annotations

import torch

from verispec.heads.eagle import EagleHead
from verispec.heads.medusa import MedusaHeads
from verispec.models import Transformer
from verispec.proposers.base import Proposer, register
from verispec.proposers.eagle import EagleProposer
from verispec.proposers.state_draft import StateDrafter
from verispec.sampling import argmax, sample_from, warp_probs


@register("head")
def head_proposer(heads: MedusaHeads | EagleHead, target: Transformer) -> Proposer:
    """The proposer for a heads file of either kind."""
    return EagleProposer(heads, target) if isinstance(heads, EagleHead) else HeadProposer(heads, target)


class HeadProposer(StateDrafter):
    def __init__(self, heads: MedusaHeads, target: Transformer):
        self.heads = heads
        self.depth = heads.num_heads
        self.target = target
        self.vocab = heads.vocab                                     # (N,) token ids
        self.vocab_size = target.config.vocab_size
        # Build the restricted LM head and run the heads once now, so that the first timed round does
        # not carry these one-off costs (half a second, which priced the heads out of `auto`).
        with torch.inference_mode():
            state = torch.zeros(1, target.config.hidden_size)
            target.project(heads(state, 1).to(target.dtype), self.vocab)

    def draft(self, seqs, ks, active, tokens, q):
        k_max = tokens.shape[1]
        h = torch.stack([seqs[j].pending_state for j in active]).float()           # (A, C)
        g = self.heads(h, k_max)                                                   # (A, K, C)
        logits = self.target.project(g.to(self.target.dtype), self.vocab)          # (A, K, N)
        for row, j in enumerate(active):
            s, k = seqs[j], ks[j]
            if s.params.greedy:                 # greedy acceptance compares tokens only; q stays unused
                tokens[j, :k] = self.vocab[argmax(logits[row, :k])]
                continue
            probs = warp_probs(logits[row, :k][None], torch.tensor([s.params.temperature]),
                               torch.tensor([s.params.top_k]), torch.tensor([s.params.top_p]))[0]   # (k, N)
            tokens[j, :k] = self.vocab[sample_from(probs, [s.generator] * k)]
            q[j, :k, self.vocab] = probs        # zero off the heads' vocabulary
