"""One speculative round for a batch of sequences (DESIGN: propose → verify → accept → commit).

Plain decoding is the same round with K = 0: the verify pass then scores just the pending token.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Callable

import torch

from verispec.errors import NonFiniteOutput
from verispec.models.runner import ModelRunner
from verispec.engine.sequence import Sequence
from verispec.proposers.base import Proposal, Proposer
from verispec.engine.forks import Forks
from verispec.sampling import AcceptanceResult, accept_greedy, accept_sampling, warp_probs
from verispec.sampling.branches import accept_branches


@dataclass
class RoundReport:
    num_draft: list[int]
    num_accepted: list[int]
    sources: list[str]
    width: int                                  # tokens per row in the verify pass (K_max + 1)
    verify_s: float
    steps: dict[str, tuple[int, float]]         # proposer source -> (steps, seconds)
    catchup: dict[str, tuple[int, float]] | None = None   # source -> (tokens, seconds) of one-off prefill
    rows: int = 0                               # sequences in the verify pass, forks of alternative branches included
    mixed: bool = False                         # prefill pieces rode along: verify_s is not a verify pass's cost
    primary_accepted: list[int] | None = None   # drafts of the primary chain the same draws accepted
    alternatives: list[int] | None = None       # alternative branches verified per sequence


# (seqs, proposal) -> how many of each row's alternative branches to verify (the engine's branch policy)
ChooseBranches = Callable[[list[Sequence], Proposal], list[int]]


def speculative_round(seqs: list[Sequence], target: ModelRunner, proposer: Proposer, ks: list[int],
                      forks: Forks | None = None, choose_branches: ChooseBranches | None = None,
                      ride: list[tuple[int, int, list[int]]] | None = None, ride_width: int = 0) -> RoundReport:
    """forks, choose_branches: verify alternative candidate branches (Proposal.branches) beside the
    primary drafts, each on a fork of its sequence's cache; without them only the primary chains.
    ride: prefill chunks (slot, start, tokens) written in the same pass, cut into pieces of
    ride_width tokens (default: the widest verify row) — one read of the weights for both; a sequence
    of the round may ride its own prompt's tail ahead of its row. Their lengths are the caller's."""
    t0 = time.perf_counter()

    # 1. Propose: up to ks[b] draft tokens x̃ per sequence (ragged), with q or as point masses.
    proposal = proposer.propose(seqs, ks)
    num_draft = proposal.num_draft.tolist()
    t1 = time.perf_counter()

    # 2. Verify: one target pass over [pending token, x̃_0 … x̃_{k-1}]; logits only for those k+1 rows.
    #    Alternative branches ride along as sequences of their own (forks sharing the cached prefix).
    chunks, rows = [], []
    for b, s in enumerate(seqs):
        chunk = s.tokens[target.length(s.slot):] + proposal.tokens[b, : num_draft[b]].tolist()
        chunks.append(chunk)
        rows.append(list(range(len(chunk) - num_draft[b] - 1, len(chunk))))
    # Per row: [(fork slot, tokens)]. Not beside prefill pieces: a fork would be padded to their width.
    alts = _open_branches(seqs, target, proposal, forks if not ride else None, choose_branches)
    slots = [s.slot for s in seqs]
    for b, s in enumerate(seqs):
        for fork, toks in alts[b]:
            pending = s.tokens[target.length(s.slot):]
            slots.append(fork)
            chunks.append(pending + toks)
            rows.append(list(range(len(pending) - 1, len(pending) + len(toks))))
    starts = [target.length(slot) for slot in slots]
    if ride:
        for slot, start, toks in ModelRunner.pieces(ride, ride_width or max(len(c) for c in chunks)):
            slots.append(slot)
            chunks.append(toks)
            starts.append(start)
    out = target.forward(slots, chunks, rows, states=proposer.wants_states, starts=starts, pad_beyond=bool(ride))
    logits, states = out if proposer.wants_states else (out, None)              # (B+F, K+1, V), (B+F, K+1, C)
    t2 = time.perf_counter()
    _check_finite(logits[: len(seqs)], proposal)
    if len(rows) > len(seqs) and not torch.isfinite(logits[len(seqs):]).all():
            raise NonFiniteOutput("the target model produced NaN or infinite logits; its weights or settings "
                                  "are broken (or its activations overflow)")

    # 3. Accept: greedy rows by argmax, sampling rows by modified rejection sampling; rows with
    #    alternative branches walk their token tree (sampling/branches.py).
    branched = [b for b in range(len(seqs)) if alts[b]]
    result = _accept(seqs, logits, proposal, skip=set(branched))
    primary = result.num_accepted.tolist()
    state_row = list(range(len(seqs)))                 # which pass row holds each sequence's states
    fork_row = len(seqs)
    for b in range(len(seqs)):
        if not alts[b]:
            continue
        s = seqs[b]
        branches = [proposal.tokens[b, : num_draft[b]].tolist()] + [toks for _, toks in alts[b]]
        rows_of = [b] + list(range(fork_row, fork_row + len(alts[b])))
        fork_row += len(alts[b])
        scores = [logits[r, : len(toks) + 1] for r, toks in zip(rows_of, branches)]
        if not s.params.greedy:
            p = s.params
            scores = [warp_probs(x[None], torch.tensor([p.temperature]), torch.tensor([p.top_k]),
                                 torch.tensor([p.top_p]))[0] for x in scores]
        walk = accept_branches(branches, scores, s.params.greedy, s.generator)
        result.num_accepted[b] = walk.num_accepted
        result.tokens[b] = -1
        result.tokens[b, : len(walk.tokens)] = torch.tensor(walk.tokens)
        primary[b] = walk.primary_accepted
        if walk.branch:
            forks.adopt(alts[b][walk.branch - 1][0], s.slot, target.length(s.slot), walk.num_accepted + 1)
            state_row[b] = rows_of[walk.branch]
        s.metrics.record_branches(len(alts[b]), walk.branch != 0, walk.num_accepted - walk.primary_accepted)
    if forks is not None:
        forks.close()

    # 4. Commit: append emitted tokens one by one (stops cut exactly where plain decoding would),
    #    then move the target's length pointer; rejected cache entries are simply left behind.
    sources = proposal.source or [proposer.name] * len(seqs)
    for b, s in enumerate(seqs):
        n = int(result.num_accepted[b])
        emitted = result.emitted(b)
        appended = 0
        for token in emitted:
            appended += 1
            if s.append(token):
                break
        target.cache.set_length(s.slot, len(s.tokens) - 1)
        if states is not None and not s.finished:   # rows 0 … n scored the n + 1 emitted tokens
            new = states[state_row[b], max(0, n + 1 - proposer.state_window): n + 1]
            kept = new if s.recent_states is None else torch.cat([s.recent_states, new])
            s.recent_states = kept[-proposer.state_window:].clone()
        verified = min(n + 1, num_draft[b])
        overlaps = result.overlap[b, :verified].tolist() if result.overlap is not None and not alts[b] else []
        s.metrics.record_round(num_draft[b], n, appended, overlaps, sources[b])

    # 5. Hear back: the proposer rolls its own state back to the committed tokens.
    proposer.observe(seqs, result.num_accepted.tolist())
    t3 = time.perf_counter()
    for s, src, k in zip(seqs, sources, num_draft):
        s.metrics.draft_s += t1 - t0
        s.metrics.verify_s += t2 - t1
        s.metrics.other_s += t3 - t2
        if k:                                   # by proposer ('ngram:3' counts as ngram)
            name = src.split(":")[0]
            s.metrics.sources[name] = s.metrics.sources.get(name, 0) + 1
    steps = proposal.steps or {proposer.name: (max(num_draft, default=0), t1 - t0)}
    return RoundReport(num_draft, result.num_accepted.tolist(), sources, max(num_draft, default=0) + 1,
                       t2 - t1, steps, proposal.catchup, rows=len(rows), mixed=bool(ride),
                       primary_accepted=primary, alternatives=[len(a) for a in alts])


def _open_branches(seqs: list[Sequence], target: ModelRunner, proposal: Proposal, forks: Forks | None,
                   choose: ChooseBranches | None) -> list[list[tuple[int, list[int]]]]:
    """The alternative branches this round verifies, each with the fork it is scored on."""
    alts: list[list[tuple[int, list[int]]]] = [[] for _ in seqs]
    if proposal.branches is None or forks is None or choose is None:
        return alts
    keep = choose(seqs, proposal)
    for b, s in enumerate(seqs):
        length = target.length(s.slot)
        if len(s.tokens) - length > 1:          # a prompt's tail is still uncached: a fork would replay it
            continue
        for toks in proposal.branches[b][: keep[b]]:
            fork = forks.open(s.slot, length, len(s.tokens) + len(toks))
            if fork is None:                        # no free blocks: the primary chain alone
                break
            alts[b].append((fork, toks))
    return alts


def _check_finite(logits: torch.Tensor, proposal: Proposal) -> None:
    """Fail loudly on NaN or infinite scores (a broken or overflowing model) instead of sampling garbage.
    Only the rows each sequence reads count: padding rows of a ragged pass may hold anything."""
    drafted = proposal.num_draft.tolist()
    if not all(_finite(logits[b, : n + 1]) for b, n in enumerate(drafted)):
        raise NonFiniteOutput("the target model produced NaN or infinite logits; its weights or settings are "
                              "broken (or its activations overflow)")
    if proposal.q is not None and proposal.q.numel():
        if not all(_finite(proposal.q[b, :n]) for b, n in enumerate(drafted) if n):
            raise NonFiniteOutput("the draft model produced NaN or infinite probabilities; its weights or "
                                  "settings are broken (or its activations overflow)")


def _finite(scores: torch.Tensor) -> bool:
    """Every value finite, from the smallest and largest alone (one reduction over a view, no copy): a NaN
    propagates into both, an infinity into one."""
    low, high = torch.aminmax(scores)
    return math.isfinite(low.item()) and math.isfinite(high.item())


def _accept(seqs: list[Sequence], logits: torch.Tensor, proposal: Proposal, skip: set[int]) -> AcceptanceResult:
    """Chains: rows in `skip` (they walk their branches instead) are left at 0 accepted."""
    b, k = proposal.tokens.shape
    num_accepted = torch.zeros(b, dtype=torch.long)
    tokens = torch.full((b, k + 1), -1, dtype=torch.long)
    overlap = torch.zeros(b, k)
    greedy = [i for i, s in enumerate(seqs) if s.params.greedy and i not in skip]
    sampled = [i for i, s in enumerate(seqs) if not s.params.greedy and i not in skip]
    if greedy:
        g = slice(None) if len(greedy) == b else torch.tensor(greedy)          # every row: no copy of the logits
        res = accept_greedy(logits[g], proposal.tokens[g], proposal.num_draft[g])
        num_accepted[g], tokens[g], overlap[g] = res.num_accepted, res.tokens, res.overlap
    if sampled:
        idx = slice(None) if len(sampled) == b else torch.tensor(sampled)     # every row: no copy of the logits
        ps = [seqs[i].params for i in sampled]
        p = warp_probs(logits[idx], torch.tensor([x.temperature for x in ps]),
                       torch.tensor([x.top_k for x in ps]), torch.tensor([x.top_p for x in ps]))
        q = proposal.q[idx] if proposal.q is not None else None
        res = accept_sampling(p, proposal.tokens[idx], q, proposal.num_draft[idx],
                              [seqs[i].generator for i in sampled])
        num_accepted[idx], tokens[idx], overlap[idx] = res.num_accepted, res.tokens, res.overlap
    return AcceptanceResult(num_accepted, tokens, overlap)
