"""Logits -> warped probabilities (temperature, top-k, top-p), per row, and per-request sampling.

The same function warps the target's p and the draft's q before acceptance, and plain sampling
draws from it too: that is what makes speculative sampling equal plain sampling of the *warped*
target. Greedy (temperature 0) never comes here.
"""

from __future__ import annotations

import torch

TOP_P_FIRST = 64        # candidates top-p looks at first (most rows' mass reaches top_p within them)
CHUNK = 128             # _top_values' chunk of the vocabulary (151,936 = 1,187 × 128)


def warp_probs(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
               top_p: torch.Tensor) -> torch.Tensor:
    """logits (B, R, V); temperature, top_k, top_p (B,) -> float32 probs (B, R, V).

    top_k = 0 and top_p = 1.0 mean "off". top-k keeps every token whose logit is at least the k-th
    largest (ties at the boundary all kept). top-p then keeps the smallest set of most likely tokens
    whose mass reaches top_p (at least one token), and with it every token exactly as likely as the
    least likely one it took (ties at the boundary all kept, whatever order a sort would put them in).
    Example: probs [0.5, 0.3, 0.2], top_p=0.7 -> keep {0.5, 0.3} -> [0.625, 0.375, 0].

    Nothing sorts the whole vocabulary: the k-th largest logit comes from a partial selection
    (_top_values), and top-p's boundary from the most likely `TOP_P_FIRST` tokens, eight times as many
    each time they hold less than top_p. Sorting 151,936 logits took ~16 ms per row on a Zen/Zen+
    core, a third of the 1.5B's whole pass.
    """
    z = logits.float() / temperature.clamp_min(1e-6)[:, None, None]         # (B, R, V)
    b, r, v = z.shape
    k_on = (top_k > 0) & (top_k < v)                                       # (B,)
    p_on = top_p < 1.0                                                     # (B,)
    # Unnormalised probabilities, the largest 1: each step below drops tokens by setting theirs to 0,
    # and one division at the end normalises what is left (no second softmax over the vocabulary).
    e = (z - z.amax(-1, keepdim=True)).exp_()                              # (B, R, V)
    if bool(k_on.any()):
        k = torch.where(k_on, top_k, 1)                                    # (B,)
        best = _top_values(z, int(k.max()))                                # (B, R, k_max), descending
        kth = best.gather(-1, (k - 1)[:, None, None].expand(b, r, 1))      # (B, R, 1)
        kth = kth.masked_fill(~k_on[:, None, None], float("-inf"))         # rows without top-k drop nothing
        e = torch.where(z < kth, 0.0, e)
    if bool(p_on.any()):
        need = top_p[:, None, None] * e.sum(-1, keepdim=True)              # (B, R, 1) top_p of the mass
        width = min(TOP_P_FIRST, v)
        while True:
            top = _top_values(e, width)                                    # (B, R, W), descending
            mass = top.cumsum(-1)                                          # mass of the best 1 … W
            if width == v or bool(((mass[..., -1:] >= need) | ~p_on[:, None, None]).all()):
                break
            width = min(8 * width, v)
        # Kept: the best one, then each next one while the mass before it is below top_p.
        count = 1 + (mass[..., :-1] < need).sum(-1, keepdim=True)          # (B, R, 1)
        least = top.gather(-1, count - 1)                                  # (B, R, 1) the last one taken
        least = least.masked_fill(~p_on[:, None, None], 0.0)               # rows without top-p drop nothing
        e = torch.where(e < least, 0.0, e)
    return e.div_(e.sum(-1, keepdim=True))


def _top_values(x: torch.Tensor, k: int) -> torch.Tensor:
    """x (B, R, V) -> its k largest values per row, descending: torch.topk(x, k).values, found in the k
    chunks of CHUNK columns with the largest maxima (a quarter of torch.topk's time over 151,936 columns).
    Exact: the i-th largest value v_i has i values >= v_i in those chunks — either all of its row's
    values >= v_i lie in them, or one lies in a chunk left out, and then each of the k chunks kept has a
    maximum >= v_i."""
    b, r, v = x.shape
    n = v // CHUNK
    if v % CHUNK or 4 * k > n:                   # too few chunks to leave most of them out
        return torch.topk(x, k, dim=-1).values
    chunks = x.reshape(b, r, n, CHUNK)                                           # (B, R, N, CHUNK)
    best = torch.topk(chunks.amax(-1), k, dim=-1).indices                        # (B, R, k)
    kept = chunks.gather(2, best[..., None].expand(b, r, k, CHUNK))              # (B, R, k, CHUNK)
    return torch.topk(kept.reshape(b, r, k * CHUNK), k, dim=-1).values


def sample_from(probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    """One token per row of probs (B, V), row b drawn with generators[b] (the request's own)."""
    from verispec.sampling.acceptance import inverse_cdf, uniforms

    return inverse_cdf(probs, uniforms(generators, 1, probs.device)[:, 0])
