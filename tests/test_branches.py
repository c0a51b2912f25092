"""Candidate branches (a token tree): the walk of sampling/branches.py keeps exactly the target's
distribution, greedy branches give plain decoding's tokens, and forks leave the cache as a chain would."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import tiny_model
from stat_harness import chi_square_p_values, exact_marginals, random_tables, total_variation
from verispec import LLM, SamplingParams
from verispec.sampling.branches import BranchResult, accept_branches

V, N_TOKENS, SAMPLES = 6, 4, 12_000


def test_greedy_walk_follows_the_branch_that_agrees_with_argmax():
    # Branches [1 2 3], [1 4 0], [5]: argmax goes 1, then 4, then 2 (not a child) -> emit 2.
    def rows(*tokens):
        return torch.nn.functional.one_hot(torch.tensor(tokens), 6).float()
    branches = [[1, 2, 3], [1, 4, 0], [5]]
    scores = [rows(1, 4, 9 % 6, 0), rows(1, 4, 2, 0), rows(1, 0)]
    res = accept_branches(branches, scores, greedy=True)
    assert res == BranchResult(branch=1, num_accepted=2, tokens=[1, 4, 2], primary_accepted=1)
    # The primary right to its end: a bonus token after it.
    res = accept_branches(branches, [rows(1, 2, 3, 5), rows(1, 2, 0, 0), rows(1, 0)], greedy=True)
    assert res == BranchResult(branch=0, num_accepted=3, tokens=[1, 2, 3, 5], primary_accepted=3)
    # No child agrees at the root: argmax is emitted, nothing accepted.
    res = accept_branches(branches, [rows(4, 0, 0, 0), rows(4, 0, 0, 0), rows(4, 0)], greedy=True)
    assert res == BranchResult(branch=0, num_accepted=0, tokens=[4], primary_accepted=0)


def test_worked_example_frequencies():
    """The module docstring's example: p = [.5 .3 .2], children [1, 2] -> P = .5 / .3 / .2."""
    p = torch.tensor([[.5, .3, .2], [1.0, 0, 0]])
    g = torch.Generator().manual_seed(0)
    counts = np.zeros(3)
    for _ in range(20_000):
        counts[accept_branches([[1], [2]], [p, p], greedy=False, generator=g).tokens[0]] += 1
    assert np.allclose(counts / counts.sum(), [.5, .3, .2], atol=0.015)


def walk_sequences(P: torch.Tensor, Q: torch.Tensor, k: int, branches: int, samples: int, seed: int,
                   walk=accept_branches) -> np.ndarray:
    """`samples` sequences of N_TOKENS tokens, each round verifying `branches` candidates of k tokens
    drawn independently from the Markov table Q (so they share leading tokens now and then);
    scores come from P given each branch's own previous token."""
    v = P.shape[-1]
    g = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    cdf = np.cumsum(Q.double().numpy(), -1)                                   # (T, V+1, V)
    out = np.zeros((samples, N_TOKENS), dtype=np.int64)
    for row in range(samples):
        seq: list[int] = []
        while len(seq) < N_TOKENS:
            pos, prev = len(seq), (seq[-1] if seq else v)
            cands, scores = [], []
            for u in rng.random((branches, k)):
                chain = [prev]
                for i in range(k):
                    chain.append(min(int(np.searchsorted(cdf[pos + i, chain[-1]], u[i] * cdf[pos + i, chain[-1], -1],
                                                         side="right")), v - 1))
                scores.append(P[torch.arange(pos, pos + k + 1), torch.tensor(chain)])   # (k+1, V)
                cands.append(chain[1:])
            seq += walk(cands, scores, False, g).tokens
        out[row] = seq[:N_TOKENS]
    return out


def tables(seed: int, temperature=1.0, top_k=0, top_p=1.0):
    from verispec.sampling import warp_probs

    def warp(logits):
        t, s, v = logits.shape
        return warp_probs(logits.reshape(1, t * s, v), torch.tensor([temperature]), torch.tensor([top_k]),
                          torch.tensor([top_p])).reshape(t, s, v)
    # Positions beyond N_TOKENS are reached by the last round's drafts.
    return warp(random_tables(seed, N_TOKENS + 4, V)), torch.softmax(random_tables(seed + 1, N_TOKENS + 4, V, 1.0), -1)


