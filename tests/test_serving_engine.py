"""The serving engine on tiny models: continuous batching, paged cache, prefix caching, preemption,
cancellation — outputs always equal what each request produces alone with `LLM.generate`."""

from __future__ import annotations

import pytest
import torch

from conftest import tiny_model
from verispec import LLM, SamplingParams
from verispec.errors import InvalidRequest
from verispec.engine.block_pool import BlockPool, block_hashes
from verispec.engine.engine import Engine, Request


def collect(engine: Engine, requests: list[tuple[str, list[list[int]], SamplingParams]],
            join_every: int = 0, max_steps: int = 5000) -> dict[str, dict[int, list[int]]]:
    """Run requests to completion; with join_every > 0, request i joins after i·join_every steps."""
    out: dict[str, dict[int, list[int]]] = {}

    def sink(u):
        assert u.error is None, u.error
        out.setdefault(u.request_id, {}).setdefault(u.index, []).extend(u.token_ids)

    pending = list(requests)
    step = 0
    while pending or engine.has_work:
        while pending and step >= join_every * (len(requests) - len(pending)):
            rid, prompts, params = pending.pop(0)
            engine.add(Request(rid, prompts, params, sink))
        engine.step() if engine.has_work else None
        step += 1
        assert step < max_steps
    return out


def make(proposer="ngram", k="auto", draft=True, **kw):
    target = tiny_model(0)
    llm = LLM(target, draft=tiny_model(1) if draft and proposer in ("draft", "hybrid") else None,
              proposer=proposer, k=k)
    return llm, llm.engine(**kw)


PROMPTS = [[5, 6, 7, 8, 9, 5, 6, 7], [1, 2, 3], list(range(10, 50)), [7] * 20, [3, 1, 4, 1, 5, 9, 2, 6, 5, 3]]


@pytest.mark.parametrize("proposer,k", [("none", 0), ("ngram", "auto"), ("draft", 3), ("hybrid", "auto")])
def test_continuous_batching_equals_alone(proposer, k):
    llm, engine = make(proposer, k, block_size=4, kv_budget_mb=4)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    alone = {f"r{i}": llm.generate([p], params)[0].token_ids for i, p in enumerate(PROMPTS)}
    got = collect(engine, [(f"r{i}", [p], params) for i, p in enumerate(PROMPTS)], join_every=3)
    assert {rid: v[0] for rid, v in got.items()} == alone
    assert engine.pool.available() == engine.pool.usable          # every block came back


def test_seeded_sampling_is_reproducible_in_any_batch():
    llm, engine = make("draft", 2, block_size=4, kv_budget_mb=4)
    params = SamplingParams(temperature=0.8, max_tokens=16, seed=11, ignore_eos=True)
    alone = llm.generate([PROMPTS[0]], params)[0].token_ids
    got = collect(engine, [("a", [PROMPTS[0]], params), ("b", [PROMPTS[2]], params), ("c", [PROMPTS[1]], params)])
    assert got["a"][0] == alone


def test_preemption_under_block_pressure_keeps_outputs():
    # A pool of a few sequences' worth, so running sequences must preempt each other.
    llm, engine = make("ngram", "auto", block_size=4, num_blocks=20)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    alone = {f"r{i}": llm.generate([p], params)[0].token_ids for i, p in enumerate(PROMPTS[:4])}
    got = collect(engine, [(f"r{i}", [p], params) for i, p in enumerate(PROMPTS[:4])])
    assert {rid: v[0] for rid, v in got.items()} == alone
    assert engine.scheduler.preemptions > 0
    assert engine.pool.available() == engine.pool.usable


def test_prefix_cache_shares_a_repeated_prompt():
    llm, engine = make("none", 0, block_size=4, kv_budget_mb=4)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompt = list(range(10, 50))
    first = collect(engine, [("a", [prompt], params)])
    hits_before = engine.pool.hits
    second = collect(engine, [("b", [prompt], params)])
    assert second["b"][0] == first["a"][0] == llm.generate([prompt], params)[0].token_ids
    assert engine.pool.hits - hits_before == (len(prompt) - 1) // 4   # every full prompt block reused


def test_a_prompt_found_whole_in_the_prefix_cache_is_not_computed_again(monkeypatch):
    """Every block of the prompt (all but its pending token) is cached: its first round is one row,
    not the whole prompt again (which also padded every other sequence of the round to its length)."""
    from verispec.models.runner import ModelRunner

    llm, engine = make("none", 0, block_size=4, kv_budget_mb=4)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompt = list(range(10, 51))                                    # 40 cacheable tokens: 10 whole blocks
    first = collect(engine, [("a", [prompt], params)])
    alone = llm.generate([prompt], params)[0].token_ids
    widths = []
    forward = ModelRunner.forward
    monkeypatch.setattr(ModelRunner, "forward",
                        lambda self, slots, chunks, *a, **kw: widths.append(max(map(len, chunks)))
                        or forward(self, slots, chunks, *a, **kw))
    second = collect(engine, [("b", [prompt], params)])
    assert second["b"][0] == first["a"][0] == alone
    assert widths and max(widths) == 1


