"""What a proposer's drafts are expected to achieve: running acceptance rates per position, per
sequence and proposer source (AcceptanceEstimate), from priors by source until measured."""

from __future__ import annotations

from dataclasses import dataclass, field

from verispec.engine.ema import EMA, running

PRIOR_WEIGHT = 2.0        # a sequence's acceptance prior counts as this many observations (see update)
# Acceptance before anything is measured, by source; prompt lookup by match length (ngram.py): the
# first-token rates measured on the bundled suite, greedy — 0.21 / 0.50 / 0.70 after 1 / 2 / 3+ tokens.
# Longer matches (copied text) start higher; each bucket then learns its own rate.
PRIOR_RATE = {"draft": 0.7, "ngram": 0.5, "head": 0.5}
LOOKUP_PRIOR_RATE = {"1": 0.2, "2": 0.5, "3": 0.7, "4-7": 0.75, "8-15": 0.8, "16+": 0.85}   # "ngram:<bucket>"
# Inside an established copy (lookup matches of 8+ tokens) a draft is right or wrong wherever it
# stands in the round: an edit ahead breaks the copy at one place. Those sources keep one rate for
# every position, from all drafts verified (AcceptanceEstimate.pooled). Per position, one miss at
# position 3 of a 24-token round held K at 3 for the rest of an 800-token answer: K = 3 rounds never
# verify position 3 again, so its estimate could not recover (a rename in a copied file: 95 rounds
# per position, 64 pooled, alternated in one process).
POOLED_SOURCES = ("ngram:8-15", "ngram:16+")
POOLED_PRIOR = 4.0        # a pooled estimate's prior counts as this many verified drafts
# A draft model's agreement with the target moves little along an answer: misses rarely come in runs
# (the 0.5B over the 1.5B's greedy answers to the bundled suite, 20 MT-Bench first turns and 20 HumanEval
# prompts agreed at 0.87 of tokens, 0.77 after a miss, 0.69 after two, 0.87 after three; runs of four
# were 5 in 5,414 tokens), so its per-position rates settle at a slower EMA than a lookup's, whose
# matches start and end abruptly. At EMA's 0.2, five misses in a row took the draft's first position
# from 0.94 to 0.31, below what a draft step costs, and K stayed 0 for ~30 tokens until a probe. The
# draft alone replayed on those answers (docs/measure_draft_agreement.py): 1.63 -> 1.70x with AVX-512
# costs, 1.36 -> 1.39x with AVX2's (docs/PERFORMANCE_LOG.md). The shipped EAGLE head ("head") keeps EMA:
# replayed on the same answers at 0.1 it gained 1–3 % overall but lost chat, 1.17 -> 1.00x with AVX-512 costs.
MODEL_SOURCES = ("draft",)
MODEL_EMA = 0.1
PROBE_EVERY = 16          # after this many K = 0 rounds, try K = 1 once to refresh the estimate …
PROBE_MAX = 256           # … doubling the wait after each probe that did not revive speculation


def prior_rate(source: str) -> float:
    """A match-length source ('ngram:2', 'ngram:8-15') from LOOKUP_PRIOR_RATE, any other from
    PRIOR_RATE (else 0.5)."""
    name, _, bucket = source.partition(":")
    if bucket in LOOKUP_PRIOR_RATE:
        return LOOKUP_PRIOR_RATE[bucket]
    return PRIOR_RATE.get(name, 0.5)


def source_ema(source: str) -> float:
    """The EMA weight a source's acceptance settles at: MODEL_EMA for a draft model, EMA else."""
    return MODEL_EMA if source.split(":")[0] in MODEL_SOURCES else EMA


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
    ema: float = EMA          # the weight a new outcome settles at (source_ema)

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
                   pooled=source in POOLED_SOURCES, ema=source_ema(source))

    def update(self, proposed: int, accepted: int) -> None:
        """Positions 0 … min(accepted, proposed−1) were reached; those < accepted were accepted.

        The prior counts as PRIOR_WEIGHT observations: the n-th observation of a position weighs
        1 / (PRIOR_WEIGHT + n) — the running mean of prior and outcomes — until that falls to its
        `ema` (source_ema), which then keeps the estimate moving. A sequence thus leaves a wrong
        prior after one or two rounds instead of four or five (each a verify pass wider than plain
        decoding's).
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
            self.rates[i] = running(self.rates[i], hit, self.seen[i], PRIOR_WEIGHT, self.ema)
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
