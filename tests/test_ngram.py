"""Prompt lookup: worked examples from proposers/ngram.py."""

from verispec.proposers.ngram import lookup


def test_docstring_example_most_frequent_then_most_recent():
    assert lookup([5, 6, 7, 9, 6, 7, 8, 6, 7], k=2, n_max=3, n_min=1) == [8, 6]


def test_longest_match_wins_over_shorter_ones():
    # n=2 suffix [1, 2] occurred once (followed by 3); n=1 suffix [2] also occurred before 9.
    assert lookup([2, 9, 1, 2, 3, 4, 1, 2], k=2) == [3, 4]


def test_most_frequent_continuation():
    toks = [1, 2, 1, 5, 1, 2, 1, 5, 1, 7, 1]
    # [1, 7, 1] and [7, 1] never occurred before; [1] did, followed by 2 (x2), 5 (x2) and 7 (x1).
    # 2 and 5 tie on count; 5's latest occurrence (position 6) is more recent than 2's (position 4).
    assert lookup(toks, k=1) == [5]


def test_no_match_and_k_zero():
    assert lookup([1, 2, 3, 4], k=3) == []
    assert lookup([1, 2, 1, 2], k=0) == []


def test_continuation_is_capped_at_k_and_at_the_end():
    assert lookup([4, 5, 6, 7, 8, 4, 5], k=2) == [6, 7]
    assert lookup([4, 5, 4], k=5) == [5, 4]
