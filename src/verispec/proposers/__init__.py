from verispec.proposers.base import REGISTRY, Proposal, Proposer, register
from verispec.proposers import draft as _draft, hybrid as _hybrid, ngram as _ngram  # noqa: F401  (registration)

__all__ = ["REGISTRY", "Proposal", "Proposer", "register"]
