"""Choosing K per sequence and per round from measured costs and running acceptance estimates.

For a proposer whose drafts are accepted at position i (given positions < i were) with rate a_i,
K drafts emit on average E(K) = 1 + Σ_{j=1..K} Π_{i<j} a_i tokens per round (the +1 is the
recovered or bonus token). A round costs K·c_q + c_p(K+1): c_q the proposer's cost per drafted
token, c_p(n) one target pass over n tokens. We pick

    K* = argmax_{K ∈ 0 … K_max}  E(K) / (K·c_q + c_p(K+1)),

so K = 0 (plain decoding for that round) wins whenever speculation does not pay — or pays by less
than the estimates' own error could lose, a MARGIN of what the round adds to a plain pass's cost
(clears_margin). With a constant rate a this is the DESIGN formula E = (1 − a^{K+1}) / (1 − a).

Costs are measured on the fly: c_p(n) as the machine's current level (every pass moves it) times a
ratio per width — this machine's calibrated ratios, or without a calibration ratios learned slowly
from the passes — so widths are compared at one moment of a shared machine; widths not yet measured
are extrapolated with a prior slope, optimistic enough to be tried once and then known (CostModel).

A proposer may first have to catch up — the draft model prefills a sequence's prompt (and any
tokens it skipped during K = 0 rounds) the first time it drafts for it. That one-off cost is paid
only when speculating over the tokens still to generate saves more than it costs:

    remaining · (c_p(1) − (K·c_q + c_p(K+1)) / E(K))  >  backlog · c_catchup

so a long prompt with a short answer is decoded plainly rather than prefilled twice. `remaining`
there is the answer's expected remainder (answer_lengths.py), not its cap: an open-ended answer's
cap is the rest of the context.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

from verispec.engine.answer_lengths import AnswerLengths
from verispec.kernels import builds_with
from verispec.models.transformer import ROW_EXACT_MAX_T

EMA = 0.2                 # weight of a new measurement (costs; acceptance once past its prior)
RATIO_EMA = 0.1           # weight of a new measurement of a pass width's cost relative to a 1-token pass
PRIOR_WEIGHT = 2.0        # a sequence's acceptance prior counts as this many observations (see update)
PRIOR_SLOPE = 0.35        # unmeasured c_p(n) ≈ c_p(m) + slope · c_p(1) · (n − m)
# Acceptance before anything is measured, by source; prompt lookup by match length (ngram.py): the
# first-token rates measured on the bundled suite, greedy — 0.21 / 0.50 / 0.70 after 1 / 2 / 3+ tokens.
# Longer matches (copied text) start higher; each bucket then learns its own rate.
PRIOR_RATE = {"draft": 0.7, "ngram": 0.5, "head": 0.5}
LOOKUP_PRIOR_RATE = {"1": 0.2, "2": 0.5, "3": 0.7, "4-7": 0.75, "8-15": 0.8, "16+": 0.85}   # "ngram:<bucket>"
K_MAX = ROW_EXACT_MAX_T - 1   # the widest lookahead: a verify pass must stay row-exact (a long copied match)
# Inside an established copy (lookup matches of 8+ tokens) a draft is right or wrong wherever it
# stands in the round: an edit ahead breaks the copy at one place. Those sources keep one rate for
# every position, from all drafts verified (AcceptanceEstimate.pooled). Per position, one miss at
# position 3 of a 24-token round held K at 3 for the rest of an 800-token answer: K = 3 rounds never
# verify position 3 again, so its estimate could not recover (a rename in a copied file: 95 rounds
# per position, 64 pooled, alternated in one process).
POOLED_SOURCES = ("ngram:8-15", "ngram:16+")
POOLED_PRIOR = 4.0        # a pooled estimate's prior counts as this many verified drafts
PROBE_EVERY = 16          # after this many K = 0 rounds, try K = 1 once to refresh the estimate …
PROBE_MAX = 256           # … doubling the wait after each probe that did not revive speculation
SHARED_EMA = 0.05         # weight of one sequence's round in the shared (cross-sequence) prior
SHARE_PRIOR = (1, 2)      # a source's share of a sequence's rounds starts as 1 won of 2 (choose_for)
CATCHUP_PRIOR = 0.2       # unmeasured catch-up cost per token, as a fraction of the proposer's c_q
CATCHUP_MIN = 16          # catch-ups of fewer tokens measure a pass's fixed cost, not the cost per token
WARM = 3                  # a calibrated bucket's first passes: the level keeps the fastest (CostModel)
SPIKE = 4.0               # one proposer timing counts as at most this many times the current estimate


@dataclass(frozen=True)
class StaticCosts:
    """Fixed costs, in units of c_p(1), for seeded sampled requests: their K schedule — and with it
    the sample a seed produces — must not depend on timings. One profile per kind of CPU kernel
    (static_costs), so a seed gives the same text on every machine of a kind.

    ratios: (width, c_p(width) / c_p(1)) in increasing width, interpolated linearly and extended
    beyond the last with the last segment's slope; c_q, catchup: per proposer (source before any
    ':'), per drafted token and per token caught up on."""

    ratios: tuple[tuple[int, float], ...]
    c_q: dict[str, float]
    catchup: dict[str, float]

    @cached_property
    def _curve(self) -> tuple[float, ...]:
        """_ratio_at by width up to the widest pass K may ask for (choose_k prices them all)."""
        return tuple(self._ratio_at(n) for n in range(K_MAX + 2))

    def c_p(self, n: int) -> float:
        return self._curve[n] if 1 <= n <= K_MAX + 1 else self._ratio_at(n)

    def _ratio_at(self, n: int) -> float:
        points = ((1, 1.0),) + self.ratios
        for (w0, r0), (w1, r1) in zip(points, points[1:]):
            if n <= w1:
                return r0 + (r1 - r0) * (n - w0) / (w1 - w0)
        (w0, r0), (w1, r1) = points[-2], points[-1]
        return r1 + (r1 - r0) * (n - w1) / (w1 - w0)


# AVX2 (and torch's own kernels): a pass is memory-bound to 2 rows only (the Zen 2's calibration of
# the int4 1.5B, rounded up: 1.02 / 1.30 / 1.68 / 2.01 / 2.18 / 3.11 / 4.26 / 6.15 / 11.9 / 22.6 at
# 2 … 65 rows), a draft step (int4-all, 32k-token head) 0.24–0.25 of a pass, the heads' 0.07.
STATIC_AVX2 = StaticCosts(((2, 1.05), (3, 1.35), (4, 1.7), (5, 2.05), (6, 2.3), (8, 3.15), (12, 4.3), (17, 6.2),
                           (33, 12.0), (65, 22.6)), {"draft": 0.27, "head": 0.08}, {"draft": 0.1})
# AVX2 with AVX-VNNI (Intel cores since Alder Lake without AVX-512): vpdpbusd on 256-bit vectors keeps a
# pass memory-bound to 3 rows (a Golden Cove Xeon's avxvnni build, rounded up: 1.04 / 1.05 / 1.26 / 1.44 /
# 1.59 / 2.08 / 2.90 / 3.88 / 7.17 / 14.8 at 2 … 65 rows); a draft step as on AVX2.
STATIC_AVXVNNI = StaticCosts(((2, 1.05), (3, 1.12), (4, 1.3), (5, 1.5), (6, 1.7), (8, 2.1), (12, 2.95), (17, 3.95),
                              (33, 7.3), (65, 15.0)), {"draft": 0.27, "head": 0.08}, {"draft": 0.1})
# AVX-512 VNNI: a pass stays memory-bound to ~5 rows (the Zen 4's calibration of the int4 1.5B,
# rounded up: 0.95 / 0.95 / 1.00 / 1.09 / 1.16 / 1.61 / 2.21 / 3.08 / 6.16 / 12.2 at 2 … 65 rows),
# a draft step (int4-all, 32k-token head) 0.22–0.26 of a pass.
STATIC_AVX512 = StaticCosts(((2, 1.0), (4, 1.05), (5, 1.12), (6, 1.2), (8, 1.65), (12, 2.3), (17, 3.2),
                             (33, 6.3), (65, 12.5)), {"draft": 0.28, "head": 0.05}, {"draft": 0.1})


def static_costs(kernel_variant: str | None) -> StaticCosts:
    """The fixed profile for the native kernel variant in use (kernels.active_variant())."""
    if builds_with(kernel_variant, "avx512f"):
        return STATIC_AVX512
    return STATIC_AVXVNNI if builds_with(kernel_variant, "avxvnni") else STATIC_AVX2


# Speculate only when the model predicts more tokens per second than plain decoding by at least
# MARGIN of the share of the round's cost that speculation adds (clears_margin). Below it the
# estimates' own error decides (acceptance learned from a few rounds, costs that move ±5 % on a
# shared machine), and what such an error can lose is that added share: nothing where a wider pass
# costs no more than a plain one (AVX-512, up to ~4 rows), ~8 % of a round where each row costs half
# a pass (a Zen/Zen+), 4 % at c_p(2) = 1.2 c_p(1). A fixed 5 % of the value instead kept K = 0 where
# rows were free once a short match's estimate fell below 5 %: replayed on 82 recorded answers
# with AVX-512 costs, 3.6 % of the speedup (bench/replay.py, docs/PERFORMANCE_LOG.md).
MARGIN = 0.25


def clears_margin(value: float, plain: float, c_1: float, cost: float) -> bool:
    """value (tokens per second of a round costing `cost`) beats plain decoding's rate `plain` (a
    1-token pass costing c_1) by MARGIN of the share of the round's cost above a plain pass."""
    return value > plain * (1 + MARGIN * max(0.0, 1 - c_1 / cost))


