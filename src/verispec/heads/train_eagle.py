"""Training the EAGLE-style head on this CPU (`verispec train-head --kind eagle`).

The features are the Medusa heads' (heads/train.py): per position t the target's final-normed state
h_t, its greedy next token a_t, and the text's token x_t. A training example is a segment of S
consecutive positions t_0 … t_{S−1} of one window.

Step 1 (teacher-forced, as EAGLE-1): the layer reads the true pairs (h_t, x_{t+1}) of the segment,
causally, and predicts ĥ_{t+1}; the loss is SmoothL1(ĥ_{t+1}, h_{t+1}) plus 0.1 × cross-entropy of
E_N ĥ_{t+1} against a_{t+1}, the target's own next token.

Steps 2 … U (as drafting runs): the pair at row j becomes (ĥ_{t_j+1}, x_{t_j+2}) — the layer's own
prediction, not the target's — attending over the true pairs up to row j and its own earlier
predictions for that row only, exactly the context a draft i places deep sees in a round. Each
further step's loss weighs 0.8× the one before. Without them a chain's second draft reads a state
the layer never saw in training.

Held-out windows (every 20th) give the greedy chain acceptance by draft position, measured the way
a round drafts: the true pairs before t, then the layer's own predictions and its own tokens.
"""

from __future__ import annotations

import math
import time
from typing import Callable

import torch
import torch.nn.functional as F

from verispec.heads.eagle import EagleHead
from verispec.heads.train import Features, split_windows

SEGMENT = 16            # positions per training example (the context a row sees grows 1 … SEGMENT)
CLS_WEIGHT = 0.1        # EAGLE-1's weight of the token loss beside the state regression
NOISE = 0.1             # uniform noise on the input states, so that later drafts meet imperfect inputs


def segments(features: Features, windows: list[int], length: int, unroll: int) -> torch.Tensor:
    """First positions of the non-overlapping segments of `length` rows in the given windows that leave
    `unroll` labelled positions after their last row: (G,)."""
    out = []
    for w in windows:
        a, b = int(features.starts[w]), int(features.starts[w + 1])
        last = b - 1 - unroll - (length - 1)                # the latest first row
        if last >= a:
            out.append(torch.arange(a, last + 1, length))
    return torch.cat(out) if out else torch.zeros(0, dtype=torch.long)


def unrolled_mask(s: int, step: int) -> torch.Tensor:
    """(S, S·step) keys a row of unroll step `step` (1-based) attends to: the true rows 0 … j of step 1
    and, of each later step, its own row j."""
    m = torch.zeros(s, s * step, dtype=torch.bool)
    m[:, :s] = torch.ones(s, s, dtype=torch.bool).tril()
    for k in range(1, step):
        m[:, k * s: (k + 1) * s] = torch.eye(s, dtype=torch.bool)
    return m


