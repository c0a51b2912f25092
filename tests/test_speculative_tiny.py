"""End to end on tiny random-weight model pairs: speculation changes nothing but speed."""

from __future__ import annotations

import pytest
import torch

from verispec import LLM, SamplingParams
from conftest import tiny_model

PROMPTS = [[1, 5, 9, 2, 7], [3, 3], [11, 4, 8, 15, 16, 23, 42, 8, 1]]


@pytest.fixture(scope="module")
def pair():
    target = tiny_model(0, scale=1.5)
    draft = tiny_model(1, scale=1.5, num_layers=1)
    return target, draft


def greedy(max_tokens=24, **kw):
    return SamplingParams(temperature=0, max_tokens=max_tokens, **kw)


def plain_outputs(target, params):
    return [o.token_ids for o in LLM(target, proposer="none").generate(PROMPTS, params)]


@pytest.mark.parametrize("k", [1, 2, 3, 4, 6, 8])
def test_greedy_draft_equals_plain(pair, k):
    target, draft = pair
    want = plain_outputs(target, greedy())
    got = LLM(target, draft=draft, proposer="draft", k=k).generate(PROMPTS, greedy())
    assert [o.token_ids for o in got] == want
    assert all(len(t) == 24 for t in want)


@pytest.mark.parametrize("k", [1, 4])
def test_greedy_ngram_equals_plain(pair, k):
    target, _ = pair
    want = plain_outputs(target, greedy(40))
    got = LLM(target, proposer="ngram", k=k).generate(PROMPTS, greedy(40))
    assert [o.token_ids for o in got] == want


def test_draft_equal_to_target_accepts_every_proposal(pair):
    target, _ = pair
    for params in (greedy(), SamplingParams(temperature=0.8, max_tokens=24, seed=3)):
        out = LLM(target, draft=target, proposer="draft", k=4).generate(PROMPTS, params)
        for o in out:
            assert o.spec["acceptance_rate"] == 1.0, o.spec
            assert o.spec["alpha"] == pytest.approx(1.0, abs=1e-5)


def test_batch_equals_each_prompt_alone_with_seeds(pair):
    target, draft = pair
    llm = LLM(target, draft=draft, proposer="draft", k=3)
    params = SamplingParams(temperature=0.9, top_k=20, max_tokens=16, seed=7)
    batch = llm.generate(PROMPTS, params)
    for prompt, out in zip(PROMPTS, batch):
        assert llm.generate([prompt], params)[0].token_ids == out.token_ids


def test_stop_token_and_max_tokens_cut_exactly(pair):
    target, draft = pair
    plain = plain_outputs(target, greedy())[0]
    stop_at = plain[5]
    first = plain.index(stop_at)
    params = greedy(stop_token_ids=[stop_at])
    for proposer, extra in (("none", {}), ("draft", {"draft": draft}), ("ngram", {})):
        out = LLM(target, proposer=proposer, k=4, **extra).generate([PROMPTS[0]], params)[0]
        assert out.token_ids == plain[:first] and out.finish_reason == "stop"
        out = LLM(target, proposer=proposer, k=4, **extra).generate([PROMPTS[0]], greedy(max_tokens=7))[0]
        assert out.token_ids == plain[:7] and out.finish_reason == "length"


def test_sampled_first_tokens_follow_plain_sampling(pair):
    """Distribution of the first two generated tokens: plain vs speculative (draft), 1500 samples each."""
    from scipy import stats
    target, draft = pair
    params = SamplingParams(temperature=1.0, max_tokens=2, seed=0, n=1500)
    prompt = [PROMPTS[0]]
    plain = LLM(target, proposer="none", max_batch=1500).generate(prompt, params)
    spec = LLM(target, draft=draft, proposer="draft", k=2, max_batch=1500).generate(prompt, params)
    for pos in range(2):
        a = torch.bincount(torch.tensor([o.token_ids[pos] for o in plain]), minlength=96)
        b = torch.bincount(torch.tensor([o.token_ids[pos] for o in spec]), minlength=96)
        keep = (a + b) >= 10
        table = torch.stack([a[keep], b[keep]]).numpy()
        assert stats.chi2_contingency(table).pvalue > 1e-3


def test_bad_parameters_are_clear_errors(pair):
    from verispec.errors import InvalidRequest, VerispecError
    target, _ = pair
    llm = LLM(target, proposer="none")
    for bad in (dict(max_tokens=-1), dict(temperature=-0.5), dict(top_p=0.0), dict(top_p=1.5), dict(top_k=-2)):
        with pytest.raises(InvalidRequest):
            SamplingParams(**bad)
    with pytest.raises(InvalidRequest, match="context"):
        llm.generate([[1] * 500], SamplingParams(max_tokens=100))
    with pytest.raises(InvalidRequest, match="tokenizer"):
        llm.generate(["text prompt"], SamplingParams())
    with pytest.raises(InvalidRequest, match="token ids"):
        llm.generate([[10_000]], SamplingParams())
    with pytest.raises(VerispecError, match="proposer"):
        LLM(target, proposer="magic")
    with pytest.raises(VerispecError, match="vocabulary"):
        LLM(target, draft=tiny_model(2, vocab=80), proposer="draft")


@pytest.mark.parametrize("proposer", ["draft", "ngram", "hybrid"])
def test_greedy_auto_k_equals_plain(pair, proposer):
    target, draft = pair
    want = plain_outputs(target, greedy(40))
    llm = LLM(target, draft=draft if proposer != "ngram" else None, proposer=proposer, k="auto")
    got = llm.generate(PROMPTS, greedy(40))
    assert [o.token_ids for o in got] == want
    assert all(sum(o.spec["k_histogram"].values()) == o.spec["rounds"] for o in got)


