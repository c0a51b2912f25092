"""Statistical losslessness: emitted tokens follow the (warped) target at every position.

10^5 sequences per case with fixed seeds, so the test is deterministic; the threshold (p > 1e-4
at every position, TV < 0.01) is far from what the broken samplers below produce.
"""

from __future__ import annotations

import pytest
import torch

from stat_harness import (chi_square_p_values, exact_marginals, random_tables, recover_from_p, run_speculative,
                          total_variation)
from verispec.sampling import accept_sampling

V, N_TOKENS, SAMPLES = 8, 4, 100_000


def warp_table(logits: torch.Tensor, temperature=1.0, top_k=0, top_p=1.0) -> torch.Tensor:
    from verispec.sampling import warp_probs
    t, s, v = logits.shape
    flat = logits.reshape(1, t * s, v)
    probs = warp_probs(flat, torch.tensor([temperature]), torch.tensor([top_k]), torch.tensor([top_p]))
    return probs.reshape(t, s, v)


def assert_matches_target(P, tokens):
    marg = exact_marginals(P, N_TOKENS)
    pvals = chi_square_p_values(tokens, marg)
    tvs = [total_variation(tokens, marg[t], t) for t in range(N_TOKENS)]
    assert min(pvals) > 1e-4 and max(tvs) < 0.01, (pvals, tvs)


def is_biased(P, tokens) -> bool:
    marg = exact_marginals(P, N_TOKENS)
    return min(chi_square_p_values(tokens, marg)) < 1e-8


@pytest.mark.parametrize("k", [1, 2, 4])
def test_draft_sampling_matches_target(k):
    P = torch.softmax(random_tables(1, N_TOKENS + k + 1, V), -1)
    Q = torch.softmax(random_tables(2, N_TOKENS + k + 1, V), -1)
    assert_matches_target(P, run_speculative(P, Q, k, N_TOKENS, SAMPLES, seed=k))


@pytest.mark.parametrize("warp", [dict(temperature=0.7), dict(top_k=3), dict(top_p=0.8),
                                  dict(temperature=1.3, top_k=5, top_p=0.9)])
def test_warped_p_and_q_match_warped_target(warp):
    k = 3
    P = warp_table(random_tables(3, N_TOKENS + k + 1, V), **warp)
    Q = warp_table(random_tables(4, N_TOKENS + k + 1, V), **warp)
    assert_matches_target(P, run_speculative(P, Q, k, N_TOKENS, SAMPLES, seed=5))


def test_draft_equal_to_target_accepts_everything():
    k = 4
    P = torch.softmax(random_tables(5, N_TOKENS + k + 1, V), -1)
    tokens = run_speculative(P, P, k, N_TOKENS, SAMPLES, seed=6)
    assert_matches_target(P, tokens)
    p = P[:k + 1, V][None].repeat(50, 1, 1)
    res = accept_sampling(p, torch.zeros(50, k, dtype=torch.long), p[:, :k], torch.full((50,), k),
                          [torch.Generator().manual_seed(0)] * 50)
    # With q == p every draft has acceptance probability min(1, p/q) = 1.
    assert res.num_accepted.tolist() == [k] * 50


