"""Logits -> warped probabilities (temperature, top-k, top-p), per row, and per-request sampling.

The same function warps the target's p and the draft's q before acceptance, and plain sampling
draws from it too: that is what makes speculative sampling equal plain sampling of the *warped*
target. Greedy (temperature 0) never comes here.
"""

from __future__ import annotations

import torch

TOP_P_FIRST = 64        # candidates top-p looks at first (most rows' mass reaches top_p within them)


def warp_probs(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
               top_p: torch.Tensor) -> torch.Tensor:
    """logits (B, R, V); temperature, top_k, top_p (B,) -> float32 probs (B, R, V).

    top_k = 0 and top_p = 1.0 mean "off". top-k keeps every token whose logit is at least the k-th
    largest (ties at the boundary all kept). top-p then keeps the smallest set of most likely tokens
    whose mass reaches top_p (at least one token), and with it every token exactly as likely as the
    least likely one it took (ties at the boundary all kept, whatever order a sort would put them in).
    Example: probs [0.5, 0.3, 0.2], top_p=0.7 -> keep {0.5, 0.3} -> [0.625, 0.375, 0].

    Nothing sorts the whole vocabulary: the k-th largest logit comes from a partial selection
    (torch.topk), and top-p's boundary from the most likely `TOP_P_FIRST` tokens, eight times as many
    each time they hold less than top_p. Sorting 151,936 logits took ~16 ms per row on a Zen/Zen+
    core, a third of the 1.5B's whole pass.
    """
    logits = logits.float() / temperature.clamp_min(1e-6)[:, None, None]   # (B, R, V)
    b, r, v = logits.shape
    k_on = (top_k > 0) & (top_k < v)                                       # (B,)
    p_on = top_p < 1.0                                                     # (B,)
    if bool(k_on.any()):
        k = torch.where(k_on, top_k, 1)                                    # (B,)
        best = torch.topk(logits, int(k.max()), dim=-1).values             # (B, R, k_max), descending
        kth = best.gather(-1, (k - 1)[:, None, None].expand(b, r, 1))      # (B, R, 1)
        logits = logits.masked_fill(k_on[:, None, None] & (logits < kth), float("-inf"))
    if bool(p_on.any()):
        probs = torch.softmax(logits, dim=-1)                              # (B, R, V)
        need = top_p[:, None, None].to(probs.dtype)                        # (B, 1, 1)
        width = min(TOP_P_FIRST, v)
        while True:
            top = torch.topk(probs, width, dim=-1).values                  # (B, R, W), descending
            mass = top.cumsum(-1)                                          # mass of the best 1 … W
            if width == v or bool(((mass[..., -1:] >= need) | ~p_on[:, None, None]).all()):
                break
            width = min(8 * width, v)
        # Kept: the best one, then each next one while the mass before it is below top_p.
        count = 1 + (mass[..., :-1] < need).sum(-1, keepdim=True)          # (B, R, 1)
        least = top.gather(-1, count - 1)                                  # (B, R, 1) the last one taken
        logits = logits.masked_fill(p_on[:, None, None] & (probs < least), float("-inf"))
    return torch.softmax(logits, dim=-1)


def sample_from(probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    """One token per row of probs (B, V), row b drawn with generators[b] (the request's own)."""
    from verispec.sampling.acceptance import inverse_cdf, uniforms

    return inverse_cdf(probs, uniforms(generators, 1, probs.device)[:, 0])