def prior_rate(source: str) -> float:
    """A match-length source ('ngram:2', 'ngram:8-15') from LOOKUP_PRIOR_RATE, any other from
    PRIOR_RATE (else 0.5)."""
    name, _, bucket = source.partition(":")
    if bucket in LOOKUP_PRIOR_RATE:
        return LOOKUP_PRIOR_RATE[bucket]
    return PRIOR_RATE.get(name, 0.5)


def _best(values: list[float]) -> int:
    """Index of the largest value; ties go to the first."""
    return max(range(len(values)), key=lambda i: (values[i], -i))


def expected_tokens(rates: list[float], k: int) -> float:
    """E(K) = 1 + Σ_{j=1..K} Π_{i<j} rates[i]."""
    return cumulative_expected(rates, k)[k]


def cumulative_expected(rates: list[float], k_max: int) -> list[float]:
    """[E(0), E(1), …, E(k_max)] in one pass (k_max ≤ len(rates))."""
    out, e, prod = [1.0], 1.0, 1.0
    for i in range(k_max):
        prod *= rates[i]
        e += prod
        out.append(e)
    return out


def choose_k(rates: list[float], c_p, c_q: float, k_max: int) -> int:
    """argmax over K ∈ 0 … k_max of E(K) / (K·c_q + c_p(K+1)); ties go to the smaller K, and K > 0
    must beat plain decoding (K = 0) by its margin (clears_margin)."""
    c_1 = c_p(1)
    plain = 1.0 / c_1
    best_k, best = 0, plain
    top = min(k_max, len(rates))
    for k, e in enumerate(cumulative_expected(rates, top)[1:], start=1):
        cost = k * c_q + c_p(k + 1)
        value = e / cost
        if value > best * (1 + 1e-9) and clears_margin(value, plain, c_1, cost):
            best_k, best = k, value
    return best_k


