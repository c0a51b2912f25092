"""Monte-Carlo harness: run speculative sampling on synthetic Markov p and q and compare the
empirical distribution of emitted tokens at each position with the exact target marginals.

p(x_t | x_{t-1}) and q(x_t | x_{t-1}) are position-dependent transition tables over a small
vocabulary, so positions reached only after acceptances (and recovered/bonus tokens drawn at
the wrong position) are all checked.
"""

from __future__ import annotations

import numpy as np
import torch
from scipy import stats

from verispec.sampling import accept_sampling


def random_tables(seed: int, positions: int, v: int, sharp: float = 2.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(positions, v + 1, v, generator=g) * sharp    # (T, prev token incl. start=v, V) logits


def exact_marginals(P: torch.Tensor, n: int) -> list[np.ndarray]:
    """P: (T, V+1, V) probabilities; the start state is index V. Marginal of x_t for t < n."""
    v = P.shape[-1]
    m = P[0, v].double()
    out = [m.numpy()]
    for t in range(1, n):
        m = m @ P[t, :v].double()
        out.append(m.numpy())
    return out


def run_speculative(P: torch.Tensor, Q: torch.Tensor, k: int, n: int, samples: int, seed: int,
                    accept=accept_sampling, q_for_acceptance: torch.Tensor | None = None,
                    point_mass: bool = False, heads: bool = False, heads_report_chain: bool = False,
                    stop_below: float = 0.0, stop_reported_as_k: bool = False, two_sources: str = "") -> np.ndarray:
    """Generate `samples` sequences of n tokens by speculative rounds; return (samples, n) tokens.

    The draft samples from Q; acceptance sees `q_for_acceptance` (default Q) — passing something
    else simulates the "raw q" bug. point_mass: drafts are passed with q=None.
    heads: every draft of a round is drawn from Q given the token before the round only (as Medusa
    heads draft: none sees the others' guesses). heads_report_chain: broken on purpose — such drafts
    reported to acceptance with the q of a chain (given the previous draft).
    stop_below: a row stops drafting after a draft whose q's largest probability is below it (the
    draft model's early stop: fewer than k drafts, decided by the drafts alone). stop_reported_as_k:
    broken on purpose — the rows that stopped are still reported as k drafts long (padding verified).
    two_sources: each round a row drafts either by "lookup" (a point-mass chain, token t followed by
    3t + 1 mod V) or from Q, as a hybrid does. "history": the choice reads the sequence so far alone
    (lookup after an even token), as the K policy's choice does. "peek": broken on purpose — both
    proposals are verified and the one that kept more drafts is taken (a choice that sees the target).
    """
    v = P.shape[-1]
    gen = torch.Generator().manual_seed(seed)
    qa = Q if q_for_acceptance is None else q_for_acceptance
    out = torch.full((samples, n + k + 1), -1, dtype=torch.long)
    length = torch.zeros(samples, dtype=torch.long)
    rows = torch.arange(samples)
    while True:
        active = rows[length < n]
        if len(active) == 0:
            break
        b = len(active)
        pos = length[active]                                              # (b,)
        prev = torch.where(pos > 0, out[active, (pos - 1).clamp_min(0)], torch.full_like(pos, v))
        drafts = torch.empty(b, k, dtype=torch.long)
        q = torch.empty(b, k, v)
        p = torch.empty(b, k + 1, v)
        cur = prev
        num = torch.full((b,), k)
        for i in range(k + 1):
            p[:, i] = P[pos + i, cur]
            if i == k:
                break
            probs = Q[pos + i, prev if heads else cur]
            drafts[:, i] = torch.multinomial(probs, 1, generator=gen).squeeze(1)
            q[:, i] = qa[pos + i, prev if heads and not heads_report_chain else cur]
            cur = drafts[:, i]
            if stop_below > 0:
                stopped = num <= i                                        # rows that already stopped
                drafts[stopped, i], q[stopped, i] = 0, 0.0                # padding, as a ragged round has
                num = torch.where(~stopped & (probs.amax(-1) < stop_below), torch.full_like(num, i + 1), num)
        if stop_reported_as_k:
            num = torch.full((b,), k)
        if two_sources:
            look = torch.empty(b, k, dtype=torch.long)
            t = prev.clone()
            for i in range(k):
                t = (3 * torch.where(t == v, torch.zeros_like(t), t) + 1) % v
                look[:, i] = t
            q_look = torch.nn.functional.one_hot(look, v).float()          # (b, K, V) point masses
            p_look = torch.empty(b, k + 1, v)
            cur = prev
            for i in range(k + 1):
                p_look[:, i] = P[pos + i, cur]
                cur = look[:, i] if i < k else cur
            if two_sources == "history":
                use = (prev % 2 == 0)[:, None, None]                       # (b, 1, 1): lookup rows
                drafts = torch.where(use[..., 0], look, drafts)
                q, p = torch.where(use, q_look, q), torch.where(use, p_look, p)
            else:
                from_q = accept(p, drafts, q, num, [gen] * b)
                from_look = accept(p_look, look, q_look, num, [gen] * b)
                better = from_look.num_accepted > from_q.num_accepted
                from_q.tokens[better] = from_look.tokens[better]
                from_q.num_accepted[better] = from_look.num_accepted[better]
                res = from_q
        if two_sources != "peek":
            res = accept(p, drafts, None if point_mass else q, num, [gen] * b)
        cols = pos[:, None] + torch.arange(k + 1)[None, :]                # (b, K+1)
        keep = res.tokens >= 0
        out[active[:, None].expand_as(cols)[keep], cols[keep]] = res.tokens[keep]
        length[active] = pos + res.num_emitted
    return out[:, :n].numpy()


def chi_square_p_values(tokens: np.ndarray, marginals: list[np.ndarray]) -> list[float]:
    """One p-value per position (cells with expected count >= 5 pooled otherwise)."""
    pvals = []
    for t, m in enumerate(marginals):
        counts = np.bincount(tokens[:, t], minlength=len(m)).astype(float)
        expected = m * len(tokens)
        big = expected >= 5
        obs = np.append(counts[big], counts[~big].sum())
        exp = np.append(expected[big], expected[~big].sum())
        if exp[-1] == 0:
            obs, exp = obs[:-1], exp[:-1]
        pvals.append(float(stats.chisquare(obs, exp * obs.sum() / exp.sum()).pvalue))
    return pvals


def total_variation(tokens: np.ndarray, marginal: np.ndarray, t: int) -> float:
    counts = np.bincount(tokens[:, t], minlength=len(marginal)) / len(tokens)
    return 0.5 * float(np.abs(counts - marginal).sum())


def recover_from_p(p, drafts, q, num_draft, generators):
    """A deliberately broken acceptance rule: on rejection, resample from p instead of
    norm(max(0, p − q)). The statistical checks must flag it."""
    res = accept_sampling(p, drafts, q, num_draft, generators)
    for row in range(len(drafts)):
        j = int(res.num_accepted[row])
        if j < int(num_draft[row]):
            res.tokens[row, j] = torch.multinomial(p[row, j], 1, generator=generators[row])
    return res
