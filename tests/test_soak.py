"""`verispec loadtest --soak`: streams for a fixed time, some hung up early; lost or garbled streams,
KV blocks held when idle and the server's memory are reported, and a broken server fails the soak."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import pytest

from conftest import write_chat_model_dir

pytest.importorskip("uvicorn")
from test_server import tiny_live_server  # noqa: E402
from verispec.bench.soak import soak  # noqa: E402

PROMPTS = [[{"role": "user", "content": text}] for text in ("sort a list", "hello there", "def f(x):", "why?")]


@pytest.fixture
def server():
    yield from tiny_live_server()


def test_a_short_soak_loses_and_garbles_nothing_and_leaves_no_blocks_held(server):
    report = asyncio.run(soak(server.url, "tiny", PROMPTS, concurrency=8, seconds=8, max_tokens=24,
                              disconnect=0.3, sample_s=1))
    assert report.completed > 8 and report.hung_up > 0
    assert report.lost == [] and report.garbled == []
    assert report.idle_kv_usage == 0 and report.healthy_after
    assert len(report.rss_mib) >= 5                                 # the server reports its memory


def test_a_server_whose_greedy_answers_change_fails_the_soak(server, monkeypatch):
    """The deliberately broken variant: greedy acceptance that sometimes emits another token."""
    import random

    import verispec.engine.spec_round as spec_round
    real, rng = spec_round.accept_greedy, random.Random(0)

    def flaky(logits, tokens, num_draft):
        res = real(logits, tokens, num_draft)
        if rng.random() < 0.2:
            res.tokens[:, 0] = (res.tokens[:, 0] + 1) % logits.shape[-1]
        return res

    monkeypatch.setattr(spec_round, "accept_greedy", flaky)
    report = asyncio.run(soak(server.url, "tiny", PROMPTS, concurrency=4, seconds=5, max_tokens=24,
                              disconnect=0.0, sample_s=1))
    assert report.garbled and not report.passed


def test_cli_soak_spawns_a_server_and_writes_its_report(tmp_path):
    (tmp_path / "m").mkdir()
    write_chat_model_dir(tmp_path / "m")
    out = tmp_path / "soak.json"
    proc = subprocess.run([sys.executable, "-m", "verispec.cli.main", "loadtest", "--soak", "0.25",
                           "--concurrency", "6", "--max-tokens", "16", "--disconnect", "0.3",
                           "--spawn", f"--model {tmp_path / 'm'} --dtype float32", "--json", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-2000:]
    report = json.loads(out.read_text())
    assert report["passed"] and report["lost"] == 0 and report["garbled"] == 0 and report["idle_kv_usage"] == 0
    assert report["rss_mib"] and "PASSED" in proc.stdout


def test_soak_flags_are_checked():
    proc = subprocess.run([sys.executable, "-m", "verispec.cli.main", "loadtest", "--soak", "5",
                           "--concurrency", "4,8", "--url", "http://127.0.0.1:9"], capture_output=True, text=True)
    assert proc.returncode != 0 and "one server" in proc.stderr
