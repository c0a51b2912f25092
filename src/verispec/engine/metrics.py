"""Speculation metrics, defined once (README "Metrics" explains them in words).

- acceptance_rate = accepted / proposed
- mean_accepted_length τ = emitted tokens / rounds (bonus or recovered token included)
- per_position_acceptance[i] = rounds whose draft i was accepted / rounds that proposed a draft i
- alpha = mean over verified positions of Σ_x min(p(x), q(x)); a position is verified when its
  prefix was the true one (every accepted draft plus the first rejected one). Greedy: p, q are
  point masses at their argmax, so the overlap is 1 when the argmaxes agree.
- predicted_tokens_per_round = (1 − α^{K+1}) / (1 − α)
- by_source: rounds, proposed and accepted drafts per full source label ('ngram:16+', 'head', …):
  for lookup, a histogram of match lengths with each bucket's acceptance
- branches: rounds that verified alternative candidates beside the primary draft (a token tree,
  sampling/branches.py), the alternatives verified, the rounds an alternative's path was taken, and
  the tokens gained over what the primary alone would have had accepted
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecMetrics:
    proposer: str
    k: int | str
    rounds: int = 0
    proposed: int = 0
    accepted: int = 0
    emitted: int = 0
    position_proposed: list[int] = field(default_factory=list)
    position_accepted: list[int] = field(default_factory=list)
    overlap_sum: float = 0.0
    overlap_count: int = 0
    draft_s: float = 0.0
    verify_s: float = 0.0
    other_s: float = 0.0
    k_histogram: dict[int, int] = field(default_factory=dict)
    sources: dict[str, int] = field(default_factory=dict)   # rounds with drafts, by proposer source
    by_source: dict[str, list[int]] = field(default_factory=dict)   # full source label -> [rounds, proposed, accepted]
    branches: list[int] = field(default_factory=lambda: [0, 0, 0, 0])  # [rounds, alternatives, taken, gained]

    def record_round(self, k: int, accepted: int, emitted: int, overlaps: list[float],
                     source: str | None = None) -> None:
        if k and source is not None:
            counts = self.by_source.setdefault(source, [0, 0, 0])
            counts[0], counts[1], counts[2] = counts[0] + 1, counts[1] + k, counts[2] + accepted
        self.rounds += 1
        self.proposed += k
        self.accepted += accepted
        self.emitted += emitted
        self.k_histogram[k] = self.k_histogram.get(k, 0) + 1
        while len(self.position_proposed) < k:
            self.position_proposed.append(0)
            self.position_accepted.append(0)
        for i in range(k):
            self.position_proposed[i] += 1
            self.position_accepted[i] += int(i < accepted)
        self.overlap_sum += sum(overlaps)
        self.overlap_count += len(overlaps)

    def record_branches(self, alternatives: int, taken: bool, gained: int) -> None:
        """A round verified `alternatives` candidates beside the primary draft."""
        for i, c in enumerate((1, alternatives, int(taken), gained)):
            self.branches[i] += c

    def add(self, other: "SpecMetrics") -> None:
        """Fold another sequence's counts into these (the engine's running total)."""
        self.rounds += other.rounds
        self.proposed += other.proposed
        self.accepted += other.accepted
        self.emitted += other.emitted
        for i, (p, a) in enumerate(zip(other.position_proposed, other.position_accepted)):
            if i == len(self.position_proposed):
                self.position_proposed.append(0)
                self.position_accepted.append(0)
            self.position_proposed[i] += p
            self.position_accepted[i] += a
        self.overlap_sum += other.overlap_sum
        self.overlap_count += other.overlap_count
        self.draft_s += other.draft_s
        self.verify_s += other.verify_s
        self.other_s += other.other_s
        for k, v in other.k_histogram.items():
            self.k_histogram[k] = self.k_histogram.get(k, 0) + v
        for name, v in other.sources.items():
            self.sources[name] = self.sources.get(name, 0) + v
        for i, c in enumerate(other.branches):
            self.branches[i] += c
        for name, counts in other.by_source.items():
            mine = self.by_source.setdefault(name, [0, 0, 0])
            for i, c in enumerate(counts):
                mine[i] += c

    @property
    def drafting_rounds(self) -> int:
        """Rounds that proposed at least one token."""
        return sum(v for k, v in self.k_histogram.items() if k > 0)

    @property
    def alpha(self) -> float | None:
        return self.overlap_sum / self.overlap_count if self.overlap_count else None

    def to_dict(self) -> dict:
        alpha = self.alpha
        # The prediction uses the mean K of rounds that drafted (K varies under --k auto).
        drafted = {k: v for k, v in self.k_histogram.items() if k > 0}
        k_num = round(sum(k * v for k, v in drafted.items()) / sum(drafted.values())) if drafted else 0
        if alpha is None:
            predicted = None
        elif alpha >= 1.0:
            predicted = float(k_num + 1)
        else:
            predicted = (1 - alpha ** (k_num + 1)) / (1 - alpha)
        return {
            "proposer": self.proposer,
            "k": self.k,
            "rounds": self.rounds,
            "proposed": self.proposed,
            "accepted": self.accepted,
            "acceptance_rate": self.accepted / self.proposed if self.proposed else None,
            "mean_accepted_length": self.emitted / self.rounds if self.rounds else None,
            "per_position_acceptance": [a / p if p else None
                                        for a, p in zip(self.position_accepted, self.position_proposed)],
            "alpha": alpha,
            "predicted_tokens_per_round": predicted,
            "k_histogram": {str(k): v for k, v in sorted(self.k_histogram.items())},
            "rounds_by_source": dict(self.sources),
            "by_source": {name: {"rounds": r, "proposed": p, "accepted": a, "acceptance_rate": a / p if p else None}
                          for name, (r, p, a) in sorted(self.by_source.items())},
            "branches": dict(zip(("rounds", "alternatives", "taken", "gained"), self.branches)),
            "draft_s": round(self.draft_s, 6),
            "verify_s": round(self.verify_s, 6),
            "other_s": round(self.other_s, 6),
        }
