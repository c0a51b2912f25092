from verispec.sampling.acceptance import AcceptanceResult, accept_greedy, accept_sampling
from verispec.sampling.greedy import argmax
from verispec.sampling.warp import sample_from, warp_probs

__all__ = ["AcceptanceResult", "accept_greedy", "accept_sampling", "argmax", "sample_from", "warp_probs"]