def saving(rates: list[float], k: int, c_p, c_q: float, remaining: int) -> float:
    """Seconds that K-token speculation is expected to save over `remaining` tokens vs plain decoding."""
    return remaining * (c_p(1) - (k * c_q + c_p(k + 1)) / expected_tokens(rates, k))


def batch_bucket(batch: int) -> int:
    """Costs are kept per power-of-two batch size (1, 2, 4, 8, …): a wide batch turns compute-bound
    sooner, so c_p(n)/c_p(1) grows with it and K should shrink."""
    return 1 << max(0, batch - 1).bit_length()


def _running(old: float, new: float, n: int, prior_weight: float = 1.0) -> float:
    """The n-th measurement folded into an estimate whose prior counts as prior_weight measurements:
    a running mean of prior and measurements while 1 / (prior_weight + n) > EMA, an exponential
    moving average after. For costs the prior counts as one: a first measurement that carries
    one-off costs (a model's first call in a process) moves the estimate half-way instead of all
    the way — and does not stop the proposer being tried again."""
    weight = max(EMA, 1.0 / (prior_weight + n))
    return old + weight * (new - old)


@dataclass
class CostModel:
    """Seconds per target pass by (batch bucket, width), and per drafted token by proposer source.

    A pass costs level × ratio(width). The level — what a 1-token pass costs now — follows every
    pass whatever its width (an EMA of seconds / ratio), so widths are never compared at different
    moments of a shared machine. (With one EMA per width, c_p(1) stayed at whatever the machine's
    speed was in the last K = 0 round for as long as a sequence speculated; a slow spell then made
    speculation look better than it was, or the reverse.)

    Where this machine's ratios c_p(n) / c_p(1) were calibrated (`seed`, engine/calibrate.py: widths
    timed round-robin in one loop), they stay fixed and passes move the level only. Learned from the
    passes of a run, they cannot be told apart from the level: level × ratio is all a pass shows,
    and where almost every round speculates (a draft model on new text: 4 one-token passes in 320)
    nothing pins the split, so both drifted — measured: the ratios of 2–6-token passes wandered to
    1.3–2.1 while the level fell from 50 to 28 ms against 1-token passes of 36 ms, so plain decoding
    looked cheap and `auto` stopped speculating for whole answers. Without a calibration (a model
    built in memory) a width's ratio is learned slowly (RATIO_EMA) from its passes over the level
    at the time."""

    level: dict[int, float] = field(default_factory=dict)               # bucket -> c_p(1) now
    ratio: dict[tuple[int, int], float] = field(default_factory=dict)   # (bucket, width ≥ 2) -> c_p(width) / c_p(1)
    propose: dict[str, float] = field(default_factory=dict)             # source -> seconds per drafted token
    propose_ratio: dict[str, float] = field(default_factory=dict)       # source -> calibrated prior, × c_p(1)
    catchup: dict[str, float] = field(default_factory=dict)             # source -> seconds per token ingested
    counts: dict[tuple[str, str], int] = field(default_factory=dict)    # (table, source) -> measurements so far
    last_width: dict[int, int] = field(default_factory=dict)            # bucket -> width of its latest pass
    calibrated: set[int] = field(default_factory=set)                   # buckets whose ratios stay as seeded
    # bucket -> [1.0 (width 0, unused), 1.0, ratio(2), ratio(3), …]: _ratio's values by width, filled
    # on demand and dropped whenever a ratio of the bucket changes. Choosing K prices every width up
    # to K_MAX + 1 several times a round; derived afresh each time that cost ~0.5 ms of Python per choice.
    curves: dict[int, list[float]] = field(default_factory=dict, repr=False)

    def record_verify(self, width: int, seconds: float, batch: int = 1) -> None:
        bucket = batch_bucket(batch)
        level = self.level.get(bucket)
        if level is None:                                 # first pass in this bucket: sets the level
            self.level[bucket], self.last_width[bucket] = seconds / self._ratio(bucket, width), width
            return
        if bucket in self.calibrated:
            key = ("verify", str(bucket))                 # passes so far, the one that set the level first
            n = self.counts[key] = self.counts.get(key, 1) + 1
            level_now = seconds / self._ratio(bucket, width)
            # A process's first passes carry one-off costs (measured: 129 ms, then 47–51, for the
            # 1.5B on a Xeon): with EMA alone the level kept their trace for some twenty passes.
            self.level[bucket] = min(level, level_now) if n <= WARM else (1 - EMA) * level + EMA * level_now
            return
        if width > 1 and (bucket, width) not in self.ratio:
            self._set_ratio(bucket, width, seconds / level)     # a width's first pass: its ratio
            self.last_width[bucket] = width
            return
        ratio = self._ratio(bucket, width)
        self.level[bucket] = (1 - EMA) * level + EMA * seconds / ratio
        # A run of one width cannot tell a slower machine from a dearer width: it moves the level
        # only. A ratio learns from a pass right after one of another width (the level then reflects
        # the same moment of the machine).
        if width > 1 and self.last_width.get(bucket) != width:
            self._set_ratio(bucket, width, (1 - RATIO_EMA) * ratio + RATIO_EMA * seconds / level)
        self.last_width[bucket] = width

    def record_propose(self, source: str, tokens: int, seconds: float) -> None:
        self._record_per_token("propose", self.propose, source, tokens, seconds, self.c_q(source))

    def record_catchup(self, source: str, tokens: int, seconds: float) -> None:
        """A catch-up of CATCHUP_MIN tokens or more: its pass's fixed cost (a proposal step's worth)
        spread over a few tokens overstated the rate that prices backlogs of hundreds — measured, a
        warm-up's 5-token catch-up priced the 0.5B's at 5 ms a token where 140 tokens took 2.6."""
        if tokens >= CATCHUP_MIN:
            self._record_per_token("catchup", self.catchup, source, tokens, seconds, self.c_catchup(source))

    def _record_per_token(self, name: str, table: dict[str, float], source: str, tokens: int,
                          seconds: float, prior: float) -> None:
        if tokens <= 0:
            return
        n = self.counts[(name, source)] = self.counts.get((name, source), 0) + 1
        per_token = seconds / tokens
        if prior > 0:           # a one-off stall (first call, page-in) must not price a source out for
            per_token = min(per_token, SPIKE * prior)   # good; a really dearer one climbs in a few rounds
        table[source] = _running(table.get(source, prior), per_token, n)

    def c_catchup(self, source: str) -> float:
        return self.catchup.get(source, CATCHUP_PRIOR * self.c_q(source))

    def seed(self, ratios: dict[int, float], batch: int = 1) -> None:
        """Price passes with calibrated ratios c_p(n) / c_p(1) (engine/calibrate.py), interpolated
        between the widths measured; passes then move only the level."""
        bucket = batch_bucket(batch)
        for n, r in ratios.items():
            if n > 1:
                self._set_ratio(bucket, n, r)
        if any(n > 1 for n in ratios):
            self.calibrated.add(bucket)

    def _set_ratio(self, bucket: int, width: int, ratio: float) -> None:
        self.ratio[(bucket, width)] = ratio
        self.curves.pop(bucket, None)

    def _ratio(self, bucket: int, n: int) -> float:
        """c_p(n) / c_p(1) (_ratio_at), from the bucket's curve."""
        if n < 2:
            return 1.0 if n == 1 else self._ratio_at(bucket, n)
        curve = self.curves.get(bucket)
        if curve is None:
            curve = self.curves[bucket] = [1.0, 1.0]       # by width (0 unused)
        while len(curve) <= n:
            curve.append(self._ratio_at(bucket, len(curve)))
        return curve[n]

    def _ratio_at(self, bucket: int, n: int) -> float:
        """c_p(n) / c_p(1) for n ≠ 1: measured; linear between the nearest measured widths around n;
        beyond the widest, extended from it with a prior slope (optimistic enough that an unmeasured
        width gets tried once). Widths below n are read from the curve, which holds them by now."""
        if (bucket, n) in self.ratio:
            return self.ratio[(bucket, n)]
        widths = [w for b, w in self.ratio if b == bucket]
        lo = max((w for w in widths if w < n), default=1)
        hi = min((w for w in widths if w > n), default=None)
        if hi is not None:
            r_lo, r_hi = self._ratio(bucket, lo), self.ratio[(bucket, hi)]
            return r_lo + (r_hi - r_lo) * (n - lo) / (hi - lo)
        slope = min(1.0, PRIOR_SLOPE * bucket)          # wider batches turn compute-bound sooner
        return self._ratio(bucket, lo) + slope * (n - lo)

    def c_p(self, n: int, batch: int = 1) -> float:
        bucket = batch_bucket(batch)
        return self.level.get(bucket, 1.0) * self._ratio(bucket, n)   # unit-less before any measurement

    def pricer(self, batch: int = 1):
        """c_p(·, batch) for one decision, the same values: the level read once and widths up to
        K_MAX + 1 from the curve (choosing K prices all of them)."""
        bucket = batch_bucket(batch)
        level = self.level.get(bucket, 1.0)
        self._ratio(bucket, K_MAX + 1)                  # the curve now covers every width K may ask for
        curve = self.curves[bucket]
        return lambda n: level * curve[n] if 1 <= n < len(curve) else level * self._ratio(bucket, n)

    def seed_propose(self, source: str, ratio: float) -> None:
        """A calibrated proposal cost, as a fraction of c_p(1) (engine/calibrate.py): the prior until
        the source's own steps are measured (without one, a draft model starts as free)."""
        self.propose_ratio[source] = ratio

    def c_q(self, source: str) -> float:
        if source in self.propose:
            return self.propose[source]
        return self.propose_ratio.get(source, 0.0) * self.c_p(1)


