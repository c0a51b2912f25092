"""`verispec serve` over HTTP on a free loopback port: the official `openai` client, raw HTTP for
bad input, concurrency, disconnects. A tiny random model with a real byte-level tokenizer."""

from __future__ import annotations

import concurrent.futures
import json
import socket
import threading
import time

import httpx
import pytest

from conftest import tiny_text_model
from verispec import LLM, SamplingParams

openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")

from verispec.serving.api import ServerConfig, create_app  # noqa: E402
from verispec.engine.engine import Engine  # noqa: E402


class LiveServer:
    """uvicorn on a free 127.0.0.1 port in a thread; stopped at the end of the module."""

    def __init__(self, app):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="error"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.time() + 30
        while not self.server.started:
            assert time.time() < deadline, "server did not start"
            time.sleep(0.02)

    def wait_ready(self) -> None:
        deadline = time.time() + 60
        while httpx.get(self.url + "/health").status_code != 200:
            assert time.time() < deadline, "model did not load"
            time.sleep(0.05)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


@pytest.fixture(scope="module")
def llm():
    return LLM(tiny_text_model(0), proposer="ngram", k="auto")


@pytest.fixture(scope="module")
def server(llm):
    engine = llm.engine(kv_budget_mb=8, block_size=8, max_running=8)
    app = create_app(ServerConfig("tiny", aliases=["tiny-alias"]), lambda: engine)
    live = LiveServer(app)
    live.wait_ready()
    live.engine = engine
    yield live
    live.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def alone(llm, prompt, **kw) -> list[int]:
    return llm.generate([prompt], SamplingParams(**kw))[0].token_ids


def test_completion_matches_generate_and_counts_usage(client, llm):
    out = client.completions.create(model="tiny", prompt="def add(a, b):", max_tokens=20, temperature=0)
    ids = alone(llm, "def add(a, b):", max_tokens=20, temperature=0)
    assert out.object == "text_completion" and len(out.choices) == 1
    assert out.choices[0].text == llm.tokenizer.decode(ids, skip_special=True)
    assert out.usage.prompt_tokens == len(llm.encode("def add(a, b):"))
    assert out.usage.completion_tokens == len(ids)
    assert out.usage.total_tokens == out.usage.prompt_tokens + len(ids)
    assert out.choices[0].finish_reason in ("stop", "length")
    extra = out.model_extra["verispec"]
    assert extra["proposer"] == "ngram" and extra["accepted"] <= extra["drafted"]


def test_token_id_prompt_and_alias(client, llm):
    out = client.completions.create(model="tiny-alias", prompt=[5, 6, 7, 5, 6], max_tokens=8, temperature=0)
    assert out.usage.prompt_tokens == 5 and out.usage.completion_tokens == len(alone(llm, [5, 6, 7, 5, 6],
                                                                                       max_tokens=8, temperature=0))


def test_chat_non_streaming_and_streaming_agree(client, llm):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}]
    full = client.chat.completions.create(model="tiny", messages=messages, max_tokens=24, temperature=0)
    assert full.object == "chat.completion" and full.choices[0].message.role == "assistant"
    chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=24, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens
    ids = alone(llm, llm.chat_prompt(messages), max_tokens=24, temperature=0)
    assert full.usage.completion_tokens == len(ids)


def test_stop_string_cuts_text(client, llm):
    ids = alone(llm, "abc", max_tokens=30, temperature=0, ignore_eos=True)
    text = llm.tokenizer.decode(ids, skip_special=True)
    stop = text[5:8] if len(text) >= 8 else None
    if not stop:
        pytest.skip("the tiny model's greedy text is too short to pick a stop string from")
    out = client.completions.create(model="tiny", prompt="abc", max_tokens=30, temperature=0, stop=[stop],
                                    extra_body={"ignore_eos": True})
    assert out.choices[0].text == text[: text.find(stop)]
    assert out.choices[0].finish_reason == "stop"


def test_seed_reproducible_and_n_samples(client):
    kw = dict(model="tiny", prompt="once upon", max_tokens=16, temperature=0.9, seed=123, n=3)
    a = client.completions.create(**kw)
    b = client.completions.create(**kw)
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert sorted(c.index for c in a.choices) == [0, 1, 2]
    assert a.usage.prompt_tokens == len("once upon")            # counted once, not n times


def test_parallel_greedy_requests_equal_alone(server, llm):
    prompts = ["alpha beta", "x = [1, 2, 3]", "the quick brown fox", "SELECT * FROM", "ab ab ab ab", "zzz"]
    expected = [llm.tokenizer.decode(alone(llm, p, max_tokens=16, temperature=0), skip_special=True)
                for p in prompts]

    def one(p):
        r = httpx.post(server.url + "/v1/completions", timeout=60,
                       json={"model": "tiny", "prompt": p, "max_tokens": 16, "temperature": 0})
        return r.json()["choices"][0]["text"]

    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        assert list(pool.map(one, prompts)) == expected


