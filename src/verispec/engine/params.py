"""Per-request sampling parameters, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass, field

from verispec.errors import InvalidRequest


@dataclass
class SamplingParams:
    """temperature 0 = greedy (its own code path). top_k = 0 and top_p = 1.0 mean "off".

    seed: a request with a seed is reproducible whatever else is in the batch and whatever the
    machine's timings (under k="auto" its K schedule uses fixed costs, see KPolicy.choose); without
    one every request draws fresh randomness. With n > 1, sample i uses seed + i.
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    max_tokens: int = 256
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    n: int = 1

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in (self.stop or []) if s]
        self.stop_token_ids = list(self.stop_token_ids or [])
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise InvalidRequest(f"max_tokens must be a positive integer, got {self.max_tokens!r}", param="max_tokens")
        if not self.temperature >= 0:
            raise InvalidRequest(f"temperature must be >= 0, got {self.temperature!r}", param="temperature")
        if not (0.0 < self.top_p <= 1.0):
            raise InvalidRequest(f"top_p must be in (0, 1], got {self.top_p!r}", param="top_p")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise InvalidRequest(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}", param="top_k")
        if not isinstance(self.n, int) or self.n < 1:
            raise InvalidRequest(f"n must be a positive integer, got {self.n!r}", param="n")
        if self.seed is not None and not isinstance(self.seed, int):
            raise InvalidRequest(f"seed must be an integer, got {self.seed!r}", param="seed")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def reproducible(self) -> bool:
        """Seeded sampling: K must follow a timing-free schedule (greedy output never depends on K)."""
        return self.seed is not None and not self.greedy
