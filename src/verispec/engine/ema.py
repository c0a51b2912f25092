"""How the engine's running estimates (pass and proposal costs, acceptance rates) take in a measurement."""

from __future__ import annotations

EMA = 0.2                 # weight of a new measurement (costs; acceptance once past its prior)


def running(old: float, new: float, n: int, prior_weight: float = 1.0, ema: float = EMA) -> float:
    """The n-th measurement folded into an estimate whose prior counts as prior_weight measurements:
    a running mean of prior and measurements while 1 / (prior_weight + n) > EMA, an exponential
    moving average after. For costs the prior counts as one: a first measurement that carries
    one-off costs (a model's first call in a process) moves the estimate half-way instead of all
    the way — and does not stop the proposer being tried again. ema: the weight it settles at."""
    weight = max(ema, 1.0 / (prior_weight + n))
    return old + weight * (new - old)