def test_hybrid_uses_both_sources_and_stays_exact_when_sampling(pair):
    target, draft = pair
    repetitive = [[7, 8, 9, 7, 8, 9, 7, 8, 9, 7, 8]]
    out = LLM(target, draft=draft, proposer="hybrid", k=3).generate(repetitive + PROMPTS, greedy(24))
    sources = set().union(*(o.spec["rounds_by_source"] for o in out))
    assert sources == {"ngram", "draft"}
    for o in out:                    # the full sources (lookup by match length) add up to the totals
        by = o.spec["by_source"]
        assert all(name == "draft" or name.startswith("ngram:") for name in by)
        assert sum(v["rounds"] for v in by.values()) == sum(o.spec["rounds_by_source"].values())
        assert sum(v["proposed"] for v in by.values()) == o.spec["proposed"]
        assert sum(v["accepted"] for v in by.values()) == o.spec["accepted"]
    assert [o.token_ids for o in out] == plain_outputs_for(target, repetitive + PROMPTS, greedy(24))


def plain_outputs_for(target, prompts, params):
    return [o.token_ids for o in LLM(target, proposer="none").generate(prompts, params)]


@pytest.mark.parametrize("proposer", ["draft", "hybrid"])
def test_greedy_rounds_carry_no_draft_probabilities(pair, proposer, monkeypatch):
    """Greedy acceptance compares tokens alone, so a greedy round's proposal holds no q (no (B, K, V)
    floats built per round); a sampled round carries the q its drafts were sampled from."""
    from verispec.proposers.draft import DraftModelProposer
    from verispec.proposers.hybrid import HybridProposer

    cls = DraftModelProposer if proposer == "draft" else HybridProposer
    target, draft = pair
    seen: list[bool] = []
    original = cls.propose

    def spy(self, seqs, ks):
        out = original(self, seqs, ks)
        if int(out.num_draft.sum()) and (out.source is None or "draft" in out.source):
            seen.append(out.q is not None)
        return out

    monkeypatch.setattr(cls, "propose", spy)
    llm = LLM(target, draft=draft, proposer=proposer, k=3)
    llm.generate(PROMPTS, greedy())
    assert seen and not any(seen)
    seen.clear()
    llm.generate(PROMPTS, SamplingParams(temperature=0.8, max_tokens=24, seed=2))
    assert seen and all(seen)


def test_samples_of_one_prompt_share_its_prefill_and_match_separate_runs():
    """n > 1 prefills the prompt once and copies the cache; each sample equals a run of its own."""
    from conftest import tiny_model
    from verispec import LLM, SamplingParams

    llm = LLM(tiny_model(0), proposer="ngram", k=2)
    many = llm.generate([[1, 2, 3, 4, 5, 6]], SamplingParams(temperature=0.9, max_tokens=12, seed=5, n=4))
    for i, out in enumerate(many):
        alone = llm.generate([[1, 2, 3, 4, 5, 6]], SamplingParams(temperature=0.9, max_tokens=12, seed=5 + i))
        assert out.token_ids == alone[0].token_ids


@pytest.mark.parametrize("proposer,temperature", [("none", 0.0), ("none", 0.8), ("draft", 0.8)])
def test_non_finite_scores_fail_loudly_instead_of_sampling_garbage(proposer, temperature):
    """A model whose activations overflow gives inf/NaN logits: generate raises NonFiniteOutput (the
    argmax of NaN scores would otherwise be an arbitrary token). A broken draft matters only where its
    q enters the acceptance rule (sampling); greedy verification rejects its tokens as any others."""
    from verispec.errors import NonFiniteOutput

    target, draft = tiny_model(0), tiny_model(1)
    broken = target if proposer == "none" else draft
    with torch.no_grad():
        broken.model.norm.weight.fill_(float("inf"))
    llm = LLM(target, draft=draft if proposer == "draft" else None, proposer=proposer, k=2)
    with pytest.raises(NonFiniteOutput, match="NaN or infinite"):
        llm.generate([[1, 2, 3]], SamplingParams(temperature=temperature, max_tokens=4, seed=0))


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_a_draft_that_stops_when_unsure_drafts_less_and_changes_nothing(pair, temperature):
    """draft_stop: a row stops drafting after a token the draft gave less than that probability — fewer
    drafts per round, greedy output still plain decoding's (sampling: tests/test_losslessness_stats.py)."""
    target, draft = pair
    params = SamplingParams(temperature=temperature, max_tokens=24, seed=5)
    always = LLM(target, draft=draft, proposer="draft", k=4, draft_stop=0).generate(PROMPTS, params)
    unsure = LLM(target, draft=draft, proposer="draft", k=4, draft_stop=0.9).generate(PROMPTS, params)
    def per_round(outs):
        return sum(o.spec["proposed"] for o in outs) / sum(o.spec["rounds"] for o in outs)

    assert per_round(unsure) < 0.8 * per_round(always)
    if temperature == 0:
        assert [o.token_ids for o in unsure] == [o.token_ids for o in always] == plain_outputs(target, params)
    from verispec.errors import VerispecError
    for bad in (1.0, -0.1, float("nan"), "0.5", True):
        with pytest.raises(VerispecError, match="draft_stop"):
            LLM(target, draft=draft, proposer="draft", k=4, draft_stop=bad)
