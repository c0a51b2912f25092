"""Medusa heads (`--proposer head`, `verispec train-head`): the file format refuses bad files, training
learns the target's own tokens, and output is exactly plain decoding's (greedy) or reproducible (seeded)."""

from __future__ import annotations

import pytest
import torch

from conftest import tiny_text_model
from verispec import LLM, SamplingParams
from verispec.errors import InvalidModelFile, VerispecError
from verispec.heads import MedusaHeads, load_heads, save_heads
from verispec.heads.train import agreement, extract, labelled_rows, train, windows_of
from verispec.text_collection import stdlib_sources

C, V = 64, 260


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("VERISPEC_CACHE", str(tmp_path))


def random_heads(num: int = 3, seed: int = 0, vocab: torch.Tensor | None = None) -> MedusaHeads:
    torch.manual_seed(seed)
    heads = MedusaHeads(num, C, torch.arange(V) if vocab is None else vocab, {"vocab_size": str(V)})
    with torch.no_grad():
        heads.weight.normal_(0, 0.05)
        heads.bias.normal_(0, 0.05)
    return heads


def test_a_heads_file_round_trips_and_bad_ones_are_refused(tmp_path):
    heads = random_heads(vocab=torch.tensor([3, 7, 200]))
    path = tmp_path / "h.safetensors"
    save_heads(heads, path, dtype=torch.float32)
    back = load_heads(path, C, V)
    assert torch.equal(back.weight, heads.weight) and torch.equal(back.vocab, heads.vocab) and back.num_heads == 3
    with pytest.raises(InvalidModelFile, match="hidden size 64"):
        load_heads(path, 128, V)
    with pytest.raises(InvalidModelFile, match="vocabulary of 260"):
        load_heads(path, C, 100)

    def broken(name: str, **change) -> str:
        h = random_heads(vocab=torch.tensor([3, 7, 200]))
        for k, v in change.items():
            if k == "vocab":
                h.vocab = v
            else:
                getattr(h, k).data = v
        p = tmp_path / name
        save_heads(h, p, dtype=torch.float32)
        return p

    with pytest.raises(InvalidModelFile, match="NaN"):
        load_heads(broken("nan.safetensors", weight=torch.full((3, C, C), float("nan"))), C, V)
    with pytest.raises(InvalidModelFile, match="sorted"):
        load_heads(broken("unsorted.safetensors", vocab=torch.tensor([7, 3, 200])), C, V)
    with pytest.raises(InvalidModelFile, match="sorted"):
        load_heads(broken("outside.safetensors", vocab=torch.tensor([3, 7, 999])), C, V)
    with pytest.raises(InvalidModelFile, match=r"\(H, C, C\)"):
        load_heads(broken("shape.safetensors", bias=torch.zeros(2, C)), C, V)
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(b"\xff" * 64)
    with pytest.raises(InvalidModelFile, match="safetensors"):
        load_heads(garbage, C, V)
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(path.read_bytes()[:200])
    with pytest.raises(InvalidModelFile):
        load_heads(cut, C, V)
    with pytest.raises(InvalidModelFile, match="cannot be read"):
        load_heads(tmp_path / "missing.safetensors", C, V)


def test_head_proposer_without_heads_says_how_to_make_them():
    with pytest.raises(VerispecError, match="train-head"):
        LLM(tiny_text_model(0), proposer="head")


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """Heads trained for a few seconds on a tiny model's own tokens over standard-library text."""
    root = tmp_path_factory.mktemp("heads")
    target = tiny_text_model(0)
    # text whose next token follows from the current one (cycles through 37 random bytes), so the
    # target's tokens two and more places ahead are learnable from its state — and the other half
    # standard-library source, where they mostly are not
    g = torch.Generator().manual_seed(0)
    cycle = torch.randperm(256, generator=g)[:37].tolist()
    ids = [(cycle * 200)[i: i + 1000] for i in range(0, 30 * 37, 37)]
    ids += [target.tokenizer.encode(t) for t in stdlib_sources(100_000)]
    windows = windows_of(ids, 128)[:60]
    features = extract(target.model, windows, root / "features")
    heads = MedusaHeads(3, C, torch.arange(V))
    untrained = agreement_of(heads, target, features)
    score = train(heads, target.model.lm_head.weight.detach().float(), features, minutes=10, lr=3e-3,
                  batch=128, log=lambda s: None, max_steps=600)
    fitted = agreement_of(heads, target, features)
    heads.meta = {"vocab_size": str(V)}
    path = root / "tiny.safetensors"
    save_heads(heads, path, dtype=torch.float32)
    return target, path, untrained, score, features, root, windows, fitted