def test_disjoint_supports_never_accept_and_stay_exact():
    k = 2
    logits_p = random_tables(7, N_TOKENS + k + 1, V)
    logits_q = random_tables(8, N_TOKENS + k + 1, V)
    logits_p[..., V // 2:] = float("-inf")      # p lives on the lower half of the vocabulary
    logits_q[..., : V // 2] = float("-inf")     # q on the upper half
    P, Q = torch.softmax(logits_p, -1), torch.softmax(logits_q, -1)
    assert_matches_target(P, run_speculative(P, Q, k, N_TOKENS, SAMPLES, seed=9))


@pytest.mark.parametrize("k", [1, 3])
def test_point_mass_proposals_match_target(k):
    P = torch.softmax(random_tables(10, N_TOKENS + k + 1, V), -1)
    Q = torch.softmax(random_tables(11, N_TOKENS + k + 1, V), -1)   # a deterministic-looking proposer
    assert_matches_target(P, run_speculative(P, Q, k, N_TOKENS, SAMPLES, seed=12, point_mass=True))


# --- the same check must catch real bugs -------------------------------------------------------

def test_broken_residual_is_detected():
    k = 2
    P = torch.softmax(random_tables(1, N_TOKENS + k + 1, V), -1)
    Q = torch.softmax(random_tables(2, N_TOKENS + k + 1, V), -1)
    assert is_biased(P, run_speculative(P, Q, k, N_TOKENS, SAMPLES, seed=3, accept=recover_from_p))


def test_unwarped_q_is_detected():
    """Bug seen in the wild: the draft samples from warped q but acceptance uses the raw q."""
    k = 2
    raw_q = random_tables(4, N_TOKENS + k + 1, V)
    P = warp_table(random_tables(3, N_TOKENS + k + 1, V), temperature=0.5, top_k=3)
    Q_warped = warp_table(raw_q, temperature=0.5, top_k=3)
    tokens = run_speculative(P, Q_warped, k, N_TOKENS, SAMPLES, seed=5, q_for_acceptance=torch.softmax(raw_q, -1))
    assert is_biased(P, tokens)


def test_a_truncated_draft_vocabulary_stays_exact_and_a_truncated_verifier_is_caught():
    """q is zero on part of p's support (a draft that may propose only 5 of the 8 tokens): the output
    still follows p, because rejections recover from norm(max(0, p − q)), which covers the rest.
    Broken on purpose: verifying over the truncated vocabulary too (p restricted to the subset and
    renormalised) — the test then sees the bias."""
    k = 3
    keep = torch.tensor([0, 2, 3, 5, 7])
    logits_q = random_tables(12, N_TOKENS + k + 1, V)
    off = torch.ones(V, dtype=torch.bool)
    off[keep] = False
    logits_q[..., off] = float("-inf")
    P = torch.softmax(random_tables(13, N_TOKENS + k + 1, V), -1)
    Q = torch.softmax(logits_q, -1)
    assert_matches_target(P, run_speculative(P, Q, k, N_TOKENS, SAMPLES, seed=14))
    P_truncated = P.clone()
    P_truncated[..., off] = 0.0
    P_truncated /= P_truncated.sum(-1, keepdim=True)
    assert is_biased(P, run_speculative(P_truncated, Q, k, N_TOKENS, SAMPLES, seed=14))


def test_head_drafts_stay_exact_and_a_head_reported_as_a_chain_is_caught():
    """Medusa heads draft every position of a round from the state before it (a draft never sees the
    previous draft): still an exact sample from p, since acceptance only needs the q each draft was
    drawn from. Broken on purpose: reporting each draft's q as if it had seen the previous draft."""
    k = 3
    P = torch.softmax(random_tables(21, N_TOKENS + k + 1, V), -1)
    Q = torch.softmax(random_tables(22, N_TOKENS + k + 1, V), -1)
    assert_matches_target(P, run_speculative(P, Q, k, N_TOKENS, SAMPLES, seed=23, heads=True))
    assert is_biased(P, run_speculative(P, Q, k, N_TOKENS, SAMPLES, seed=23, heads=True, heads_report_chain=True))


@pytest.mark.parametrize("warp", [dict(temperature=1.0), dict(temperature=0.7, top_k=5), dict(top_k=4)])
def test_a_draft_that_stops_when_unsure_stays_exact_and_padding_verified_is_caught(warp):
    """The draft model's early stop (proposers/draft.py): a row drafts until a draft's q has no token
    above 0.6, so rows end after 1 … k drafts, decided by the drafts alone — still an exact sample
    from p (here q has no token above 0.6 at 38–57 % of steps). Broken on purpose: reporting every row as k drafts long, so the padding after a stop is
    verified as if it had been drafted."""
    k = 4
    P = warp_table(random_tables(31, N_TOKENS + k + 1, V, sharp=3.0), **warp)
    Q = warp_table(random_tables(32, N_TOKENS + k + 1, V), **warp)
    stops = run_speculative(P, Q, k, N_TOKENS, SAMPLES, seed=33, stop_below=0.6)
    assert_matches_target(P, stops)
    assert is_biased(P, run_speculative(P, Q, k, N_TOKENS, SAMPLES, seed=33, stop_below=0.6,
                                        stop_reported_as_k=True))


@pytest.mark.parametrize("warp", [dict(temperature=1.0), dict(temperature=0.7, top_k=5)])
def test_a_source_chosen_from_the_past_stays_exact_and_one_chosen_after_verifying_is_caught(warp):
    """A hybrid drafts each round by lookup (point masses) or from the draft's q, the K policy choosing
    from the sequence's past rounds alone (engine/k_policy.py, choose_for): still an exact sample from
    p. Broken on purpose: verifying both proposals and keeping the one that kept more drafts."""
    k = 3
    P = warp_table(random_tables(41, N_TOKENS + k + 1, V, sharp=3.0), **warp)
    Q = warp_table(random_tables(42, N_TOKENS + k + 1, V), **warp)
    assert_matches_target(P, run_speculative(P, Q, k, N_TOKENS, SAMPLES, seed=43, two_sources="history"))
    assert is_biased(P, run_speculative(P, Q, k, N_TOKENS, SAMPLES, seed=43, two_sources="peek"))
