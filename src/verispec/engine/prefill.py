"""A step's prefill pass: every prompt chunk of the step in one pass, cut into pieces of one width,
with the first round of each prompt whose last chunk this is.

A finishing prompt's row in that round is its last tokens (its pending token last) plus its first
drafts, filling the pass's last piece for it; the rest of its chunk rides ahead in whole pieces.
Its first token then comes from the pass that finished its prompt instead of the next step's. Its
K is the one the next step would choose (a seeded request's K schedule, and so its sample, must
not depend on which step its first round falls in) — but 0 where the chosen source would first
have to catch up on the prompt: a draft model's prefill of it, before this pass, would delay the
first token (measured on a Zen 2: by 27–34 % in the default mode) for one round's drafts; the
next round catches up instead, after the first token went out.

With mix_decode the running sequences' round joins the pass too (one read of the weights for
both); the pieces must then be as narrow as the round's rows, which on a 2-core CPU costs about
what the saved weight read is worth (docs/SERVING.md), so it is off by default.
"""

from __future__ import annotations

from dataclasses import dataclass

from verispec.engine.block_pool import BlockPool
from verispec.engine.k_policy import KPolicy
from verispec.engine.scheduler import Entry
from verispec.models.runner import ModelRunner
from verispec.proposers import Proposer

# mix_decode only while every prompt chunk ends within this many tokens: pieces are as narrow as
# the round's rows (often 1), each attending its prompt's whole prefix on its own, and past about a
# thousand positions those re-reads cost more than the weight read a mixed pass saves.
MIX_MAX_CONTEXT = 1024


@dataclass
class PrefillPass:
    ride: list[tuple[int, int, list[int]]]     # (slot, start, tokens) pieces' sources, fed only
    width: int                                 # the pieces' width
    finishing: list[Entry]                     # prompts whose first round is in this pass
    ks: list[int]                              # their first K


def plan_prefill(parts: list[tuple[Entry, int, int]], target: ModelRunner, policy: KPolicy, proposer: Proposer,
                 pool: BlockPool, round_ks: list[int] | None) -> PrefillPass:
    """parts: (entry, start, end) chunks of this step; round_ks: the running sequences' K when their
    round joins the pass (mix_decode), else None. Sets each finishing prompt's cache length to where
    its round row starts."""
    finishing = [e for e, _, b in parts if b == len(e.seq.tokens) - 1]     # the prompts' last chunks
    ks = policy.choose_for(proposer, [e.seq for e in finishing]) if finishing else []
    # A source that must first ingest the prompt (a draft model's catch-up) waits for the next round:
    # its prefill would come before this pass and delay the first token by a prefill of the draft.
    # Not for seeded requests, whose K schedule must not depend on where their first round falls.
    ks = [0 if k and not e.seq.params.reproducible and proposer.backlog(e.seq) else k
          for e, k in zip(finishing, ks)]
    ks = [k if pool.grow(e.slot, len(e.seq.tokens) + k) else 0 for e, k in zip(finishing, ks)]
    first_k = dict(zip(map(id, finishing), ks))
    # Rows each part needs: its chunk, and for a finishing prompt its pending token and drafts too.
    need = [len(e.seq.tokens) - a + first_k[id(e)] if id(e) in first_k else b - a for e, a, b in parts]
    if round_ks is not None:
        width = 1 + max(round_ks + ks)
    else:
        exact = target.model.exact_pass_rows(target.cache.store)
        width = target.piece_width(need, exact, 1 + max(ks, default=0))
    ride = []
    for (e, a, b), n in zip(parts, need):
        if id(e) in first_k:
            k = first_k[id(e)]
            tail = (n - 1) // width * width
            if n - tail - k < 1:                # drafts alone would fill the last piece
                tail = n - k - 1
            b = a + tail
            target.cache.set_length(e.slot, b)
        if b > a:
            ride.append((e.slot, a, e.seq.tokens[a:b]))
    return PrefillPass(ride, width, finishing, ks)
