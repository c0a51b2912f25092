"""Training Medusa heads on this CPU (`verispec train-head`).

1. Features, teacher-forced: the target reads windows of text (row-exact passes, as in serving) and
   keeps, per position t, its final-normed state h_t (float16) and its own greedy next token a_t.
   Stored in shards under the cache, so an interrupted run resumes where it stopped.
2. Labels: head i at position t learns a_{t+i} — what the target itself would say i tokens after the
   token it predicts at t. Learning the target's choices (not the text's) is what acceptance rewards.
3. Training: cross-entropy over the heads' vocabulary through the target's frozen LM head rows,
   AdamW with a cosine schedule sized to the time budget; head i's loss weighs 0.8^(i−1) (Medusa-1).
   Held-out windows give top-1 agreement per head and the chain acceptance (heads 1 … i all right),
   printed as it learns.
"""

from __future__ import annotations

import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from verispec.cache import atomic_file, save_tensors
from verispec.heads.medusa import MedusaHeads
from verispec.models import Transformer
from verispec.models.runner import ModelRunner

WINDOW = 512               # tokens per teacher-forced window
SHARD_WINDOWS = 16         # windows per feature shard (8,192 positions)
HELDOUT_EVERY = 20         # every 20th window is held out


@dataclass
class Features:
    states: torch.Tensor    # (P, C) float16 final-normed target states
    argmax: torch.Tensor    # (P,) int64 the target's greedy next token at each position
    starts: torch.Tensor    # (W + 1,) window boundaries into P
    tokens: torch.Tensor | None = None   # (P,) int64 the text's token at each position


def windows_of(token_lists: list[list[int]], window: int = WINDOW, min_tail: int | None = None) -> list[list[int]]:
    """Documents cut into windows of `window` tokens; a last window shorter than min_tail (default:
    a whole window) is dropped."""
    keep = window if min_tail is None else min_tail
    out = []
    for ids in token_lists:
        out.extend(w for w in (ids[i: i + window] for i in range(0, len(ids), window)) if len(w) >= keep)
    return out


@torch.inference_mode()
def extract(model: Transformer, windows: list[list[int]], out_dir: Path,
            on_progress: Callable[[int, int, int, int, float], None] | None = None) -> Features:
    """Teacher-forced states and greedy tokens for every window (shards kept in out_dir, reused).
    on_progress(windows done, windows, tokens read in this run, tokens left, seconds) after each window."""
    from safetensors.torch import load_file

    out_dir.mkdir(parents=True, exist_ok=True)
    runner = ModelRunner(model, 1, max(len(w) for w in windows))
    step = model.exact_pass_rows(runner.cache.store) or 64
    shards = [windows[i: i + SHARD_WINDOWS] for i in range(0, len(windows), SHARD_WINDOWS)]
    parts, start, done, read, left = [], time.perf_counter(), 0, 0, sum(map(len, windows))
    for n, shard in enumerate(shards):
        path = out_dir / f"shard-{n:05d}.safetensors"
        if path.exists():
            try:
                parts.append(load_file(str(path)))
                done += len(shard)
                left -= sum(map(len, shard))
                continue
            except Exception:                # a damaged shard is made again
                path.unlink(missing_ok=True)
        states, argmax = [], []
        for ids in shard:
            runner.cache.set_length(0, 0)
            for at in range(0, len(ids), step):
                chunk = ids[at: at + step]
                logits, h = runner.forward([0], [chunk], [list(range(len(chunk)))], states=True)   # (1, R, V), (1, R, C)
                states.append(h[0].to(torch.float16))
                argmax.append(logits[0].argmax(-1))
                runner.cache.set_length(0, runner.length(0) + len(chunk))
            done, read, left = done + 1, read + len(ids), left - len(ids)
            if on_progress:
                on_progress(done, len(windows), read, left, time.perf_counter() - start)
        part = {"states": torch.cat(states), "argmax": torch.cat(argmax),
                "lengths": torch.tensor([len(w) for w in shard], dtype=torch.long)}
        with atomic_file(path) as tmp:
            save_tensors(part, tmp)
        parts.append(part)
    lengths = torch.cat([p["lengths"] for p in parts])
    return Features(torch.cat([p["states"] for p in parts]), torch.cat([p["argmax"] for p in parts]),
                    torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)]),
                    torch.tensor([t for w in windows for t in w], dtype=torch.long))


