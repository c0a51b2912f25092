"""A step's prefill chunks in one pass as pieces, with the first round of each prompt they finish
(and, mixed, the running sequences' round too). Nothing but timing may change."""

from __future__ import annotations

import pytest

from conftest import int8_model
from verispec import LLM, SamplingParams, kernels
from verispec.engine.engine import Request
from verispec.models.runner import ModelRunner

# Pieces and first rounds in one pass are the native pass's (the torch layers run chunks, then rounds).
native_only = pytest.mark.skipif(not kernels.available(), reason=f"native kernel {kernels.kernel_status()}")

PROMPTS = [[(7 * i + j) % 90 + 3 for j in range(n)] for i, n in enumerate((5, 40, 23, 70, 9, 130, 17, 33))]


@pytest.fixture(scope="module")
def model():
    return int8_model(0, max_position_embeddings=1024)


def run(model, mixed: bool | None, budget: int, proposer="ngram", params=None):
    """All prompts arrive at once; returns (tokens per prompt, step at which each got its first token).
    mixed: True — decode rows in the prefill pass too; False — first rounds in the prefill pass, the
    running sequences' round apart; None — neither (the torch layers' path: chunks, then rounds)."""
    llm = LLM(model, proposer=proposer, k=3)
    engine = llm.engine(kv_budget_mb=8, block_size=8, prefill_budget=budget)
    engine.mix_decode = bool(mixed)
    if mixed is None:
        def chunks_then_round(plan):
            engine._prefill(plan.prefill)
            if plan.decode:
                engine._round(plan.decode, plan.ks)
        engine._prefill_with_first_rounds = chunks_then_round
    tokens = {i: [] for i in range(len(PROMPTS))}
    first: dict[int, int] = {}
    step = [0]

    def sink_for(i):
        def sink(u):
            tokens[i] += u.token_ids
            if u.token_ids:
                first.setdefault(i, step[0])
        return sink
    params = params or SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    for i, p in enumerate(PROMPTS):
        engine.add(Request(f"r{i}", [p], params, sink_for(i)))
    while engine.has_work:
        step[0] += 1
        engine.step()
    assert engine.pool.available() == engine.pool.usable
    return [tokens[i] for i in range(len(PROMPTS))], first


@native_only
@pytest.mark.parametrize("budget", [16, 64, 256])
def test_mixed_passes_change_no_token_and_bring_first_tokens_sooner(model, budget):
    assert model.exact_pass_rows(ModelRunner(model, 1, 8).cache.store) is not None   # the native pass runs
    want = [o.token_ids for o in LLM(model, proposer="none").generate(PROMPTS, SamplingParams(
        temperature=0, max_tokens=20, ignore_eos=True))]
    mixed, first_mixed = run(model, True, budget)
    first_pass, first_first = run(model, False, budget)
    separate, first_separate = run(model, None, budget)
    assert mixed == first_pass == separate == want
    # A prompt's first token comes from the pass that finished the prompt: a step sooner.
    assert first_mixed == first_first
    assert all(first_first[i] == first_separate[i] - 1 for i in first_first)


def test_seeded_sampling_is_the_same_mixed_or_not(model):
    params = SamplingParams(temperature=0.9, top_k=30, max_tokens=16, seed=3, ignore_eos=True)
    want = run(model, None, 32, params=params)[0]
    assert run(model, True, 32, params=params)[0] == run(model, False, 32, params=params)[0] == want


@native_only
def test_a_piece_written_at_the_wrong_start_is_caught(model, monkeypatch):
    """Broken on purpose: every piece of a chunk written at the chunk's start."""
    want = run(model, None, 64)[0]
    monkeypatch.setattr(ModelRunner, "pieces", staticmethod(
        lambda parts, width: [(s, start, t[at: at + width]) for s, start, t in parts for at in range(0, len(t), width)]))
    assert run(model, True, 64)[0] != want
    assert run(model, False, 64)[0] != want


@native_only
def test_padding_written_over_a_neighbouring_piece_is_caught(model, monkeypatch):
    """Broken on purpose: padding rows right after their own piece (where the next piece, or the
    round's row of the same prompt, writes in the same pass)."""
    want = run(model, None, 16)[0]
    forward = ModelRunner.forward
    monkeypatch.setattr(ModelRunner, "forward", lambda self, *a, **kw: forward(self, *a, **{**kw, "pad_beyond": False}))
    assert run(model, True, 16)[0] != want


def _first_step_with_draft(model, params):
    """One request with the draft model as proposer (K = 3), stepped until its first token: the
    draft's committed length then, and the whole answer."""
    llm = LLM(model, draft=int8_model(1, max_position_embeddings=1024), proposer="draft", k=3)
    engine = llm.engine(kv_budget_mb=8, block_size=8, prefill_budget=256)
    got: list[int] = []
    engine.add(Request("r", [PROMPTS[3]], params, lambda u: got.extend(u.token_ids)))
    while not got:
        engine.step()
    ingested = max(engine.proposer.runner.cache.lengths.values(), default=0)     # over every slot
    while engine.has_work:
        engine.step()
    return ingested, got


@native_only
def test_the_first_token_does_not_wait_for_a_draft_model_to_read_the_prompt(model):
    """The pass that finishes a prompt sends its first token: a draft model that would first have to
    prefill the prompt drafts from the next round on (a seeded request keeps its K schedule)."""
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    want = LLM(model, proposer="none").generate([PROMPTS[3]], params)[0].token_ids
    ingested, got = _first_step_with_draft(model, params)
    assert ingested == 0 and got == want
    seeded = SamplingParams(temperature=0.9, max_tokens=12, seed=5, ignore_eos=True)
    assert _first_step_with_draft(model, seeded)[0] > 0          # its first round catches up, as before
