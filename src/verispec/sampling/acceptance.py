"""Acceptance: the one pure function that makes speculative decoding lossless.

Vocabulary (DESIGN.md): p = target distribution, q = draft distribution. For each row the
proposer drafted x̃_0 … x̃_{k-1} (k = num_draft[b] ≤ K); the target scored K+1 positions.

Sampling path (Leviathan et al. / Chen et al.):
  for i = 0 … k-1: accept x̃_i with probability min(1, p_i(x̃_i) / q_i(x̃_i));
  on the first rejection at i, draw the **recovered** token from norm(max(0, p_i − q_i)) and stop;
  if all k are **accepted**, draw the **bonus** token from p_k.
  Emitted per row: accepted + 1 token (1 … k+1).
A proposer without probabilities (n-gram lookup) is a point mass: q = one-hot(x̃), so x̃ is
accepted with probability p(x̃) and the recovered token comes from p with x̃ removed, renormalised.

Greedy path (temperature 0): accept while x̃_i == argmax p_i, then emit argmax p at the first
mismatch (or the bonus position). No randomness; never emulated with a tiny temperature.

Worked example (sampling, k = 2, V = 3):
  p_0 = [.5 .3 .2], q_0 = [.2 .6 .2], x̃_0 = 1: accept with prob .3/.6 = .5.
  Suppose u = .7 > .5: reject; residual max(0, p_0 − q_0) = [.3 0 0] -> recovered token 0.
  Output: [0], num_accepted = 0.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from verispec.sampling.greedy import argmax


@dataclass
class AcceptanceResult:
    num_accepted: torch.Tensor   # (B,) accepted drafts per row, 0 … num_draft[b]
    tokens: torch.Tensor         # (B, K+1) emitted tokens: first num_accepted+1 are valid, rest -1
    overlap: torch.Tensor | None  # (B, K) Σ_x min(p_i, q_i) per drafted position, 0 past num_draft (greedy: 1 or 0)

    @property
    def num_emitted(self) -> torch.Tensor:
        return self.num_accepted + 1

    def emitted(self, row: int) -> list[int]:
        return self.tokens[row, : int(self.num_accepted[row]) + 1].tolist()


def _valid(num_draft: torch.Tensor, k: int) -> torch.Tensor:
    return torch.arange(k, device=num_draft.device)[None, :] < num_draft[:, None]   # (B, K)


def _leading_true(mask: torch.Tensor) -> torch.Tensor:
    """(B, K) bool -> (B,) length of the all-True prefix of each row."""
    return mask.long().cumprod(dim=-1).sum(dim=-1)


def accept_greedy(target_logits: torch.Tensor, draft_tokens: torch.Tensor,
                  num_draft: torch.Tensor) -> AcceptanceResult:
    """target_logits (B, K+1, V), draft_tokens (B, K), num_draft (B,) -> result."""
    b, k = draft_tokens.shape
    best = argmax(target_logits)                                                 # (B, K+1)
    match = (draft_tokens == best[:, :k]) & _valid(num_draft, k)
    n = _leading_true(match)                                                     # (B,)
    # Accepted drafts equal argmax, so the emitted block is argmax[0 … n].
    keep = torch.arange(k + 1)[None, :] <= n[:, None]
    # Greedy p and q are point masses at their argmax: overlap = 1 where they agree.
    return AcceptanceResult(n, torch.where(keep, best, torch.full_like(best, -1)), match.float())


def accept_sampling(p: torch.Tensor, draft_tokens: torch.Tensor, q: torch.Tensor | None,
                    num_draft: torch.Tensor, generators: list[torch.Generator | None]) -> AcceptanceResult:
    """Modified rejection sampling.

    p: (B, K+1, V) warped target probs; draft_tokens: (B, K); q: (B, K, V) warped draft probs that
    the drafts were actually sampled from, or None for point-mass proposals; num_draft: (B,);
    generators: one per row (the request's own), so a row's randomness never depends on the batch.
    """
    b, k = draft_tokens.shape
    v = p.shape[-1]
    if k == 0:                                      # nothing drafted (plain sampling): the bonus alone
        _, u_final = _round_uniforms(generators, num_draft, 0, p.device)       # the uniforms drawn below
        return AcceptanceResult(torch.zeros(b, dtype=torch.long), inverse_cdf(p[:, 0], u_final)[:, None],
                                torch.zeros(b, 0, dtype=p.dtype, device=p.device))
    safe_tokens = draft_tokens.clamp(0, v - 1)
    point = q is None                               # point mass: q = one-hot(x̃), never built
    valid = _valid(num_draft, k)                                                  # (B, K)
    p_tok = p[:, :k].gather(-1, safe_tokens[..., None]).squeeze(-1)               # (B, K)
    q_tok = torch.ones_like(p_tok) if point else q.gather(-1, safe_tokens[..., None]).squeeze(-1)   # (B, K)
    u, u_final = _round_uniforms(generators, num_draft, k, p.device)             # (B, K), (B,)
    # u < min(1, p/q)  <=>  u·q < p  (q(x̃) > 0 whenever x̃ was drawn from q)
    accepted = (u * q_tok < p_tok) & valid
    n = _leading_true(accepted)                                                   # (B,)

    # The final token: recovered from norm(max(0, p_n - q_n)) if row rejected at n, else bonus from p_n.
    rows = torch.arange(b, device=p.device)
    p_n = p[rows, n]                                                              # (B, V)
    rejected = n < num_draft
    dist = p_n
    if bool(rejected.any()):                         # no row rejected (plain sampling): p_n as it is
        if point:                                    # max(0, p_n - one-hot(x̃_n)): p_n without x̃_n (p <= 1)
            residual, out = p_n.clone(), rows[rejected]
            residual[out, safe_tokens[out, n[out]]] = 0.0
        else:
            q_n = torch.zeros_like(p_n)
            q_n[rejected] = q[rows[rejected], n[rejected]]
            residual = (p_n - q_n).clamp_min(0)
        empty = residual.sum(-1) <= 0                 # p == q up to rounding: the residual is empty
        dist = torch.where((rejected & ~empty)[:, None], residual, p_n)
    final = inverse_cdf(dist, u_final)                                            # (B,)

    tokens = torch.full((b, k + 1), -1, dtype=torch.long, device=p.device)
    tokens[:, :k] = torch.where(torch.arange(k)[None, :] < n[:, None], draft_tokens, -1)
    tokens[rows, n] = final
    overlap = (p_tok if point else torch.minimum(p[:, :k], q).sum(-1)) * valid   # Σ min(p, one-hot(x̃)) = p(x̃)
    return AcceptanceResult(n, tokens, overlap)


def _round_uniforms(generators, num_draft: torch.Tensor, k: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Row b takes num_draft[b] + 1 uniforms from its own generator (acceptance tests, then the final
    token), so what a request draws never depends on the other rows of the batch."""
    b = len(generators)
    nd = num_draft.tolist()
    if b and all(g is generators[0] for g in generators) and all(n == k for n in nd):
        u = torch.rand(b, k + 1, generator=generators[0], device=device)
        return u[:, :k], u[:, k]
    u = torch.ones(b, k, device=device)
    u_final = torch.empty(b, device=device)
    for row, (g, n) in enumerate(zip(generators, nd)):
        r = torch.rand(n + 1, generator=g, device=device)
        u[row, :n], u_final[row] = r[:n], r[n]
    return u, u_final


def uniforms(generators: list[torch.Generator | None], n: int, device=None) -> torch.Tensor:
    """(B, n) uniforms, row b from generators[b]; one draw when every row shares one generator."""
    if len(generators) and all(g is generators[0] for g in generators):
        return torch.rand(len(generators), n, generator=generators[0], device=device)
    return torch.stack([torch.rand(n, generator=g, device=device) for g in generators]) if generators \
        else torch.empty(0, n, device=device)


def inverse_cdf(dist: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Sample one index per row of unnormalised dist (B, V) with uniforms u (B,). Zero-mass entries
    are never chosen: the first index whose cumulative mass exceeds u·total is returned."""
    cdf = dist.double().cumsum(-1)                                                # (B, V)
    target = u.double() * cdf[:, -1]
    idx = torch.searchsorted(cdf, target[:, None], right=True).squeeze(1)
    return idx.clamp_max(dist.shape[-1] - 1)
