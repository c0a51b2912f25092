"""`draft`: a smaller model of the same vocabulary proposes K tokens autoregressively.

The draft keeps its own KV cache (made by the engine's runner factory) with its own committed
length per slot. The draft is filled lazily: a sequence's prompt is prefilled into the draft the
first time a round asks it for drafts, so rounds with K = 0 cost the draft nothing. Each propose
first catches up on what the draft has not yet ingested — normally just the pending token, or the
last accepted draft plus the bonus token after a round in which all K were accepted — then one
token per step. A sequence whose prompt starts with blocks a draft already filled for an earlier
sequence (the engine's prefix cache: a conversation's history, a document asked about again)
starts past them (`KVCache.written_prefix`).

A row stops drafting early when the draft is unsure: after a step whose distribution's largest
probability is below `stop_below` (at temperature 1 for greedy rows, the warped q for sampled
ones), that step's token is the row's last draft this round. The draft length is then a stopping
time of the draft's own process — it never looks at the target — so acceptance stays exact
(DESIGN: the number of drafts may depend on the drafts).
"""

from __future__ import annotations

import time

import torch

from verispec.models.runner import ModelRunner
from verispec.models import Transformer
from verispec.proposers.base import Proposal, Proposer, register
from verispec.sampling import argmax, sample_from, warp_probs


# A row's drafting stops after a step whose largest probability is below this (measured on the bundled
# suite with `hybrid`, docs/PERFORMANCE_LOG.md).
STOP_BELOW = 0.6


