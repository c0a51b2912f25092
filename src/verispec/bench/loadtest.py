"""A bounded load test for a verispec (or any OpenAI-compatible) server on this machine.

Closed loop: `concurrency` workers each send streaming chat requests back to back until
`requests` have been sent or `time_limit` passed. Per request:
  TTFT  request sent → first content chunk
  ITL   gaps between content chunks (a chunk may carry several tokens when speculation accepts several)
  TPOT  (end − first chunk) / (completion_tokens − 1), tokens counted from the server's usage
  E2E   request sent → [DONE]
Throughput = completion tokens of successful requests / wall time of the level; goodput counts only
requests that met the TTFT and TPOT objectives.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from dataclasses import dataclass, field
from urllib.parse import urlparse

from verispec.errors import VerispecError

LOOPBACK = {"127.0.0.1", "localhost", "::1"}


@dataclass
class RequestResult:
    ok: bool
    ttft: float | None = None
    e2e: float | None = None
    tpot: float | None = None
    itl: list[float] = field(default_factory=list)
    completion_tokens: int = 0
    prompt_tokens: int = 0
    drafted: int = 0
    accepted: int = 0
    error: str | None = None


def check_loopback(url: str) -> None:
    host = urlparse(url).hostname
    if host not in LOOPBACK:
        raise VerispecError(f"verispec loadtest only targets this machine (127.0.0.1, localhost, ::1), not {host!r}")


async def one_request(client, url: str, model: str, messages: list[dict], max_tokens: int) -> RequestResult:
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    first = last = None
    result = RequestResult(ok=False)
    try:
        async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                text = (await r.aread()).decode(errors="replace")
                result.error = f"HTTP {r.status_code}: {text[:200]}"
                return result
            async for line in r.aiter_lines():
                if line.startswith("event: error"):
                    result.error = "server sent an error event"
                    return result
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                obj = json.loads(line[6:])
                now = time.perf_counter()
                if any((c.get("delta") or {}).get("content") for c in obj.get("choices", [])):
                    if first is None:
                        first = now
                    else:
                        result.itl.append(now - last)
                    last = now
                if obj.get("usage"):
                    result.completion_tokens = obj["usage"]["completion_tokens"]
                    result.prompt_tokens = obj["usage"]["prompt_tokens"]
                    spec = obj.get("verispec") or {}
                    result.drafted, result.accepted = spec.get("drafted", 0), spec.get("accepted", 0)
    except Exception as err:                       # connection refused, reset, timeout …
        result.error = f"{type(err).__name__}: {err}"
        return result
    end = time.perf_counter()
    result.ok = True
    result.e2e = end - start
    result.ttft = (first or end) - start
    if result.completion_tokens > 1 and first is not None:
        result.tpot = (end - first) / (result.completion_tokens - 1)
    return result


async def run_level(url: str, model: str, prompts: list[list[dict]], concurrency: int, requests: int,
                    max_tokens: int, time_limit: float) -> tuple[list[RequestResult], float]:
    import httpx

    results: list[RequestResult] = []
    counter = iter(range(requests))
    deadline = time.perf_counter() + time_limit

    async def worker(client):
        for i in counter:
            if time.perf_counter() > deadline:
                return
            results.append(await one_request(client, url, model, prompts[i % len(prompts)], max_tokens))

    start = time.perf_counter()
    async with httpx.AsyncClient(timeout=httpx.Timeout(time_limit + 60)) as client:
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
    return results, time.perf_counter() - start


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, max(0, round(q * (len(values) - 1))))]


def summarize(results: list[RequestResult], wall: float, concurrency: int, slo_ttft: float, slo_tpot: float) -> dict:
    ok = [r for r in results if r.ok]
    good = [r for r in ok if r.ttft <= slo_ttft and (r.tpot is None or r.tpot <= slo_tpot)]
    row = {"concurrency": concurrency, "requests": len(results), "ok": len(ok), "errors": len(results) - len(ok),
           "wall_s": round(wall, 3),
           "throughput_tok_s": sum(r.completion_tokens for r in ok) / wall if wall else None,
           "goodput_tok_s": sum(r.completion_tokens for r in good) / wall if wall else None,
           "requests_per_s": len(ok) / wall if wall else None,
           "completion_tokens": sum(r.completion_tokens for r in ok),
           "acceptance_rate": (sum(r.accepted for r in ok) / sum(r.drafted for r in ok))
           if sum(r.drafted for r in ok) else None,
           "first_errors": [r.error for r in results if not r.ok][:3]}
    for name, values in (("ttft_s", [r.ttft for r in ok]), ("tpot_s", [r.tpot for r in ok if r.tpot is not None]),
                         ("itl_s", [x for r in ok for x in r.itl]), ("e2e_s", [r.e2e for r in ok])):
        row[name] = {"median": statistics.median(values) if values else None, "p99": _pct(values, 0.99)}
    return row


def format_rows(label: str, rows: list[dict]) -> str:
    def ms(x):
        return "–" if x is None else f"{1000 * x:.0f}"

    def num(x, digits=2):
        return "–" if x is None else f"{x:.{digits}f}"

    def pair(stat, fmt):
        return f"{fmt(stat['median'])} / {fmt(stat['p99'])}"

    head = ("| server | conc. | ok/sent | TTFT ms (med / p99) | TPOT ms (med / p99) | ITL ms (med / p99) | "
            "E2E s (med / p99) | tok/s | goodput tok/s | acceptance |\n" + "| --- " * 10 + "|")
    lines = [head]
    for r in rows:
        lines.append(f"| {label} | {r['concurrency']} | {r['ok']}/{r['requests']} | {pair(r['ttft_s'], ms)} | "
                     f"{pair(r['tpot_s'], ms)} | {pair(r['itl_s'], ms)} | "
                     f"{pair(r['e2e_s'], lambda x: num(x, 1))} | {num(r['throughput_tok_s'])} | "
                     f"{num(r['goodput_tok_s'])} | {num(r['acceptance_rate'])} |")
    return "\n".join(lines)