def agreement_of(heads, target, features):
    rows, labels = labelled_rows(features, heads.num_heads, list(range(len(features.starts) - 1)))
    return agreement(heads, target.model.lm_head.weight.detach().float(), features, rows, labels)


def test_features_are_resumed_and_training_learns_the_targets_tokens(trained):
    target, _, untrained, score, features = trained[:5]
    assert features.states.shape == (60 * 128, C) and features.states.dtype == torch.float16
    # argmax is the target's own greedy token at every position
    assert len(features.argmax) == 60 * 128 and int(features.argmax.max()) < V
    # learning: the heads fit the target's tokens 2 … 4 places ahead far better than before (a random
    # tiny model's tokens are hard to guess on held-out text; the real 1.5B's are on docs/PERFORMANCE.md)
    fitted = trained[7]
    assert fitted["top1"][0] > untrained["top1"][0] + 0.2, (untrained, fitted)
    assert score["chain"][0] >= score["chain"][1] >= score["chain"][2] and score["steps"] > 0
    # resumable: a shard lost (a run stopped mid-way) is made again, the same bits; the rest are read back
    root, windows = trained[5], trained[6]
    shards = sorted((root / "features").glob("shard-*.safetensors"))
    assert len(shards) == 4
    shards[-1].unlink()
    again = extract(target.model, windows, root / "features")
    assert torch.equal(again.states, features.states) and torch.equal(again.argmax, features.argmax)


def test_greedy_head_output_is_plain_decoding_and_drafts_are_accepted(trained):
    target, path, *_ = trained
    prompts = ["def add(a, b):", "for i in range(10):", "class Stack:"]
    greedy = SamplingParams(temperature=0, max_tokens=40)
    plain = [o.token_ids for o in LLM(target, proposer="none").generate(prompts, greedy)]
    for k in (1, 3, "auto"):
        outs = LLM(target, proposer="head", head=path, k=k).generate(prompts, greedy)
        assert [o.token_ids for o in outs] == plain, k
    outs = LLM(target, proposer="head", head=path, k=3).generate(prompts, greedy)
    assert sum(o.spec["accepted"] for o in outs) > 0
    assert sum(o.spec["proposed"] - o.spec["accepted"] for o in outs) > 0      # both paths ran


def test_seeded_sampling_with_heads_is_reproducible_and_heads_cap_k(trained):
    target, path, *_ = trained
    seeded = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=24, seed=5)
    a = LLM(target, proposer="head", head=path, k=8)
    b = LLM(target, proposer="head", head=path, k=8)
    outs = a.generate(["def add(a, b):"], seeded)
    assert [o.token_ids for o in outs] == [o.token_ids for o in b.generate(["def add(a, b):"], seeded)]
    assert max(int(k) for k in outs[0].spec["k_histogram"]) <= 3          # one head per drafted position


def test_a_broken_head_proposer_changes_nothing_but_speed():
    """Heads that guess garbage only cost acceptance: output stays plain decoding's."""
    target = tiny_text_model(0)
    heads = random_heads(4, seed=9)
    with torch.no_grad():
        heads.bias.fill_(50.0)                                         # every guess the same token
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "bad.safetensors"
        save_heads(heads, path, dtype=torch.float32)
        greedy = SamplingParams(temperature=0, max_tokens=30)
        plain = LLM(target, proposer="none").generate(["x = 1"], greedy)[0].token_ids
        assert LLM(target, proposer="head", head=path, k=4).generate(["x = 1"], greedy)[0].token_ids == plain