@pytest.mark.parametrize("warp,branches", [((1.0, 0, 1.0), 3), ((0.7, 4, 1.0), 2), ((1.3, 0, 0.8), 3)])
def test_branch_walk_matches_target(warp, branches):
    P, Q = tables(11, *warp)
    tokens = walk_sequences(P, Q, k=2, branches=branches, samples=SAMPLES, seed=5)
    marg = exact_marginals(P, N_TOKENS)
    pvals = chi_square_p_values(tokens, marg)
    tvs = [total_variation(tokens, marg[t], t) for t in range(N_TOKENS)]
    assert min(pvals) > 1e-4 and max(tvs) < 0.02, (pvals, tvs)


def recover_from_p(branches, scores, greedy, generator):
    """Broken on purpose: after the children were rejected, the recovered token is drawn from p with
    the rejected children still in it."""
    res = accept_branches(branches, scores, greedy, generator)
    if res.num_accepted < len(branches[res.branch]):
        res.tokens[-1] = int(torch.multinomial(scores[res.branch][res.num_accepted], 1, generator=generator))
    return res


def primary_scores_for_all(branches, scores, greedy, generator):
    """Broken on purpose: every branch scored with the primary's rows (a tree mask that shows a node
    the wrong ancestors)."""
    return accept_branches(branches, [scores[0]] * len(branches), greedy, generator)


@pytest.mark.parametrize("broken", [recover_from_p, primary_scores_for_all])
def test_broken_walks_are_detected(broken):
    P, Q = tables(11)
    tokens = walk_sequences(P, Q, k=2, branches=3, samples=SAMPLES, seed=5, walk=broken)
    assert min(chi_square_p_values(tokens, exact_marginals(P, N_TOKENS))) < 1e-8


# -- in the engine ---------------------------------------------------------------------------------
PROMPTS = [[1, 5, 9, 2, 7, 1, 5, 3, 1, 5, 9, 4, 1, 5], [3, 3, 4, 3, 5, 3, 3], [11, 4, 8, 15, 16, 23, 42, 8, 1]]


@pytest.fixture(scope="module")
def target():
    return tiny_model(0, scale=1.5)


def test_greedy_with_branches_equals_plain_and_a_fork_not_adopted_is_caught(target, monkeypatch):
    params = SamplingParams(temperature=0, max_tokens=60)
    want = [o.token_ids for o in LLM(target, proposer="none").generate(PROMPTS, params)]
    taken = 0
    for k in (2, 4, "auto"):
        out = LLM(target, proposer="ngram", k=k, branches=2).generate(PROMPTS, params)
        assert [o.token_ids for o in out] == want, k
        taken += sum(o.spec["branches"]["taken"] for o in out)
        if k != "auto":                             # auto's K follows timings: it may not draft at all
            assert all(o.spec["branches"]["rounds"] > 0 for o in out[:2]), k
    assert taken > 0
    # Broken on purpose: the winning alternative's keys and values are not copied back.
    from verispec.engine.forks import Forks
    monkeypatch.setattr(Forks, "adopt", lambda self, *a: None)
    out = LLM(target, proposer="ngram", k=4, branches=2).generate(PROMPTS, params)
    assert [o.token_ids for o in out] != want


def test_forks_return_every_block(target):
    llm = LLM(target, proposer="ngram", k=4, branches=3)
    llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=40))
    engine = llm._engine
    assert not any(slot < 0 for slot in engine.pool.tables)
    assert engine.pool.available() == engine.pool.usable     # every sequence left; nothing leaked


def test_seeded_sampling_with_branches_is_reproducible(target):
    params = SamplingParams(temperature=0.8, top_k=20, max_tokens=30, seed=4)
    a = LLM(target, proposer="ngram", k=3, branches=2).generate(PROMPTS, params)
    b = LLM(target, proposer="ngram", k=3, branches=2).generate(PROMPTS, params)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert sum(o.spec["branches"]["rounds"] for o in a) > 0


def test_bad_branches_setting_is_refused(target):
    from verispec.errors import VerispecError
    for bad in (-1, 9, "many", 1.5):
        with pytest.raises(VerispecError, match="branches"):
            LLM(target, proposer="ngram", branches=bad)
