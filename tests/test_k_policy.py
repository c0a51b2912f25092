"""The K policy on synthetic costs: K* = argmax E(K) / (K·c_q + c_p(K+1)), catch-ups, probes, batches,
sources and the calibration it is seeded with."""

import pytest

from verispec.engine.acceptance_rates import AcceptanceEstimate
from verispec.engine.cost_model import CostModel
from verispec.engine.k_policy import KPolicy, choose_k, expected_tokens


def flat(c1: float, slope: float):
    return lambda n: c1 * (1 + slope * (n - 1))


def test_expected_tokens_matches_closed_form():
    a, k = 0.7, 4
    assert expected_tokens([a] * k, k) == pytest.approx((1 - a ** (k + 1)) / (1 - a))


def test_useless_draft_drives_k_to_zero():
    assert choose_k([0.05] * 8, flat(1.0, 0.3), c_q=0.3, k_max=8) == 0


def test_draft_equal_to_target_with_cheap_steps_drives_k_to_max():
    assert choose_k([1.0] * 8, flat(1.0, 0.05), c_q=0.05, k_max=8) == 8


def test_cheap_lookup_with_long_matches_drives_k_up_and_poor_matches_down():
    long_matches = choose_k([0.95] * 8, flat(1.0, 0.2), c_q=0.0, k_max=8)
    poor_matches = choose_k([0.3] * 8, flat(1.0, 0.2), c_q=0.0, k_max=8)
    assert long_matches >= 6 and poor_matches <= 1


def test_expensive_verify_makes_plain_decoding_win():
    # Verify cost grows like plain decoding itself (no parallelism): speculation never pays.
    assert choose_k([0.9] * 8, flat(1.0, 1.0), c_q=0.2, k_max=8) == 0


def test_a_first_measurement_with_one_off_costs_does_not_lock_the_draft_out():
    """A model's first call in a process is slow; taken at face value it priced the draft out and no
    later draft step ever measured it again. Half-way from the prior, it is tried and corrected."""
    p = KPolicy("auto", k_max=4)
    for n in range(1, 6):
        p.costs.record_verify(n, 0.1 * (1 + 0.2 * (n - 1)))
    p.shared[("draft", "greedy")] = [0.9] * 4
    p.costs.record_propose("draft", 1, 0.1)       # first call: a whole target step per drafted token
    assert p.choose(0, "draft", remaining=200) > 0


def test_one_stalled_proposer_call_does_not_price_cheap_heads_out():
    """A first heads round that took half a second (one-off set-up) moved c_q half-way to it and
    `auto` never drafted again; one timing now counts as at most SPIKE times the estimate, while a
    source that really is dear is priced at over half its cost within five rounds."""
    from verispec.engine.cost_model import SPIKE

    p = KPolicy("auto", k_max=4)
    p.limit("head", 4)
    for n in range(1, 6):
        p.costs.record_verify(n, 0.036 * (1 + 0.05 * (n - 1)))
    p.costs.seed_propose("head", 0.03)
    p.shared[("head", "greedy")] = [0.4] * p.k_max
    p.costs.record_propose("head", 3, 0.534)
    assert p.costs.c_q("head") <= SPIKE * 0.03 * 0.036
    assert p.choose(0, "head", remaining=100) > 0
    dear = KPolicy("auto", k_max=4)
    dear.costs.record_verify(1, 0.036)
    dear.costs.seed_propose("draft", 0.03)
    for _ in range(5):
        dear.costs.record_propose("draft", 1, 0.036)            # really a whole pass per token
    assert dear.costs.c_q("draft") > 0.5 * 0.036


def test_a_sequence_leaves_an_optimistic_prior_within_four_failed_rounds():
    """A source whose prior (pooled from other sequences, say code edits) is far too good for this
    sequence stops speculating after four misses (an EMA of 0.2 from the start would take five, each
    failed round costing a wider pass for one token)."""
    p = KPolicy("auto", k_max=4)
    for n in range(1, 6):
        p.costs.record_verify(n, 1.0 + 0.25 * (n - 1))
    p.shared[("ngram:3", "greedy")] = [0.9] * 4
    ks = []
    for _ in range(6):
        k = p.choose(0, "ngram:3", remaining=100)
        ks.append(k)
        p.observe(0, "ngram:3", k, 0)
    assert all(k > 0 for k in ks[:4]) and ks[4:] == [0, 0]


def test_always_accepted_cheap_lookup_climbs_past_k1():
    p = KPolicy("auto", k_max=6)
    for n, c in ((1, 1.0), (2, 1.05), (3, 1.1), (4, 1.2), (5, 1.3), (6, 1.4), (7, 1.5)):
        p.costs.record_verify(n, c)
    ks = []
    for _ in range(12):
        k = p.choose(0, "ngram", remaining=100)
        ks.append(k)
        p.observe(0, "ngram", k, k)       # every proposal accepted
    assert ks[-1] >= 4


def test_policy_probes_after_many_zero_rounds_and_caps_at_remaining():
    p = KPolicy("auto", k_max=4)
    p.costs.record_verify(1, 1.0)
    for n in range(2, 6):
        p.costs.record_verify(n, float(n))          # verify as expensive as n plain steps
    ks = [p.choose(0, "draft", remaining=100) for _ in range(16)]
    assert ks[:15] == [0] * 15 and ks[15] == 1
    fixed = KPolicy(4)
    assert fixed.choose(0, "draft", remaining=3) == 2


