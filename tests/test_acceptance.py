"""Hand-built logits: each case computed by hand from the rule in sampling/acceptance.py."""

from __future__ import annotations

import pytest
import torch

from verispec.sampling import accept_greedy, accept_sampling

NEG = -1e9


def one_hot_logits(rows: list[int], v: int = 6) -> torch.Tensor:
    """(len(rows), V) logits whose argmax is rows[i]."""
    x = torch.full((len(rows), v), NEG)
    x[torch.arange(len(rows)), torch.tensor(rows)] = 0.0
    return x


def greedy(targets: list[list[int]], drafts: list[list[int]], num_draft: list[int] | None = None):
    logits = torch.stack([one_hot_logits(t) for t in targets])          # (B, K+1, V)
    d = torch.tensor(drafts)
    n = torch.tensor(num_draft if num_draft is not None else [d.shape[1]] * d.shape[0])
    return accept_greedy(logits, d, n)


def test_greedy_perfect_match_gets_bonus():
    r = greedy([[1, 2, 3, 4]], [[1, 2, 3]])
    assert r.num_accepted.tolist() == [3]
    assert r.emitted(0) == [1, 2, 3, 4]


def test_greedy_early_mismatch_emits_target_token():
    r = greedy([[1, 2, 3, 4]], [[1, 5, 3]])
    assert r.num_accepted.tolist() == [1]
    assert r.emitted(0) == [1, 2]
    assert r.tokens[0].tolist() == [1, 2, -1, -1]


def test_greedy_first_mismatch():
    r = greedy([[0, 2, 3, 4]], [[1, 2, 3]])
    assert r.emitted(0) == [0]


def test_empty_draft_is_plain_decoding():
    logits = one_hot_logits([4])[None]                                    # (1, 1, V)
    r = accept_greedy(logits, torch.zeros(1, 0, dtype=torch.long), torch.tensor([0]))
    assert r.emitted(0) == [4]
    p = torch.softmax(one_hot_logits([4])[None], -1)
    s = accept_sampling(p, torch.zeros(1, 0, dtype=torch.long), None, torch.tensor([0]), [torch.Generator()])
    assert s.emitted(0) == [4]


@pytest.mark.parametrize("shared", [True, False])
def test_sampling_with_nothing_drafted_draws_from_p_as_a_round_with_drafts_would(shared):
    """No drafts: each row's token is p_0 sampled with its generator's next uniform, one uniform taken —
    the same token and the same stream as the rows of a round with drafts that all took K = 0."""
    from verispec.sampling.acceptance import inverse_cdf

    p = torch.softmax(torch.randn(3, 1, 500, generator=torch.Generator().manual_seed(0)) * 3, -1)
    seeds = [7, 7, 7] if shared else [7, 8, 9]
    gens = [torch.Generator().manual_seed(s) for s in dict.fromkeys(seeds)]
    rows = [gens[0]] * 3 if shared else gens
    twin = [torch.Generator().manual_seed(s) for s in dict.fromkeys(seeds)]
    next_u = lambda: (torch.rand(3, 1, generator=twin[0])[:, 0] if shared                # (3,) a uniform per row
                      else torch.cat([torch.rand(1, generator=g) for g in twin]))
    for _ in range(3):
        r = accept_sampling(p, torch.zeros(3, 0, dtype=torch.long), None, torch.zeros(3, dtype=torch.long), rows)
        assert r.num_accepted.tolist() == [0, 0, 0] and r.overlap.shape == (3, 0)
        assert r.tokens[:, 0].tolist() == inverse_cdf(p[:, 0], next_u()).tolist()


def test_point_mass_drafts_are_one_hot_q_without_building_it():
    """q = None (prompt lookup, greedy drafters) against the same drafts with q given as one-hot rows:
    the same accepted counts, tokens (recovered ones included) and overlaps, bit for bit, from the same
    generators — over rows that accept, reject, reject with p(x̃) = 0, and draft fewer than K."""
    g = torch.Generator().manual_seed(1)
    for trial in range(40):
        b, k, v = 3, 4, 50
        p = torch.softmax(torch.randn(b, k + 1, v, generator=g) * 2, -1)
        drafts = torch.randint(0, v, (b, k), generator=g)
        drafts[0] = p[0, :k].argmax(-1)                                     # likely accepted
        p[1, 1, drafts[1, 1]] = 0.0                                         # certain rejection at position 1
        p[1, 1] /= p[1, 1].sum()
        num_draft = torch.tensor([k, k, 2])
        one_hot = torch.zeros(b, k, v).scatter_(-1, drafts[..., None], 1.0)
        seeds = [trial, trial + 100, trial + 200]
        a = accept_sampling(p, drafts, None, num_draft, [torch.Generator().manual_seed(s) for s in seeds])
        c = accept_sampling(p, drafts, one_hot, num_draft, [torch.Generator().manual_seed(s) for s in seeds])
        assert torch.equal(a.num_accepted, c.num_accepted) and torch.equal(a.tokens, c.tokens)
        assert torch.equal(a.overlap, c.overlap)
        assert a.num_accepted[1] <= 1 and a.tokens[1, 1] != drafts[1, 1]


def test_batch_rows_have_their_own_outcomes_and_ragged_lengths():
    r = greedy([[1, 2, 3, 4], [1, 2, 3, 4], [5, 5, 5, 5]],
               [[1, 2, 3], [0, 0, 0], [5, 5, 0]], num_draft=[3, 3, 1])
    assert r.num_accepted.tolist() == [3, 0, 1]
    assert [r.emitted(i) for i in range(3)] == [[1, 2, 3, 4], [1], [5, 5]]


def test_sampling_certain_accept_and_certain_reject():
    # p puts all mass on token 2 at position 0, token 3 at position 1.
    p = torch.zeros(2, 2, 4)
    p[:, 0, 2] = 1.0
    p[:, 1, 3] = 1.0
    q = torch.full((2, 1, 4), 0.25)
    drafts = torch.tensor([[2], [1]])   # row 0 proposes p's token (accept prob 1/0.25 -> 1); row 1 p(x̃)=0
    g = [torch.Generator().manual_seed(0), torch.Generator().manual_seed(1)]
    r = accept_sampling(p, drafts, q, torch.tensor([1, 1]), g)
    assert r.emitted(0) == [2, 3]          # accepted + bonus from p_1
    assert r.emitted(1) == [2]             # rejected; residual max(0, p-q) = [0,0,.75,0] -> token 2
    torch.testing.assert_close(r.overlap, torch.tensor([[0.25], [0.25]]))


def test_point_mass_rejection_recovers_from_p_without_the_draft():
    # p_0 = [.5, .5, 0]; draft proposes 0 with no q. Rejection recovers from p minus {0} -> token 1.
    p = torch.tensor([[[0.5, 0.5, 0.0], [0.0, 0.0, 1.0]]])
    outcomes = set()
    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        r = accept_sampling(p, torch.tensor([[0]]), None, torch.tensor([1]), [g])
        outcomes.add(tuple(r.emitted(0)))
    assert outcomes == {(0, 2), (1,)}


def test_stop_token_inside_accepted_block_is_visible_in_order():
    # The engine truncates at a stop token; acceptance itself just reports the block in order.
    r = greedy([[7 % 6, 0, 3, 4]], [[1, 0, 3]])
    assert r.emitted(0) == [1, 0, 3, 4]
