"""The engine: continuous batching over a paged KV cache, one speculative round per step.

    step() = schedule → run → commit
      schedule  the scheduler (counting only) picks prefill chunks, the round's sequences and K each
      run       the prefill chunks, then one batched speculative round (K = 0 is plain decoding)
      commit    cache lengths and prefix blocks are recorded, updates go to each request's sink,
                finished sequences leave and free their blocks

Everything that generates drives this one loop: `LLM.generate` (submit, step until done), `bench`,
`verify`, `chat` and the server (`EngineLoop` steps it on a thread). Requests join and leave between
steps; the engine itself is single-threaded.
"""

from __future__ import annotations

import itertools
import os
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from verispec.engine.block_pool import BlockPool
from verispec.engine.branch_policy import BranchPolicy
from verispec.engine.forks import Forks
from verispec.engine.k_policy import KPolicy
from verispec.engine.metrics import SpecMetrics
from verispec.engine.params import SamplingParams
from verispec.engine.prefill import MIX_MAX_CONTEXT, plan_prefill
from verispec.engine.scheduler import Entry, Scheduler
from verispec.engine.sequence import Sequence
from verispec.engine.spec_round import RoundReport, speculative_round
from verispec.engine.stats import EngineStats
from verispec.errors import InvalidRequest
from verispec.loaders.tokenizer import TextTokenizer
from verispec.models import Transformer
from verispec.models.paged_cache import PagedKVCache
from verispec.models.runner import ModelRunner
from verispec.proposers import Proposer


@dataclass
class Update:
    """What one step did to one sequence of a request (sent to the request's sink)."""

    request_id: str
    index: int                          # choice index (prompt i, sample j → i·n + j)
    text: str                           # new text, safe to show (stop strings held back)
    token_ids: list[int]                # new tokens
    finish_reason: str | None = None    # set on the last update of the sequence
    prompt_tokens: int = 0
    completion_tokens: int = 0
    spec: dict | None = None            # drafted / accepted counts, on the last update
    error: str | None = None            # the engine failed this request
    seq: Sequence | None = field(default=None, repr=False)   # for in-process callers (LLM.generate)


@dataclass
class Request:
    id: str
    prompts: list[list[int]]
    params: SamplingParams
    sink: Callable[[Update], None]
    arrival: float = field(default_factory=time.perf_counter)
    text_deltas: bool = True            # put the new text in each Update (a stream's reader wants it)


def encode_prompt(tokenizer: TextTokenizer | None, vocab_size: int, prompt: str | list[int]) -> list[int]:
    """Text or token ids -> validated token ids (InvalidRequest for an empty or out-of-vocabulary prompt)."""
    if isinstance(prompt, str):
        if tokenizer is None:
            raise InvalidRequest("this model has no tokenizer: pass prompts as lists of token ids")
        ids = tokenizer.encode(prompt)
    else:
        ids = [int(t) for t in prompt]
    if not ids:
        raise InvalidRequest("the prompt is empty")
    if any(not 0 <= t < vocab_size for t in ids):
        raise InvalidRequest(f"prompt token ids must be in [0, {vocab_size})")
    return ids


