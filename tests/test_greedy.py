"""sampling.greedy.argmax against torch's argmax: the same index for every input the engine feeds it."""

from __future__ import annotations

import pytest
import torch

from verispec.sampling import accept_greedy, argmax


def _last_max(x: torch.Tensor) -> torch.Tensor:
    """A deliberately broken greedy choice: the last occurrence of the largest value."""
    return x.shape[-1] - 1 - x.flip(-1).argmax(-1)


def _ties(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Scores from three values only: every row's largest value occurs many times."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 3, shape, generator=g).float()


def test_the_same_index_as_torch_on_logits_of_the_real_vocabulary():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 151_936, generator=g) * 8                      # (B, K+1, V)
    got = argmax(x)
    assert got.dtype == torch.int64 and got.shape == (3, 5)
    assert torch.equal(got, x.argmax(-1))


def test_ties_go_to_the_first_occurrence():
    x = _ties((4, 3, 1000), seed=1)
    assert torch.equal(argmax(x), x.argmax(-1))
    # The data can tell a first occurrence from a last one, so a broken tie rule fails the line above.
    assert not torch.equal(_last_max(x), x.argmax(-1))


@pytest.mark.parametrize("values, expected", [
    ([1.0, float("nan"), 3.0, float("nan")], 1),                         # a NaN counts as largest
    ([float("-inf"), float("-inf")], 0),
    ([1.0, float("inf"), float("inf")], 1),
    ([-0.0, 0.0], 0),                                                    # +0 and −0 are equal
    ([0.0, -0.0], 0),
    ([-3.0e38, -3.4e38, -1.0e38], 2),
])
def test_special_values_as_torch_orders_them(values, expected):
    x = torch.tensor(values)
    assert int(argmax(x)) == int(x.argmax()) == expected
    assert argmax(x).dim() == 0


def test_strided_views_and_other_types():
    x = _ties((6, 8, 300), seed=2)
    for view in (x[:, ::2], x[..., 1:], x.transpose(0, 1), x[2, 3]):
        assert torch.equal(argmax(view), view.argmax(-1))
    for other in (x.bfloat16(), x.double(), x.clone().requires_grad_()):   # torch's own argmax
        assert torch.equal(argmax(other), other.argmax(-1))
    with torch.inference_mode():
        y = x * 1
        assert torch.equal(argmax(y), y.argmax(-1))


def test_empty_rows_fail_as_torch_does():
    with pytest.raises((RuntimeError, IndexError)):
        argmax(torch.empty(2, 0))


def test_greedy_acceptance_takes_the_first_of_tied_logits():
    logits = torch.zeros(1, 3, 5)                                        # (B, K+1, V): every token tied
    logits[0, 1, 2] = logits[0, 1, 4] = 1.0
    r = accept_greedy(logits, torch.tensor([[0, 2]]), torch.tensor([2]))
    assert r.emitted(0) == [0, 2, 0]