def test_wide_batches_drive_k_to_zero_while_a_single_sequence_speculates():
    """Costs are kept per batch bucket: alone, a 5-token verify costs 1.3x a 1-token pass (speculate);
    in a batch of 8 the pass is compute-bound, c_p(n) ∝ n (plain decoding wins)."""
    from verispec.engine.cost_model import batch_bucket

    p = KPolicy("auto", k_max=4)
    for n in range(1, 6):
        p.costs.record_verify(n, 1.0 + 0.075 * (n - 1), batch=1)
        p.costs.record_verify(n, 4.0 * n, batch=8)
    assert batch_bucket(1) == 1 and batch_bucket(5) == batch_bucket(8) == 8 and batch_bucket(9) == 16
    assert p.choose(0, "ngram", remaining=100, batch=1) > 0
    assert p.choose(1, "ngram", remaining=100, batch=7) == 0


def test_reproducible_choices_ignore_measured_costs():
    """Seeded sampling must not depend on timings: with reproducible=True, wildly different
    measured costs give the same K schedule."""
    schedules = []
    for slope in (0.05, 5.0):
        p = KPolicy("auto", k_max=4)
        for n in range(1, 6):
            p.costs.record_verify(n, 1.0 + slope * (n - 1))
        ks = []
        for i in range(20):
            k = p.choose(0, "ngram", remaining=100, reproducible=True)
            ks.append(k)
            p.observe(0, "ngram", k, k if i % 3 else 0)
        schedules.append(ks)
    assert schedules[0] == schedules[1] and max(schedules[0]) > 0


def test_new_sequences_start_from_what_earlier_ones_learned():
    p = KPolicy("auto", k_max=4)
    for n in range(1, 6):
        p.costs.record_verify(n, 1.0 + 0.1 * (n - 1))
    for slot in range(80):                       # many sequences whose lookups are never accepted
        p.choose(slot, "ngram", remaining=100, greedy=False)
        p.observe(slot, "ngram", 2, 0)
    first = p.choose(99, "ngram", remaining=100, greedy=False)          # a new one tries once …
    p.observe(99, "ngram", first, 0)
    assert first == 1 and p.choose(99, "ngram", remaining=100, greedy=False) == 0   # … and stops at a miss
    assert p.choose(98, "ngram", remaining=100, greedy=True) > 0       # greedy has its own prior
    assert p.choose(97, "ngram", remaining=100, greedy=False, reproducible=True) > 0   # fixed prior


def test_a_sequence_that_suits_the_source_drafts_after_many_that_did_not():
    """Heads on code after prose: the shared prior has learned prose's low rate, but a new sequence
    tries the source on its first round and, accepted, keeps drafting; a variant without the first
    try waits PROBE_EVERY rounds in plain decoding."""
    p = KPolicy("auto", k_max=4)
    p.limit("head", 4)
    for n in range(1, 6):
        p.costs.record_verify(n, 1.0 + 0.15 * (n - 1))
    p.costs.seed_propose("head", 0.03)
    for slot in range(40):                       # prose: heads rarely right
        for _ in range(4):
            k = p.choose(slot, "head", remaining=100)
            p.observe(slot, "head", k, 0)
    after_prose = list(p.shared[("head", "greedy")])
    ks = []
    for _ in range(8):                           # code: the first head always right
        k = p.choose(50, "head", remaining=100)
        ks.append(k)
        p.observe(50, "head", k, min(k, 1))
    assert ks[0] == 1 and all(k > 0 for k in ks)
    p.estimates[(51, "head")] = AcceptanceEstimate(after_prose, cap=4, fresh=False)
    assert [p.choose(51, "head", remaining=100) for _ in range(8)] == [0] * 8


def test_a_source_that_must_first_catch_up_gets_no_first_try():
    """The first try is for sources that draft at once (lookup, heads): a draft model would first
    prefill the whole prompt, so a new sequence follows the shared prior for it."""
    p = KPolicy("auto", k_max=4)
    for n in range(1, 6):
        p.costs.record_verify(n, 1.0 + 0.05 * (n - 1))
    p.costs.seed_propose("draft", 0.4)
    p.shared[("draft", "greedy")] = [0.05] * p.k_max           # the draft never paid before
    assert p.choose(0, "draft", remaining=100, backlog=80) == 0
    assert p.choose(1, "draft", remaining=100) == 1            # nothing to catch up on: it tries


def test_a_missed_first_try_leaves_the_probe_schedule_as_it_was():
    """The first try is not a probe: after it misses, the first probe still comes after 16 rounds of
    K = 0, not after the 32 a failed probe would earn."""
    p = KPolicy("auto", k_max=4)
    for n in range(1, 6):
        p.costs.record_verify(n, 1.0 + 0.1 * (n - 1))
    for slot in range(80):                       # lookups that are never accepted
        p.choose(slot, "ngram", remaining=1000, greedy=False)
        p.observe(slot, "ngram", 2, 0)
    ks = []
    for _ in range(1 + 16 + 1):
        k = p.choose(99, "ngram", remaining=1000, greedy=False)
        p.observe(99, "ngram", k, 0)
        ks.append(k)
    assert ks[0] == 1 and ks[1:16] == [0] * 15 and ks[16] == 1     # the try, 15 zero rounds, the probe


def test_probes_back_off_while_speculation_keeps_not_paying():
    p = KPolicy("auto", k_max=4)
    p.costs.record_verify(1, 1.0)
    for n in range(2, 6):
        p.costs.record_verify(n, float(n))
    probes = []
    for i in range(16 + 32 + 64 + 1):
        k = p.choose(0, "draft", remaining=1000)
        if k:
            probes.append(i)
            p.observe(0, "draft", k, 0)
    assert probes == [15, 15 + 32, 15 + 32 + 64]        # waits of 16, 32, 64 zero rounds


