"""Choosing K per sequence and per round from measured costs and running acceptance estimates.

For a proposer whose drafts are accepted at position i (given positions < i were) with rate a_i,
K drafts emit on average E(K) = 1 + Σ_{j=1..K} Π_{i<j} a_i tokens per round (the +1 is the
recovered or bonus token). A round costs K·c_q + c_p(K+1): c_q the proposer's cost per drafted
token, c_p(n) one target pass over n tokens. We pick

    K* = argmax_{K ∈ 0 … K_max}  E(K) / (K·c_q + c_p(K+1)),

so K = 0 (plain decoding for that round) wins whenever speculation does not pay — or pays by less
than the estimates' own error could lose, a MARGIN of what the round adds to a plain pass's cost
(clears_margin). With a constant rate a this is the DESIGN formula E = (1 − a^{K+1}) / (1 − a).

Costs are measured on the fly (cost_model.py: c_p(n) as the machine's current level times a ratio
per width), acceptance rates per position, sequence and source from priors (acceptance_rates.py).

A proposer may first have to catch up — the draft model prefills a sequence's prompt (and any
tokens it skipped during K = 0 rounds) the first time it drafts for it. That one-off cost is paid
only when speculating over the tokens still to generate saves more than it costs:

    remaining · (c_p(1) − (K·c_q + c_p(K+1)) / E(K))  >  backlog · c_catchup

so a long prompt with a short answer is decoded plainly rather than prefilled twice. `remaining`
there is the answer's expected remainder (answer_lengths.py), not its cap: an open-ended answer's
cap is the rest of the context.
"""

from __future__ import annotations

from verispec.engine.acceptance_rates import AcceptanceEstimate, prior_rate
from verispec.engine.answer_lengths import AnswerLengths
from verispec.engine.cost_model import STATIC_AVX2, WIDEST, CostModel, StaticCosts

K_MAX = WIDEST - 1        # the widest lookahead: a verify pass must stay row-exact (a long copied match)
SHARED_EMA = 0.05         # weight of one sequence's round in the shared (cross-sequence) prior
SHARE_PRIOR = (1, 2)      # a source's share of a sequence's rounds starts as 1 won of 2 (choose_for)


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