@register("draft")
class DraftModelProposer(Proposer):
    """vocab: a truncated draft vocabulary (N token ids, `draft_vocab.frequent_tokens`): the draft's LM
    head reads only those N rows, and q is zero on every other token. Acceptance is unchanged and
    stays exact — the target verifies over its full vocabulary, and a rejection recovers from
    norm(max(0, p − q)), which covers every token the draft cannot propose."""

    def __init__(self, draft: Transformer, target_vocab: int, vocab: torch.Tensor | None = None,
                 stop_below: float | None = None):
        stop_below = STOP_BELOW if stop_below is None else stop_below
        if not 0.0 <= stop_below < 1.0:
            raise ValueError(f"stop_below must be in [0, 1), got {stop_below!r}")
        self.stop_below = stop_below
        self.draft = draft
        self.target_vocab = target_vocab
        self.vocab = vocab
        self._vocab_ids = None if vocab is None else vocab.tolist()     # subset index -> token id, as ints
        self.runner: ModelRunner | None = None
        self.written: dict[int, int] = {}
        self.resumed: set[int] = set()          # slots whose shared prefix was looked up

    def start(self, make_runner):
        self.runner = make_runner(self.draft)

    def _resume(self, seq) -> None:
        """A new sequence starts the draft past the leading blocks an earlier draft filled with the
        same tokens (never past its last token, which the first step feeds)."""
        if seq.slot in self.resumed or self.runner is None:
            return
        self.resumed.add(seq.slot)
        if self.runner.length(seq.slot) == 0:
            start = min(self.runner.cache.written_prefix(seq.slot), len(seq.tokens) - 1)
            if start > 0:
                self.runner.cache.set_length(seq.slot, start)

    def backlog(self, seq) -> int:
        self._resume(seq)
        unseen = len(seq.tokens) - (self.runner.length(seq.slot) if self.runner is not None else 0)
        return unseen if unseen > 2 else 0          # 1–2 unseen tokens are part of a normal step

    def _align(self, logits: torch.Tensor) -> torch.Tensor:
        """Draft logits (B, 1, V_d) on the target's vocabulary (padding rows beyond it never proposed)."""
        v_d, v_t = logits.shape[-1], self.target_vocab
        if v_d >= v_t:
            return logits[..., :v_t]
        pad = torch.full((*logits.shape[:-1], v_t - v_d), float("-inf"), dtype=logits.dtype)
        return torch.cat([logits, pad], dim=-1)

    def propose(self, seqs, ks):
        assert self.runner is not None, "start() first"
        self.written = {}        # only sequences drafted this round move past their committed length
        b, k_max = len(seqs), max(ks, default=0)
        drafted = [[0] * k_max for _ in range(b)]          # (B, K) token ids; a tensor once the round is done
        greedy = [s.params.greedy for s in seqs]
        # q only where a drafted row samples: greedy acceptance compares tokens alone (None = point masses).
        sampling = any(k and not g for k, g in zip(ks, greedy))
        q = torch.zeros(b, k_max, self.target_vocab) if sampling else None
        if k_max == 0:
            return Proposal(torch.zeros(b, 0, dtype=torch.long), torch.tensor(ks), q)
        temp = torch.tensor([s.params.temperature if not g else 1.0 for s, g in zip(seqs, greedy)])
        top_k = torch.tensor([s.params.top_k for s in seqs])
        top_p = torch.tensor([s.params.top_p for s in seqs])
        gens = [s.generator for s in seqs]
        # Catch up (lazy prefill) on all but the pending token where more than a round's worth is unseen.
        t0 = time.perf_counter()
        behind = [s for s, k in zip(seqs, ks) if k and self.backlog(s)]     # backlog() resumes a new slot
        caught = sum(self.backlog(s) for s in behind)
        if behind:
            self.runner.extend([s.slot for s in behind], [s.tokens for s in behind])
        t1 = time.perf_counter()
        # Step 0 ingests what the draft has not seen; later steps feed the previous proposal.
        chunks = [s.tokens[self.runner.length(s.slot):] for s in seqs]
        ks, steps = list(ks), 0
        for i in range(k_max):
            active = [j for j in range(b) if ks[j] > i]
            if not active:                     # every row stopped early
                break
            steps += 1
            slots = [seqs[j].slot for j in active]
            logits = self.runner.forward(slots, [chunks[j] for j in active], [[len(chunks[j]) - 1] for j in active],
                                         self.vocab)                                  # (A, 1, V or N)
            logits = self._align(logits) if self.vocab is None else logits
            for j, c in zip(active, (chunks[j] for j in active)):
                self.runner.cache.set_length(seqs[j].slot, self.runner.length(seqs[j].slot) + len(c))
            # Python lists between passes where they will do: right after a pass every small torch op
            # costs tens of microseconds (its code and data were evicted by the weights).
            picked = argmax(logits[:, 0])                                         # (A,)
            if q is not None:
                a = torch.tensor(active)
                probs = warp_probs(logits, temp[a], top_k[a], top_p[a])[:, 0]    # (A, V or N)
                greedy_rows = torch.tensor([greedy[j] for j in active])
                picked = torch.where(greedy_rows, picked, sample_from(probs, [gens[j] for j in active]))
                if self.vocab is None:
                    q[a, i] = probs
                else:                          # q is zero off the subset
                    q[a[:, None], i, self.vocab[None, :]] = probs
            ids = picked.tolist()
            if self._vocab_ids is not None:    # subset indices -> token ids
                ids = [self._vocab_ids[x] for x in ids]
            for j, token in zip(active, ids):
                drafted[j][i] = token
            if self.stop_below > 0 and i + 1 < k_max:
                sure = (probs if q is not None else torch.softmax(logits[:, 0].float(), -1)).amax(-1)    # (A,)
                for j, unsure in zip(active, (sure < self.stop_below).tolist()):
                    if unsure:
                        ks[j] = i + 1          # this step's token is the row's last draft
            chunks = [[drafted[j][i]] if ks[j] > i else [] for j in range(b)]
        width = max(ks)                        # rows that stopped early may leave the round narrower
        tokens = torch.tensor([row[:width] for row in drafted], dtype=torch.long).reshape(b, width)   # (B, K)
        q = q[:, :width] if q is not None else None
        # The last proposal was never fed: the draft's cache now covers tokens + x̃_0 … x̃_{k-2}.
        self.written = {s.slot: self.runner.length(s.slot) for s in seqs}
        # The cost model gets the per-token drafting cost; catching up after K = 0 rounds is a
        # one-off that would otherwise make drafting look dearer than it is and keep K at 0.
        return Proposal(tokens, torch.tensor(ks), q, steps={"draft": (steps, time.perf_counter() - t1)},
                        catchup={"draft": (caught, t1 - t0)} if caught else None)

    def observe(self, seqs, num_accepted):
        for s in seqs:
            # Valid draft cache = what it wrote, cut back to the committed prefix (rollback by length).
            written = self.written.get(s.slot, self.runner.length(s.slot))
            length = min(written, len(s.tokens) - 1)
            self.runner.cache.set_length(s.slot, length)
            self.runner.cache.mark_written(s.slot, length)     # committed tokens: reusable by a later prompt

    def release(self, slots):
        for slot in slots:
            self.written.pop(slot, None)
            self.resumed.discard(slot)
            if hasattr(self.runner.cache, "drop"):
                self.runner.cache.drop(slot)

    def reset(self):
        self.runner = None
        self.written = {}
        self.resumed = set()