@dataclass
class AcceptanceEstimate:
    """Running per-position acceptance rates of one sequence for one proposer source (for
    POOLED_SOURCES one rate, the same at every position)."""

    rates: list[float]
    seen: list[int] = field(default_factory=list)      # observations per position so far
    zero_rounds: int = 0
    reached: int = 0          # deepest position ever verified + 1
    probe_every: int = PROBE_EVERY
    probing: bool = False     # the last K > 0 was a probe
    regime: str = "greedy"    # greedy | sampled: which shared prior this sequence feeds
    cap: int | None = None    # the source drafts at most this many tokens: later positions stay 0
    fresh: bool = True        # no round chosen for this sequence and source yet
    pooled: bool = False      # one rate for every position: accepted / verified drafts, per round EMA
    hits: float = 0.0         # pooled: decayed counts of accepted and of verified drafts
    verified: float = 0.0

    def __post_init__(self):
        self.seen = self.seen or [0] * len(self.rates)
        if self.pooled:
            self.rates = [self.rates[0]] * len(self.rates)
            self.hits, self.verified = self.rates[0] * POOLED_PRIOR, POOLED_PRIOR
        self._apply_cap()

    def _apply_cap(self) -> None:
        if self.cap is not None:
            self.rates[self.cap:] = [0.0] * len(self.rates[self.cap:])

    @classmethod
    def prior(cls, source: str, k_max: int, shared: list[float] | None = None,
              regime: str = "greedy", cap: int | None = None, rate: float | None = None) -> "AcceptanceEstimate":
        """rate: the fixed prior (default prior_rate(source))."""
        rate = prior_rate(source) if rate is None else rate
        return cls(list(shared) if shared else [rate] * k_max, regime=regime, cap=cap,
                   pooled=source in POOLED_SOURCES)

    def update(self, proposed: int, accepted: int) -> None:
        """Positions 0 … min(accepted, proposed−1) were reached; those < accepted were accepted.

        The prior counts as PRIOR_WEIGHT observations: the n-th observation of a position weighs
        1 / (PRIOR_WEIGHT + n) — the running mean of prior and outcomes — until that falls to EMA,
        which then keeps the estimate moving. A sequence thus leaves a wrong prior after one or two
        rounds instead of four or five (each a verify pass wider than plain decoding's).
        Positions never reached yet follow the deepest observed one, so a proposer that is always
        accepted at K gets to try K+1 instead of being held back by the prior.

        Pooled: accepted and verified drafts are counted over rounds (each round's counts decayed by
        1 − EMA, the prior counting as POOLED_PRIOR drafts), and every position's rate is their
        ratio: a miss anywhere lowers all positions a little, and every hit counts for all."""
        depth = min(accepted + 1, proposed)
        self.reached = max(self.reached, depth)
        if self.pooled:                      # a round's drafts, as one batch of evidence (EMA per round)
            self.hits = (1 - EMA) * self.hits + accepted
            self.verified = (1 - EMA) * self.verified + depth
            self.rates = [self.hits / self.verified] * len(self.rates)
            self._apply_cap()
            return
        for i in range(depth):
            hit = 1.0 if i < accepted else 0.0
            self.seen[i] += 1
            self.rates[i] = _running(self.rates[i], hit, self.seen[i], PRIOR_WEIGHT)
        for i in range(self.reached, len(self.rates)):
            self.rates[i] = self.rates[self.reached - 1]
        self._apply_cap()

    def track(self, k: int, may_probe: bool = True, probe_now: bool = False) -> int:
        """Record the chosen K; after probe_every rounds of K = 0 (or at once when probe_now) return 1
        instead (a probe, when may_probe), doubling the wait after each probe that did not revive
        speculation."""
        self.fresh = False
        if k > 0:
            self.probe_every, self.probing = PROBE_EVERY, False
            return k
        if probe_now and may_probe:          # a first try: a miss does not lengthen the wait for probes
            return 1
        if self.probing:                     # the probe did not make speculation pay: wait longer
            self.probe_every, self.probing = min(2 * self.probe_every, PROBE_MAX), False
        self.zero_rounds += 1
        if self.zero_rounds >= self.probe_every and may_probe:
            self.zero_rounds, self.probing = 0, True
            return 1
        return 0


