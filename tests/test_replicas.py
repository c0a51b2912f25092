"""`verispec serve --replicas 2` on a local Ray instance bound to 127.0.0.1, with a tiny model saved
as a directory: both replicas serve, a conversation's next turn returns to its replica and hits its
prefix cache, a replica killed mid-stream ends that stream with an SSE error event and the next
request succeeds, and SIGTERM leaves no Ray process behind. Plus the router's counting on its own."""

from __future__ import annotations

import concurrent.futures
import os
import re
import signal
import socket
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest

from conftest import write_chat_model_dir
from verispec.cli.loadtest import _wait_healthy
from verispec.errors import VerispecError
from verispec.serving.replicas import Affinity, prefix_keys

RAY_PROCESSES = ("raylet", "gcs_server", "ServeReplica", "ServeController")


def chat(*contents):
    roles = ["user", "assistant"]
    return SimpleNamespace(messages=[{"role": roles[i % 2], "content": c} for i, c in enumerate(contents)])


def test_prefix_keys_chain_message_by_message():
    first, second = prefix_keys("chat", chat("hi")), prefix_keys("chat", chat("hi", "hello", "more"))
    assert second[0] == first[0] and len(second) == 3
    assert prefix_keys("chat", chat("ho"))[0] != first[0]
    long = prefix_keys("completion", SimpleNamespace(prompts=["x" * 600]))
    assert len(long) == 3 and prefix_keys("completion", SimpleNamespace(prompts=["x" * 300]))[0] == long[0]


def test_affinity_follows_a_prefix_while_its_replica_has_room():
    a = Affinity(replicas=2, capacity=1)
    turn1 = prefix_keys("chat", chat("hi"))
    turn2 = prefix_keys("chat", chat("hi", "hello", "more"))
    assert a.pick(turn1) == (0, False)
    a.record(turn1, 1)                                   # say replica 1 served it
    assert a.pick(turn2) == (1, True)
    a.in_flight[1] = 1                                   # full: the least-loaded one instead
    assert a.pick(turn2) == (0, False)
    a.in_flight[1], a.down_since[1] = 0, 0.0             # down: never chosen
    assert a.pick(turn2) == (0, False)


def _ray_processes() -> list[str]:
    out = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True).stdout.splitlines()
    return [line for line in out if any(p in line for p in RAY_PROCESSES) and "ps -eo" not in line]


@pytest.fixture(scope="module")
def replicas(tmp_path_factory):
    pytest.importorskip("ray")
    pytest.importorskip("ray.serve")
    pytest.importorskip("httpx")
    if _ray_processes():
        pytest.skip("another Ray instance runs on this machine")
    root = write_chat_model_dir(tmp_path_factory.mktemp("tiny-replicas"))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "VERISPEC_CACHE": str(root / "cache")}
    proc = subprocess.Popen([sys.executable, "-m", "verispec.cli.main", "serve", "--model", str(root),
                             "--dtype", "float32", "--replicas", "2", "--threads-per-replica", "1",
                             "--port", str(port), "--max-running", "4", "--served-model-name", "tiny"],
                            env=env, stdout=open(root / "serve.log", "w"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(url, proc, timeout=300)
    except VerispecError:
        proc.kill()
        raise AssertionError(f"replicas did not come up: {(root / 'serve.log').read_text()[-2000:]}") from None
    yield SimpleNamespace(url=url, proc=proc)
    if proc.poll() is None:
        proc.kill()
        subprocess.run(["ray", "stop", "--force"], capture_output=True)


def _post(url, body, timeout=60):
    import httpx

    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=timeout)
    return r.status_code, r.headers.get("x-verispec-replica"), r.json()


def _prefix_hits(url) -> dict[str, float]:
    import httpx

    text = httpx.get(url + "/metrics", timeout=30).text
    return {m.group(1): float(m.group(2))
            for m in re.finditer(r'verispec:prefix_cache_hits\{[^}]*replica="(\d+)"\} (\S+)', text)}


@pytest.mark.ray
def test_two_replicas_share_the_load_and_a_conversation_returns_to_its_replica(replicas):
    import openai

    client = openai.OpenAI(base_url=replicas.url + "/v1", api_key="unused", max_retries=0, timeout=120)

    def ask(i):
        raw = client.chat.completions.with_raw_response.create(
            model="tiny", messages=[{"role": "user", "content": f"question {i} " * 8}], max_tokens=48, temperature=0)
        return raw.headers["x-verispec-replica"], raw.parse()

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        served = list(pool.map(ask, range(8)))
    assert {r for r, _ in served} == {"0", "1"}                        # both replicas took requests
    assert all(out.choices[0].message.content for _, out in served)

    history = [{"role": "system", "content": "you are a terse assistant " * 4},
               {"role": "user", "content": "first question, long enough to fill blocks " * 3}]
    status, first, out = _post(replicas.url, {"messages": history, "max_tokens": 16, "temperature": 0})
    assert status == 200
    before = _prefix_hits(replicas.url)
    history += [out["choices"][0]["message"], {"role": "user", "content": "and the second one"}]
    status, second, _ = _post(replicas.url, {"messages": history, "max_tokens": 16, "temperature": 0})
    assert status == 200 and second == first                          # prefix affinity
    assert _prefix_hits(replicas.url)[first] > before.get(first, 0)   # and its cache held the history


@pytest.mark.ray
def test_a_replica_killed_mid_stream_gives_an_error_event_and_the_next_request_succeeds(replicas):
    import httpx

    body = {"messages": [{"role": "user", "content": "go on forever"}], "max_tokens": 480, "temperature": 0,
            "stream": True}
    events = []
    with httpx.stream("POST", replicas.url + "/v1/chat/completions", json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        replica = r.headers["x-verispec-replica"]
        victim = [line for line in _ray_processes() if f"verispec-replica-{replica}" in line]
        assert victim, _ray_processes()
        for line in r.iter_lines():
            events.append(line)
            if len(events) == 6:                                      # streaming: kill its replica
                os.kill(int(victim[0].split()[0]), signal.SIGKILL)
    assert any(line.startswith("event: error") for line in events), events[-5:]
    assert "data: [DONE]" not in events
    status, other, out = _post(replicas.url, {"messages": [{"role": "user", "content": "still there?"}],
                                              "max_tokens": 8, "temperature": 0})
    assert status == 200 and other != replica and out["choices"][0]["message"]["content"]


@pytest.mark.ray
def test_sigterm_drains_and_leaves_no_ray_process(replicas):
    replicas.proc.send_signal(signal.SIGTERM)
    replicas.proc.wait(120)
    assert replicas.proc.returncode == 0
    deadline = time.time() + 30
    while _ray_processes() and time.time() < deadline:
        time.sleep(0.5)
    assert _ray_processes() == []


def test_replicas_without_ray_fail_with_what_to_install(monkeypatch):
    import builtins

    from verispec.cli.serve import _check_replicas
    from verispec.errors import VerispecError

    real_import = builtins.__import__

    def no_ray(name, *args, **kw):
        if name == "ray" or name.startswith("ray."):
            raise ImportError(name)
        return real_import(name, *args, **kw)

    monkeypatch.setattr(builtins, "__import__", no_ray)
    with pytest.raises(VerispecError, match=r"pip install 'verispec\[serve,ray\]'"):
        _check_replicas(SimpleNamespace(replicas=2, threads_per_replica=None, ray_address=None))
    with pytest.raises(VerispecError, match="go with --replicas"):
        _check_replicas(SimpleNamespace(replicas=None, threads_per_replica=2, ray_address=None))
