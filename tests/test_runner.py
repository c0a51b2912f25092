"""ModelRunner.extend: short catch-ups share a pass, long prefills get a pass each (no padding)."""

from __future__ import annotations

import pytest
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


def split_prefill(model, cut: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Prefill a 150-token prompt whole (slot 0) and as `cut` tokens then the rest (slot 1, as after a
    prefix-cache hit); the two slots' cached keys, (layers, H_kv, 149, D) each."""
    r = ModelRunner(model, num_slots=2, max_len=160)
    prompt = [(7 * i + 3) % model.config.vocab_size for i in range(150)]
    r.extend([0], [prompt])
    r.extend([1], [prompt[: cut + 1]])
    r.extend([1], [prompt])
    assert r.length(0) == r.length(1) == 149
    return r.cache.k[:, 0, :, :149], r.cache.k[:, 1, :, :149]


def test_a_prompt_split_anywhere_caches_the_same_bits():
    """Cold, after a prefix-cache hit or in chunks, a position's keys are bit-identical, so a greedy
    request gets one answer whichever way its prompt reached the cache."""
    from verispec import kernels
    from conftest import int8_model

    model = int8_model(0)
    if not kernels.available() or model.exact_pass_rows(ModelRunner(model, 1, 8).cache.store) is None:
        pytest.skip(f"no row-exact native pass here ({kernels.kernel_status()})")
    for cut in (16, 48, 97):
        whole, split = split_prefill(model, cut)
        assert torch.equal(whole, split), cut


def test_a_prefill_that_ignores_row_exact_passes_is_caught(monkeypatch):
    """The broken variant: long passes on the torch layers, short tails on the native pass."""
    from verispec import kernels
    from conftest import int8_model

    model = int8_model(0)
    if not kernels.available():
        pytest.skip(f"no native pass here ({kernels.kernel_status()})")
    monkeypatch.setattr(model, "exact_pass_rows", lambda store: None)
    whole, split = split_prefill(model, 48)
    assert not torch.equal(whole, split)


def test_prefill_pieces_are_whole_tiles_of_16_rows_unless_a_round_needs_more():
    """Pieces of at most PIECE_ROWS = 64 rows, though a row-exact pass may hold 65: the amx kernels take
    rows 16 at a time, and a 65th would cost a tile sweep of its own. A finishing prompt whose round holds
    64 drafts still gets its 65 rows; the padding limit holds as before."""
    width = ModelRunner.piece_width
    assert runner_mod.PIECE_ROWS % 16 == 0 and runner_mod.PIECE_ROWS == 64
    assert width([3090], 65) == 64                           # long prompts: pieces of 64, not 65
    assert width([3090], 65, least=65) == 65                 # the round's pending token and 64 drafts
    assert width([125], 65) == 64                            # two pieces of 64, 3 rows of padding
    assert width([70], 65) == 35                             # 64 would pad 70 to 128: two of 35
    assert width([40], 65) == 40 and width([5, 7], 65) == 1   # 7 would pad 12 rows to 14
    assert width([3090], 32) == 32                           # a narrower row-exact pass stays the bound