class KPolicy:
    """K per sequence per round: fixed, or `auto` from costs and acceptance."""

    def __init__(self, k: int | str, k_max: int = K_MAX, static: StaticCosts = STATIC_AVX2):
        """static: the fixed costs seeded sampled requests are priced with (static_costs)."""
        self.static = static
        self.auto = k == "auto"
        self.k_fixed = 0 if self.auto else int(k)
        self.k_max = k_max if self.auto else int(k)
        self.costs = CostModel()
        self.estimates: dict[tuple[int, str], AcceptanceEstimate] = {}
        # Per (source, regime): acceptance rates by position pooled over past sequences; a new
        # sequence starts from them rather than from a fixed guess (short requests learn little).
        self.shared: dict[tuple[str, str], list[float]] = {}
        self.source_k_max: dict[str, int] = {}
        self.prior_rates: dict[str, float] = {}   # source -> fixed prior that replaces prior_rate(source)
        self.lengths = AnswerLengths()           # finished answers: what a catch-up is amortised over
        # slot -> source name -> rounds in which it was valued most or was the only source
        self.wins: dict[int, dict[str, int]] = {}

    def limit(self, source: str, k_max: int) -> None:
        """This source never drafts more than k_max tokens (Medusa heads: one per head): positions past
        it count as never accepted, so `auto` never pays for drafts that cannot come."""
        self.source_k_max[source] = k_max

    def set_prior(self, source: str, rate: float) -> None:
        """This source's acceptance before anything is measured (a heads file's held-out figure)."""
        if not 0.0 <= rate <= 1.0:
            raise ValueError(f"an acceptance rate is in [0, 1], got {rate!r}")
        self.prior_rates[source] = rate

    def _prior_rate(self, source: str) -> float:
        return self.prior_rates.get(source, prior_rate(source))

    def _costs(self, source: str, batch: int, reproducible: bool):
        """(c_p(n), c_q, catch-up seconds per token) for pricing a round: measured, or for seeded
        sampled requests the fixed STATIC ones."""
        if reproducible:
            name = source.split(":")[0]
            return self.static.c_p, self.static.c_q.get(name, 0.0), self.static.catchup.get(name, 0.0)
        return self.costs.pricer(batch), self.costs.c_q(source), self.costs.c_catchup(source)

    def _best_k(self, rates: list[float], c_p, c_q: float, per_token: float, cap: int, backlog: int,
                horizon: float) -> int:
        """The K that maximises expected tokens per second (≤ cap); 0 where a catch-up of `backlog`
        tokens would cost more than speculating saves over `horizon` tokens."""
        k = min(choose_k(rates, c_p, c_q, self.k_max), cap)
        if k > 0 and backlog and saving(rates, k, c_p, c_q, horizon) <= backlog * per_token:
            return 0
        return k

    def value(self, seq, source: str, backlog: int = 0, batch: int = 1, share: float = 1.0) -> float:
        """Expected tokens per second of seq's next round drafted by `source` at its best K —
        plain decoding's rate where no K pays; a catch-up of `backlog` tokens must be repaid by the
        `share` of the answer's expected remainder this source is expected to draft. Reads the
        estimates without moving them."""
        p = seq.params
        c_p, c_q, per_token = self._costs(source, batch, p.reproducible)
        if source == "none":
            return 1.0 / c_p(1)
        remaining = p.max_tokens - len(seq.generated)
        est = self._estimate(seq.slot, source, p.greedy, use_shared=not p.reproducible)
        k = self._best_k(est.rates, c_p, c_q, per_token, max(0, remaining - 1), backlog,
                         share * self._horizon(seq, backlog))
        return expected_tokens(est.rates, k) / (k * c_q + c_p(k + 1))

    def choose_for(self, proposer, seqs: list, batch: int | None = None) -> list[int]:
        """K for each of seqs' next round with this proposer. Where it offers several sources
        (Proposer.options: a hybrid's lookup match and its fallback), `auto` keeps the one whose
        best K promises the most tokens per second (ties: the proposer's own choice) and tells the
        proposer (Proposer.prefer); then choose_round. The choice reads only the sequence's past
        rounds and the costs (seeded requests: the fixed ones), never the drafts it leads to, so
        acceptance stays exact.

        A source that must first catch up (a draft model behind the text) repays that only over the
        rounds it will draft: its share of the sequence's rounds so far — rounds where it was valued
        most, catch-ups aside, or was the only source — counts (SHARE_PRIOR). Answering with a copy
        of a long input, lookup wins nearly every round, so the draft is not fed the input for the
        few rounds where a match breaks off."""
        batch = batch or len(seqs)
        if self.auto:
            for s in seqs:
                options = proposer.options(s)
                if len(options) == 1:
                    self._count_win(s.slot, options[0][0])
                    continue
                values = [self.value(s, src, 0, batch) for src, _ in options]    # catch-ups aside
                self._count_win(s.slot, options[_best(values)][0])
                if any(bl for _, bl in options):
                    values = [self.value(s, src, bl, batch, self._share(s.slot, src)) if bl else v
                              for (src, bl), v in zip(options, values)]
                proposer.prefer(s, options[_best(values)][0])
        return self.choose_round(seqs, [proposer.source_for(s) for s in seqs], batch,
                                 [proposer.backlog(s) for s in seqs])

    def _count_win(self, slot: int, source: str) -> None:
        wins = self.wins.setdefault(slot, {})
        name = source.split(":")[0]
        wins[name] = wins.get(name, 0) + 1

    def _share(self, slot: int, source: str) -> float:
        """The share of this sequence's rounds that source drafted or was valued most in."""
        wins = self.wins.get(slot, {})
        won, (prior_won, prior_rounds) = wins.get(source.split(":")[0], 0), SHARE_PRIOR
        return (won + prior_won) / (sum(wins.values()) + prior_rounds)

    def _horizon(self, seq, backlog: int) -> float:
        """What a catch-up is amortised over: the answer's expected remainder where one is due."""
        remaining = seq.params.max_tokens - len(seq.generated)
        if not backlog:
            return float(remaining)
        return self.lengths.expected_remaining(len(seq.generated), seq.params.max_tokens,
                                               learned=not seq.params.reproducible)

    def choose(self, slot: int, source: str, remaining: int, batch: int = 1, reproducible: bool = False,
               greedy: bool = True, backlog: int = 0, horizon: float | None = None) -> int:
        """K for this sequence's next round in a round of `batch` sequences; never more drafts than
        tokens left to generate − 1. backlog: tokens the proposer must first catch up on (see the
        module docstring); K stays 0 while that would cost more than speculating saves over the
        `horizon` tokens the answer is expected to add (default: all `remaining` up to its cap).

        reproducible: use fixed STATIC costs and the fixed prior instead of measured costs and the
        shared prior, so the K schedule depends only on the sequence's own acceptance history
        (seeded sampling: the same seed gives the same text whatever the machine's timings, the
        batch around it, or the requests before it)."""
        cap = max(0, remaining - 1)
        horizon = remaining if horizon is None else horizon
        if not self.auto:
            return min(self.k_fixed, cap)
        if source == "none":
            return 0
        est = self._estimate(slot, source, greedy, use_shared=not reproducible)
        c_p, c_q, per_token = self._costs(source, batch, reproducible)
        catchup = backlog * per_token
        k = self._best_k(est.rates, c_p, c_q, per_token, self.k_max, backlog, horizon)
        # A probe that needs a catch-up must pay off at the prior acceptance rate.
        prior = [self._prior_rate(source)]
        may_probe = not backlog or saving(prior, 1, c_p, c_q, horizon) > catchup
        # A sequence's first round tries the source once when the fixed prior says drafting pays,
        # even if the shared prior says it does not: that one pools other sequences, perhaps other
        # kinds of text (prose before code), and the sequence's own rate is learned from one round.
        # Only a source with nothing to catch up on: a draft model's try would first prefill the
        # whole prompt into it (measured: the draft on chat fell from 0.88x to 0.63x accounted).
        first = est.fresh and not backlog and choose_k(prior, c_p, c_q, 1) > 0
        return min(est.track(k, may_probe, probe_now=first), cap)

    def _estimate(self, slot: int, source: str, greedy: bool = True, use_shared: bool = True) -> AcceptanceEstimate:
        """This sequence's estimate for source, started from the shared prior of its regime (or the
        fixed prior) the first time."""
        est = self.estimates.get((slot, source))
        if est is None:
            regime = "greedy" if greedy else "sampled"
            shared = self.shared.get((source, regime)) if use_shared else None
            est = self.estimates[(slot, source)] = AcceptanceEstimate.prior(
                source, self.k_max, shared, regime, self.source_k_max.get(source.split(":")[0]),
                self._prior_rate(source))
        return est

    def rates(self, slot: int, source: str, greedy: bool = True) -> list[float]:
        """This sequence's per-position acceptance estimates for source."""
        return self._estimate(slot, source, greedy).rates

    def choose_round(self, seqs: list, sources: list[str], batch: int | None = None,
                     backlogs: list[int] | None = None) -> list[int]:
        """K for every sequence of one batched round.

        A batched verify pass is as wide as its widest row (shorter rows are padded), so one
        sequence's K costs the whole batch. Alone, a sequence chooses its own K (choose); in a
        batch, one K is chosen for all as argmax Σ_b E_b(K) / (K·c_q + c_p(K+1, B)) — K = 0 as soon
        as the batch is wide enough that speculation stops paying. Seeded sampled sequences keep
        their own timing-free schedule (see choose). backlogs: per sequence, the proposer's catch-up
        (Proposer.backlog); speculation must save more than the batch's catch-ups cost."""
        batch = batch or len(seqs)
        backlogs = backlogs or [0] * len(seqs)
        remaining = [s.params.max_tokens - len(s.generated) for s in seqs]
        # A catch-up is repaid only over the share of the rounds its source drafts (choose_for), also
        # where it is the only source this round: a hybrid whose lookup copies the answer caught its
        # draft up on a 1,276-token prompt (2.2 s) at the one place a match broke off.
        horizons = [self._horizon(s, bl) * (self._share(s.slot, src) if bl and self.auto else 1.0)
                    for s, src, bl in zip(seqs, sources, backlogs)]
        if len(seqs) == 1 or not self.auto:
            return [self.choose(s.slot, src, r, batch, s.params.reproducible, s.params.greedy, bl, h)
                    for s, src, r, bl, h in zip(seqs, sources, remaining, backlogs, horizons)]
        joint = [i for i, s in enumerate(seqs) if not s.params.reproducible and sources[i] != "none"]
        ks = [self.choose(s.slot, src, r, batch, True, s.params.greedy, bl, h) if i not in joint else 0
              for i, (s, src, r, bl, h) in enumerate(zip(seqs, sources, remaining, backlogs, horizons))]
        if not joint:
            return ks
        ests = [self._estimate(seqs[i].slot, sources[i], seqs[i].params.greedy) for i in joint]
        c_q = max(self.costs.c_q(sources[i]) for i in joint)
        c_p = self.costs.pricer(batch)
        c_1 = c_p(1)
        best_k, best = 0, len(joint) / c_1
        caps = [min(self.k_max, max(0, remaining[i] - 1)) for i in joint]
        tables = [cumulative_expected(e.rates, cap) for e, cap in zip(ests, caps)]    # E(0 … cap) per sequence
        for k in range(1, self.k_max + 1):
            cost = k * c_q + c_p(k + 1)
            value = sum(t[min(k, cap)] for t, cap in zip(tables, caps)) / cost
            if value > best * (1 + 1e-9) and clears_margin(value, len(joint) / c_1, c_1, cost):
                best_k, best = k, value
        catchup = sum(backlogs[i] * self.costs.c_catchup(sources[i]) for i in joint)
        if best_k and catchup:
            # Tokens per second with speculation (best) vs without (plain), over all tokens still to come.
            plain = len(joint) / c_p(1)
            if sum(horizons[i] for i in joint) * (1 / plain - 1 / best) <= catchup:
                best_k = 0
        best_k = ests[0].track(best_k)          # the batch's probing state rides on its first sequence
        for i in joint:
            ks[i] = min(best_k, max(0, remaining[i] - 1))
        return ks

    def observe(self, slot: int, source: str, proposed: int, accepted: int) -> None:
        if not (self.auto and proposed > 0):
            return
        est = self._estimate(slot, source, use_shared=False)
        est.update(proposed, accepted)
        shared = self.shared.setdefault((source, est.regime), [self._prior_rate(source)] * self.k_max)
        if est.pooled:
            shared[:] = [(1 - SHARED_EMA) * shared[0] + SHARED_EMA * accepted / min(accepted + 1, proposed)] * len(shared)
            return
        for i in range(min(accepted + 1, proposed)):
            shared[i] = (1 - SHARED_EMA) * shared[i] + SHARED_EMA * (1.0 if i < accepted else 0.0)

    def finished(self, generated: int, capped: bool) -> None:
        """An answer ended after `generated` tokens, by a stop or by its max_tokens (`capped`)."""
        self.lengths.record(generated, capped)

    def forget_slot(self, slot: int) -> None:
        for key in [key for key in self.estimates if key[0] == slot]:
            del self.estimates[key]
        self.wins.pop(slot, None)

    def forget(self) -> None:
        """Drop per-sequence estimates (a new batch); measured costs are kept."""
        self.estimates.clear()
        self.wins.clear()