def test_a_batch_shares_one_k_and_stops_speculating_when_width_costs_too_much():
    from types import SimpleNamespace

    from verispec.engine.params import SamplingParams

    def seqs(n):
        return [SimpleNamespace(slot=i, generated=[], params=SamplingParams(temperature=0, max_tokens=50))
                for i in range(n)]

    cheap = KPolicy("auto", k_max=4)
    for n in range(1, 6):
        cheap.costs.record_verify(n, 1.0 + 0.05 * (n - 1), batch=4)
    ks = cheap.choose_round(seqs(4), ["ngram"] * 4)
    assert len(set(ks)) == 1 and ks[0] > 0                  # one K for the whole batch
    dear = KPolicy("auto", k_max=4)
    for n in range(1, 6):
        dear.costs.record_verify(n, float(n), batch=4)      # every extra row costs a full pass
    assert dear.choose_round(seqs(4), ["ngram"] * 4) == [0, 0, 0, 0]


def test_a_draft_catch_up_is_paid_only_when_the_remaining_tokens_repay_it():
    """A 600-token prompt the draft has not seen: with 20 tokens left, prefilling it into the draft
    costs more than speculation saves (K = 0); with 2000 left it pays (K > 0). Same for probes."""
    p = KPolicy("auto", k_max=4)
    for n in range(1, 6):
        p.costs.record_verify(n, 0.1 * (1 + 0.2 * (n - 1)))
    for _ in range(40):
        p.costs.record_propose("draft", 1, 0.02)
        p.costs.record_catchup("draft", 600, 600 * 0.02)      # 20 ms per prompt token
    assert p.costs.c_catchup("draft") == pytest.approx(0.02, rel=1e-3)
    assert p.choose(0, "draft", remaining=2000) > 0                # nothing to catch up
    assert p.choose(1, "draft", remaining=20, backlog=600) == 0
    assert p.choose(2, "draft", remaining=2000, backlog=600) > 0
    probing = KPolicy("auto", k_max=4)
    probing.costs.record_verify(1, 1.0)
    for n in range(2, 6):
        probing.costs.record_verify(n, float(n))
    probing.costs.record_propose("draft", 1, 0.45)
    probing.costs.record_catchup("draft", 100, 10.0)               # catching up costs a plain step per token
    assert all(probing.choose(0, "draft", remaining=40, backlog=100) == 0 for _ in range(40))


def test_a_batch_does_not_start_drafting_when_catch_ups_cost_more_than_they_save():
    from types import SimpleNamespace

    from verispec.engine.params import SamplingParams

    p = KPolicy("auto", k_max=4)
    for n in range(1, 6):
        p.costs.record_verify(n, 0.1 * (1 + 0.1 * (n - 1)), batch=2)
    p.costs.record_propose("draft", 1, 0.01)
    p.costs.record_catchup("draft", 100, 100 * 0.02)
    seqs = [SimpleNamespace(slot=i, generated=[], params=SamplingParams(temperature=0, max_tokens=30)) for i in (0, 1)]
    assert p.choose_round(seqs, ["draft", "draft"]) != [0, 0]
    assert p.choose_round(seqs, ["draft", "draft"], backlogs=[800, 800]) == [0, 0]


def test_short_lookup_matches_start_at_plain_decoding_and_long_ones_speculate():
    """Priors by match length (ngram.py): at c_p(2) = 1.3 c_p(1) a 1-token match (≈ 20 % accepted)
    does not pay for the wider pass, a 3-token match (≈ 70 %) does."""
    from verispec.engine.acceptance_rates import prior_rate

    p = KPolicy("auto")
    p.costs.record_verify(1, 0.10)
    for n in range(2, 10):
        p.costs.record_verify(n, 0.10 + 0.03 * (n - 1))
    assert prior_rate("ngram:1") < prior_rate("ngram:2") < prior_rate("ngram:3")
    assert p.choose(0, "ngram:1", remaining=100) == 0
    assert p.choose(1, "ngram:3", remaining=100) > 0
    buckets = ["ngram:1", "ngram:2", "ngram:3", "ngram:4-7", "ngram:8-15", "ngram:16+"]
    assert [prior_rate(b) for b in buckets] == sorted(prior_rate(b) for b in buckets)   # longer: higher
    assert prior_rate("retrieval") == 0.5


def test_speculation_must_beat_plain_decoding_by_the_margin():
    from verispec.engine.k_policy import MARGIN

    c_p = flat(1.0, 0.2)                                      # c_p(2) = 1.2 c_p(1)
    breakeven = 0.2                                           # (1 + a) / 1.2 = 1  <=>  a = 0.2
    bar = (1 + MARGIN * (1 - 1 / 1.2)) * 1.2 - 1              # MARGIN of the added sixth of the round's cost
    assert 0.04 < bar - breakeven < 0.06
    assert choose_k([breakeven + 0.02] * 8, c_p, c_q=0.0, k_max=1) == 0          # +1.7 %: not worth it
    assert choose_k([bar - 0.005] * 8, c_p, c_q=0.0, k_max=1) == 0
    assert choose_k([bar + 0.005] * 8, c_p, c_q=0.0, k_max=1) == 1