def labelled_rows(features: Features, num_heads: int, windows: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions t of the given windows and their labels a_{t+1} … a_{t+H}: (P',) and (P', H), -1 where
    t + i runs past the window's end."""
    rows, labels = [], []
    for w in windows:
        a, b = int(features.starts[w]), int(features.starts[w + 1])
        t = torch.arange(a, b)
        idx = t[:, None] + torch.arange(1, num_heads + 1)[None, :]                 # (T, H)
        lab = features.argmax[idx.clamp(max=b - 1)]
        rows.append(t)
        labels.append(torch.where(idx < b, lab, torch.full_like(lab, -1)))
    return torch.cat(rows), torch.cat(labels)


def split_windows(num: int) -> tuple[list[int], list[int]]:
    """(held-out, training) window indices: every HELDOUT_EVERY-th window is held out."""
    held = [w for w in range(num) if w % HELDOUT_EVERY == HELDOUT_EVERY - 1] or [num - 1]
    fit = [w for w in range(num) if w not in set(held)] or held
    return held, fit


def training_tokens(features: Features) -> torch.Tensor:
    """The target's tokens at the training (not held-out) positions."""
    _, fit = split_windows(len(features.starts) - 1)
    return torch.cat([features.argmax[int(features.starts[w]): int(features.starts[w + 1])] for w in fit])


def heads_vocab(argmax: torch.Tensor, n: int, fill: torch.Tensor) -> torch.Tensor:
    """The heads' n tokens (sorted ids): those the target itself chose most often in the features
    (ties: the lower id), then tokens of `fill` (e.g. the most frequent in a text collection) until
    there are n — so the heads can propose what the target says in the text they learn from."""
    counts = torch.bincount(argmax, minlength=int(max(argmax.max(), fill.max())) + 1)
    said = torch.argsort(-counts, stable=True)[: int((counts > 0).sum())][:n]
    extra = fill[~torch.isin(fill, said)][: n - len(said)]
    return torch.sort(torch.cat([said, extra])).values


def agreement(heads: MedusaHeads, head_rows: torch.Tensor, features: Features, rows: torch.Tensor,
              labels: torch.Tensor, batch: int = 1024) -> dict:
    """Top-1 agreement of each head with the target's own token, and the chain acceptance (heads 1 … i
    all right) — the greedy acceptance by draft position, teacher-forced."""
    hits, valid = [], []
    with torch.no_grad():
        for i in range(0, len(rows), batch):
            h = features.states[rows[i: i + batch]].float()                          # (b, C)
            logits = heads(h) @ head_rows.T                                          # (b, H, N)
            guess = heads.vocab[logits.argmax(-1)]                                   # (b, H)
            lab = labels[i: i + batch]
            hits.append((guess == lab) & (lab >= 0))
            valid.append(lab >= 0)
    hit, ok = torch.cat(hits), torch.cat(valid)
    per_head = (hit.sum(0) / ok.sum(0).clamp_min(1)).tolist()
    full = ok.all(1)
    chain = torch.cumprod(hit[full].float(), dim=1).mean(0).tolist() if full.any() else []
    return {"top1": [round(x, 4) for x in per_head], "chain": [round(x, 4) for x in chain],
            "positions": int(len(rows))}


def train(heads: MedusaHeads, head_rows: torch.Tensor, features: Features, minutes: float,
          lr: float = 1e-3, batch: int = 256, log: Callable[[str], None] = print, seed: int = 0,
          max_steps: int | None = None) -> dict:
    """Fit heads (in place) to the features within `minutes` (or `max_steps`, whichever comes first:
    a step budget makes a run independent of the machine's speed); returns the held-out agreement."""
    torch.manual_seed(seed)
    held, fit = split_windows(len(features.starts) - 1)
    rows, labels = labelled_rows(features, heads.num_heads, fit)
    hrows, hlabels = labelled_rows(features, heads.num_heads, held)
    index = torch.full((int(max(features.argmax.max(), heads.vocab.max())) + 1,), -1, dtype=torch.long)
    index[heads.vocab] = torch.arange(len(heads.vocab))
    targets = torch.where(labels >= 0, index[labels.clamp_min(0)], torch.full_like(labels, -1))   # (P, H)
    covered = float((targets >= 0).sum() / (labels >= 0).sum().clamp_min(1))
    log(f"{len(rows):,} training positions, {len(hrows):,} held out; the heads' {len(heads.vocab):,}-token "
        f"vocabulary holds {covered:.1%} of the target's tokens")
    weights = torch.tensor([0.8 ** i for i in range(heads.num_heads)])
    opt = torch.optim.AdamW([heads.weight, heads.bias], lr=lr, weight_decay=0.0)
    heads.requires_grad_(True)
    budget, start, step, total = minutes * 60, time.perf_counter(), 0, max_steps
    perm = torch.randperm(len(rows))
    evaluated = time.perf_counter()
    while True:
        elapsed = time.perf_counter() - start
        if elapsed >= budget or (max_steps is not None and step >= max_steps):
            break
        if step == 20 and max_steps is None:               # size the cosine schedule to the budget from the first steps
            total = max(40, int(budget / (elapsed / 20)))
        frac = min(1.0, step / total) if total else 0.0
        for g in opt.param_groups:
            g["lr"] = lr * (0.5 * (1 + math.cos(math.pi * frac))) if total else lr
        at = (step * batch) % len(rows)
        pick = perm[at: at + batch]
        h = features.states[rows[pick]].float()                                       # (b, C)
        logits = heads(h) @ head_rows.T                                               # (b, H, N)
        loss = sum(weights[i] * F.cross_entropy(logits[:, i], targets[pick, i], ignore_index=-1)
                   for i in range(heads.num_heads))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        step += 1
        if time.perf_counter() - evaluated > 60 or step == 1:
            evaluated = time.perf_counter()
            heads.requires_grad_(False)
            score = agreement(heads, head_rows, features, hrows[:4096], hlabels[:4096])
            heads.requires_grad_(True)
            left = max(0.0, budget - (time.perf_counter() - start))
            log(f"step {step:,} ({step * batch / len(rows):.2f} epochs), loss {loss.item():.3f}, held-out "
                f"chain acceptance {' / '.join(f'{x:.2f}' for x in score['chain'])}, {left / 60:.1f} min left")
    heads.requires_grad_(False)
    score = agreement(heads, head_rows, features, hrows, hlabels)
    score.update(steps=step, epochs=round(step * batch / len(rows), 2), vocab_coverage=round(covered, 4))
    return score


def progress_line(done: int, total: int, read: int, left: int, seconds: float) -> None:
    rate = read / max(seconds, 1e-9)
    sys.stderr.write(f"\rfeatures: {done}/{total} windows ({rate:.0f} tokens/s, {left / max(rate, 1e-9) / 60:.1f} min left)")
    if done == total:
        sys.stderr.write("\n")
    sys.stderr.flush()


def record(path: Path, info: dict) -> None:
    """The command, corpus and held-out figures beside the heads file (`<file>.json`)."""
    with atomic_file(path.with_name(path.name + ".json")) as tmp:
        tmp.write_text(json.dumps(info, indent=1) + "\n")