def test_models_health_metrics(server):
    models = httpx.get(server.url + "/v1/models").json()
    assert [m["id"] for m in models["data"]] == ["tiny", "tiny-alias"]
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    text = httpx.get(server.url + "/metrics").text
    for name in ("spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens",
                 "spec_decode_num_accepted_tokens_per_pos", "time_to_first_token_seconds",
                 "time_per_output_token_seconds", "num_requests_running", "num_requests_waiting",
                 "kv_cache_usage_perc", "num_preemptions"):
        assert f"verispec:{name}" in text


BAD_FIELDS = [
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "x", "max_tokens": "ten"}, "max_tokens"),
    ({"prompt": "x", "temperature": -1}, "temperature"),
    ({"prompt": "x", "temperature": "hot"}, "temperature"),
    ({"prompt": "x", "top_p": 1.5}, "top_p"),
    ({"prompt": "x", "top_k": 2.5}, "top_k"),
    ({"prompt": "x", "n": 0}, "n"),
    ({"prompt": "x", "n": 1000}, "n"),
    ({"prompt": "x", "seed": "abc"}, "seed"),
    ({"prompt": "x", "stop": 5}, "stop"),
    ({"prompt": "x", "stream": "yes"}, "stream"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": 42}, "prompt"),
    ({}, "prompt"),
    ({"prompt": [1, 2, 99999]}, "prompt"),
    ({"prompt": "x", "max_tokens": 10 ** 6}, "max_tokens"),
    ({"prompt": "x", "model": 7}, "model"),
]


