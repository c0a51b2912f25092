"""Logits -> warped probabilities (temperature, top-k, top-p), per row, and per-request sampling.

The same function warps the target's p and the draft's q before acceptance, and plain sampling
draws from it too: that is what makes speculative sampling equal plain sampling of the *warped*
target. Greedy (temperature 0) never comes here.
"""

from __future__ import annotations

import torch


def warp_probs(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
               top_p: torch.Tensor) -> torch.Tensor:
    """logits (B, R, V); temperature, top_k, top_p (B,) -> float32 probs (B, R, V).

    top_k = 0 and top_p = 1.0 mean "off". Ties at the top-k boundary are all kept; top-p keeps the
    smallest prefix of the descending order whose mass reaches top_p (at least one token).
    Example: probs [0.5, 0.3, 0.2], top_p=0.7 -> keep {0.5, 0.3} -> [0.625, 0.375, 0].
    """
    logits = logits.float() / temperature.clamp_min(1e-6)[:, None, None]
    v = logits.shape[-1]
    need_k = bool(((top_k > 0) & (top_k < v)).any())
    need_p = bool((top_p < 1.0).any())
    if not (need_k or need_p):
        return torch.softmax(logits, dim=-1)
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)        # (B, R, V)
    remove = torch.zeros_like(sorted_logits, dtype=torch.bool)
    if need_k:
        k = torch.where(top_k > 0, top_k, v).clamp(max=v)                      # (B,)
        kth = sorted_logits.gather(-1, (k - 1)[:, None, None].expand(-1, sorted_logits.shape[1], 1))
        remove |= sorted_logits < kth
    if need_p:
        probs = torch.softmax(sorted_logits.masked_fill(remove, float("-inf")), dim=-1)
        mass_before = probs.cumsum(-1) - probs                                 # mass of strictly better tokens
        remove |= mass_before >= top_p[:, None, None]
    sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    warped = torch.empty_like(logits).scatter_(-1, order, sorted_logits)
    return torch.softmax(warped, dim=-1)


def sample_from(probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    """One token per row of probs (B, V), row b drawn with generators[b] (the request's own)."""
    from verispec.sampling.acceptance import inverse_cdf, uniforms

    return inverse_cdf(probs, uniforms(generators, 1, probs.device)[:, 0])