class Engine:
    """target: the model every token is verified by; proposer: made for this engine (it keeps
    per-sequence state); policy: chooses K per round and learns from what each round measured;
    kv_dtype: how both models' caches store keys and values (None: each model's dtype);
    branches: alternative candidate branches verified beside a draft ("auto": when they pay,
    engine/branch_policy.py; N: up to N whenever offered; 0: chains only). Where passes are
    row-exact, a step's prefill chunks share one pass with the first rounds of the prompts they
    finish; mix_decode: the running sequences' round joins that pass too (one read of the weights for
    both; off by default: on a 2-core CPU the narrow pieces it needs cost more than the read saved)."""

    def __init__(self, target: Transformer, proposer: Proposer, policy: KPolicy, tokenizer: TextTokenizer | None,
                 proposer_name: str, k: int | str, context_length: int, draft: Transformer | None = None,
                 kv_budget_mb: float = 1024, block_size: int = 16, max_running: int = 32,
                 prefill_budget: int = 256, num_blocks: int | None = None, kv_dtype: torch.dtype | None = None,
                 branches: int | str = "auto", mix_decode: bool = False):
        if block_size < 1 or kv_budget_mb <= 0 or max_running < 1 or prefill_budget < 1:
            raise ValueError("block_size, kv_budget_mb, max_running and prefill_budget must be positive")
        models = [target] + ([draft] if draft is not None else [])
        per_block = sum(PagedKVCache.bytes_per_block(m.config, block_size, kv_dtype or m.dtype) for m in models)
        num_blocks = num_blocks or int(kv_budget_mb * 2**20 // per_block)
        self.pool = BlockPool(num_blocks, block_size)
        self.scheduler = Scheduler(self.pool, max_running, prefill_budget)

        def runner(model: Transformer) -> ModelRunner:
            return ModelRunner(model, cache=PagedKVCache(model.config, num_blocks, block_size, self.pool.tables,
                                                         model.dtype, model.device, kv_dtype, self.pool.epochs))

        self.target = runner(target)
        self.forks = Forks(self.pool, self.target.cache)
        self.proposer = proposer
        self.proposer.start(runner)
        self.policy = policy
        self.branch_policy = BranchPolicy(policy, branches)
        self.mix_decode = mix_decode
        self.tokenizer = tokenizer
        self.proposer_name, self.k = proposer_name, k
        self.stop_ids = frozenset(tokenizer.stop_token_ids) if tokenizer is not None else frozenset()
        self.context_length = context_length
        self.stats = EngineStats()
        self._slots = itertools.count(1)
        self._requests: dict[str, Request] = {}
        self._entries: dict[str, list[Entry]] = {}

    # -- requests ---------------------------------------------------------------------------
    def encode(self, prompt: str | list[int]) -> list[int]:
        return encode_prompt(self.tokenizer, self.target.model.config.vocab_size, prompt)

    def chat_prompt(self, messages: list[dict]) -> str:
        """A conversation rendered by the model's chat template."""
        if self.tokenizer is None:
            raise InvalidRequest("this model has no tokenizer, so no chat template")
        return self.tokenizer.apply_chat_template(messages)

    def check(self, prompts: list[list[int]], params: SamplingParams) -> None:
        """Raise InvalidRequest when a request can never run (called before it is queued)."""
        for ids in prompts:
            total = len(ids) + params.max_tokens
            if total > self.context_length:
                raise InvalidRequest(f"this model's context is {self.context_length} tokens, but the prompt "
                                     f"({len(ids)}) + max_tokens ({params.max_tokens}) asks for {total}",
                                     param="max_tokens", code="context_length_exceeded")
            if not self.scheduler.fits_ever(total + 1):      # K falls to 0 when blocks run short
                raise InvalidRequest(f"prompt + max_tokens ({total} tokens) does not fit the KV cache "
                                     f"({self.pool.usable * self.pool.block_size} tokens); start the server "
                                     "with a larger --kv-cache-mb", param="max_tokens",
                                     code="context_length_exceeded")

    def add(self, request: Request) -> list[Entry]:
        """Queue a request: one sequence per prompt and sample (n). Samples of one prompt wait for
        its first sample's prefill and then share it through the prefix cache."""
        self.check(request.prompts, request.params)
        params = request.params
        stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(self.stop_ids))
        entries = []
        for i, ids in enumerate(request.prompts):
            leader = None
            for j in range(params.n):
                seed = params.seed + j if params.seed is not None else int.from_bytes(os.urandom(7), "little")
                seq = Sequence(i * params.n + j, list(ids), params, torch.Generator().manual_seed(seed),
                               next(self._slots), frozenset(stop_ids), self.tokenizer,
                               SpecMetrics(self.proposer_name, self.k))
                entry = Entry(seq, request.id, request.arrival, leader=leader)
                leader = leader or entry
                entries.append(entry)
        self._requests[request.id] = request
        self._entries[request.id] = entries
        for e in entries:
            self.scheduler.add(e)
        self.stats.requests_received += 1
        return entries

    def abort(self, request_id: str) -> None:
        """Cancel a request (client gone, caller interrupted): its sequences leave and free their
        blocks; what they committed stays in the prefix cache."""
        for e in self._entries.pop(request_id, []):
            if not e.seq.finished:
                self._leave(e)
        self._requests.pop(request_id, None)

    @property
    def has_work(self) -> bool:
        return bool(self.scheduler.admitted or self.scheduler.waiting)

    def clear_prefix_cache(self) -> None:
        """Forget every cached prefix that no live sequence holds (a benchmark's cold start)."""
        self.pool.evict_cached()

    # -- one step ---------------------------------------------------------------------------
    def step(self) -> None:
        ks = self._choose_ks()
        plan = self.scheduler.schedule(lambda entry: ks.get(entry.slot, 0))
        for e in plan.preempted:
            self._free_caches(e)
        for e in plan.admitted:      # what the prefix cache already holds counts as written (a prompt
            self.target.cache.set_length(e.slot, e.computed)    # found whole then needs no prefill at all)
        if plan.prefill and self.target.model.exact_pass_rows(self.target.cache.store) is not None:
            self._prefill_with_first_rounds(plan)
        else:
            if plan.prefill:
                self._prefill(plan.prefill)
            if plan.decode:
                self._round(plan.decode, plan.ks)
        self.stats.preemptions = self.scheduler.preemptions

    def _choose_ks(self) -> dict[int, int]:
        """K (and source) for each sequence ready to decode, chosen jointly for the round (KPolicy.choose_for)."""
        ready = [e.seq for e in self.scheduler.admitted if e.prefilled]
        if not ready:
            return {}
        ks = self.policy.choose_for(self.proposer, ready)
        return {s.slot: k for s, k in zip(ready, ks)}

    def _prefill(self, parts: list[tuple[Entry, int, int]]) -> None:
        """Every prefill chunk of the step in one pass (pieces of equal width, ModelRunner.prefill)."""
        parts = [p for p in parts if p[2] > p[1]]
        if not parts:
            return
        self.target.prefill([(e.slot, a, e.seq.tokens[a:b]) for e, a, b in parts])
        for e, _, end in parts:
            self.scheduler.committed(e, end)

    def _prefill_with_first_rounds(self, plan) -> None:
        """The step's prefill pass with the first rounds of the prompts it finishes (engine/prefill.py);
        then the running sequences' round, or in that pass too with mix_decode."""
        parts = [(e, a, b) for e, a, b in plan.prefill if b > a]
        mix = self.mix_decode and bool(plan.decode) and max(b for _, _, b in parts) <= MIX_MAX_CONTEXT
        pp = plan_prefill(parts, self.target, self.policy, self.proposer, self.pool, plan.ks if mix else None)
        entries, ks = (plan.decode + pp.finishing, plan.ks + pp.ks) if mix else (pp.finishing, pp.ks)
        if entries:
            self._round(entries, ks, ride=pp.ride, ride_width=pp.width)
        else:
            self.target.prefill(pp.ride)
        for e, _, end in parts:
            if e not in pp.finishing:
                self.target.cache.set_length(e.slot, end)
                self.scheduler.committed(e, end)
        if plan.decode and not mix:
            self._round(plan.decode, plan.ks)

    def _round(self, entries: list[Entry], ks: list[int], ride: list | None = None, ride_width: int = 0) -> None:
        seqs = [e.seq for e in entries]
        before = [len(s.generated) for s in seqs]
        report = speculative_round(seqs, self.target, self.proposer, ks, self.forks, self.branch_policy.choose,
                                   ride, ride_width)
        self.learn(seqs, report)
        now = time.perf_counter()
        for e, s, n0 in zip(entries, seqs, before):
            self.scheduler.committed(e, len(s.tokens) - 1)
            new = s.generated[n0:]
            if (new or s.finished) and e.first_token is None:
                e.first_token, e.first_count = now, len(new)
                self.stats.ttft.append(now - e.arrival)
            self._send(e, new)
        for e in entries:                  # after every update went out (a request may finish whole)
            if e.seq.finished:
                e.done = now
                self._leave(e)

    def learn(self, seqs: list[Sequence], report: RoundReport) -> None:
        """Feed measured costs and acceptance into the K policy (used by k="auto")."""
        costs = self.policy.costs
        if not report.mixed:                # a mixed pass's time is not what a verify pass costs
            costs.record_verify(report.width, report.verify_s, report.rows or len(seqs))
        for source, (steps, seconds) in report.steps.items():
            costs.record_propose(source, steps, seconds)
        for source, (tokens, seconds) in (report.catchup or {}).items():
            costs.record_catchup(source, tokens, seconds)
        # The chains' acceptance: what the primary drafts alone had accepted (alternatives count apart).
        primary = report.primary_accepted or report.num_accepted
        for s, src, k, n in zip(seqs, report.sources, report.num_draft, primary):
            self.policy.observe(s.slot, src, k, n)
        if report.alternatives:
            self.branch_policy.observe(report.sources, report.alternatives,
                                       [n - p for n, p in zip(report.num_accepted, primary)])

    def _send(self, e: Entry, new_tokens: list[int]) -> None:
        s = e.seq
        request = self._requests.get(e.request_id)
        if request is None:
            return
        text = s.take_stream_delta() if request.text_deltas and s.tokenizer is not None else ""
        if not new_tokens and not text and not s.finished:
            return
        update = Update(e.request_id, s.index, text, new_tokens, seq=s)
        if s.finished:
            m = s.metrics
            update.finish_reason = s.finish_reason
            update.prompt_tokens, update.completion_tokens = len(s.prompt_ids), len(s.generated)
            update.spec = {"proposer": m.proposer, "rounds": m.rounds, "drafted": m.proposed,
                           "accepted": m.accepted, "k_histogram": {str(k): v for k, v in sorted(m.k_histogram.items())}}
        request.sink(update)

    def _free_caches(self, e: Entry) -> None:
        """Forget the entry's cache lengths and proposer state (its blocks are the scheduler's)."""
        self.proposer.release([e.slot])
        self.target.cache.drop(e.slot)

    def _leave(self, e: Entry) -> None:
        self.scheduler.finish(e)
        self._free_caches(e)
        self.policy.forget_slot(e.slot)
        if e.seq.finished:
            self.policy.finished(len(e.seq.generated), e.seq.finish_reason == "length")
        self.stats.record_left(e.seq, e.arrival, e.first_token)
        entries = self._entries.get(e.request_id, [])
        if e.seq.finished and all(x.seq.finished for x in entries):
            self._entries.pop(e.request_id, None)
            self._requests.pop(e.request_id, None)

    def fail_all(self, message: str) -> None:
        """The engine hit an internal error: tell every live request and drop it."""
        for request_id, entries in list(self._entries.items()):
            request = self._requests.get(request_id)
            for e in entries:
                self.scheduler.finish(e)
                self._free_caches(e)
                self.policy.forget_slot(e.slot)
                if request is not None and not e.seq.finished:
                    request.sink(Update(request_id, e.seq.index, "", [], finish_reason="error", error=message,
                                        seq=e.seq))
        self._entries.clear()
        self._requests.clear()
