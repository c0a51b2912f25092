"""The pass and proposal costs the K policy prices rounds with (engine/cost_model.py): measured widths,
interpolated and extrapolated ones, a level that follows the machine, calibrated ratios that stay, and
one-off costs that do not set a price."""

import pytest

from verispec.engine.cost_model import CostModel


def test_cost_model_measures_and_extrapolates():
    c = CostModel()
    c.record_verify(1, 0.1)
    c.record_verify(3, 0.14)
    assert c.c_p(3) == pytest.approx(0.14)
    assert c.c_p(5) > c.c_p(3) > c.c_p(1)
    c.record_propose("draft", 4, 0.2)     # 50 ms per token; the prior (free) counts as one measurement
    assert c.c_q("draft") == pytest.approx(0.025) and c.c_q("ngram") == 0.0
    for _ in range(40):
        c.record_propose("draft", 4, 0.2)
    assert c.c_q("draft") == pytest.approx(0.05, rel=1e-3)


def test_width_costs_read_from_the_curve_follow_every_new_measurement():
    """Widths' costs are kept as a curve for speed (choosing K prices ~65 widths several times a
    round); a width measured for the first time, or learned further, must reshape it at once:
    interpolation below it and extrapolation beyond it, as derived afresh."""
    c = CostModel()
    c.record_verify(1, 0.10)
    c.record_verify(5, 0.30)                  # ratio 3: widths 2 … 4 interpolated, 6 … extrapolated
    assert c.c_p(3) == pytest.approx(0.20) and c.c_p(7) == pytest.approx(0.30 + 2 * 0.35 * 0.10)
    c.record_verify(3, 0.12)                  # width 3 measured: cheaper than the line through 1 and 5
    assert c.c_p(3) == pytest.approx(0.12) and c.c_p(2) == pytest.approx(0.11)
    assert c.c_p(4) == pytest.approx(0.21)
    c.record_verify(9, 0.50)                  # beyond the widest: widths 6 … 8 now interpolated
    assert c.c_p(7) == pytest.approx(0.30 + 0.5 * (0.5 - 0.3))
    assert c.c_p(12) == pytest.approx(0.50 + 3 * 0.35 * 0.10)
    c.seed({2: 1.5})                          # a calibration replaces what was learned
    assert c.c_p(2) == pytest.approx(0.15)
    price = c.pricer()
    assert [price(n) for n in range(1, 66)] == [c.c_p(n) for n in range(1, 66)]


def test_pass_costs_follow_the_machine_whatever_width_runs():
    """A slow spell while a sequence speculates (only 3-token passes run) raises c_p(1) too: the
    widths are compared at the machine's current speed, not at the speed of their last passes."""
    c = CostModel()
    c.record_verify(1, 0.10)
    c.record_verify(3, 0.14)
    for _ in range(30):
        c.record_verify(3, 0.28)          # the machine at half speed
    assert c.c_p(1) == pytest.approx(0.20, rel=0.05)
    assert c.c_p(3) / c.c_p(1) == pytest.approx(1.4, rel=0.05)


def test_a_processs_cold_first_passes_do_not_set_the_level():
    """A process's first target passes carry one-off costs (measured: 129 ms, then 47-51 ms): with the
    level an EMA from the first pass, c_p(1) read ~2x high for a dozen passes, inflating every price
    derived from it. Over its first WARM passes a calibrated bucket keeps the fastest; a slow spell
    afterwards still moves it."""
    from verispec.engine.cost_model import WARM

    c = CostModel()
    c.seed({2: 1.1, 3: 1.2})
    c.record_verify(1, 0.129)                 # cold
    c.record_verify(3, 0.050 * 1.2)
    c.record_verify(2, 0.048 * 1.1)
    assert WARM == 3 and c.c_p(1) == pytest.approx(0.048)
    for _ in range(30):
        c.record_verify(1, 0.096)             # the machine at half speed, later
    assert c.c_p(1) == pytest.approx(0.096, rel=0.01)


def test_only_a_long_catch_up_sets_the_catch_up_rate():
    """A catch-up of a few tokens costs about one pass whatever its length; as a rate per token it
    priced a 125-token backlog at twice what it took (measured on the 0.5B: 5.4 ms a token from a
    5-token catch-up, 2.6 from 140). Catch-ups shorter than CATCHUP_MIN tokens leave the rate alone."""
    from verispec.engine.cost_model import CATCHUP_MIN

    c = CostModel()
    c.record_verify(1, 0.04)
    c.seed_propose("draft", 0.25)             # c_q 10 ms: the catch-up prior is 2 ms a token
    prior = c.c_catchup("draft")
    c.record_catchup("draft", 5, 0.027)
    c.record_catchup("draft", CATCHUP_MIN - 1, 0.05)
    assert c.c_catchup("draft") == prior
    c.record_catchup("draft", 140, 140 * 0.0026)
    assert c.c_catchup("draft") == pytest.approx((prior + 0.0026) / 2)


def test_calibrated_ratios_stay_and_every_pass_moves_the_level():
    """Almost every round speculates (2–6-token passes, noisy, a 1-token pass once in 80): with the
    calibrated ratios fixed, c_p(1) stays at what a 1-token pass costs and follows the machine when
    it slows down, whatever width runs."""
    import random

    truth = {1: 0.036, 2: 0.0362, 3: 0.0367, 4: 0.0376, 5: 0.039, 6: 0.0413}
    rng = random.Random(5)
    c = CostModel()
    c.seed({n: truth[n] / truth[1] for n in range(2, 7)})
    for i in range(4000):
        width = 1 if i % 80 == 0 else rng.choice([2, 3, 3, 4, 4, 5, 6])
        c.record_verify(width, truth[width] * rng.lognormvariate(0, 0.15))
    assert c.c_p(1) == pytest.approx(0.036, rel=0.1)
    assert all(c.c_p(n) / c.c_p(1) == pytest.approx(truth[n] / truth[1]) for n in range(2, 7))
    for _ in range(40):
        c.record_verify(3, 2 * truth[3])              # the machine at half speed
    assert c.c_p(1) == pytest.approx(0.072, rel=0.05)
    unseeded = CostModel()                            # no calibration: a width's passes teach its ratio
    unseeded.record_verify(1, 0.036)
    for _ in range(30):
        unseeded.record_verify(1, 0.036)
        unseeded.record_verify(3, 0.054)
    assert unseeded.c_p(3) / unseeded.c_p(1) == pytest.approx(1.5, rel=0.05)
