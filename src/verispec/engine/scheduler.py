"""The scheduler decides, each step, who prefills how much and who joins the speculative round.

It counts and never touches tensors. Per step (`schedule`):
1. running sequences get room for their next round: len(tokens) + K positions (the pending token
   and K drafts are written by the verify pass). If the pool is short, K falls to 0; if it is still
   short, the most recently admitted other sequence is preempted (its blocks are freed and it is
   recomputed from its tokens later; its output so far is kept, so nothing visible changes);
2. sequences part-way through their prompt continue prefilling, oldest first, within a per-step
   token budget (chunked prefill: a long prompt never stalls running streams for long);
3. waiting sequences are admitted in arrival order while blocks and budget last; a prompt whose
   leading blocks are in the prefix cache starts prefilling after them. A further sample of a
   prompt (n > 1) waits until the first one has prefilled, then finds that prompt in the cache.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from verispec.engine.sequence import Sequence
from verispec.engine.block_pool import BlockPool


@dataclass(eq=False)
class Entry:
    seq: Sequence
    request_id: str
    arrival: float
    computed: int = 0             # tokens in the target's cache
    admitted: int = -1            # admission order (-1: waiting)
    cached: int = 0               # prompt tokens found in the prefix cache at (the last) admission
    leader: "Entry | None" = None  # the first sample of the same prompt (n > 1): its prefill is shared
    first_token: float | None = None   # when the first generated token (or the finish) was committed
    first_count: int = 0               # tokens committed then (a speculative first round emits several)
    done: float | None = None          # when the sequence finished

    @property
    def slot(self) -> int:
        return self.seq.slot

    @property
    def prefilled(self) -> bool:
        return self.admitted >= 0 and self.computed >= len(self.seq.tokens) - 1


@dataclass
class Plan:
    prefill: list[tuple[Entry, int, int]] = field(default_factory=list)  # write seq.tokens[start:end]
    decode: list[Entry] = field(default_factory=list)
    ks: list[int] = field(default_factory=list)
    preempted: list[Entry] = field(default_factory=list)
    admitted: list[Entry] = field(default_factory=list)   # admitted this step (their caches start at .computed)


class Scheduler:
    def __init__(self, pool: BlockPool, max_running: int = 32, prefill_budget: int = 256):
        self.pool = pool
        self.max_running = max_running
        self.prefill_budget = prefill_budget
        self.waiting: deque[Entry] = deque()
        self.admitted: list[Entry] = []          # prefilling or running, in admission order
        self._counter = 0
        self.preemptions = 0

    # -- bookkeeping ------------------------------------------------------------------------
    def add(self, entry: Entry) -> None:
        self.waiting.append(entry)

    def finish(self, entry: Entry) -> None:
        """The entry is done (finished or cancelled): it leaves and its blocks are released."""
        if entry in self.admitted:
            self.admitted.remove(entry)
            self.pool.register(entry.slot, entry.seq.tokens, entry.computed)
            self.pool.release(entry.slot)
        elif entry in self.waiting:
            self.waiting.remove(entry)

    def committed(self, entry: Entry, computed: int) -> None:
        """The engine wrote up to `computed` tokens of the entry into the target cache."""
        entry.computed = computed
        self.pool.register(entry.slot, entry.seq.tokens, computed)

    @property
    def num_running(self) -> int:
        return len(self.admitted)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def fits_ever(self, positions: int) -> bool:
        """Could a sequence of this many positions run at all, alone in the pool?"""
        return self.pool.blocks_for(positions) <= self.pool.usable

    # -- one step ---------------------------------------------------------------------------
    def schedule(self, choose_k: Callable[[Entry], int]) -> Plan:
        plan = Plan()
        for entry in [e for e in self.admitted if e.prefilled]:
            if entry not in self.admitted:           # preempted earlier in this loop
                continue
            k = choose_k(entry)
            need = len(entry.seq.tokens)
            while not self.pool.grow(entry.slot, need + k):
                if k > 0:
                    k = 0
                    continue
                victim = self._victim(entry)
                if victim is None:                  # cannot happen for requests that fit_ever
                    raise RuntimeError("the KV block pool cannot hold a single sequence")
                self._preempt(victim, plan)
            plan.decode.append(entry)
            plan.ks.append(k)

        budget = self.prefill_budget
        for entry in self.admitted:
            if budget <= 0:
                break
            if not entry.prefilled:
                budget -= self._prefill_chunk(entry, budget, plan)
        while self.waiting and budget > 0 and len(self.admitted) < self.max_running:
            entry = self.waiting[0]
            if entry.leader is not None and entry.leader.admitted >= 0 and not entry.leader.prefilled:
                break
            tokens = entry.seq.tokens
            # Room for the prompt and the first round, keeping one block per running sequence spare.
            if self.pool.available() - self.pool.blocks_for(len(tokens)) < len(self.admitted):
                break
            cached = self.pool.admit(entry.slot, tokens[:-1], len(tokens))
            if cached is None:
                break
            self.waiting.popleft()
            entry.computed, entry.cached, entry.admitted = cached, cached, self._counter
            self._counter += 1
            self.admitted.append(entry)
            plan.admitted.append(entry)
            if not entry.prefilled:
                budget -= self._prefill_chunk(entry, budget, plan)
        return plan

    def _prefill_chunk(self, entry: Entry, budget: int, plan: Plan) -> int:
        end = min(len(entry.seq.tokens) - 1, entry.computed + budget)
        plan.prefill.append((entry, entry.computed, end))
        return end - entry.computed

    def _victim(self, keep: Entry) -> Entry | None:
        candidates = [e for e in self.admitted if e is not keep]
        return max(candidates, key=lambda e: e.admitted) if candidates else None

    def _preempt(self, entry: Entry, plan: Plan) -> None:
        """Recompute preemption: free the blocks, keep the tokens, queue at the front."""
        self.admitted.remove(entry)
        self.pool.register(entry.slot, entry.seq.tokens, entry.computed)
        self.pool.release(entry.slot)
        entry.computed, entry.admitted = 0, -1
        self.waiting.appendleft(entry)
        self.preemptions += 1
        for part in [p for p in plan.prefill if p[0] is entry]:
            plan.prefill.remove(part)
        if entry in plan.decode:
            i = plan.decode.index(entry)
            del plan.decode[i], plan.ks[i]
        plan.preempted.append(entry)
