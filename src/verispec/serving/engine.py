"""The serving engine: continuous batching over a paged KV cache, one speculative round per step.

    step() = schedule → run → commit
      schedule  the scheduler (counting only) picks prefill chunks, the round's sequences and K each
      run       one batched prefill pass for the chunks, then one batched speculative round
      commit    cache lengths and prefix blocks are recorded, updates go to each request's sink,
                finished sequences leave and free their blocks

Requests join and leave between steps. The engine is single-threaded; `ServingLoop` runs it on a
thread and takes requests and cancellations from other threads.
"""

from __future__ import annotations

import itertools
import os
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from verispec.engine.llm import LLM
from verispec.engine.metrics import SpecMetrics
from verispec.engine.params import SamplingParams
from verispec.models.runner import ModelRunner
from verispec.engine.sequence import Sequence
from verispec.engine.spec_round import speculative_round
from verispec.errors import InvalidRequest
from verispec.models.paged_cache import PagedKVCache
from verispec.engine.block_pool import BlockPool
from verispec.engine.scheduler import Entry, Scheduler
from verispec.engine.stats import ServerStats


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


@dataclass
class Request:
    id: str
    prompts: list[list[int]]
    params: SamplingParams
    sink: Callable[[Update], None]
    arrival: float = field(default_factory=time.perf_counter)


class ServingEngine:
    def __init__(self, llm: LLM, kv_budget_mb: float = 1024, block_size: int = 16, max_running: int = 32,
                 prefill_budget: int = 256, num_blocks: int | None = None):
        if block_size < 1 or kv_budget_mb <= 0 or max_running < 1 or prefill_budget < 1:
            raise ValueError("block_size, kv_budget_mb, max_running and prefill_budget must be positive")
        self.llm = llm
        target = llm.target.model
        models = [target] + ([llm.draft.model] if llm.draft is not None else [])
        per_block = sum(PagedKVCache.bytes_per_block(m.config, block_size, m.dtype) for m in models)
        num_blocks = num_blocks or int(kv_budget_mb * 2**20 // per_block)
        self.pool = BlockPool(num_blocks, block_size)
        self.scheduler = Scheduler(self.pool, max_running, prefill_budget)
        self.target = ModelRunner(target, cache=PagedKVCache(
            target.config, num_blocks, block_size, self.pool.tables, target.dtype, target.device))
        self.proposer = llm.make_proposer()
        self.proposer.start(lambda m: ModelRunner(m, cache=PagedKVCache(
            m.config, num_blocks, block_size, self.pool.tables, m.dtype, m.device)))
        self.policy = llm.policy
        self.stop_ids = frozenset(llm.tokenizer.stop_token_ids) if llm.tokenizer is not None else frozenset()
        self.context_length = llm.context_length
        self.stats = ServerStats()
        self._slots = itertools.count(1)
        self._requests: dict[str, list[Entry]] = {}
        self._sinks: dict[str, Callable[[Update], None]] = {}
        self._first_token: dict[int, float] = {}

    # -- requests ---------------------------------------------------------------------------
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

    def add(self, request: Request) -> None:
        self.check(request.prompts, request.params)
        params = request.params
        stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(self.stop_ids))
        entries = []
        for i, ids in enumerate(request.prompts):
            for j in range(params.n):
                seed = params.seed + j if params.seed is not None else int.from_bytes(os.urandom(7), "little")
                seq = Sequence(i * params.n + j, list(ids), params, torch.Generator().manual_seed(seed),
                               next(self._slots), frozenset(stop_ids), self.llm.tokenizer,
                               SpecMetrics(self.llm.proposer_name, self.llm.k))
                entries.append(Entry(seq, request.id, request.arrival))
        self._requests[request.id] = entries
        self._sinks[request.id] = request.sink
        for e in entries:
            self.scheduler.add(e)
        self.stats.requests_received += 1

    def abort(self, request_id: str) -> None:
        """Cancel a request (client gone): its sequences leave and their blocks are freed."""
        for e in self._requests.pop(request_id, []):
            if not e.seq.finished:
                self._leave(e)
        self._sinks.pop(request_id, None)

    @property
    def has_work(self) -> bool:
        return bool(self.scheduler.admitted or self.scheduler.waiting)

    # -- one step ---------------------------------------------------------------------------
    def step(self) -> None:
        ks = self._choose_ks()
        plan = self.scheduler.schedule(lambda entry: ks.get(entry.slot, 0))
        for e in plan.preempted:
            self._free_caches(e)
        if plan.prefill:
            self._prefill(plan.prefill)
        if plan.decode:
            self._round(plan.decode, plan.ks)
        self.stats.preemptions = self.scheduler.preemptions

    def _choose_ks(self) -> dict[int, int]:
        """K for each sequence ready to decode, chosen jointly for the round (KPolicy.choose_round)."""
        ready = [e.seq for e in self.scheduler.admitted if e.prefilled]
        if not ready:
            return {}
        ks = self.policy.choose_round(ready, [self.proposer.source_for(s) for s in ready],
                                      backlogs=[self.proposer.backlog(s) for s in ready])
        return {s.slot: k for s, k in zip(ready, ks)}

    def _prefill(self, parts: list[tuple[Entry, int, int]]) -> None:
        parts = [p for p in parts if p[2] > p[1]]
        if not parts:
            return
        for e, start, _ in parts:
            self.target.cache.set_length(e.slot, start)
        t0 = time.perf_counter()
        self.target.forward([e.slot for e, _, _ in parts], [e.seq.tokens[a:b] for e, a, b in parts], rows=None)
        self.stats.prefill_s += time.perf_counter() - t0
        for e, _, end in parts:
            self.target.cache.set_length(e.slot, end)
            self.scheduler.committed(e, end)

    def _round(self, entries: list[Entry], ks: list[int]) -> None:
        seqs = [e.seq for e in entries]
        before = [len(s.generated) for s in seqs]
        report = speculative_round(seqs, self.target, self.proposer, ks)
        self.llm.learn(seqs, report)
        self.stats.record_round(report)
        now = time.perf_counter()
        for e, s, n0 in zip(entries, seqs, before):
            self.scheduler.committed(e, len(s.tokens) - 1)
            new = s.generated[n0:]
            if new and s.slot not in self._first_token:
                self._first_token[s.slot] = now
                self.stats.ttft.append(now - e.arrival)
            self._send(e, new)
        for e in entries:                  # after every update went out (a request may finish whole)
            if e.seq.finished:
                self._leave(e)

    def _send(self, e: Entry, new_tokens: list[int]) -> None:
        s = e.seq
        sink = self._sinks.get(e.request_id)
        text = s.take_stream_delta() if s.tokenizer is not None else ""
        if sink is None or (not new_tokens and not text and not s.finished):
            return
        update = Update(e.request_id, s.index, text, new_tokens)
        if s.finished:
            m = s.metrics
            update.finish_reason = s.finish_reason
            update.prompt_tokens, update.completion_tokens = len(s.prompt_ids), len(s.generated)
            update.spec = {"proposer": m.proposer, "rounds": m.rounds, "drafted": m.proposed,
                           "accepted": m.accepted, "k_histogram": {str(k): v for k, v in sorted(m.k_histogram.items())}}
        sink(update)

    def _free_caches(self, e: Entry) -> None:
        """Forget the entry's cache lengths and proposer state (its blocks are the scheduler's)."""
        self.proposer.release([e.slot])
        self.target.cache.drop(e.slot)

    def _leave(self, e: Entry) -> None:
        self.scheduler.finish(e)
        self._free_caches(e)
        self.policy.forget_slot(e.slot)
        first = self._first_token.pop(e.slot, None)
        s = e.seq
        if s.finished:
            self.stats.record_finished(s, e.arrival, first)
            entries = self._requests.get(e.request_id, [])
            if all(x.seq.finished for x in entries):
                self._requests.pop(e.request_id, None)
                self._sinks.pop(e.request_id, None)

    def fail_all(self, message: str) -> None:
        """The engine hit an internal error: tell every live request and drop it."""
        for request_id, entries in list(self._requests.items()):
            sink = self._sinks.get(request_id)
            for e in entries:
                self.scheduler.finish(e)
                self._free_caches(e)
                self.policy.forget_slot(e.slot)
                self._first_token.pop(e.slot, None)
                if sink is not None and not e.seq.finished:
                    sink(Update(request_id, e.seq.index, "", [], finish_reason="error", error=message))
        self._requests.clear()
        self._sinks.clear()