def test_where_a_wider_pass_costs_no_more_any_expected_gain_is_taken_and_dear_rows_ask_more():
    """The margin covers what the estimates' error could lose, which is what the round adds to a
    plain pass's cost: nothing where rows are free, so even a rarely right source drafts; much where
    each row costs half a pass."""
    assert choose_k([0.02] * 8, flat(1.0, 0.0), c_q=0.0, k_max=1) == 1
    assert choose_k([0.02] * 8, flat(1.0, 0.0), c_q=0.1, k_max=1) == 0         # its own steps cost 10 %
    dear = flat(1.0, 0.5)                                                      # c_p(2) = 1.5 c_p(1)
    assert choose_k([0.6] * 8, dear, c_q=0.0, k_max=1) == 0                   # +6.7 %: the bar is 8.3 %
    assert choose_k([0.65] * 8, dear, c_q=0.0, k_max=1) == 1                  # +10 %


def test_calibrated_widths_are_interpolated_and_let_a_long_match_draft_far():
    """Seeded with calibrated ratios, widths between measured ones are interpolated; a lookup source
    that is nearly always right then drafts far beyond the widths ever run in this process — and
    without the calibration the prior slope alone would keep it at a few tokens."""
    c = CostModel()
    c.seed({2: 1.1, 3: 1.2, 5: 1.4, 9: 1.8, 17: 2.6, 33: 4.2, 65: 7.4})
    c.record_verify(1, 0.05)
    assert c.c_p(5) == pytest.approx(0.07)
    assert c.c_p(13) == pytest.approx(0.05 * 2.2)                    # half-way between 9 and 17
    assert c.c_p(80) > c.c_p(65)                                     # beyond: the prior slope
    seeded, unseeded = KPolicy("auto"), KPolicy("auto")
    seeded.costs = c
    unseeded.costs.record_verify(1, 0.05)
    unseeded.costs.record_verify(2, 0.055)
    for p in (seeded, unseeded):
        p.shared[("ngram:16+", "greedy")] = [0.97] * p.k_max
    assert seeded.choose(0, "ngram:16+", remaining=200) >= 16
    assert unseeded.choose(0, "ngram:16+", remaining=200) <= 8


def test_width_ratios_are_measured_once_and_then_read_back(tmp_path, monkeypatch):
    from conftest import tiny_model
    from verispec.engine import calibrate

    monkeypatch.setenv("VERISPEC_CACHE", str(tmp_path))
    monkeypatch.setattr(calibrate, "pass_costs", seconds_of(QUIET)[0])     # real timings: test_real_models
    model = tiny_model(0)
    first = calibrate.width_ratios(model, "tiny", widths=(2, 4), repeats=1)
    assert set(first) == {2, 4} and all(r > 0 for r in first.values())
    monkeypatch.setattr(calibrate, "pass_costs", lambda *a, **k: pytest.fail("measured twice"))
    assert calibrate.width_ratios(model, "tiny", widths=(2, 4)) == first
    (tmp_path / "calibration.json").write_text("{not json")        # a corrupt file is measured again
    monkeypatch.setattr(calibrate, "pass_costs", seconds_of(QUIET)[0])
    assert set(calibrate.width_ratios(model, "tiny", widths=(2, 4), repeats=1)) == {2, 4}


# c_p(n) / c_p(1) as a Zen 4 stored them at its first run, beside a compiler on both cores, and as its
# quiet passes give them (verispec profile, the same machine, the same day).
BUSY = {2: 0.568, 3: 0.257, 4: 0.570, 5: 0.525, 6: 0.575, 8: 0.612, 12: 1.079, 17: 1.415}
QUIET = {2: 0.99, 3: 1.01, 4: 0.99, 5: 1.05, 6: 1.24, 8: 1.55, 12: 2.10, 17: 2.90}


def seconds_of(ratios: dict[int, float], one: float = 0.03):
    """A fake calibrate.pass_costs giving these ratios, counting its calls."""
    calls = []

    def pass_costs(model, widths, *args, **kw):
        calls.append(widths)
        widest = max(ratios)                                              # wider: in proportion
        return {n: one * (1.0 if n == 1 else ratios.get(n, ratios[widest] * n / widest)) for n in widths}
    return pass_costs, calls


def test_ratios_no_quiet_machine_gives_are_implausible():
    from verispec.engine.calibrate import plausible_ratios

    assert plausible_ratios(QUIET) and plausible_ratios({2: 0.95, 3: 0.95, 4: 1.0})
    assert not plausible_ratios(BUSY)
    assert not plausible_ratios({**QUIET, 8: 6.0})       # one width timed in a stall: wider ones look cheap


def test_an_implausible_calibration_in_the_file_is_measured_again(tmp_path, monkeypatch):
    """A calibration stored from busy cores (wide passes priced as nearly free) is not read back: the
    widths are measured again and the file corrected, so a machine heals at its next start."""
    from conftest import tiny_model
    from verispec.engine import calibrate
    import json

    monkeypatch.setenv("VERISPEC_CACHE", str(tmp_path))
    model, widths = tiny_model(0), tuple(QUIET)
    fake, calls = seconds_of(BUSY)
    monkeypatch.setattr(calibrate, "RATIO_FLOOR", 0.0)                  # an older build: stored as measured
    monkeypatch.setattr(calibrate, "pass_costs", fake)
    assert calibrate.width_ratios(model, "tiny", widths=widths) == pytest.approx(BUSY)
    monkeypatch.undo()
    monkeypatch.setenv("VERISPEC_CACHE", str(tmp_path))
    fake, calls = seconds_of(QUIET)
    monkeypatch.setattr(calibrate, "pass_costs", fake)
    assert calibrate.width_ratios(model, "tiny", widths=widths) == pytest.approx(QUIET) and len(calls) == 1
    stored = json.loads((tmp_path / "calibration.json").read_text())
    assert [{int(n): r for n, r in e.items()} for e in stored.values()] == [pytest.approx(QUIET)]