def test_train_head_refuses_absurd_budgets(capsys):
    from pathlib import Path

    from verispec.cli.main import main

    assert main(["train-head", "--kind", "eagle", "--heads", "17", "--out", "x.safetensors"]) == 2
    assert main(["train-head", "--kind", "eagle", "--unroll", "0", "--out", "x.safetensors"]) == 2
    assert main(["train-head", "--kind", "eagle", "--intermediate", "-5", "--out", "x.safetensors"]) == 2
    assert main(["train-head", "--heads", "0", "--out", "x.safetensors"]) == 2
    assert main(["train-head", "--minutes", "-1", "--out", "x.safetensors"]) == 2
    assert main(["train-head", "--out", str(Path(__file__).parent)]) == 2      # a directory, before any work
    assert main(["train-head", "--corpus", "/no/such/dir", "--out", "x.safetensors"]) == 2


def test_hybrid_with_heads_copies_by_lookup_and_drafts_new_text_with_the_heads(trained):
    """`hybrid` + a heads file: lookup where the suffix repeats, the heads elsewhere, no draft model."""
    target, path, *_ = trained
    prompt = "def add(a, b):\n    return a + b\n\ndef add(a, b):\n"
    greedy = SamplingParams(temperature=0, max_tokens=40)
    plain = LLM(target, proposer="none").generate([prompt], greedy)[0].token_ids
    llm = LLM(target, proposer="hybrid", head=path, k=3)
    assert llm.draft is None
    out = llm.generate([prompt], greedy)[0]
    assert out.token_ids == plain
    assert set(out.spec["rounds_by_source"]) <= {"ngram", "head"} and "head" in out.spec["rounds_by_source"]
    with pytest.raises(VerispecError, match="head or hybrid"):
        LLM(target, proposer="ngram", head=path)


def test_the_shipped_head_loads_for_the_embedded_target_and_says_how_it_was_made():
    from verispec.heads import EagleHead, shipped_heads

    path = shipped_heads("qwen2.5-coder-1.5b-instruct")
    assert path is not None and path.stat().st_size < 48 * 2**20
    heads = load_heads(path, 1536, 151936)
    assert isinstance(heads, EagleHead) and heads.depth == 6 and len(heads.vocab) == 16384
    assert "verispec train-head" in heads.meta["command"]
    assert path.with_name(path.name + ".json").is_file()
    assert shipped_heads("no-such-model") is None


def test_the_corpus_puts_the_targets_own_answers_first_and_keeps_to_the_budget(monkeypatch, tmp_path):
    from verispec.cli import train_head

    answers = {"answers": [list(range(600)), list(range(40)), list(range(100))], "tasks": [list(range(70))]}
    monkeypatch.setattr(train_head, "_own_answers", lambda target, dtype, entry: answers[entry])
    (tmp_path / "a.py").write_text("x = 1\n" * 2000)
    windows, name = train_head._corpus(["answers", str(tmp_path)], tiny_text_model(0), "auto", 2000)
    # an answer's 88-token tail is kept, a 40-token answer is not; then whole 512-token windows of text
    assert windows[:3] == [answers["answers"][0][:512], answers["answers"][0][512:], answers["answers"][2]]
    assert [len(w) for w in windows[3:]] == [512, 512] and name == f"answers {tmp_path}"
    windows, name = train_head._corpus(["tasks", "answers"], tiny_text_model(0), "auto", 2000)
    assert windows == [answers["answers"][0][:512], answers["answers"][0][512:], answers["answers"][2],
                       answers["tasks"][0]] and name == "tasks answers"


def test_task_prompts_are_made_from_documented_stdlib_names_and_are_the_same_each_time():
    from verispec.text_collection import stdlib_tasks

    tasks = stdlib_tasks(40)
    assert tasks == stdlib_tasks(40) and len(tasks) == 40 and len({t[0] for t in tasks}) == 40
    assert [kind for _, kind, _ in tasks].count("explanation") == 10
    for id, kind, prompt in tasks:
        name = id.rsplit(".", 1)[1]
        assert name in prompt and not name.startswith("_") and ".test" not in id
        assert kind == "explanation" or "Write a Python function" in prompt or "Implement a Python class" in prompt


