"""`head` with an EAGLE-style heads file: one decoder layer drafts the target's next states (heads/eagle.py).

The round keeps, per sequence, the target's final-normed states of the last W settled positions
(`Sequence.recent_states`, W = the head's window); the token after each is in `seq.tokens`. A round
runs the layer once over those W pairs — the last one is (state that scored the pending token,
pending token) — and takes its predicted state as the first draft's; each further draft feeds the
layer its own predicted state and the token just drafted, attending over the pairs and the drafts
before it. q_i is the target's LM head over the head's N tokens, warped like the target's p, so
each draft is an exact sample from the q it reports. A sequence's first round (right after its
prefill) has no states yet and drafts nothing.
"""

from __future__ import annotations

import torch

from verispec.heads.eagle import EagleHead
from verispec.models import Transformer
from verispec.proposers.state_draft import StateDrafter
from verispec.sampling import argmax, sample_from, warp_probs


class EagleProposer(StateDrafter):
    def __init__(self, head: EagleHead, target: Transformer):
        self.head = head.quantize()
        self.target = target
        self.state_window = head.window
        self.depth = head.depth
        self.vocab = head.vocab                                          # (N,) token ids
        self.vocab_size = target.config.vocab_size
        self.embed = target.model.embed_tokens
        with torch.inference_mode():                                     # build the restricted LM head now
            state = torch.zeros(1, 1, target.config.hidden_size)
            out, _ = head(state, state, torch.zeros(1, 1, dtype=torch.long))
            target.project(out[:, 0].to(target.dtype), self.vocab)

    def draft(self, seqs, ks, active, tokens, q):
        k_max = tokens.shape[1]
        a = len(active)
        ctx = [seqs[j].recent_states[-min(self.head.window, len(seqs[j].tokens)):] for j in active]  # each (m, C)
        width = max(len(c) for c in ctx)
        c_dim = ctx[0].shape[-1]
        h = torch.zeros(a, width, c_dim)                                      # (A, L, C), left-padded
        ids = torch.zeros(a, width, dtype=torch.long)
        real = torch.zeros(a, width, dtype=torch.bool)                        # (A, L) real context rows
        for row, (j, c) in enumerate(zip(active, ctx)):
            m = len(c)
            h[row, width - m:] = c.float()
            ids[row, width - m:] = torch.tensor(seqs[j].tokens[-m:])          # the token after each state
            real[row, width - m:] = True
        pos = (torch.arange(width)[None] - (~real).sum(1, keepdim=True)).clamp_min(0)    # (A, L)
        # A real row sees the real rows up to itself; a padding row only itself (never seen).
        mask = (torch.ones(width, width, dtype=torch.bool).tril()[None] & real[:, None, :]) \
            | torch.eye(width, dtype=torch.bool)[None]                        # (A, L, L)
        cur, kv = self.head(h, self.embed(ids).float(), pos, mask=mask, last_only=True)   # (A, 1, C)
        last = pos[:, -1:]                                                    # (A, 1)
        keys = real
        for d in range(k_max):
            logits = self.target.project(cur[:, 0].to(self.target.dtype), self.vocab)      # (A, N)
            drafted = torch.zeros(a, dtype=torch.long)
            for row, j in enumerate(active):
                s = seqs[j]
                if d >= ks[j]:
                    continue
                if s.params.greedy:             # greedy acceptance compares tokens only; q stays unused
                    drafted[row] = argmax(logits[row])
                else:
                    p = s.params
                    probs = warp_probs(logits[row][None, None], torch.tensor([p.temperature]),
                                       torch.tensor([p.top_k]), torch.tensor([p.top_p]))[0]    # (1, N)
                    drafted[row] = sample_from(probs, [s.generator])[0]
                    q[j, d, self.vocab] = probs[0]   # zero off the head's vocabulary
                tokens[j, d] = self.vocab[drafted[row]]
            if d + 1 == k_max:
                break
            keys = torch.cat([keys, torch.ones(a, 1, dtype=torch.bool)], dim=1)              # (A, L + d + 1)
            cur, kv = self.head(cur, self.embed(self.vocab[drafted])[:, None].float(), last + d + 1,
                                past=kv, mask=keys[:, None, :])
