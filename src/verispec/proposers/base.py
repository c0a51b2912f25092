"""The one proposer interface, and the registry that chooses proposers by name (DESIGN rule 4)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import torch

if TYPE_CHECKING:
    from verispec.engine.sequence import Sequence


@dataclass
class Proposal:
    tokens: torch.Tensor            # (B, K) proposed tokens x̃ (padding past num_draft[b] is 0)
    num_draft: torch.Tensor         # (B,) how many of each row are real, 0 … K
    q: torch.Tensor | None = None   # (B, K, V) warped draft distributions the tokens were sampled from;
                                    # None = point mass (no probabilities)
    source: list[str] | None = None  # per row, which proposer produced it (hybrid proposers)
    steps: dict[str, tuple[int, float]] | None = None  # source -> (proposal steps, seconds), for the cost model
    catchup: dict[str, tuple[int, float]] | None = None  # source -> (tokens ingested, seconds): one-off prefill
    # Per row, alternative point-mass continuations beside tokens[b, :num_draft[b]] (each at most that
    # long; distinct, none a prefix of another): candidate branches the round may verify too. Only for
    # rows whose draft is itself a point mass. None: no row has any.
    branches: list[list[list[int]]] | None = None


class Proposer(ABC):
    """propose for a batch → tokens (+ optional q); hear back how many were accepted; reset."""

    name: str = "?"
    wants_states: bool = False      # True: the round keeps the target's states of the last settled
                                    # positions on each sequence (Sequence.recent_states), as heads need
    state_window: int = 1           # with wants_states: how many (1: the pending token's state only)

    def source_for(self, seq: "Sequence") -> str:
        """Which proposer would draft for this sequence next (a hybrid picks per sequence)."""
        return self.name

    def options(self, seq: "Sequence") -> list[tuple[str, int]]:
        """Every source that could draft for seq next, with the tokens it would first catch up on
        (see backlog), this proposer's own choice first. A hybrid offers its lookup match and its
        fallback; the K policy keeps the one it values most and says so with prefer."""
        return [(self.source_for(seq), self.backlog(seq))]

    def prefer(self, seq: "Sequence", source: str) -> None:
        """Draft seq's next round from `source`, one of options(seq); source_for, backlog and propose
        follow it until seq's tokens change."""

    def start(self, make_runner: Callable[[Any], Any]) -> None:
        """Before the first round: make_runner(model) gives a ModelRunner over a cache the engine
        sized (static for a batch, paged for the server). Sequences may join at any round; a
        proposer catches up on tokens it has not seen when it first drafts for them."""

    def backlog(self, seq: "Sequence") -> int:
        """Tokens this proposer would first have to ingest (a one-off catch-up) before it can draft
        for seq — the K policy weighs that cost against what speculating would save."""
        return 0

    @abstractmethod
    def propose(self, seqs: list["Sequence"], ks: list[int]) -> Proposal:
        """Draft up to ks[b] tokens after seqs[b].tokens."""

    def observe(self, seqs: list["Sequence"], num_accepted: list[int]) -> None:
        """Hear back after the round: seqs now hold their committed tokens."""

    def release(self, slots: list[int]) -> None:
        """These sequences left (finished, cancelled or preempted): forget their state."""

    def reset(self) -> None:
        """Drop all per-batch state."""


def empty_proposal(batch: int) -> Proposal:
    return Proposal(torch.zeros(batch, 0, dtype=torch.long), torch.zeros(batch, dtype=torch.long))


REGISTRY: dict[str, Callable[..., Proposer]] = {}


def register(name: str):
    def wrap(factory):
        REGISTRY[name] = factory
        factory.name = name
        return factory
    return wrap


class NoProposer(Proposer):
    """Plain decoding: every round is a K = 0 round (one target pass per token)."""

    def propose(self, seqs, ks):
        return empty_proposal(len(seqs))


register("none")(NoProposer)
