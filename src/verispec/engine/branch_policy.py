"""How many alternative branches a round verifies beside each primary draft (a token tree).

An alternative (Proposal.branches: another continuation lookup found) is scored on a fork of the
sequence's cache (engine/forks.py), so it adds a row of width ≤ K + 1 to the verify pass. It pays
only when what it adds — the tokens it is accepted for where the primary was not — outweighs that:

    m* = argmax_m  (E(K) + m·g) / (K·c_q + c_p(K+1, B + m)),   m = 0 … available

with E(K) the primary chain's expected tokens (the K policy's estimate), g the tokens one
alternative has added per round (learned per source, starting from PRIOR_GAIN, what the bundled
suite measured), and c_p(n, B) the pass cost over B rows of width n as the K policy
measures it (a row count not measured yet is priced as one sequence of B·n tokens). An
alternative must beat the chain by BRANCH_MARGIN, so a tree that does not pay is not
chosen (no probes: on a 2-core CPU each costs a wider pass and the suite's alternatives never paid).

`branches` = "auto" chooses so; an integer N verifies up to N alternatives whenever there are
any (0: chains only). Seeded sampled requests never branch under "auto": their schedule must not
depend on timings (engine/k_policy.py, reproducible).
"""

from __future__ import annotations

from verispec.engine.cost_model import batch_bucket
from verispec.engine.ema import EMA
from verispec.engine.k_policy import KPolicy, expected_tokens
from verispec.engine.sequence import Sequence
from verispec.proposers.base import Proposal

# Tokens one alternative adds per round before any round measured it: what lookup's alternatives
# added on the bundled suite (0.16 on summarisation, 0.18 on code; docs/PERFORMANCE_LOG.md).
PRIOR_GAIN = 0.15
BRANCH_MARGIN = 0.05      # what a tree must promise over its chain (tokens per second), as a fraction
PRIOR_WEIGHT = 2.0        # the prior counts as this many rounds
MAX_ALTERNATIVES = 4      # never more than this many alternatives per sequence


class BranchPolicy:
    def __init__(self, policy: KPolicy, branches: int | str = "auto"):
        if branches != "auto" and (not isinstance(branches, int) or not 0 <= branches <= MAX_ALTERNATIVES):
            raise ValueError(f"branches must be 'auto' or an integer in 0 … {MAX_ALTERNATIVES}, got {branches!r}")
        self.policy = policy
        self.auto = branches == "auto"
        self.fixed = 0 if self.auto else branches
        self.gain: dict[str, list[float]] = {}      # source -> [tokens gained per alternative, rounds seen]

    def choose(self, seqs: list[Sequence], proposal: Proposal) -> list[int]:
        """Alternatives to verify per row (≤ what the proposal offers)."""
        offered = [len(b) for b in proposal.branches] if proposal.branches else [0] * len(seqs)
        if not self.auto:
            return [min(self.fixed, n) for n in offered]
        keep, rows = [0] * len(seqs), len(seqs)
        sources = proposal.source or [""] * len(seqs)
        for b, s in enumerate(seqs):
            k = int(proposal.num_draft[b])
            if not offered[b] or not k or s.params.reproducible:
                continue
            m = self._best(s, sources[b], k, min(offered[b], MAX_ALTERNATIVES), rows)
            keep[b], rows = m, rows + m
        return keep

    def _best(self, s: Sequence, source: str, k: int, available: int, rows: int) -> int:
        costs = self.policy.costs
        e = expected_tokens(self.policy.rates(s.slot, source, s.params.greedy), k)
        g = self.gain.get(source, [PRIOR_GAIN, 0.0])[0]
        c_q = costs.c_q(source)

        def c_p(n: int, b: int) -> float:
            return costs.c_p(n, b) if batch_bucket(b) in costs.level else costs.c_p(n * b, 1)

        best_m, best = 0, e / (k * c_q + c_p(k + 1, rows)) * (1 + BRANCH_MARGIN)
        for m in range(1, available + 1):
            value = (e + m * g) / (k * c_q + c_p(k + 1, rows + m))
            if value > best * (1 + 1e-9):
                best_m, best = m, value
        return best_m

    def observe(self, sources: list[str], alternatives: list[int], gained: list[int]) -> None:
        """After a round: per sequence, alternatives verified and tokens gained over the primary."""
        for source, m, g in zip(sources, alternatives, gained):
            if not m:
                continue
            est = self.gain.setdefault(source, [PRIOR_GAIN, 0.0])
            est[1] += 1
            weight = max(EMA, 1.0 / (PRIOR_WEIGHT + est[1]))
            est[0] += weight * (g / m - est[0])