def test_a_calibration_timed_on_busy_cores_is_retried_then_not_kept(tmp_path, monkeypatch):
    """Implausible ratios are measured again (ATTEMPTS in all); if every attempt is, nothing is stored
    and the LLM prices passes with its CPU kind's profile, saying why."""
    from types import SimpleNamespace

    from conftest import tiny_model
    from verispec import kernels
    from verispec.engine import calibrate
    from verispec.engine.cost_model import static_costs
    from verispec.engine.llm import LLM

    monkeypatch.setenv("VERISPEC_CACHE", str(tmp_path))
    model, widths = tiny_model(0), tuple(QUIET)
    busy, calls = seconds_of(BUSY)
    monkeypatch.setattr(calibrate, "pass_costs", busy)
    assert calibrate.width_ratios(model, "tiny", widths=widths) is None
    assert len(calls) == calibrate.ATTEMPTS and not (tmp_path / "calibration.json").exists()
    with pytest.warns(RuntimeWarning, match="could not be timed consistently"):
        ratios = LLM._width_ratios(SimpleNamespace(name="tiny", model=model), False)
    assert ratios == dict(static_costs(kernels.active_variant()).ratios)
    answers = iter([BUSY, QUIET])                                       # a second attempt on quiet cores
    monkeypatch.setattr(calibrate, "pass_costs", lambda m, w, **kw: seconds_of(next(answers))[0](m, w))
    assert calibrate.width_ratios(model, "tiny", widths=widths) == pytest.approx(QUIET)


def test_one_calibration_stored_keeps_the_others(tmp_path, monkeypatch):
    """The target's pass widths and the draft's step share one calibration file: storing one must not
    drop the other (else each process measured both again, a few noisy seconds each time)."""
    from conftest import tiny_model
    from verispec.engine import calibrate

    monkeypatch.setenv("VERISPEC_CACHE", str(tmp_path))
    monkeypatch.setattr(calibrate, "pass_costs", seconds_of(QUIET)[0])
    target, draft = tiny_model(0), tiny_model(1)
    widths = calibrate.width_ratios(target, "tiny", widths=(2, 4), repeats=1)
    step = calibrate.draft_step_ratio(target, draft, "tiny|draft", repeats=1)
    monkeypatch.setattr(calibrate, "pass_costs", lambda *a, **k: pytest.fail("widths measured twice"))
    monkeypatch.setattr(calibrate, "alternated_steps", lambda *a, **k: pytest.fail("draft measured twice"))
    assert calibrate.width_ratios(target, "tiny", widths=(2, 4)) == widths
    assert calibrate.draft_step_ratio(target, draft, "tiny|draft") == step


def test_a_rebuilt_kernel_is_calibrated_again(tmp_path, monkeypatch):
    """Ratios measured with one kernel build are not reused with another (a kernel change moves them)."""
    from conftest import tiny_model
    from verispec import kernels
    from verispec.engine import calibrate

    monkeypatch.setenv("VERISPEC_CACHE", str(tmp_path))
    model = tiny_model(0)
    machine = kernels.machine()
    monkeypatch.setattr(kernels, "machine", lambda: {**machine, "kernel_build": "build-a"})
    monkeypatch.setattr(calibrate, "pass_costs", seconds_of(QUIET)[0])
    calibrate.width_ratios(model, "tiny", widths=(2,), repeats=1)
    monkeypatch.setattr(calibrate, "pass_costs", lambda *a, **k: {1: 1.0, 2: 1.5})
    assert calibrate.width_ratios(model, "tiny", widths=(2,)) != {2: 1.5}        # same build: read back
    monkeypatch.setattr(kernels, "machine", lambda: {**machine, "kernel_build": "build-b"})
    assert calibrate.width_ratios(model, "tiny", widths=(2,)) == {2: 1.5}        # another build: measured


def test_a_calibrated_draft_cost_keeps_a_dear_draft_from_drafting():
    """Without a calibrated c_q a draft model starts as free and speculates until its own steps are
    measured; calibrated at 0.6 of a target pass it does not draft where 70 % acceptance cannot pay."""
    free, calibrated = KPolicy("auto"), KPolicy("auto")
    for p in (free, calibrated):
        p.costs.record_verify(1, 0.036)
        p.costs.seed({2: 1.25, 3: 1.43, 5: 1.71, 9: 2.8})
        p.shared[("draft", "greedy")] = [0.7] * p.k_max
    calibrated.costs.seed_propose("draft", 0.6)
    assert calibrated.costs.c_q("draft") == pytest.approx(0.6 * 0.036)
    assert free.choose(0, "draft", remaining=100) > 0
    assert calibrated.choose(0, "draft", remaining=100) == 0
    calibrated.costs.record_propose("draft", 2, 2 * 0.0036)                # a measured step, much cheaper:
    assert calibrated.costs.c_q("draft") == pytest.approx((0.6 * 0.036 + 0.0036) / 2)   # prior counts as one