@pytest.mark.parametrize("body,param", BAD_FIELDS)
def test_invalid_fields_are_400_in_openai_shape(server, body, param):
    r = httpx.post(server.url + "/v1/completions", json={"model": "tiny", **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error" and err["param"] == param and err["message"]


def test_chat_bad_messages_and_context_length(server):
    for messages in (None, [], [{"role": "wizard", "content": "x"}], [{"role": "user", "content": 5}], "hi"):
        r = httpx.post(server.url + "/v1/chat/completions", json={"model": "tiny", "messages": messages})
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text
    r = httpx.post(server.url + "/v1/completions", json={"model": "tiny", "prompt": "x" * 400, "max_tokens": 200})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"


def test_malformed_bodies(server):
    url = server.url + "/v1/completions"
    cases = [(b"{not json", "invalid_json", 400), (b"[1, 2]", "invalid_json", 400),
             (b'{"prompt": "\xff\xfe"}', "invalid_utf8", 400),
             (b'{"prompt": "' + b"a" * (5 << 20) + b'"}', "request_too_large", 413)]
    for raw, code, status in cases:
        r = httpx.post(url, content=raw, headers={"content-type": "application/json"})
        assert r.status_code == status and r.json()["error"]["code"] == code, r.text
    r = httpx.post(url, json={"model": "gpt-9", "prompt": "x"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    r = httpx.get(server.url + "/v1/nothing")
    assert r.status_code == 404 and "error" in r.json()


def test_hostile_bodies_are_400_not_500(server, llm):
    """Deep nesting, numbers too long to convert, lone surrogates (in the model name, a prompt, a
    message) and a prompt too long to tokenize: each a 400 in OpenAI's shape, checked before the work."""
    url = server.url + "/v1/completions"
    bodies = [b'{"prompt": "x", "user": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
              b'{"prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}",
              b'{"model": "\\ud800", "prompt": "x"}', b'{"prompt": "a\\udfff b"}']
    for raw in bodies:
        r = httpx.post(url, content=raw, headers={"content-type": "application/json"})
        assert r.status_code == 400, (raw[:60], r.text)
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    r = httpx.post(server.url + "/v1/chat/completions", content=b'{"messages": [{"role": "user", "content": "\\ud83d"}]}',
                   headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    huge = "y" * (llm.context_length * 32 + 1)
    r = httpx.post(url, json={"prompt": huge, "max_tokens": 1})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert httpx.post(url, json={"prompt": "still fine", "max_tokens": 2}).status_code == 200


def test_a_chat_template_that_rejects_the_messages_is_a_400(server, llm, monkeypatch):
    """Real templates call raise_exception(...) on, say, a wrong role order: that is the client's error."""
    template = ("{% if messages[0].role != 'user' %}{{ raise_exception('conversations must start with a user') }}"
                "{% endif %}{% for m in messages %}{{ m.content }}{% endfor %}")
    monkeypatch.setattr(llm.tokenizer, "chat_template", template)
    monkeypatch.setattr(llm.tokenizer, "_template", None)
    r = httpx.post(server.url + "/v1/chat/completions",
                   json={"messages": [{"role": "assistant", "content": "hi"}], "max_tokens": 2})
    assert r.status_code == 400 and "must start with a user" in r.json()["error"]["message"], r.text
    r = httpx.post(server.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                              "max_tokens": 2})
    assert r.status_code == 200, r.text
    monkeypatch.setattr(llm.tokenizer, "_template", None)


def test_unknown_fields_are_ignored(client):
    out = client.completions.create(model="tiny", prompt="x", max_tokens=2, temperature=0,
                                    extra_body={"frequency_penalty": 0, "user": "me", "best_of": 1})
    assert out.choices


def test_disconnect_mid_stream_frees_blocks(server):
    pool = server.engine.pool
    with httpx.stream("POST", server.url + "/v1/completions",
                      json={"model": "tiny", "prompt": "long story", "max_tokens": 300, "temperature": 0,
                            "stream": True, "ignore_eos": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                break                                   # one chunk, then hang up
    deadline = time.time() + 20
    while pool.available() != pool.usable or server.engine.has_work:
        assert time.time() < deadline, "blocks were not returned after the disconnect"
        time.sleep(0.05)


def test_api_key_queue_full_and_loading(llm):
    gate = threading.Event()

    def slow_load():
        gate.wait(30)
        return llm.engine(kv_budget_mb=4, block_size=8)

    live = LiveServer(create_app(ServerConfig("tiny", api_key="s3cret", max_waiting=0), slow_load))
    try:
        r = httpx.post(live.url + "/v1/completions", json={"prompt": "x"}, headers={"authorization": "Bearer s3cret"})
        assert r.status_code == 503 and r.json()["error"]["code"] == "model_loading"
        assert httpx.get(live.url + "/health").status_code == 503
        gate.set()
        live.wait_ready()
        r = httpx.post(live.url + "/v1/completions", json={"prompt": "x"})
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        r = httpx.post(live.url + "/v1/completions", json={"prompt": "x"}, headers={"authorization": "Bearer wrong"})
        assert r.status_code == 401
        r = httpx.post(live.url + "/v1/completions", json={"prompt": "x"}, headers={"authorization": "Bearer s3cret"})
        assert r.status_code == 429 and r.json()["error"]["type"] == "rate_limit_error"
    finally:
        gate.set()
        live.stop()


def test_engine_error_mid_stream_is_an_sse_error_event(server, monkeypatch):
    def broken(*a, **k):
        raise RuntimeError("simulated failure")

    monkeypatch.setattr(server.engine, "_round", broken)
    with httpx.stream("POST", server.url + "/v1/completions",
                      json={"model": "tiny", "prompt": "x", "max_tokens": 50, "stream": True}) as r:
        events = [line for line in r.iter_lines() if line]
    monkeypatch.undo()
    assert any(line == "event: error" for line in events), events
    payload = json.loads(next(line for line in reversed(events) if line.startswith("data: {"))[6:])
    assert "simulated failure" in payload["error"]["message"]
    assert server.engine.pool.available() == server.engine.pool.usable


def test_loadtest_counts_from_usage(server):
    import asyncio

    from verispec.errors import VerispecError
    from verispec.bench.loadtest import check_loopback, run_level, summarize

    results, wall = asyncio.run(run_level(server.url, "tiny", [[{"role": "user", "content": "hi"}]], 2, 4, 8, 60))
    row = summarize(results, wall, 2, slo_ttft=60, slo_tpot=60)
    assert row["ok"] == 4 and row["errors"] == 0
    assert row["completion_tokens"] == sum(r.completion_tokens for r in results) > 0
    assert row["ttft_s"]["median"] > 0 and row["goodput_tok_s"] == row["throughput_tok_s"]
    with pytest.raises(VerispecError, match="only targets this machine"):
        check_loopback("http://example.com:8000")


def test_cli_serve_drains_on_sigterm(tmp_path):
    """`verispec serve` as a process on a saved checkpoint: a stream in flight when SIGTERM arrives
    still completes with [DONE], then the process exits cleanly."""
    import signal
    import subprocess
    import sys

    transformers = pytest.importorskip("transformers")
    import torch

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                   rms_norm_eps=1e-6, tie_word_embeddings=False)
    transformers.LlamaForCausalLM(cfg).float().eval().save_pretrained(tmp_path / "m")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "verispec.cli.main", "serve", "--model", str(tmp_path / "m"),
                             "--dtype", "float32", "--port", str(port), "--proposer", "ngram"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 120
        while True:
            assert proc.poll() is None, proc.stderr.read().decode()
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.time() < deadline
            time.sleep(0.2)
        lines = []
        with httpx.stream("POST", url + "/v1/completions", timeout=60,
                          json={"prompt": [1, 2, 3], "max_tokens": 200, "stream": True, "ignore_eos": True}) as r:
            for line in r.iter_lines():
                if line and not lines:
                    proc.send_signal(signal.SIGTERM)         # mid-stream
                lines.append(line)
        assert lines[-2:] == ["data: [DONE]", ""] or "data: [DONE]" in lines
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()


def test_one_step_loop_gives_generate_the_engine_and_the_server_the_same_seeded_tokens():
    """`LLM.generate` (what bench and verify call), an engine stepped by hand and the HTTP server
    drive the same Engine.step: a seeded sampled request with a draft model gives the same text."""
    from verispec.engine.engine import Request

    llm = LLM(tiny_text_model(0), draft=tiny_text_model(1), proposer="draft", k=3)
    params = dict(max_tokens=24, temperature=0.9, top_p=0.95, seed=5, ignore_eos=True)
    prompt = "def add(a, b):"
    generated = [o.text for o in llm.generate([prompt], SamplingParams(n=2, **params))]
    stepped: dict[int, str] = {}
    engine = llm.engine(kv_budget_mb=4, block_size=8)
    engine.add(Request("r", [llm.encode(prompt)], SamplingParams(n=2, **params),
                       lambda u: stepped.__setitem__(u.index, stepped.get(u.index, "") + u.text)))
    while engine.has_work:
        engine.step()
    live = LiveServer(create_app(ServerConfig("tiny"), lambda: llm.engine(kv_budget_mb=4, block_size=8)))
    try:
        live.wait_ready()
        body = {k: v for k, v in params.items() if k != "ignore_eos"}
        out = httpx.post(live.url + "/v1/completions", json={"prompt": prompt, "n": 2, "ignore_eos": True, **body},
                         timeout=60).json()
    finally:
        live.stop()
    served = [c["text"] for c in sorted(out["choices"], key=lambda c: c["index"])]
    assert generated == [stepped[0], stepped[1]] == served
    assert len(set(generated)) == 2 and all(generated)          # two different, non-empty samples


def test_loadtest_alternates_configurations_within_each_level(monkeypatch):
    """Two configurations take turns A B, B A within a level (drift hits both alike), each gets its
    share of the level's requests, and the report gives their ratio."""
    from types import SimpleNamespace

    from verispec.bench.loadtest import RequestResult
    from verispec.cli import loadtest

    order = []

    def fake_level(url, label, args, c, n, prompts):
        order.append((label, c, n))
        ok = [RequestResult(ok=True, ttft=0.1 if label == "A" else 0.2, e2e=1.0, completion_tokens=10)
              for _ in range(n)]
        return ok, 1.0 if label == "A" else 2.0

    monkeypatch.setattr(loadtest, "_level", fake_level)
    args = SimpleNamespace(requests=5, rounds=2, slo_ttft=5.0, slo_tpot=0.5)
    rows = loadtest._interleaved([("u1", "A"), ("u2", "B")], args, [4], prompts=[])
    assert order == [("A", 4, 3), ("B", 4, 3), ("B", 4, 2), ("A", 4, 2)]
    assert [(r["server"], r["requests"]) for r in rows] == [("A", 5), ("B", 5)]
    text = loadtest._ratios(rows, ["A", "B"])
    assert "'B' at concurrency 4: throughput 0.50x, TTFT p99 2.00x" in text


def tiny_live_server():
    """A live server over a tiny model with a small paged cache (a fixture body: `yield from`); the
    engine rides on the server object for tests that inspect its blocks."""
    llm = LLM(tiny_text_model(0), proposer="ngram", k="auto")
    engine = llm.engine(kv_budget_mb=8, block_size=8, max_running=8)
    live = LiveServer(create_app(ServerConfig("tiny"), lambda: engine))
    live.wait_ready()
    live.engine = engine
    yield live
    live.stop()


def test_a_server_freezes_what_it_loaded_so_full_collections_skip_it():
    import gc

    from verispec.serving.backend import freeze_loaded_objects

    kept = [[i] for i in range(50_000)]                   # stand-ins for a tokenizer's tables
    try:
        assert freeze_loaded_objects() >= len(kept)
        assert id(kept[0]) not in {id(o) for o in gc.get_objects(generation=2)}   # not scanned any more
    finally:
        gc.unfreeze()