def test_heads_compute_only_the_positions_a_round_drafts():
    torch.manual_seed(0)
    heads = MedusaHeads(4, 16, torch.arange(8))
    with torch.no_grad():
        heads.weight.normal_(), heads.bias.normal_()
    h = torch.randn(3, 16)
    assert heads(h, 2).shape == (3, 2, 16)
    torch.testing.assert_close(heads(h, 2), heads(h)[:, :2])


def test_a_sequence_without_a_state_yet_asks_auto_for_nothing():
    """Before its first round a sequence has no target state, so the heads cannot draft: the proposer
    says 'none' (alone and as hybrid's fallback) and `auto` spends no first try or probe on it —
    that wasted try left whole answers in plain decoding."""
    from types import SimpleNamespace

    from verispec.engine.k_policy import KPolicy
    from verispec.proposers.head import HeadProposer
    from verispec.proposers.hybrid import HybridProposer

    target = tiny_text_model(0)
    proposer = HeadProposer(random_heads(3), target.model)
    hybrid = HybridProposer(proposer, V)
    fresh = SimpleNamespace(pending_state=None, tokens=[1, 2, 3], slot=0)
    ready = SimpleNamespace(pending_state=torch.zeros(C), tokens=[1, 2, 3], slot=0)
    assert proposer.source_for(fresh) == hybrid.source_for(fresh) == "none"
    assert proposer.source_for(ready) == hybrid.source_for(ready) == "head"
    policy = KPolicy("auto")
    assert policy.choose(0, proposer.source_for(fresh), remaining=50) == 0
    assert (0, "head") not in policy.estimates                    # its first try is still to come


def test_the_default_proposer_is_lookup_then_the_targets_shipped_heads(monkeypatch, tmp_path):
    """With no proposer named, a target that has shipped heads drafts by lookup where the text
    repeats and with its heads elsewhere (no draft model loaded); one without heads uses lookup."""
    import verispec.heads as heads_package

    target = tiny_text_model(0)
    assert LLM(target).proposer_name == "ngram"
    path = tmp_path / "tiny.medusa.safetensors"
    save_heads(random_heads(3), path, dtype=torch.float32)
    monkeypatch.setattr(heads_package, "shipped_heads", lambda name: path)
    llm = LLM(target)
    assert llm.proposer_name == "hybrid" and llm.heads is not None and llm.draft is None
    greedy = SamplingParams(temperature=0, max_tokens=30)
    plain = LLM(target, proposer="none").generate(["x = 1"], greedy)[0].token_ids
    assert llm.generate(["x = 1"], greedy)[0].token_ids == plain
    assert LLM(target, draft=target).proposer_name == "draft"


def test_hybrid_offers_its_match_and_its_heads_and_drafts_from_the_one_preferred():
    """Where the suffix has a match the hybrid offers both sources (the K policy keeps the one it
    values more, engine/k_policy.py choose_for); a preference holds until the sequence's tokens
    change."""
    from types import SimpleNamespace

    from verispec.proposers.head import HeadProposer
    from verispec.proposers.hybrid import HybridProposer

    target = tiny_text_model(0)
    from verispec.engine.params import SamplingParams

    seq = SimpleNamespace(pending_state=torch.zeros(C), tokens=[5, 6, 7, 5, 9, 1, 5], slot=0,  # suffix [5]: 1 token
                          params=SamplingParams(temperature=0))
    hybrid = HybridProposer(HeadProposer(random_heads(3), target.model), V)
    assert hybrid.options(seq) == [("ngram:1", 0), ("head", 0)]
    assert hybrid.source_for(seq) == "ngram:1"
    hybrid.prefer(seq, "head")
    assert hybrid.source_for(seq) == "head"
    assert hybrid.propose([seq], [2]).source == ["head"]
    seq.tokens = seq.tokens + [6]                        # the next round: the match is used again
    assert hybrid.source_for(seq) == "ngram:2"
    no_state = SimpleNamespace(pending_state=None, tokens=[5, 6, 7, 5], slot=1)
    assert hybrid.options(no_state) == [("ngram:1", 0)]  # heads without a state cannot draft