def test_a_draft_priced_out_by_its_cold_first_steps_drafts_again():
    """A source is measured only in rounds it drafts: after the weights were read from disk, the 0.5B's
    first two steps cost up to 4x its calibrated 0.22 of a pass, `auto` stopped drafting, the tokens the
    draft would have to catch up on grew with every round, and it was never tried again (a code edit
    at 0.6x its usual speed for the process's life). Unmeasured, a calibrated source's estimate returns
    to its prior pass by pass, so the draft is tried again and, costing what the calibration says,
    keeps drafting; an uncalibrated source keeps what it measured."""
    from verispec.engine.cost_model import RELAX

    def policy(calibrated: bool) -> KPolicy:
        p = KPolicy("auto")
        p.costs.seed({2: 1.05, 3: 1.1, 5: 1.2, 9: 1.8})
        p.costs.record_verify(1, 0.045)
        p.shared[("draft", "greedy")] = [0.7] * p.k_max
        if calibrated:
            p.costs.seed_propose("draft", 0.22)
        return p

    p, free = policy(True), policy(False)
    assert p.choose(0, "draft", remaining=400) > 0
    for q in (p, free):
        for _ in range(2):
            q.costs.record_propose("draft", 4, 4 * 4 * 0.22 * 0.045)          # cold: 40 ms a token
    measured, backlog = free.costs.c_q("draft"), 1
    while p.choose(0, "draft", remaining=400 - backlog, backlog=backlog) == 0:
        p.costs.record_verify(1, 0.045)                                       # plain rounds meanwhile
        free.costs.record_verify(1, 0.045)
        backlog += 1
        assert backlog < 300, "the draft was never tried again"
    assert RELAX > 0 and 10 < backlog <= 80
    assert free.costs.c_q("draft") == measured
    for _ in range(20):                                                       # it costs what calibration said
        p.costs.record_propose("draft", 4, 4 * 0.22 * 0.045)
        p.costs.record_verify(5, 0.045 * 1.2)
    assert p.choose(0, "draft", remaining=300) > 0
    assert p.costs.c_q("draft") == pytest.approx(0.22 * 0.045, rel=0.05)


def test_draft_step_ratio_is_measured_once(tmp_path, monkeypatch):
    from conftest import tiny_model
    from verispec.engine import calibrate

    monkeypatch.setenv("VERISPEC_CACHE", str(tmp_path))
    ratio = calibrate.draft_step_ratio(tiny_model(0), tiny_model(1, num_layers=1), "tiny pair", repeats=1)
    assert ratio > 0
    monkeypatch.setattr(calibrate, "pass_cost", lambda *a, **k: pytest.fail("measured twice"))
    assert calibrate.draft_step_ratio(tiny_model(0), tiny_model(1, num_layers=1), "tiny pair") == ratio


def test_a_source_limited_to_h_drafts_is_never_given_more():
    """Medusa heads draft one token per head: with 3 heads, auto never asks for K > 3, even when every
    draft is accepted (the usual rule would try K + 1 after a fully accepted round)."""
    policy = KPolicy("auto", 16)
    policy.limit("head", 3)
    policy.costs.seed({n: 1.0 + 0.02 * (n - 1) for n in range(1, 66)})
    for _ in range(20):
        k = policy.choose(1, "head", remaining=100)
        assert k <= 3
        policy.observe(1, "head", k, k)
    assert k == 3
    free = KPolicy("auto", 16)                                      # without the limit it would go on
    free.costs.seed({n: 1.0 + 0.02 * (n - 1) for n in range(1, 66)})
    ks = []
    for _ in range(20):
        ks.append(free.choose(1, "head", remaining=100))
        free.observe(1, "head", ks[-1], ks[-1])
    assert max(ks) > 3


def test_an_answers_expected_remainder_follows_the_prior_then_the_answers_that_finished():
    from verispec.engine.answer_lengths import PRIOR_ANSWERS, AnswerLengths, prior_remaining

    lengths = AnswerLengths()
    assert lengths.expected_remaining(0, 4000) == pytest.approx(prior_remaining(0, 4000))
    assert prior_remaining(0, 4000) < 100 < prior_remaining(200, 4000) < 4000 - 200   # the longer it ran …
    assert prior_remaining(64, 64) == 0.0
    for _ in range(40):
        lengths.record(12, capped=False)                 # short answers that stopped by themselves
    # 8 more in each of 40 answers, against the prior's ~106 counted as PRIOR_ANSWERS answers.
    mixed = (PRIOR_ANSWERS * prior_remaining(4, 4000) + 40 * 8) / (PRIOR_ANSWERS + 40)
    assert lengths.expected_remaining(4, 4000) == pytest.approx(mixed) and mixed < 15
    assert lengths.expected_remaining(4, 4000, learned=False) == prior_remaining(4, 4000)
    # Past every answer seen, the prior alone speaks again.
    assert lengths.expected_remaining(12, 4000) == pytest.approx(prior_remaining(12, 4000))
    capped = AnswerLengths()
    for _ in range(40):
        capped.record(64, capped=True)                   # every answer ran into its max_tokens of 64
    assert capped.expected_remaining(10, 64) == pytest.approx(54, abs=3)
    # Cut by a smaller cap than this request's: counted to it, and the prior's tail beyond.
    assert capped.expected_remaining(10, 4000) > 64 - 10 + 0.9 * prior_remaining(64, 4000)


