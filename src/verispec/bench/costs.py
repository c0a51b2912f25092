"""Speedups from measured costs: the DESIGN formula's prediction and a run's accounted speedup (the
costs themselves are measured by engine/calibrate.py)."""

from __future__ import annotations

from verispec.engine.calibrate import c_p_at


def predicted_speedup(alpha: float, k: int, c_q: float, c_p: dict[int, float]) -> float:
    """E · c_p(1) / (K · c_q + c_p(K+1)) with E = (1 − α^{K+1}) / (1 − α) (DESIGN.md)."""
    e = float(k + 1) if alpha >= 1 else (1 - alpha ** (k + 1)) / (1 - alpha)
    return e * c_p[1] / (k * c_q + c_p[k + 1])


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
