from verispec.proposers.base import REGISTRY, Proposal, Proposer, register
from verispec.proposers import draft as _draft, head as _head, hybrid as _hybrid, ngram as _ngram, retrieval as _retrieval  # noqa: F401,E501  (registration)

__all__ = ["REGISTRY", "Proposal", "Proposer", "register"]
