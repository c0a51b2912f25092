"""ModelRunner.extend: short catch-ups share a pass, long prefills get a pass each (no padding)."""

from __future__ import annotations

import torch

from verispec.models import runner as runner_mod
from verispec.models.runner import ModelRunner
from conftest import tiny_model


def passes(monkeypatch, r: ModelRunner) -> list[list[int]]:
    calls = []
    real = r.forward

    def spy(slots, chunks, rows):
        calls.append([len(c) for c in chunks])
        return real(slots, chunks, rows)

    monkeypatch.setattr(r, "forward", spy)
    return calls


def test_long_prefills_run_one_sequence_per_pass_and_short_catch_ups_share_one(monkeypatch):
    model = tiny_model(0)
    r = ModelRunner(model, num_slots=3, max_len=128)
    calls = passes(monkeypatch, r)
    long, short = list(range(1, 61)), list(range(1, 11))
    r.extend([0, 1], [long, short])
    assert calls == [[59], [9]]                                   # not one pass padded to 59 × 2 rows
    calls.clear()
    r.extend([0, 1], [long + [3, 4, 5], short + [6, 7]])          # catch-ups of 3 and 2 tokens
    assert calls == [[3, 2]]


def test_separate_prefills_leave_the_cache_as_prefilling_alone_does():
    model = tiny_model(0)
    together, alone = ModelRunner(model, 2, 128), ModelRunner(model, 1, 128)
    prompts = [list(range(3, 70)), list(range(5, 30))]
    together.extend([0, 1], prompts)
    for slot, p in enumerate(prompts):
        alone.cache.set_length(0, 0)
        alone.extend([0], [p])
        n = len(p) - 1
        assert torch.equal(together.cache.k[:, slot, :, :n], alone.cache.k[:, 0, :, :n])
        assert together.length(slot) == n
    assert runner_mod.SHARED_PASS_MAX < 30