def test_a_draft_catch_up_is_amortised_over_the_answer_expected_not_over_its_cap():
    """An open-ended request (max_tokens = the rest of the context) behind a 600-token prompt: the
    draft catches up when answers here run long, not when they stop after about ten tokens. A seeded
    request ignores the other answers (its schedule depends on its own history only)."""
    from types import SimpleNamespace

    from verispec.engine.params import SamplingParams

    def policy(answer: int) -> KPolicy:
        p = KPolicy("auto", k_max=4)
        for n in range(1, 6):
            p.costs.record_verify(n, 0.1 * (1 + 0.1 * (n - 1)))
        p.costs.record_propose("draft", 1, 0.02)
        p.costs.record_catchup("draft", 100, 100 * 0.003)
        p.shared[("draft", "greedy")] = [0.8] * p.k_max
        for _ in range(50):
            p.finished(answer, capped=False)
        return p

    seq = SimpleNamespace(slot=0, generated=[1, 2, 3], params=SamplingParams(temperature=0, max_tokens=4000))
    assert policy(3000).choose_round([seq], ["draft"], backlogs=[600]) != [0]
    assert policy(12).choose_round([seq], ["draft"], backlogs=[600]) == [0]
    assert policy(12).choose_round([seq], ["draft"], backlogs=[0]) != [0]       # nothing to catch up on
    seeded = SimpleNamespace(slot=0, generated=[1, 2, 3],
                             params=SamplingParams(temperature=0.7, max_tokens=4000, seed=1))
    assert policy(12).choose_round([seeded], ["draft"], backlogs=[600]) == \
        policy(3000).choose_round([seeded], ["draft"], backlogs=[600])


class TwoSources:
    """A proposer that offers a lookup match and a draft model for every sequence (as a hybrid does)."""

    def __init__(self, match: str, draft_backlog: int = 0):
        self.match, self.draft_backlog, self.preferred = match, draft_backlog, {}

    def options(self, seq):
        return [(self.match, 0), ("draft", self.draft_backlog)]

    def prefer(self, seq, source):
        self.preferred[seq.slot] = source

    def source_for(self, seq):
        return self.preferred.get(seq.slot, self.match)

    def backlog(self, seq):
        return self.draft_backlog if self.source_for(seq) == "draft" else 0


def two_source_policy() -> KPolicy:
    p = KPolicy("auto", k_max=8)
    for n in range(1, 10):
        p.costs.record_verify(n, 0.03 * (1 + 0.1 * (n - 1)))
    p.costs.record_propose("draft", 1, 0.008)                    # a draft step: ~0.27 of a pass
    return p


def test_a_short_match_gives_way_to_the_draft_and_a_long_one_does_not():
    """A 1-token match's drafts are right ~20 % of the time, the draft's ~70 %: the draft's round
    promises more tokens per second although lookup costs nothing; a match inside copied text
    (≥ 16 tokens, ~85 %, free) promises more than the draft. What the rounds show moves the choice."""
    from types import SimpleNamespace

    from verispec.engine.params import SamplingParams

    def seq(slot):
        return SimpleNamespace(slot=slot, generated=[], params=SamplingParams(temperature=0, max_tokens=64))

    p, short = two_source_policy(), TwoSources("ngram:1")
    assert p.choose_for(short, [seq(0)]) != [0] and short.preferred[0] == "draft"
    long_ = TwoSources("ngram:16+")
    assert p.choose_for(long_, [seq(1)]) != [0] and long_.preferred[1] == "ngram:16+"
    for _ in range(30):                                          # this sequence's 1-token matches keep being right
        p.observe(2, "ngram:1", 3, 3)
    assert p.choose_for(short, [seq(2)]) != [0] and short.preferred[2] == "ngram:1"
    fixed = TwoSources("ngram:1")                                # fixed K: the proposer's own choice stands
    KPolicy(3).choose_for(fixed, [seq(0)])
    assert fixed.preferred == {}


def test_a_draft_with_a_catch_up_that_does_not_pay_leaves_the_round_to_lookup():
    """The draft has a 3,000-token prompt to prefill and the answer is expected to be short: its
    round is worth plain decoding's, so a 2-token match (worth a little more) drafts."""
    from types import SimpleNamespace

    from verispec.engine.params import SamplingParams

    p = two_source_policy()
    p.costs.record_catchup("draft", 100, 100 * 0.003)
    for _ in range(50):
        p.finished(8, capped=False)
    s = SimpleNamespace(slot=0, generated=[1], params=SamplingParams(temperature=0, max_tokens=4000))
    both = TwoSources("ngram:2", draft_backlog=3000)
    p.choose_for(both, [s])
    assert both.preferred[0] == "ngram:2"
    caught_up = TwoSources("ngram:2")
    p.choose_for(caught_up, [s])
    assert caught_up.preferred[0] == "draft"


def test_a_seeded_request_chooses_its_source_without_reading_timings():
    from types import SimpleNamespace

    from verispec.engine.params import SamplingParams

    seeded = SimpleNamespace(slot=0, generated=[], params=SamplingParams(temperature=0.7, max_tokens=64, seed=3))
    picks = []
    for step in (0.001, 0.05):                                    # a cheap draft, then one dearer than a pass
        p = two_source_policy()
        for _ in range(10):
            p.costs.record_propose("draft", 1, step)
        proposer = TwoSources("ngram:1")
        p.choose_for(proposer, [seeded])
        picks.append(proposer.preferred[0])
    assert picks[0] == picks[1]


