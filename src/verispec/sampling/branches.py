"""Accepting from several candidate continuations (a token tree) at once, exactly.

A round may verify, beside the primary draft, alternative point-mass candidates for the same
sequence: branches c_0 (the primary) … c_{N-1}, each a token list. Together they form a token tree
(a leading run the branches share is one path). The target scored every branch: scores[j] row i is
p at the node before c_j[i], and row len(c_j) the node after its last token.

Walk from the root. At a node with target distribution p, the children are the distinct next tokens
x_1 … x_m of the branches still on the walk, in branch order (the primary's first):
  greedy     follow the child equal to argmax p; if there is none, emit argmax p and stop.
  sampling   r = p; for each child x_i in turn accept it with probability r(x_i) / Σr (one uniform
             each); if accepted, follow it; if not, set r(x_i) = 0 and go on. If no child was
             accepted, emit a sample from r (the **recovered** token) and stop.
A node without children (every branch on the walk ended) emits from p: the **bonus** token.

Why it is exact: at a node the first child is taken with probability p(x_1); the second with
(1 − p(x_1)) · p(x_2) / (1 − p(x_1)) = p(x_2); … and any other token y with
(1 − Σ_i p(x_i)) · p(y) / (1 − Σ_i p(x_i)) = p(y). So the next token is distributed exactly as p,
and the walk then continues from the node that token leads to, as plain decoding would. With one
branch this is the point-mass rule of acceptance.py (accept x̃ with p(x̃), recover from p without x̃).

Worked example: p = [.5 .3 .2] (V = 3), children [1, 2]. Accept 1 with .3; else r = [.5 0 .2],
accept 2 with .2 / .7; else r = [.5 0 0] and the recovered token is 0. Overall P(1) = .3,
P(2) = .7 · .2/.7 = .2, P(0) = .7 · .5/.7 = .5 — exactly p.

The walk also reports how far the primary alone would have been accepted with the same draws
(the depth where it left the walk): the primary's own acceptance, so the K policy's estimates
stay those of a chain, and the branches' gain is what they added beyond it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from verispec.sampling.acceptance import inverse_cdf
from verispec.sampling.greedy import argmax


@dataclass
class BranchResult:
    branch: int              # index of the branch the accepted path lies on
    num_accepted: int        # drafts accepted (the path's length)
    tokens: list[int]        # emitted: the accepted path, then the recovered or bonus token
    primary_accepted: int    # drafts of branch 0 the same draws accepted


def accept_branches(branches: list[list[int]], scores: list[torch.Tensor], greedy: bool,
                    generator: torch.Generator | None = None) -> BranchResult:
    """branches: N candidate token lists (branch 0 the primary); scores[j]: (len(branches[j]) + 1, V),
    raw logits when greedy, else the warped target probabilities p of those rows."""
    if len(branches) != len(scores) or not branches:
        raise ValueError("one score tensor per branch, at least one branch")
    alive, path, primary = list(range(len(branches))), [], None
    while True:
        depth = len(path)
        row = scores[alive[0]][depth]                                   # (V,) same bits on every live branch
        children: list[int] = []
        for j in alive:
            if len(branches[j]) > depth and branches[j][depth] not in children:
                children.append(branches[j][depth])
        follow, final = None, None
        if greedy:
            best = int(argmax(row))
            follow, final = (best, None) if best in children else (None, best)
        else:
            r = row.double().clone()
            for x in children:
                u = torch.rand(1, generator=generator).double()
                if u * r.sum() < r[x]:
                    follow = x
                    break
                r[x] = 0.0
            if follow is None:
                if r.sum() <= 0:                    # all mass on rejected children: rounding only
                    r = row.double()
                final = int(inverse_cdf(r[None], torch.rand(1, generator=generator))[0])
        if primary is None and not (0 in alive and len(branches[0]) > depth and branches[0][depth] == follow):
            primary = depth
        if follow is None:
            return BranchResult(alive[0], depth, path + [final], primary)
        path.append(follow)
        alive = [j for j in alive if len(branches[j]) > depth and branches[j][depth] == follow]
