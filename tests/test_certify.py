"""`verify` passes a correct sampler and flags a deliberately broken acceptance rule (tiny models)."""

from __future__ import annotations

import verispec.engine.spec_round as spec_round
from verispec import LLM, SamplingParams
from verispec.certify import certify
from conftest import tiny_model
from stat_harness import recover_from_p

PROMPTS = [[1, 5, 9, 2, 7]]


def llms():
    target = tiny_model(0, scale=0.6)      # flatter logits: many tokens carry mass
    draft = tiny_model(1, scale=0.6, num_layers=1)
    return LLM(target, draft=draft, proposer="draft", k=3, max_batch=512), LLM(target, proposer="none", max_batch=512)


def test_verify_certifies_the_real_sampler():
    spec, plain = llms()
    report = certify(spec, plain, PROMPTS, SamplingParams(temperature=1.0, seed=0), samples=3000)
    assert report["verdict"] == "lossless", report["checks"]


def test_verify_flags_a_broken_residual(monkeypatch):
    monkeypatch.setattr(spec_round, "accept_sampling", recover_from_p)
    spec, plain = llms()
    report = certify(spec, plain, PROMPTS, SamplingParams(temperature=1.0, seed=0), samples=3000)
    assert report["verdict"] == "biased"
