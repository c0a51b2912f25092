"""Measured costs on this machine: c_p(n), one target pass over n new tokens, and c_q, one draft step."""

from __future__ import annotations

import statistics
import time

import torch

from verispec.models import KVCache, Transformer


def pass_cost(model: Transformer, n: int, context: int = 128, repeats: int = 5) -> float:
    """Median seconds of one forward pass over n new tokens after `context` cached tokens,
    logits for all n rows (what a verify pass computes)."""
    cache = KVCache.for_model(model.config, 1, context + n + 1, model.dtype, model.device)
    ids = torch.randint(0, model.config.vocab_size, (1, context + n))
    pos = torch.arange(context)[None]
    model(ids[:, :context], pos, cache.view([0], pos))
    times = []
    new_pos = torch.arange(context, context + n)[None]
    rows = torch.arange(n)[None]
    for _ in range(repeats + 1):
        t = time.perf_counter()
        model.logits(model(ids[:, context:], new_pos, cache.view([0], new_pos)), rows)
        times.append(time.perf_counter() - t)
    return statistics.median(times[1:])


def predicted_speedup(alpha: float, k: int, c_q: float, c_p: dict[int, float]) -> float:
    """E · c_p(1) / (K · c_q + c_p(K+1)) with E = (1 − α^{K+1}) / (1 − α) (DESIGN.md)."""
    e = float(k + 1) if alpha >= 1 else (1 - alpha ** (k + 1)) / (1 - alpha)
    return e * c_p[1] / (k * c_q + c_p[k + 1])
