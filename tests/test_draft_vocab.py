"""A truncated draft vocabulary (`--draft-vocab N`): the draft's LM head reads N rows, proposals stay in
them, and greedy and seeded outputs are exactly what they are with the full vocabulary."""

from __future__ import annotations

import pytest
import torch

from conftest import tiny_model, tiny_text_model
from verispec import LLM, SamplingParams
from verispec.errors import VerispecError
from verispec.models.quant import quantize_linears
from verispec.proposers.draft import DraftModelProposer
from verispec.proposers.draft_vocab import frequent_tokens


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("VERISPEC_CACHE", str(tmp_path))


@pytest.mark.parametrize("fmt", [None, "int8", "int4-all"])
def test_the_sub_head_gives_the_full_heads_logits_for_its_rows(fmt):
    model = tiny_model(0)
    if fmt:
        model = quantize_linears(model, fmt)
    hidden, rows = torch.randn(2, 3, 64), torch.tensor([[0, 2], [1, 1]])
    vocab = torch.tensor([1, 5, 17, 40, 95])
    full = model.logits(hidden, rows)
    torch.testing.assert_close(model.logits(hidden, rows, vocab), full[..., vocab], rtol=1e-6, atol=1e-6)
    # Asked again with the same tensor (the draft's every step), another vocabulary, then the first again.
    torch.testing.assert_close(model.logits(hidden, rows, vocab), full[..., vocab], rtol=1e-6, atol=1e-6)
    other = torch.tensor([3, 4, 90])
    torch.testing.assert_close(model.logits(hidden, rows, other), full[..., other], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(model.logits(hidden, rows, vocab), full[..., vocab], rtol=1e-6, atol=1e-6)


def test_a_new_lm_head_is_not_served_the_old_heads_rows():
    model = tiny_model(0)
    hidden, rows, vocab = torch.randn(1, 2, 64), torch.tensor([[0, 1]]), torch.tensor([2, 7, 9])
    model.logits(hidden, rows, vocab)
    model = quantize_linears(model, "int8")                                  # swaps the LM head
    torch.testing.assert_close(model.logits(hidden, rows, vocab), model.logits(hidden, rows)[..., vocab],
                               rtol=1e-6, atol=1e-6)


def test_frequent_tokens_keep_the_stop_tokens_and_are_cached(tmp_path):
    tok = tiny_text_model(0).tokenizer
    ids = frequent_tokens(tok, 50, 260)
    assert len(ids) == 50 and ids.tolist() == sorted(set(ids.tolist())) and {256, 257} <= set(ids.tolist())
    assert " " in {tok.decode([i]) for i in ids.tolist()}                    # the commonest byte of source code
    assert list((tmp_path / "draft-vocab").glob("*-50.json"))
    assert torch.equal(frequent_tokens(tok, 50, 260), ids)
    with pytest.raises(ValueError):
        frequent_tokens(tok, 260, 260)


def test_greedy_and_seeded_outputs_equal_the_full_vocabulary_runs():
    target, draft = tiny_text_model(0), tiny_text_model(1)
    prompts = ["def add(a, b):", "for i in range(10):"]
    greedy = SamplingParams(temperature=0, max_tokens=24)
    plain = [o.token_ids for o in LLM(target, proposer="none").generate(prompts, greedy)]
    truncated = LLM(target, draft=draft, proposer="draft", k=3, draft_vocab=40)
    assert [o.token_ids for o in truncated.generate(prompts, greedy)] == plain
    proposer = truncated.make_proposer()
    assert isinstance(proposer, DraftModelProposer) and len(proposer.vocab) == 40
    seeded = SamplingParams(temperature=0.9, max_tokens=16, seed=3)
    again = LLM(target, draft=draft, proposer="draft", k=3, draft_vocab=40)
    assert [o.token_ids for o in truncated.generate(prompts, seeded)] == \
        [o.token_ids for o in again.generate(prompts, seeded)]


def test_proposals_stay_inside_the_vocabulary():
    target, draft = tiny_text_model(0), tiny_text_model(1)
    llm = LLM(target, draft=draft, proposer="draft", k=4, draft_vocab=30)
    seen: list[int] = []
    checked: list[int] = []
    original = DraftModelProposer.propose

    def spy(self, seqs, ks):
        proposal = original(self, seqs, ks)
        for row, n in zip(proposal.tokens.tolist(), proposal.num_draft.tolist()):
            seen.extend(row[:n])
        if proposal.num_draft.any():                                       # sampled drafts carry their q
            outside = [i for i in range(260) if i not in set(self.vocab.tolist())]
            assert proposal.q[..., outside].abs().sum() == 0             # q is zero off the subset
            checked.append(1)
        return proposal

    DraftModelProposer.propose = spy
    try:
        llm.generate(["hello world"], SamplingParams(temperature=0.8, max_tokens=20, seed=1))
    finally:
        DraftModelProposer.propose = original
    assert seen and checked and set(seen) <= set(llm.draft_vocab.tolist())


def test_bad_draft_vocab_values_are_errors():
    target = tiny_text_model(0)
    with pytest.raises(VerispecError, match="needs a draft model"):
        LLM(target, proposer="ngram", draft_vocab=100)
    with pytest.raises(VerispecError, match="draft_vocab must be"):
        LLM(target, draft=tiny_text_model(1), proposer="draft", draft_vocab=-5)
    with pytest.raises(VerispecError, match="draft_vocab must be"):
        LLM(target, draft=tiny_text_model(1), proposer="draft", draft_vocab="most")
    assert LLM(target, proposer="ngram").draft_vocab is None                 # auto without a draft: nothing


def test_auto_truncates_a_draft_models_vocabulary(monkeypatch):
    from verispec.proposers import draft_vocab

    monkeypatch.setattr(draft_vocab, "DEFAULT_DRAFT_VOCAB", 50)
    llm = LLM(tiny_text_model(0), draft=tiny_text_model(1), proposer="draft")
    assert llm.draft_vocab is not None and len(llm.draft_vocab) == 50
    assert LLM(tiny_text_model(0), draft=tiny_text_model(1), proposer="draft", draft_vocab=0).draft_vocab is None


def test_a_draft_must_share_the_targets_tokenizer_and_one_file_is_taken_as_shared(tmp_path):
    """Vocabularies are compared token by token, unless both tokenizers came from byte-identical files
    (the embedded pair: the comparison took half a second of every load). A different tokenizer is an
    error before anything is generated."""
    from conftest import byte_tokenizer
    from verispec.engine.llm import check_vocab_compatible
    from verispec.loaders.tokenizer import TextTokenizer

    target, draft = tiny_text_model(0), tiny_text_model(1)
    check_vocab_compatible(target, draft)                                   # same vocabulary, built in memory
    other = byte_tokenizer()
    other.tokenizer.add_tokens(["<|extra|>"])
    draft.tokenizer = other
    with pytest.raises(VerispecError, match="different tokenizers"):
        check_vocab_compatible(target, draft)
    path = tmp_path / "tokenizer.json"
    path.write_text(target.tokenizer.tokenizer.to_str())
    target.tokenizer = TextTokenizer.from_files(path, {})
    draft.tokenizer = TextTokenizer.from_files(path, {})
    assert target.tokenizer.source_digest and target.tokenizer.source_digest == draft.tokenizer.source_digest
    check_vocab_compatible(target, draft)
