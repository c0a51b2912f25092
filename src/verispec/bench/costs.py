"""Measured costs on this machine: c_p(n), one target pass over n new tokens, and c_q, one draft step."""

from __future__ import annotations

import statistics
import time

import torch

from verispec.models import KVCache, Transformer


def pass_costs(model: Transformer, widths: list[int], context: int = 128, repeats: int = 5,
                on_round=None) -> dict[int, float]:
    """Median seconds of one forward pass over n new tokens after `context` cached tokens, logits
    for all n rows (what a verify pass computes), for each n in widths.

    The widths are measured round-robin — every round times each width once — so a slow spell of a
    shared machine falls on all widths alike instead of on whichever was being measured."""
    widths = sorted(set(widths))
    top = max(widths)
    cache = KVCache.for_model(model.config, 1, context + top + 1, model.dtype, model.device)
    ids = torch.randint(0, model.config.vocab_size, (1, context + top))
    pos = torch.arange(context)[None]
    model(ids[:, :context], pos, cache.view([0], pos))
    times: dict[int, list[float]] = {n: [] for n in widths}
    for r in range(repeats + 1):                 # round 0 warms up
        for n in widths:
            new_pos = torch.arange(context, context + n)[None]
            t = time.perf_counter()
            model.logits(model(ids[:, context:context + n], new_pos, cache.view([0], new_pos)), torch.arange(n)[None])
            if r:
                times[n].append(time.perf_counter() - t)
        if on_round:
            on_round(r, repeats)
    return {n: statistics.median(v) for n, v in times.items()}


def pass_cost(model: Transformer, n: int, context: int = 128, repeats: int = 5) -> float:
    """pass_costs for one width."""
    return pass_costs(model, [n], context, repeats)[n]


def predicted_speedup(alpha: float, k: int, c_q: float, c_p: dict[int, float]) -> float:
    """E · c_p(1) / (K · c_q + c_p(K+1)) with E = (1 − α^{K+1}) / (1 − α) (DESIGN.md)."""
    e = float(k + 1) if alpha >= 1 else (1 - alpha ** (k + 1)) / (1 - alpha)
    return e * c_p[1] / (k * c_q + c_p[k + 1])


def c_p_at(c_p: dict[int, float], n: int) -> float:
    """c_p(n) from the measured widths: exact, linear between the two nearest, or extended along
    the widest two."""
    if n in c_p:
        return c_p[n]
    widths = sorted(c_p)
    below, above = [w for w in widths if w < n], [w for w in widths if w > n]
    if below and above:
        lo, hi = below[-1], above[0]
    else:                                   # beyond the measured widths: the nearest two
        lo, hi = (widths[-2], widths[-1]) if below else (widths[0], widths[1])
    return c_p[lo] + (c_p[hi] - c_p[lo]) * (n - lo) / (hi - lo)


def accounted_speedup(specs: list[dict], c_p: dict[int, float]) -> float | None:
    """Speedup from counts instead of the wall clock: plain decoding would spend c_p(1) on each token
    the rounds produced (rounds + accepted drafts); the rounds spent c_p(K+1) each (by the run's K
    histogram) plus the proposer's measured seconds (drafting, a draft model's catch-up prefill).

    c_p is measured once per bench run for every mode, so a slow spell of the machine while one mode
    ran does not enter: this resolves differences of a few per cent that paired wall-clock ratios on a
    shared machine cannot. It leaves out per-round work outside the passes (the same in every mode
    to within a millisecond) and assumes a pass costs the same in every mode."""
    if len(c_p) < 2 or not specs:
        return None
    plain = spent = 0.0
    for s in specs:
        plain += (s["rounds"] + s["accepted"]) * c_p[1]
        spent += sum(rounds * c_p_at(c_p, int(k) + 1) for k, rounds in s["k_histogram"].items()) + s["draft_s"]
    return plain / spent if spent else None
