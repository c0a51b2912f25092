"""Running acceptance estimates per position (engine/acceptance_rates.py): reached positions learn, the
prior counts as a few observations, and a pooled estimate counts every verified draft."""

import pytest

from verispec.engine.acceptance_rates import PRIOR_WEIGHT, AcceptanceEstimate
from verispec.engine.ema import EMA


def test_acceptance_estimate_updates_reached_positions_and_extends_the_deepest():
    e = AcceptanceEstimate([0.5] * 4)
    e.update(proposed=4, accepted=1)      # position 0 accepted, 1 rejected, 2-3 never reached
    assert e.rates[0] > 0.5 and e.rates[1] < 0.5 and e.rates[2:] == [e.rates[1]] * 2
    e = AcceptanceEstimate([0.5] * 4)
    for _ in range(10):
        e.update(proposed=1, accepted=1)  # always accepted at K = 1: deeper positions look as good
    assert e.rates[1] == e.rates[0] > 0.85


def test_the_prior_counts_as_a_few_observations_then_the_estimate_keeps_moving():
    e = AcceptanceEstimate([0.7])
    e.update(proposed=1, accepted=0)
    assert e.rates[0] == pytest.approx(0.7 * PRIOR_WEIGHT / (PRIOR_WEIGHT + 1))   # mean of prior and one miss
    e.update(proposed=1, accepted=0)
    assert e.rates[0] == pytest.approx(0.7 * PRIOR_WEIGHT / (PRIOR_WEIGHT + 2))
    for _ in range(50):
        e.update(proposed=1, accepted=1)
    before = e.rates[0]
    e.update(proposed=1, accepted=0)      # long past the prior: a miss weighs EMA, not 1 / 53
    assert e.rates[0] == pytest.approx((1 - EMA) * before)


def test_a_pooled_estimate_counts_every_verified_draft():
    from verispec.engine.acceptance_rates import POOLED_PRIOR

    e = AcceptanceEstimate([0.8] * 8, pooled=True)
    assert e.hits / e.verified == pytest.approx(0.8) and e.verified == POOLED_PRIOR
    e.update(proposed=8, accepted=3)                  # 3 accepted, the 4th rejected: 4 verified
    rate = ((1 - EMA) * 0.8 * POOLED_PRIOR + 3) / ((1 - EMA) * POOLED_PRIOR + 4)
    assert e.rates == [pytest.approx(rate)] * 8


def test_a_draft_models_estimate_outlasts_a_short_run_of_misses():
    """A draft model's misses rarely cluster, so five in a row after a long good stretch must not stop it
    drafting (at EMA's 0.2 its first position fell below what a draft step costs, K = 0 for ~30 tokens);
    a lookup's estimate, whose matches end abruptly, keeps the faster EMA and falls further."""
    from verispec.engine.acceptance_rates import MODEL_EMA, source_ema
    from verispec.engine.cost_model import STATIC_AVX512
    from verispec.engine.k_policy import choose_k

    assert source_ema("draft") == MODEL_EMA < EMA == source_ema("ngram:3") == source_ema("head")
    draft, lookup = AcceptanceEstimate.prior("draft", 4), AcceptanceEstimate.prior("ngram:3", 4)
    for e in (draft, lookup):
        for _ in range(8):                          # a stretch agreeing at 0.8
            for accepted in (1, 1, 1, 1, 0):
                e.update(proposed=1, accepted=accepted)
        for _ in range(5):
            e.update(proposed=1, accepted=0)
    assert lookup.rates[0] < draft.rates[0]
    c_q = STATIC_AVX512.c_q["draft"]
    assert choose_k(draft.rates, STATIC_AVX512.c_p, c_q, 4) > 0