def unrolled_loss(head: EagleHead, embed: torch.Tensor, head_rows: torch.Tensor, index: torch.Tensor,
                  features: Features, starts: torch.Tensor, unroll: int, noise: float = NOISE
                  ) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Loss of a batch of segments starting at `starts` (B,), and per step the greedy hits (B, S) bool
    (the head's top token equals the target's) for the rows whose label lies in the vocabulary."""
    s = SEGMENT
    t = starts[:, None] + torch.arange(s)[None]                                   # (B, S) positions
    h = features.states[t].float()                                                # (B, S, C)
    if noise:
        h = h + (torch.rand_like(h) * 2 - 1) * noise
    pos = torch.arange(s)[None].expand(len(starts), -1)                           # (B, S)
    past, loss, hits = None, 0.0, []
    for k in range(1, unroll + 1):
        e = embed[features.tokens[t + k]]                                         # (B, S, C)  x_{t+k}
        mask = unrolled_mask(s, k)                                                # (S, S·k)
        out, kv = head(h, e, pos + (k - 1), past=past, mask=mask[None].expand(len(starts), -1, -1))
        target = features.states[t + k].float()                                   # (B, S, C)
        label = index[features.argmax[t + k]]                                     # (B, S), -1 off the vocabulary
        logits = out @ head_rows.T                                                # (B, S, N)
        reg = F.smooth_l1_loss(out, target)
        cls = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), label.reshape(-1), ignore_index=-1)
        loss = loss + 0.8 ** (k - 1) * (reg + CLS_WEIGHT * cls)
        hits.append((logits.argmax(-1) == label) & (label >= 0))
        past, h = kv, out
    return loss, hits


def agreement(head: EagleHead, embed: torch.Tensor, head_rows: torch.Tensor, index: torch.Tensor,
              features: Features, starts: torch.Tensor, depth: int, batch: int = 64) -> dict:
    """Held-out greedy acceptance by draft position: chain[i] = the share of rows whose drafts 1 … i+1
    (each fed the head's own state and its own token, as in a round) all equal the target's tokens."""
    s, runs = SEGMENT, []
    with torch.no_grad():
        for i in range(0, len(starts), batch):
            st = starts[i: i + batch]
            b = len(st)
            t = st[:, None] + torch.arange(s)[None]                               # (b, S)
            h = features.states[t].float()
            e = embed[features.tokens[t + 1]]
            pos = torch.arange(s)[None].expand(b, -1)
            out, (k, v) = head(h, e, pos)                                         # every row: draft 1
            ok = torch.ones(b, s, dtype=torch.bool)
            run = torch.zeros(b, s, depth)
            tok = head.vocab[(out @ head_rows.T).argmax(-1)]                       # (b, S)
            past_k, past_v = k, v
            for d in range(depth):
                ok = ok & (tok == features.argmax[t + d + 1])
                run[:, :, d] = ok.float()
                if d + 1 == depth:
                    break
                e = embed[tok]                                                     # the head's own token
                mask = unrolled_mask(s, d + 2)[None].expand(b, -1, -1)
                out, (past_k, past_v) = head(out, e, pos + d + 1, past=(past_k, past_v), mask=mask)
                tok = head.vocab[(out @ head_rows.T).argmax(-1)]
            runs.append(run.reshape(-1, depth))
    run = torch.cat(runs)
    return {"chain": [round(x, 4) for x in run.mean(0).tolist()], "positions": int(run.shape[0])}


def train(head: EagleHead, embed: torch.Tensor, head_rows: torch.Tensor, features: Features, minutes: float,
          lr: float = 5e-4, batch: int = 16, unroll: int = 3, log: Callable[[str], None] = print, seed: int = 0,
          max_steps: int | None = None) -> dict:
    """Fit the head (in place) within `minutes` (or `max_steps`); returns the held-out acceptance.
    embed (V, C): the target's token embeddings; head_rows (N, C): its LM-head rows for head.vocab."""
    torch.manual_seed(seed)
    held, fit = split_windows(len(features.starts) - 1)
    train_starts = segments(features, fit, SEGMENT, max(unroll, head.depth))
    held_starts = segments(features, held, SEGMENT, head.depth)
    index = torch.full((int(max(features.argmax.max(), head.vocab.max())) + 1,), -1, dtype=torch.long)
    index[head.vocab] = torch.arange(len(head.vocab))
    covered = float((index[features.argmax] >= 0).float().mean())
    log(f"{len(train_starts) * SEGMENT:,} training positions in {len(train_starts):,} segments, "
        f"{len(held_starts) * SEGMENT:,} held out; the {len(head.vocab):,}-token vocabulary holds {covered:.1%} "
        f"of the target's tokens; {unroll} unrolled steps")
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    budget, start, step, total = minutes * 60, time.perf_counter(), 0, max_steps
    perm = torch.randperm(len(train_starts))
    evaluated, warmup = time.perf_counter(), 30
    head.train()
    while True:
        elapsed = time.perf_counter() - start
        if elapsed >= budget or (max_steps is not None and step >= max_steps):
            break
        if step == 10 and max_steps is None:                # size the cosine schedule to the budget
            total = max(40, int(budget / (elapsed / 10)))
        frac = min(1.0, step / total) if total else 0.0
        for g in opt.param_groups:
            g["lr"] = lr * min(1.0, (step + 1) / warmup) * (0.5 * (1 + math.cos(math.pi * frac)) if total else 1.0)
        at = (step * batch) % len(perm)
        pick = train_starts[perm[at: at + batch]]
        loss, _ = unrolled_loss(head, embed, head_rows, index, features, pick, unroll)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        step += 1
        if time.perf_counter() - evaluated > 60 or step == 1:
            evaluated = time.perf_counter()
            head.eval()
            score = agreement(head, embed, head_rows, index, features, held_starts[:128], min(head.depth, 4))
            head.train()
            left = max(0.0, budget - (time.perf_counter() - start))
            log(f"step {step:,} ({step * batch / max(len(perm), 1):.2f} epochs), loss {loss.item():.3f}, held-out "
                f"chain acceptance {' / '.join(f'{x:.2f}' for x in score['chain'])}, {left / 60:.1f} min left")
    head.eval()
    head.requires_grad_(False)
    score = agreement(head, embed, head_rows, index, features, held_starts, min(head.depth, 6))
    score.update(steps=step, epochs=round(step * batch / max(len(perm), 1), 2), vocab_coverage=round(covered, 4))
    return score
