"""`verispec verify`: a statistical certificate that speculative sampling reproduces the target.

For a few short prompts we compute the target's exact (warped) distribution of the first token,
and of the second token given each likely first token, then sample many two-token continuations
with speculative decoding (and with plain sampling as a control) and test the samples against the
exact distribution: chi-square on cells with expected count ≥ 5 (the rest pooled), total variation,
and the resolution the run had (the smallest total-variation bias it could reliably detect).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from verispec.engine.llm import LLM
from verispec.engine.params import SamplingParams
from verispec.models import KVCache
from verispec.sampling import warp_probs

DEFAULT_PROMPTS = ["def add(a, b):\n    return", "The capital of France is", "for i in range(", "Once upon a time"]
MIN_EXPECTED = 5.0


@dataclass
class Check:
    prompt: str | list[int]
    position: int              # 1 = first generated token, 2 = second (joint with the first)
    source: str                # "speculative" | "plain"
    samples: int
    cells: int                 # well-populated cells tested (+1 pooled)
    chi2_p: float
    tv: float
    resolution_tv: float       # biases of about this total variation would be detected

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def exact_distributions(llm: LLM, prompt_ids: list[int], params: SamplingParams, mass: float = 0.999,
                        max_first: int = 64) -> tuple[np.ndarray, dict[int, np.ndarray]]:
    """p(x1) over the vocabulary, and p(x2 | x1) for the most likely first tokens covering `mass`."""
    model = llm.target.model
    greedy = params.temperature == 0

    def warped(logits: torch.Tensor) -> torch.Tensor:                      # (B, V) -> (B, V)
        if greedy:
            return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
        b = logits.shape[0]
        return warp_probs(logits[:, None], torch.full((b,), params.temperature),
                          torch.full((b,), params.top_k), torch.full((b,), params.top_p))[:, 0]

    t = len(prompt_ids)
    cache = KVCache.for_model(model.config, 1, t + 2, model.dtype, model.device)
    pos = torch.arange(t)[None]
    p1 = warped(model.logits(model(torch.tensor([prompt_ids]), pos, cache.view([0], pos)),
                             torch.tensor([[t - 1]]))[:, 0])[0]                # (V,)
    order = torch.argsort(p1, descending=True)
    firsts = []
    acc = 0.0
    for tok in order.tolist()[:max_first]:
        if p1[tok] <= 0:
            break
        firsts.append(tok)
        acc += float(p1[tok])
        if acc >= mass:
            break
    b = len(firsts)
    cache = KVCache.for_model(model.config, b, t + 2, model.dtype, model.device)
    ids = torch.tensor([prompt_ids + [x] for x in firsts])
    pos = torch.arange(t + 1)[None].repeat(b, 1)
    p2 = warped(model.logits(model(ids, pos, cache.view(list(range(b)), pos)), torch.full((b, 1), t))[:, 0])
    return p1.double().numpy(), {x: p2[i].double().numpy() for i, x in enumerate(firsts)}


def goodness_of_fit(counts: np.ndarray, probs: np.ndarray) -> tuple[float, int, float]:
    """Chi-square p-value of observed counts against probabilities (cells with expected < 5 pooled),
    the number of tested cells, and the total variation between empirical and exact."""
    from scipy import stats

    n = counts.sum()
    expected = probs * n
    big = expected >= MIN_EXPECTED
    obs = list(counts[big]) + [counts[~big].sum()]
    exp = list(expected[big]) + [expected[~big].sum()]
    if exp[-1] < MIN_EXPECTED:                       # merge a thin pooled cell into the smallest big one
        obs, exp = obs[:-1], exp[:-1]
        if obs:
            obs[-1] += counts[~big].sum()
            exp[-1] += expected[~big].sum()
    tv = 0.5 * float(np.abs(counts / n - probs).sum())
    if len(obs) < 2:
        return 1.0, len(obs), tv
    exp_arr = np.array(exp) * (sum(obs) / sum(exp))
    return float(stats.chisquare(np.array(obs), exp_arr).pvalue), len(obs), tv


def resolution(cells: int, samples: int) -> float:
    """Total variation that a chi-square test with this many cells and samples detects reliably
    (noncentrality ≈ 4·N·TV²/cells must clear the test's noise, ≈ 3·sqrt(2·df) + 10)."""
    df = max(1, cells - 1)
    return math.sqrt((3 * math.sqrt(2 * df) + 10) * max(cells, 2) / (4 * samples))


def certify(spec: LLM, plain: LLM, prompts: list[str | list[int]], params: SamplingParams, samples: int,
            alpha: float = 1e-3, progress=None) -> dict:
    """Sample `samples` two-token continuations per prompt with `spec` and `plain`; test both
    against the exact target distribution. Returns the full report with a verdict."""
    checks: list[Check] = []
    for prompt in prompts:
        ids = spec.encode(prompt)
        p1, p2 = exact_distributions(spec, ids, params)
        run = SamplingParams(temperature=params.temperature, top_k=params.top_k, top_p=params.top_p,
                             max_tokens=2, seed=params.seed, n=samples, ignore_eos=True)
        for source, llm in (("speculative", spec), ("plain", plain)):
            outs = llm.generate([ids], run)
            if progress:
                progress(prompt, source)
            firsts = np.array([o.token_ids[0] for o in outs])
            counts1 = np.bincount(firsts, minlength=len(p1)).astype(float)
            pv, cells, tv = goodness_of_fit(counts1, p1)
            checks.append(Check(prompt, 1, source, samples, cells, pv, tv, resolution(cells, samples)))
            # Second token: joint cells (x1, x2) for first tokens whose conditional we computed.
            joint_probs, joint_counts = [], []
            for x1, cond in p2.items():
                seconds = np.array([o.token_ids[1] for o in outs if o.token_ids[0] == x1 and len(o.token_ids) > 1],
                                   dtype=np.int64)                  # may be empty: x1 never sampled
                joint_probs.append(p1[x1] * cond)
                joint_counts.append(np.bincount(seconds, minlength=len(cond)).astype(float))
            covered = sum(p1[x] for x in p2)
            probs = np.concatenate(joint_probs + [np.array([max(0.0, 1.0 - covered)])])
            other = float(sum(1 for o in outs if o.token_ids[0] not in p2))
            counts = np.concatenate(joint_counts + [np.array([other])])
            pv, cells, tv = goodness_of_fit(counts, probs / probs.sum())
            checks.append(Check(prompt, 2, source, samples, cells, pv, tv, resolution(cells, samples)))
    n_tests = len(checks)
    threshold = alpha / n_tests                                     # Bonferroni over all checks
    spec_checks = [c for c in checks if c.source == "speculative"]
    biased = any(c.chi2_p < threshold for c in spec_checks)
    control_failed = any(c.chi2_p < threshold for c in checks if c.source == "plain")
    verdict = "biased" if biased else ("inconclusive" if control_failed else "lossless")
    return {"verdict": verdict, "threshold": threshold, "alpha": alpha,
            "resolution_tv": max(c.resolution_tv for c in spec_checks),
            "checks": [c.to_dict() for c in checks]}
