"""Retrieval over a user corpus: worked examples, errors, and greedy equality with plain decoding."""

from __future__ import annotations

import pytest

from verispec import LLM, SamplingParams
from verispec.errors import VerispecError
from verispec.proposers.retrieval import CorpusIndex, read_corpus
from conftest import tiny_model


def test_longest_match_and_most_frequent_continuation():
    index = CorpusIndex([[1, 2, 3, 4, 5], [9, 2, 3, 7, 7], [0, 2, 3, 7, 7]], n_max=3, n_min=2)
    assert index.continuation([8, 1, 2, 3], k=2) == [4, 5]        # n=3 match [1 2 3] wins
    assert index.continuation([8, 8, 2, 3], k=2) == [7, 7]        # n=2: [2 3] -> [4 5] x1, [7 7] x2
    assert index.continuation([5, 6], k=3) == []                  # no match
    assert index.continuation([4, 5], k=3) == []                  # never crosses a document boundary


def test_read_corpus_errors(tmp_path):
    with pytest.raises(VerispecError, match="does not exist"):
        read_corpus([tmp_path / "nope"])
    (tmp_path / "empty").mkdir()
    with pytest.raises(VerispecError, match="empty"):
        read_corpus([tmp_path / "empty"])
    (tmp_path / "a.txt").write_text("hello")
    assert read_corpus([tmp_path]) == ["hello"]


def test_retrieval_greedy_equals_plain_and_drafts_from_corpus():
    target = tiny_model(0, scale=1.5)
    prompt = [1, 5, 9, 2, 7]
    params = SamplingParams(temperature=0, max_tokens=24)
    plain = LLM(target, proposer="none").generate([prompt], params)[0].token_ids
    corpus = [prompt + plain[:12], [3, 3, 3]]            # the corpus holds the start of the answer
    for k in (3, "auto"):
        out = LLM(target, proposer="retrieval", k=k, corpus=corpus).generate([prompt], params)[0]
        assert out.token_ids == plain
        if k == 3:          # under `auto` how far it drafts depends on pass costs timed on a busy machine
            assert out.spec["accepted"] >= 6
    with pytest.raises(VerispecError, match="corpus"):
        LLM(target, proposer="retrieval")