def test_a_prompt_the_draft_already_holds_is_not_fed_to_the_draft_again(monkeypatch):
    """A repeated prompt (a document asked about again, a conversation's history): the draft starts
    past the blocks an earlier sequence's draft filled, so it is fed only the last token and its own
    drafts — and it drafts exactly what it drafted the first time (same tokens accepted)."""
    from verispec.models.runner import ModelRunner

    llm, engine = make("draft", 3, block_size=4, kv_budget_mb=4)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompt = list(range(10, 51))
    spec = {}

    def run(rid):
        out = []

        def sink(u):
            out.extend(u.token_ids)
            if u.finish_reason:
                spec[rid] = u.spec
        engine.add(Request(rid, [prompt], params, sink))
        while engine.has_work:
            engine.step()
        return out

    first = run("a")
    fed = []
    forward = ModelRunner.forward
    monkeypatch.setattr(ModelRunner, "forward",
                        lambda self, slots, chunks, *a, **kw: (fed.append(max(map(len, chunks)))
                                                               if self is engine.proposer.runner else None)
                        or forward(self, slots, chunks, *a, **kw))
    second = run("b")
    assert second == first == llm.generate([prompt], params)[0].token_ids
    assert fed and max(fed) <= 2                     # never the prompt again: its last token, then drafts
    assert spec["b"]["accepted"] == spec["a"]["accepted"] and spec["b"]["k_histogram"] == spec["a"]["k_histogram"]


def test_a_cache_forgets_what_it_wrote_in_a_block_handed_out_afresh():
    from verispec.models.paged_cache import PagedKVCache
    from conftest import tiny_config

    pool = BlockPool(num_blocks=6, block_size=4)
    cache = PagedKVCache(tiny_config(), 6, 4, pool.tables, block_epochs=pool.epochs)
    tokens = list(range(9))
    pool.admit(1, tokens, 9)
    cache.mark_written(1, 9)                          # two full blocks (the third is partial)
    pool.register(1, tokens, 8)
    pool.release(1)
    pool.admit(2, tokens, 9)                          # the same prompt: both blocks shared
    assert cache.written_prefix(2) == 8
    pool.release(2)
    pool.evict_cached()
    pool.admit(3, [99] * 9, 12)                       # other tokens in the same blocks
    assert cache.written_prefix(3) == 0


def test_abort_frees_blocks():
    llm, engine = make("ngram", "auto", block_size=4, kv_budget_mb=4)
    engine.add(Request("x", [PROMPTS[2]], SamplingParams(temperature=0, max_tokens=100, ignore_eos=True),
                       lambda u: None))
    for _ in range(5):
        engine.step()
    assert engine.pool.available() < engine.pool.usable
    engine.abort("x")
    assert not engine.has_work
    assert engine.pool.available() == engine.pool.usable


def test_request_that_can_never_fit_is_refused():
    llm, engine = make("none", 0, block_size=4, kv_budget_mb=4)
    with pytest.raises(InvalidRequest, match="context") as err:
        engine.check([[1, 2, 3]], SamplingParams(max_tokens=10_000))
    assert err.value.code == "context_length_exceeded"


def test_block_pool_prefix_chain_and_eviction():
    pool = BlockPool(6, 2)                       # 5 usable blocks of 2 tokens
    assert pool.admit(1, [1, 2, 3, 4, 5], 6) == 0
    pool.register(1, [1, 2, 3, 4, 5, 6], 5)      # blocks [1 2] [3 4] committed and full
    assert block_hashes([1, 2, 3, 4], 2)[1] != block_hashes([9, 9, 3, 4], 2)[1]   # chained
    pool.release(1)
    assert pool.available() == 5 and len(pool.cached) == 2
    assert pool.admit(2, [1, 2, 3, 9], 5) == 2     # only the first block matches
    assert pool.admit(3, [7, 7, 7, 7, 7, 7, 7], 8) is None   # needs 4, only 2 left: nothing taken
    assert pool.available() == 2
    pool.release(2)
    assert pool.admit(3, [7, 7, 7, 7, 7, 7, 7], 8) == 0      # evicts cached blocks to fit
    assert pool.lookup_prefix([1, 2, 3, 4]) == [] or len(pool.by_hash) <= 2