class ServingLoop:
    """Runs a ServingEngine on its own thread; `submit` and `cancel` are safe from any thread."""

    def __init__(self, engine: ServingEngine, max_waiting: int = 256):
        self.engine = engine
        self.max_waiting = max_waiting
        self._inbox: queue.Queue = queue.Queue()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="verispec-engine", daemon=True)
        self.error: str | None = None

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._inbox.put(None)
        self._thread.join(timeout)

    @property
    def queued(self) -> int:
        return self.engine.scheduler.num_waiting + self._inbox.qsize()

    def submit(self, request: Request) -> None:
        self.engine.check(request.prompts, request.params)     # fail fast, in the caller's thread
        self._inbox.put(("add", request))

    def cancel(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id))

    def _drain(self, block: bool) -> None:
        try:
            item = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while item is not None:
            kind, arg = item
            if kind == "add":
                try:
                    self.engine.add(arg)
                except Exception as err:           # refused (or broken) request: tell it, keep serving
                    self.engine.abort(arg.id)
                    arg.sink(Update(arg.id, 0, "", [], finish_reason="error", error=str(err)))
            else:
                self.engine.abort(arg)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                item = None

    def _run(self) -> None:
        while not self._stop.is_set():
            self._drain(block=not self.engine.has_work)
            if not self.engine.has_work:
                continue
            try:
                self.engine.step()
            except Exception as err:       # keep serving: fail the live requests, not the process
                self.error = f"{type(err).__name__}: {err}"
                self.engine.fail_all(f"internal engine error: {self.error}")
                self.engine.stats.engine_errors += 1
