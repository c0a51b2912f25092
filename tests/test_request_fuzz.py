"""Hostile requests against a live server: a seeded storm of malformed, mistyped, extreme and
half-read requests, several at a time. Every answer is a 2xx or a 4xx in OpenAI's error shape (never
a 5xx), every stream ends with [DONE] or an error event, and afterwards the server holds no blocks,
has no work left and answers a greedy request exactly as before the storm.

CI sends a few hundred requests; a longer storm against any server:

    python tests/test_request_fuzz.py --count 20000 --url http://127.0.0.1:8000
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import random
import sys
import time

import httpx
import pytest


pytest.importorskip("uvicorn")
from test_server import tiny_live_server  # noqa: E402

REQUESTS = 400               # in CI: about half a minute
FIELDS = ["model", "prompt", "messages", "max_tokens", "temperature", "top_p", "top_k", "n", "stream", "stop",
          "seed", "logprobs", "echo", "ignore_eos", "user", "stream_options", "response_format", "tools",
          "presence_penalty", "max_completion_tokens", "suffix", "best_of"]


def hostile_value(rng: random.Random, depth: int = 0):
    choices = [None, True, False, -1, 0, 1, 2, 7, 2**31, 2**63, -2**63, 10**40, 1e308, -0.0, 0.5, 1.5, 1e-320,
               "", "x", "tiny", "😀" * 50, "\u0000", "a\nb", "<|im_end|>", "x" * 5000, [], {}, [1, 2, 3],
               [-5, 10**9], ["a", "b"], [[1]], {"role": "user"}]
    if depth < 3 and rng.random() < 0.2:
        return [hostile_value(rng, depth + 1) for _ in range(rng.randint(0, 4))]
    if depth < 3 and rng.random() < 0.1:
        return {rng.choice(FIELDS + ["role", "content", "type", "text"]): hostile_value(rng, depth + 1)
                for _ in range(rng.randint(0, 3))}
    return rng.choice(choices)


def hostile_messages(rng: random.Random):
    roles = ["user", "assistant", "system", "tool", "developer", "", None, 3]
    contents = ["hi", "", None, 5, ["x"], [{"type": "text", "text": "hi"}], [{"type": "image_url"}], {"a": 1},
                "write a loop " * 20, "\ud800"]
    return [{"role": rng.choice(roles), "content": rng.choice(contents)} for _ in range(rng.randint(0, 5))] \
        if rng.random() < 0.8 else hostile_value(rng)


def hostile_request(rng: random.Random, model: str = "tiny") -> dict:
    """One request: method, path, raw body or JSON, headers, and whether to hang up mid-stream."""
    path = rng.choice(["/v1/completions"] * 12 + ["/v1/chat/completions"] * 12 +
                      ["/v1/models", "/health", "/metrics", f"/v1/models/{model}", "/v1/../etc/passwd", "/%ff", "/v1/"])
    method = "POST" if rng.random() < 0.9 else rng.choice(["GET", "PUT", "DELETE", "PATCH"])
    body: dict = {}
    chat = "chat" in path
    if rng.random() < 0.85:                                   # a plausible request, then spoil some fields
        body = {"model": model, "max_tokens": rng.randint(1, 12), "temperature": rng.choice([0, 0.7, 1.3])}
        if chat:
            body["messages"] = [{"role": "user", "content": rng.choice(["hi", "sort a list", "¿qué?"])}]
        else:
            body["prompt"] = rng.choice(["def f(", "hello", [1, 2, 3], ["a", "b"]])
        if rng.random() < 0.4:
            body["stream"] = True
        for _ in range(rng.choice([0, 0, 1, 1, 2, 3])):
            name = rng.choice(FIELDS)
            body[name] = hostile_messages(rng) if name == "messages" else hostile_value(rng)
    raw = None
    r = rng.random()
    if r < 0.06:
        raw = bytes(rng.randrange(256) for _ in range(rng.randint(0, 200)))
    elif r < 0.10:
        raw = json.dumps(body).encode()[: rng.randint(0, 40)]            # cut short
    elif r < 0.13:
        d = rng.choice([40, 1000, 50_000])
        raw = b'{"prompt": "x", "user": ' + b"[" * d + b"]" * d + b"}"
    elif r < 0.16:
        raw = json.dumps(body).replace(json.dumps(model), '"\\udc80"').encode()   # a lone surrogate
    elif r < 0.19:
        raw = b'{"prompt": "x", "max_tokens": ' + b"9" * rng.choice([20, 400, 5000]) + b"}"
    elif r < 0.21:
        raw = b'{"prompt": "x", "temperature": NaN, "top_p": Infinity}'
    headers = {"content-type": rng.choice(["application/json"] * 8 + ["text/plain", "", "application/json; charset=latin-1"])}
    if rng.random() < 0.05:
        headers["authorization"] = "Bearer " + "x" * rng.choice([1, 10_000])
    return {"method": method, "path": path, "raw": raw, "json": body, "headers": headers,
            "hang_up": rng.random() < 0.5}


def check_answer(client: httpx.Client, url: str, req: dict) -> str | None:
    """Send one request; None if the answer is acceptable, else what was wrong."""
    kwargs = {"headers": req["headers"]}
    kwargs["content"] = req["raw"] if req["raw"] is not None else json.dumps(req["json"]).encode()
    try:
        with client.stream(req["method"], url + req["path"], **kwargs) as r:
            if r.status_code >= 500 and r.status_code != 503:
                return f"{r.status_code}: {r.read()[:200]!r}"
            if r.status_code == 503 and req["path"] == "/health":
                return None                                           # the health check while loading
            if r.status_code >= 400:
                try:
                    err = json.loads(r.read())["error"]
                except (ValueError, KeyError, TypeError):
                    return f"{r.status_code} without an OpenAI error body"
                if not isinstance(err, dict) or not {"message", "type", "param", "code"} <= set(err):
                    return f"{r.status_code} error body lacks OpenAI fields: {err!r:.200}"
                return None
            if "text/event-stream" in r.headers.get("content-type", ""):
                last = None
                for n, line in enumerate(r.iter_lines()):
                    if req["hang_up"] and n >= 2:
                        return None                                   # hang up mid-stream
                    if line.startswith("data: "):
                        last = line
                        if line != "data: [DONE]":
                            json.loads(line[6:])
                    elif line.startswith("event: error"):
                        last = line
                if last not in ("data: [DONE]", "event: error") and not (last or "").startswith("data: {\"error\""):
                    return f"a stream ended without [DONE] or an error (last: {last!r:.100})"
            else:
                r.read()
                if r.headers.get("content-type", "").startswith("application/json"):
                    json.loads(r.content)
    except httpx.TimeoutException:
        return "no answer within the timeout"
    except (ValueError, httpx.HTTPError) as err:
        return f"{type(err).__name__}: {err}"[:200]
    return None


def storm(url: str, count: int, seed: int, concurrency: int = 8, model: str = "tiny") -> list[str]:
    """Send `count` hostile requests, `concurrency` at a time; returns the findings."""
    rng = random.Random(seed)
    reqs = [hostile_request(rng, model) for _ in range(count)]
    findings = []
    with httpx.Client(timeout=60) as client, concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        for i, problem in enumerate(pool.map(lambda r: check_answer(client, url, r), reqs)):
            if problem:
                req = reqs[i]
                shown = req["raw"][:80] if req["raw"] is not None else json.dumps(req["json"])[:160]
                findings.append(f"request {i} {req['method']} {req['path']} {shown!r}: {problem}")
    return findings


def greedy(url: str, model: str = "tiny") -> str:
    r = httpx.post(url + "/v1/completions", json={"model": model, "prompt": "def sort(", "max_tokens": 16,
                                                   "temperature": 0}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


@pytest.fixture(scope="module")
def server():
    yield from tiny_live_server()


def test_a_storm_of_hostile_requests_gets_no_5xx_and_leaves_the_server_as_it_was(server):
    before = greedy(server.url)
    findings = storm(server.url, REQUESTS, seed=0)
    assert not findings, "\n".join(findings[:10])
    pool, deadline = server.engine.pool, time.time() + 30
    while pool.available() != pool.usable or server.engine.has_work:
        assert time.time() < deadline, "blocks or work left after the storm"
        time.sleep(0.05)
    assert greedy(server.url) == before
    assert httpx.get(server.url + "/health").status_code == 200


def test_the_checker_catches_a_500_and_a_bare_error_body():
    """The storm's checks can fail: a server that answers 500, or 4xx without OpenAI's fields, is caught."""
    class Faked:
        def __init__(self, status, body):
            self.status_code, self._body, self.headers = status, body, {"content-type": "application/json"}

        def read(self):
            return self._body

        def __enter__(self):
            return self

        def __exit__(self, *a):
            return False

    class Client:
        def __init__(self, status, body):
            self.status, self.body = status, body

        def stream(self, *a, **k):
            return Faked(self.status, self.body)

    req = {"method": "POST", "path": "/v1/completions", "raw": b"{}", "json": {}, "headers": {}, "hang_up": False}
    assert check_answer(Client(500, b"{}"), "", req)
    assert check_answer(Client(400, b'{"detail": "bad"}'), "", req)
    assert check_answer(Client(400, b'{"error": {"message": "m"}}'), "", req)
    assert check_answer(Client(400, b'{"error": {"message": "m", "type": "t", "param": null, "code": null}}'),
                        "", req) is None


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description="A long storm of hostile requests against a running server.")
    ap.add_argument("--url", required=True)
    ap.add_argument("--count", type=int, default=5000)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--concurrency", type=int, default=8)
    args = ap.parse_args()
    url = args.url.rstrip("/")
    model = httpx.get(url + "/v1/models", timeout=60).json()["data"][0]["id"]
    before, start = greedy(url, model), time.time()
    found = storm(url, args.count, args.seed, args.concurrency, model)
    seconds = round(time.time() - start, 1)
    if greedy(url, model) != before:
        found.append("a greedy completion changed after the storm")
    print(json.dumps({"model": model, "requests": args.count, "findings": len(found), "seconds": seconds}))
    for f in found[:30]:
        print(" ", f)
    sys.exit(1 if found else 0)