def test_seeded_requests_are_priced_with_the_fixed_profile_of_the_kernel_kind():
    """A seed's K schedule reads fixed costs, one profile per kind of kernel: on AVX-512 a pass stays
    memory-bound to ~5 rows and a draft step is cheaper, so a seeded draft drafts further there;
    either way the schedule never reads the measured costs."""
    from types import SimpleNamespace

    from verispec.engine.cost_model import STATIC_AVX2, STATIC_AVX512, STATIC_AVXVNNI, static_costs
    from verispec.engine.params import SamplingParams

    assert static_costs("avx512bf16") is STATIC_AVX512 and static_costs("avx512vnni") is STATIC_AVX512
    assert static_costs("amx") is STATIC_AVX512 and static_costs("avxvnni") is STATIC_AVXVNNI
    assert static_costs("avx2") is STATIC_AVX2 and static_costs(None) is STATIC_AVX2
    assert STATIC_AVX2.c_p(1) == 1.0 and STATIC_AVX2.c_p(5) == pytest.approx(2.05) and STATIC_AVX2.c_p(7) == pytest.approx(2.725)
    assert STATIC_AVX512.c_p(3) == pytest.approx(1.025) and STATIC_AVX512.c_p(80) > STATIC_AVX512.c_p(65)
    seeded = SimpleNamespace(slot=0, generated=[], params=SamplingParams(temperature=0.7, max_tokens=64, seed=1))
    ks = {}
    for name, profile in (("avx2", STATIC_AVX2), ("avxvnni", STATIC_AVXVNNI), ("avx512", STATIC_AVX512)):
        p = KPolicy("auto", k_max=8, static=profile)
        p.costs.record_verify(1, 0.03)
        p.costs.record_propose("draft", 1, 0.5)                 # measured: dearer than a pass (ignored)
        p._estimate(0, "draft", greedy=False, use_shared=False).rates = [0.8] * 8   # 80 % accepted
        ks[name] = p.choose_round([seeded], ["draft"])[0]
    assert 0 < ks["avx2"] <= ks["avxvnni"] <= ks["avx512"] and ks["avx2"] < ks["avx512"]


def test_a_catch_up_is_repaid_only_by_the_rounds_its_source_is_expected_to_draft():
    """Copying a long input, lookup wins round after round; where the match breaks off (a 1-token
    match) the draft would win the round, but feeding it the 3,000-token input first pays only if it
    will draft a good share of the rest — here it would not. A sequence whose rounds the draft
    mostly won pays the same catch-up."""
    from types import SimpleNamespace

    from verispec.engine.params import SamplingParams

    p = two_source_policy()
    p.costs.record_catchup("draft", 100, 100 * 0.001)
    for _ in range(50):
        p.finished(3000, capped=False)
    copying = SimpleNamespace(slot=0, generated=list(range(500)), params=SamplingParams(temperature=0, max_tokens=4000))
    writing = SimpleNamespace(slot=1, generated=list(range(500)), params=SamplingParams(temperature=0, max_tokens=4000))
    for _ in range(60):
        p.choose_for(TwoSources("ngram:16+"), [copying])         # lookup valued most
        p.choose_for(TwoSources("ngram:1"), [writing])           # the draft valued most
    broke_off = TwoSources("ngram:1", draft_backlog=3000)
    p.choose_for(broke_off, [copying])
    assert broke_off.preferred[0] == "ngram:1"
    p.choose_for(broke_off, [writing])
    assert broke_off.preferred[1] == "draft"


def test_inside_a_copy_one_miss_does_not_hold_k_down_for_good():
    """A long lookup match (a copied file) missed once at position 3 of a 24-token round. Per position,
    K = 3 rounds never verify position 3 again, so its estimate — and K — would stay where the miss
    left them; pooled over positions, each accepted round counts for all, and K climbs back."""
    def run(source):
        p = KPolicy("auto", k_max=32)
        p.costs.seed({n: 1.0 + 0.2 * (n - 1) for n in (2, 4, 8, 16, 32)})
        p.costs.record_verify(1, 0.03)
        p.shared[(source, "greedy")] = [1.0] * 32
        p.observe(0, source, 23, 3)                   # the miss
        ks = []
        for _ in range(12):
            k = p.choose(0, source, remaining=2000)
            p.observe(0, source, k, k)                # every later round accepted whole
            ks.append(k)
        return ks

    pooled = run("ngram:16+")
    assert pooled[-1] >= 16, pooled
    from verispec.engine import acceptance_rates

    per_position = run("draft")                        # a per-position source, same evidence
    assert per_position[-1] <= 4 and per_position[-1] < pooled[-1], per_position
    assert "ngram:16+" in acceptance_rates.POOLED_SOURCES and "ngram:3" not in acceptance_rates.POOLED_SOURCES


class DraftOnly(TwoSources):
    """No match this round: the draft (with its catch-up) is the only source."""

    def options(self, seq):
        return [("draft", self.draft_backlog)]

    def source_for(self, seq):
        return "draft"

    def backlog(self, seq):
        return self.draft_backlog


def test_a_catch_up_is_repaid_by_the_share_of_rounds_its_source_drafts_even_as_the_only_source():
    """An answer that copies its input: lookup won 40 rounds in a row, then a match breaks off and the
    draft, 1,200 tokens behind, is the only source. Its catch-up is priced against the rounds it is
    expected to draft (a share of 1 in 21), not the whole remainder, so the round decodes plainly;
    a sequence that the draft has drafted all along still catches up."""
    from types import SimpleNamespace

    from verispec.engine.params import SamplingParams

    p = two_source_policy()
    p.costs.record_catchup("draft", 100, 100 * 0.0016)           # the 0.5B's prefill: 1.6 ms a token
    params = SamplingParams(temperature=0, max_tokens=3000)
    copying = SimpleNamespace(slot=0, generated=[1] * 400, params=params)
    for _ in range(40):
        p.choose_for(TwoSources("ngram:16+", draft_backlog=1200), [copying])
    assert p.choose_for(DraftOnly("ngram:16+", draft_backlog=1200), [copying]) == [0]
    drafting = SimpleNamespace(slot=1, generated=[1] * 400, params=params)
    for _ in range(40):
        p.choose_for(DraftOnly("ngram:16+"), [drafting])
    assert p.choose_for(DraftOnly("ngram:16+", draft_backlog=1200), [drafting]) != [0]

