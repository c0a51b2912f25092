"""What a target pass and a proposal step cost, in seconds, as the K policy prices rounds with them.

c_p(n), one target pass over n new tokens, is the machine's current level (every pass moves it) times
a ratio per width: this machine's calibrated ratios (engine/calibrate.py), or without a calibration
ratios learned slowly from the passes, so that widths are compared at one moment of a shared machine;
widths not yet measured are extrapolated with a prior slope, optimistic enough to be tried once and
then known (CostModel). c_q, one proposal step per drafted token, and a proposer's catch-up cost per
token are running estimates per source. Seeded sampled requests are priced with fixed profiles per
kind of kernel instead (StaticCosts), so that a seed's text does not depend on timings.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

from verispec.engine.ema import EMA, running
from verispec.kernels import builds_with
from verispec.models.transformer import ROW_EXACT_MAX_T

WIDEST = ROW_EXACT_MAX_T  # the widest pass a round may ask for (K_MAX + 1 drafts and the bonus: row-exact)
RATIO_EMA = 0.1           # weight of a new measurement of a pass width's cost relative to a 1-token pass
PRIOR_SLOPE = 0.35        # unmeasured c_p(n) ≈ c_p(m) + slope · c_p(1) · (n − m)
CATCHUP_PRIOR = 0.2       # unmeasured catch-up cost per token, as a fraction of the proposer's c_q
CATCHUP_MIN = 16          # catch-ups of fewer tokens measure a pass's fixed cost, not the cost per token
WARM = 3                  # a calibrated bucket's first passes: the level keeps the fastest (CostModel)
SPIKE = 4.0               # one proposer timing counts as at most this many times the current estimate
RELAX = 0.02              # per target pass: how far an unmeasured calibrated source returns to its prior


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
        return tuple(self._ratio_at(n) for n in range(WIDEST + 1))

    def c_p(self, n: int) -> float:
        return self._curve[n] if 1 <= n <= WIDEST else self._ratio_at(n)

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


def batch_bucket(batch: int) -> int:
    """Costs are kept per power-of-two batch size (1, 2, 4, 8, …): a wide batch turns compute-bound
    sooner, so c_p(n)/c_p(1) grows with it and K should shrink."""
    return 1 << max(0, batch - 1).bit_length()


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
    passes: int = 0                                                     # target passes recorded so far
    measured_at: dict[tuple[str, str], int] = field(default_factory=dict)  # (table, source) -> passes then
    counts: dict[tuple[str, str], int] = field(default_factory=dict)    # (table, source) -> measurements so far
    last_width: dict[int, int] = field(default_factory=dict)            # bucket -> width of its latest pass
    calibrated: set[int] = field(default_factory=set)                   # buckets whose ratios stay as seeded
    # bucket -> [1.0 (width 0, unused), 1.0, ratio(2), ratio(3), …]: _ratio's values by width, filled
    # on demand and dropped whenever a ratio of the bucket changes. Choosing K prices every width up
    # to WIDEST several times a round; derived afresh each time that cost ~0.5 ms of Python per choice.
    curves: dict[int, list[float]] = field(default_factory=dict, repr=False)

    def record_verify(self, width: int, seconds: float, batch: int = 1) -> None:
        self.passes += 1
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
        table[source] = running(prior, per_token, n)     # prior: the estimate now (_relaxed)
        self.measured_at[(name, source)] = self.passes

    def c_catchup(self, source: str) -> float:
        prior = CATCHUP_PRIOR * self.c_q(source)
        return self._relaxed("catchup", source, self.catchup[source], prior) if source in self.catchup else prior

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
        WIDEST from the curve (choosing K prices all of them)."""
        bucket = batch_bucket(batch)
        level = self.level.get(bucket, 1.0)
        self._ratio(bucket, WIDEST)                  # the curve now covers every width K may ask for
        curve = self.curves[bucket]
        return lambda n: level * curve[n] if 1 <= n < len(curve) else level * self._ratio(bucket, n)

    def seed_propose(self, source: str, ratio: float) -> None:
        """A calibrated proposal cost, as a fraction of c_p(1) (engine/calibrate.py): the prior until
        the source's own steps are measured (without one, a draft model starts as free)."""
        self.propose_ratio[source] = ratio

    def c_q(self, source: str) -> float:
        prior = self.propose_ratio.get(source, 0.0) * self.c_p(1)
        return self._relaxed("propose", source, self.propose[source], prior) if source in self.propose else prior

    def _relaxed(self, name: str, source: str, estimate: float, prior: float) -> float:
        """A calibrated source's estimate, returned RELAX of the way to its calibrated prior for every
        target pass since its last measurement. A source is measured only in the rounds it drafts, so
        an estimate that one-off costs pushed too high would otherwise stand for the process's life:
        after the weights were read from disk, the 0.5B's first two draft steps averaged 28 ms a token
        against 10-13 later, and `auto` never drafted with it again (code edits at 0.6x of its usual
        speed). Uncalibrated sources keep their estimates (their prior is "free")."""
        if source not in self.propose_ratio:
            return estimate
        age = self.passes - self.measured_at.get((name, source), self.passes)
        return prior + (estimate - prior) * (1 - RELAX) ** age if age else estimate
