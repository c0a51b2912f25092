"""The EAGLE-style head (`verispec train-head --kind eagle`, `--proposer head`): its file is checked,
the round keeps exactly the target's states the head reads, each draft is drawn from the q it
reports, output is plain decoding's (greedy) or reproducible (seeded), and training learns."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import tiny_text_model
from verispec import LLM, SamplingParams
from verispec.engine.params import SamplingParams as Params
from verispec.errors import InvalidModelFile
from verispec.heads import EagleHead, load_heads, save_head
from verispec.heads.train import extract, windows_of
from verispec.heads.train_eagle import agreement, segments, train, unrolled_mask
from verispec.proposers.eagle import EagleProposer

C, V = 64, 260


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("VERISPEC_CACHE", str(tmp_path))


def random_head(seed: int = 0, depth: int = 4, window: int = 8, vocab: torch.Tensor | None = None,
                scale: float = 0.1) -> EagleHead:
    torch.manual_seed(seed)
    head = EagleHead(C, 4, 2, 16, 96, torch.arange(V) if vocab is None else vocab, window=window, depth=depth,
                     meta={"vocab_size": str(V)})
    with torch.no_grad():
        for p in head.parameters():
            if p.ndim > 1:
                p.normal_(0, scale)
    return head


def saved(head: EagleHead, path) -> str:
    save_head(head, path, dtype=torch.float32)
    return str(path)


def test_an_eagle_file_round_trips_and_bad_ones_are_refused(tmp_path):
    from safetensors.torch import load_file, save_file

    head = random_head(vocab=torch.tensor([3, 7, 200]))
    path = saved(head, tmp_path / "e.safetensors")
    back = load_heads(path, C, V)
    assert isinstance(back, EagleHead) and back.depth == 4 and back.window == 8
    assert torch.equal(back.vocab, head.vocab)
    x = torch.randn(1, 3, C)
    pos = torch.arange(3)[None]
    assert torch.allclose(back(x, x, pos)[0], head(x, x, pos)[0])
    with pytest.raises(InvalidModelFile, match="hidden size"):
        load_heads(path, 128, V)

    def broken(name, meta_change=None, **change):
        from safetensors import safe_open

        with safe_open(path, framework="pt") as f:
            meta = dict(f.metadata())
        tensors = load_file(path)
        tensors.update(change)
        meta.update(meta_change or {})
        out = tmp_path / name
        save_file(tensors, str(out), metadata=meta)
        return out

    with pytest.raises(InvalidModelFile, match="NaN"):
        load_heads(broken("nan.safetensors", **{"down.weight": torch.full((C, 96), float("nan"))}), C, V)
    with pytest.raises(InvalidModelFile, match="shape"):
        load_heads(broken("shape.safetensors", **{"qkv.weight": torch.zeros(10, C)}), C, V)
    with pytest.raises(InvalidModelFile, match="depth"):
        load_heads(broken("deep.safetensors", {"depth": "1000"}), C, V)
    with pytest.raises(InvalidModelFile, match="integers"):
        load_heads(broken("meta.safetensors", {"window": "many"}), C, V)
    with pytest.raises(InvalidModelFile, match="sorted"):
        load_heads(broken("unsorted.safetensors", vocab=torch.tensor([7, 3, 200])), C, V)
    with pytest.raises(InvalidModelFile, match="kind"):
        load_heads(broken("kind.safetensors", {"kind": "lstm"}), C, V)


def test_the_round_keeps_the_targets_states_of_the_last_settled_positions(monkeypatch, tmp_path):
    """Sequence.recent_states row i must be the target's state at the position that scored tokens[-m + i]
    — what a teacher-forced pass over the same tokens gives. Checked after every round of a run with
    drafts accepted and rejected; an off-by-one window would fail."""
    from verispec.models.runner import ModelRunner

    target = tiny_text_model(0)
    seen = []

    class Recording(EagleProposer):
        def propose(self, seqs, ks):
            for s in seqs:
                if s.recent_states is not None:
                    seen.append((list(s.tokens), s.recent_states.clone(), s.pending_state.clone()))
            return super().propose(seqs, ks)

    import verispec.proposers.head as head_module

    monkeypatch.setattr(head_module, "EagleProposer", Recording)
    llm = LLM(target, proposer="head", head=saved(random_head(1), tmp_path / "e.safetensors"), k=3)
    llm.generate(["def add(a, b):", "x"], SamplingParams(temperature=0, max_tokens=30))
    assert len(seen) > 10 and any(len(r) == 8 for _, r, _ in seen)
    runner = ModelRunner(target.model, 1, 64)
    for tokens, recent, pending in seen:
        runner.cache.set_length(0, 0)
        _, h = runner.forward([0], [tokens[:-1]], [list(range(len(tokens) - 1))], states=True)   # (1, T-1, C)
        m = len(recent)
        assert torch.allclose(recent, h[0, -m:].float(), atol=1e-4), (len(tokens), m)
        assert torch.equal(recent[-1], pending)


def test_greedy_eagle_output_is_plain_decoding():
    target = tiny_text_model(0)
    prompts = ["def add(a, b):", "for i in range(10):", "class Stack:"]
    greedy = SamplingParams(temperature=0, max_tokens=40)
    plain = [o.token_ids for o in LLM(target, proposer="none").generate(prompts, greedy)]
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as d:
        path = saved(random_head(2), Path(d) / "e.safetensors")
        for k in (1, 3, "auto"):
            outs = LLM(target, proposer="head", head=path, k=k).generate(prompts, greedy)
            assert [o.token_ids for o in outs] == plain, k
        outs = LLM(target, proposer="hybrid", head=path, k=3).generate(prompts, greedy)
        assert [o.token_ids for o in outs] == plain
        outs = LLM(target, proposer="head", head=path, k=4).generate(prompts, greedy)
        assert sum(o.spec["proposed"] for o in outs) > 0
        seeded = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=24, seed=5)
        a = LLM(target, proposer="head", head=path, k=8).generate(prompts, seeded)
        b = LLM(target, proposer="head", head=path, k=8).generate(prompts, seeded)
        assert [o.token_ids for o in a] == [o.token_ids for o in b]
        assert max(int(k) for o in a for k in o.spec["k_histogram"]) <= 4          # the head's depth


def _drafts(proposer, params: Params, n: int, k: int, seed: int):
    """n proposals of k drafts for one sequence state: (n, k) tokens and (n, k, V) reported q."""
    from verispec.engine.metrics import SpecMetrics
    from verispec.engine.sequence import Sequence

    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    state = torch.randn(5, C)
    seqs = []
    for i in range(n):
        s = Sequence(i, [10, 20, 30, 40, 50, 60], params, torch.Generator().manual_seed(int(torch.randint(1 << 30, (1,), generator=g))),
                     i, frozenset(), None, SpecMetrics("head", "3"))
        s.recent_states = state
        seqs.append(s)
    proposal = proposer.propose(seqs, [k] * n)
    return proposal.tokens, proposal.q


@pytest.mark.parametrize("params", [Params(temperature=1.0, max_tokens=9),
                                    Params(temperature=0.7, top_k=6, top_p=0.9, max_tokens=9)])
def test_each_draft_is_drawn_from_the_q_it_reports_and_a_wrong_q_is_caught(params):
    """Acceptance is exact when each draft is a sample from the q reported for it (given the drafts
    before it). 6,000 proposals from one state: the first draft's histogram against q_1, the second
    draft's — among proposals whose first draft was the most common token — against the q_2 reported
    for them. Broken on purpose: a proposer that samples the second draft at T = 1 but reports the
    warped q (or vice versa) fails the same test."""
    from scipy.stats import chisquare

    target = tiny_text_model(0)
    proposer = EagleProposer(random_head(3, scale=0.12), target.model)

    def p_value(tokens, q):
        counts = np.bincount(tokens.numpy(), minlength=V).astype(float)
        expected = q.double().numpy() * len(tokens)
        keep = expected > 5
        if counts[expected == 0].sum():
            return 0.0                                      # a token q says cannot be drawn
        obs, exp = counts[keep], expected[keep]
        if expected[~keep].sum() > 0:
            obs, exp = np.append(obs, counts[~keep].sum()), np.append(exp, expected[~keep].sum())
        assert len(obs) >= 3, "q too peaked for a test"
        return chisquare(obs, exp * obs.sum() / exp.sum()).pvalue

    tokens, q = _drafts(proposer, params, 6000, 2, seed=1)
    assert torch.allclose(q[:, 0], q[0, 0][None])                                   # one state, one q_1
    assert p_value(tokens[:, 0], q[0, 0]) > 1e-4
    first = torch.bincount(tokens[:, 0]).argmax()
    rows = (tokens[:, 0] == first).nonzero().squeeze(1)
    assert len(rows) > 500 and torch.allclose(q[rows, 1], q[rows[0], 1][None])
    assert p_value(tokens[rows, 1], q[rows[0], 1]) > 1e-4

    class Broken(EagleProposer):                # draws unwarped, reports warped (or warped at T=1 vs T)
        def propose(self, seqs, ks):
            raw = [Params(temperature=1.3, max_tokens=9) for _ in seqs]
            keep = [s.params for s in seqs]
            for s, p in zip(seqs, raw):
                s.params = p
            drawn = super().propose(seqs, ks)
            for s, p in zip(seqs, keep):
                s.params = p
            reported = super().propose(seqs, ks)
            drawn.q = reported.q
            return drawn

    tokens, q = _drafts(Broken(random_head(3, scale=0.12), target.model), params, 6000, 2, seed=1)
    assert p_value(tokens[:, 0], q[0, 0]) < 1e-6


def test_the_unrolled_mask_shows_a_deep_draft_its_true_past_and_its_own_rows():
    m = unrolled_mask(3, 3)
    assert m.tolist() == [[1, 0, 0, 1, 0, 0, 1, 0, 0], [1, 1, 0, 0, 1, 0, 0, 1, 0], [1, 1, 1, 0, 0, 1, 0, 0, 1]]


def test_training_learns_the_targets_next_states_and_tokens(tmp_path):
    """A few hundred steps on a tiny model's text (a cycle of 37 byte tokens, where the target's next
    tokens follow from the current one): held-out chain acceptance rises well above an untrained head's,
    and the written file drafts with accepted tokens and plain decoding's output."""
    target = tiny_text_model(0)
    g = torch.Generator().manual_seed(0)
    cycle = torch.randperm(256, generator=g)[:37].tolist()
    ids = [(cycle * 200)[i: i + 600] for i in range(0, 20 * 37, 37)]
    windows = windows_of(ids, 128)[:40]
    features = extract(target.model, windows, tmp_path / "features")
    assert torch.equal(features.tokens, torch.tensor([t for w in windows for t in w]))
    head = EagleHead(C, 4, 2, 16, 96, torch.arange(V), window=8, depth=3, meta={"vocab_size": str(V)})
    embed = target.model.model.embed_tokens.weight.detach()
    rows = target.model.lm_head.weight.detach().float()
    index = torch.arange(V)
    held = segments(features, [19, 39], 16, 3)
    before = agreement(head, embed, rows, index, features, held, 3)
    score = train(head, embed, rows, features, minutes=10, lr=3e-3, batch=16, unroll=2, log=lambda s: None,
                  max_steps=300)
    assert score["chain"][0] > before["chain"][0] + 0.3, (before, score)
    assert score["chain"][0] >= score["chain"][1] >= score["chain"][2]
    path = saved(head, tmp_path / "trained.safetensors")
    prompt = cycle[:20]
    greedy = SamplingParams(temperature=0, max_tokens=40)
    plain = LLM(target, proposer="none").generate([prompt], greedy)[0].token_ids
    out = LLM(target, proposer="head", head=path, k=3).generate([prompt], greedy)[0]
    assert out.token_ids == plain
