"""warp_probs (temperature, top-k, top-p) against a float64 reference that sorts the whole row."""

from __future__ import annotations

import pytest
import torch

from verispec.sampling import warp_probs
from verispec.sampling.warp import TOP_P_FIRST


def reference(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """One row (V,) -> probs (V,), by the documented rule, in float64 over a full sort."""
    x = logits.double() / max(temperature, 1e-6)
    v = x.numel()
    if 0 < top_k < v:
        kth = x.sort(descending=True).values[top_k - 1]
        x = x.masked_fill(x < kth, float("-inf"))
    if top_p < 1.0:
        p = torch.softmax(x, -1)
        srt = p.sort(descending=True).values
        before = srt.cumsum(-1) - srt                       # mass of the strictly better ones
        least = srt[int((before < top_p).sum()) - 1]        # the last one the prefix takes
        x = x.masked_fill(p < least, float("-inf"))
    return torch.softmax(x, -1)


def warp(rows: torch.Tensor, params: list[tuple[float, int, float]]) -> torch.Tensor:
    """rows (B, R, V) with one (temperature, top_k, top_p) per row b."""
    t, k, p = zip(*params)
    return warp_probs(rows, torch.tensor(t), torch.tensor(k), torch.tensor(p))


def fragile(row: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """(V,) bool: tokens whose top-p decision rests on rounding — the mass of the tokens better than
    them lies within 1e-4 of top_p, where a float32 sum in another order may fall either side."""
    if top_p >= 1.0:
        return torch.zeros(row.numel(), dtype=torch.bool)
    p = reference(row, temperature, top_k, 1.0)
    srt, order = p.sort(descending=True)
    before = torch.empty_like(p).scatter_(0, order, srt.cumsum(-1) - srt)
    return (before - top_p).abs() < 1e-4


def test_the_documented_example():
    probs = torch.tensor([0.5, 0.3, 0.2])
    out = warp(probs.log()[None, None], [(1.0, 0, 0.7)])[0, 0]
    assert torch.allclose(out, torch.tensor([0.625, 0.375, 0.0]))


@pytest.mark.parametrize("v, scale", [(50, 3.0), (1000, 2.0), (5000, 0.3), (151_936, 4.0)])
def test_rows_with_their_own_settings_match_the_reference(v, scale):
    g = torch.Generator().manual_seed(v)
    settings = [(0.7, 0, 0.9), (1.0, 0, 1.0), (1.3, 5, 0.95), (0.5, 40, 1.0), (1.0, 0, 0.5), (2.0, 0, 0.99)]
    rows = torch.randn(len(settings), 2, v, generator=g) * scale          # (B, R, V)
    out = warp(rows, settings)
    checked = 0
    for b, (t, k, p) in enumerate(settings):
        for r in range(2):
            ref = reference(rows[b, r], t, k, p)
            differ = (out[b, r] > 0) != (ref > 0)
            assert not (differ & ~fragile(rows[b, r], t, k, p)).any(), (b, r)
            if not differ.any():
                assert torch.allclose(out[b, r].double(), ref, rtol=1e-4, atol=1e-7)
                checked += 1
    assert checked >= 10


def test_a_flat_row_needs_more_than_the_first_candidates():
    v = 20_000
    rows = torch.randn(1, 1, v, generator=torch.Generator().manual_seed(3)) * 0.05     # nearly uniform
    out = warp(rows, [(1.0, 0, 0.9)])[0, 0]
    kept = int((out > 0).sum())
    assert kept > 8 * TOP_P_FIRST                                          # the widening was needed
    assert torch.equal(out > 0, reference(rows[0, 0], 1.0, 0, 0.9) > 0)


def test_ties_at_the_top_p_boundary_are_all_kept():
    logits = torch.tensor([3.0, 1.0, 1.0, 1.0, 0.0]).log_softmax(-1)      # the prefix ends among the 1.0s
    probs = logits.exp()
    top_p = float(probs[0] + probs[1] * 1.5)
    out = warp(logits[None, None], [(1.0, 0, top_p)])[0, 0]
    assert (out > 0).tolist() == [True, True, True, True, False]


def test_ties_at_the_top_k_boundary_are_all_kept():
    logits = torch.tensor([[[4.0, 2.0, 2.0, 2.0, 1.0]]])
    out = warp(logits, [(1.0, 2, 1.0)])[0, 0]
    assert (out > 0).tolist() == [True, True, True, True, False]


def test_a_row_with_both_off_is_the_plain_softmax_beside_rows_that_warp():
    rows = torch.randn(3, 4, 3000, generator=torch.Generator().manual_seed(5)) * 2
    out = warp(rows, [(0.8, 10, 0.9), (0.8, 0, 1.0), (0.8, 0, 0.5)])
    assert torch.equal(out[1], warp(rows[1:2], [(0.8, 0, 1.0)])[0])        # its neighbours change nothing
    assert torch.allclose(out[1], torch.softmax(rows[1] / 0.8, -1), rtol=1e-5, atol=1e-9)
    assert (out[1] > 0).all()


@pytest.mark.parametrize("v", [3000, 151_936, 151_936 + 64])
@pytest.mark.parametrize("k", [1, 5, 64, 512])
def test_top_values_are_torch_topk_values(v, k):
    """The chunked selection against torch.topk, on rows whose largest values crowd into one chunk, tie
    across chunks, or sit in the vocabulary's last chunk; widths where it falls back to torch.topk too."""
    from verispec.sampling.warp import _top_values

    x = torch.randn(2, 3, v, generator=torch.Generator().manual_seed(v + k))
    x[0, 0, 200:328] += 6.0                              # one chunk holds the best 128
    x[0, 1, ::997] = 9.0                                 # ties spread over many chunks
    x[1, 0, -100:] += 5.0                                # the best at the end of the row
    x[1, 2, : v // 2] = float("-inf")
    assert torch.equal(_top_values(x, k), torch.topk(x, k, dim=-1).values)


def test_rows_ending_in_minus_infinity():
    row = torch.full((1, 1, 300), float("-inf"))
    row[0, 0, :3] = torch.tensor([1.0, 0.5, 0.2])
    out = warp(row, [(1.0, 0, 0.7)])[0, 0]                               # probs 0.49, 0.30, 0.22
    assert torch.allclose(out, reference(row[0, 0], 1.0, 0, 0.7).float())
    assert int((out > 0).sum()) == 2
