"""A soak: `concurrency` streams for a fixed time against one server, some of them hung up early.

Each worker sends greedy streaming chat requests from the prompt suite back to back; with probability
`disconnect` it hangs up after a few chunks. What it checks:
  lost     a stream we did not hang up on that failed: a 5xx, an error event, a connection the server
           dropped, or no [DONE] (a 4xx, such as a prompt too long for the model, is counted as refused)
  garbled  a complete greedy answer that differs from the first complete answer to the same prompt
           (greedy output does not depend on what else is in the batch, so every answer must match)
  leaked   KV blocks still held once the server is idle (its kv_cache_usage_perc above 0)
  memory   the server's resident memory sampled every `sample_s`; after warm-up (the first fifth) it
           must stay within ±10 % of its post-warm-up level
"""

from __future__ import annotations

import asyncio
import json
import random
import re
import time
from dataclasses import dataclass, field

RSS_BAND = 0.10


@dataclass
class SoakReport:
    seconds: float
    concurrency: int
    requests: int = 0
    completed: int = 0
    hung_up: int = 0
    refused: dict[int, int] = field(default_factory=dict)             # 4xx answers by status (e.g. too long)
    lost: list[str] = field(default_factory=list)
    garbled: list[str] = field(default_factory=list)
    completion_tokens: int = 0
    rss_mib: list[tuple[float, float]] = field(default_factory=list)     # (seconds since start, MiB)
    idle_kv_usage: float | None = None
    healthy_after: bool = False

    @property
    def rss_drift(self) -> float | None:
        """Largest relative departure from the first sample after warm-up (the first fifth)."""
        after = [m for t, m in self.rss_mib if t >= self.seconds / 5]
        if len(after) < 2:
            return None
        return max(abs(m / after[0] - 1) for m in after)

    @property
    def passed(self) -> bool:
        drift = self.rss_drift
        return (not self.lost and not self.garbled and self.idle_kv_usage == 0 and self.healthy_after
                and drift is not None and drift <= RSS_BAND)

    def to_dict(self) -> dict:
        return {"seconds": self.seconds, "concurrency": self.concurrency, "requests": self.requests,
                "completed": self.completed, "hung_up": self.hung_up, "refused": self.refused, "lost": len(self.lost),
                "garbled": len(self.garbled), "completion_tokens": self.completion_tokens,
                "idle_kv_usage": self.idle_kv_usage, "healthy_after": self.healthy_after,
                "rss_mib": self.rss_mib, "rss_drift_after_warmup": self.rss_drift, "passed": self.passed,
                "examples": {"lost": self.lost[:10], "garbled": self.garbled[:10]}}

    def format(self) -> str:
        drift = self.rss_drift
        rss = " → ".join(f"{m:.0f}" for _, m in self.rss_mib[:: max(1, len(self.rss_mib) // 8)])
        lines = [f"soak: {self.concurrency} streams for {self.seconds / 60:.1f} min",
                 f"  requests {self.requests}: {self.completed} complete, {self.hung_up} hung up by us, "
                 f"{sum(self.refused.values())} refused (4xx), {len(self.lost)} lost, {len(self.garbled)} garbled; {self.completion_tokens} tokens",
                 f"  KV cache held when idle: {self.idle_kv_usage if self.idle_kv_usage is not None else '?'} "
                 f"(0 = no leaked blocks); healthy afterwards: {'yes' if self.healthy_after else 'NO'}",
                 f"  server RSS (MiB): {rss or 'not reported'}; largest drift after warm-up: "
                 f"{'?' if drift is None else f'{100 * drift:.1f} %'} (allowed {100 * RSS_BAND:.0f} %)",
                 f"  {'PASSED' if self.passed else 'FAILED'}"]
        lines += [f"  lost: {x}" for x in self.lost[:5]] + [f"  garbled: {x}" for x in self.garbled[:5]]
        return "\n".join(lines)


def _gauge(text: str, name: str) -> float | None:
    m = re.search(rf"^{re.escape(name)}(?:{{[^}}]*}})? ([0-9.eE+-]+)$", text, re.M)
    return float(m.group(1)) if m else None


async def _one(client, url: str, model: str, prompt_id: int, messages: list[dict], max_tokens: int,
               hang_up_after: int | None, report: SoakReport, answers: dict[int, str]) -> None:
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    report.requests += 1
    text, chunks, done, usage = [], 0, False, None
    try:
        async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
            if 400 <= r.status_code < 500:                  # refused, in OpenAI's shape: not a lost stream
                await r.aread()
                report.refused[r.status_code] = report.refused.get(r.status_code, 0) + 1
                return
            if r.status_code != 200:
                report.lost.append(f"HTTP {r.status_code}: {(await r.aread())[:120]!r}")
                return
            async for line in r.aiter_lines():
                if line.startswith("event: error"):
                    report.lost.append("an error event")
                    return
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done = True
                    break
                obj = json.loads(line[6:])
                usage = obj.get("usage") or usage
                for c in obj.get("choices", []):
                    text.append((c.get("delta") or {}).get("content") or "")
                chunks += 1
                if hang_up_after is not None and chunks >= hang_up_after:
                    report.hung_up += 1
                    return                                   # leaving the block closes the connection
    except Exception as err:                               # a dropped connection, a timeout, bad JSON
        report.lost.append(f"{type(err).__name__}: {str(err)[:120]}")
        return
    if not done:
        report.lost.append("the stream ended without [DONE]")
        return
    report.completed += 1
    report.completion_tokens += (usage or {}).get("completion_tokens", 0)
    answer = "".join(text)
    first = answers.setdefault(prompt_id, answer)
    if answer != first:
        report.garbled.append(f"prompt {prompt_id}: {answer[:60]!r} vs first {first[:60]!r}")


async def soak(url: str, model: str, prompts: list[list[dict]], concurrency: int, seconds: float,
               max_tokens: int, disconnect: float, sample_s: float, seed: int = 0, progress=None) -> SoakReport:
    import httpx

    report = SoakReport(seconds, concurrency)
    answers: dict[int, str] = {}
    rng = random.Random(seed)
    start = time.monotonic()
    deadline = start + seconds

    async def worker(client) -> None:
        while time.monotonic() < deadline:
            i = rng.randrange(len(prompts))
            hang_up = rng.randint(1, 4) if rng.random() < disconnect else None
            await _one(client, url, model, i, prompts[i], max_tokens, hang_up, report, answers)

    async def sampler(client) -> None:
        while time.monotonic() < deadline:
            try:
                text = (await client.get(url + "/metrics", timeout=10)).text
                rss = _gauge(text, "process_resident_memory_bytes")
                if rss is not None:
                    report.rss_mib.append((round(time.monotonic() - start, 1), rss / 2**20))
            except Exception:
                pass
            if progress:
                progress(report, time.monotonic() - start)
            await asyncio.sleep(sample_s)

    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600), limits=limits) as client:
        await asyncio.gather(sampler(client), *(worker(client) for _ in range(concurrency)))
        idle_by = time.monotonic() + 120                   # the hung-up streams' sequences finish or abort
        while time.monotonic() < idle_by:
            text = (await client.get(url + "/metrics", timeout=10)).text
            running = _gauge(text, "verispec:num_requests_running")
            waiting = _gauge(text, "verispec:num_requests_waiting")
            report.idle_kv_usage = _gauge(text, "verispec:kv_cache_usage_perc")
            if running == 0 and waiting == 0 and report.idle_kv_usage == 0:
                break
            await asyncio.sleep(0.5)
        rss = _gauge(text, "process_resident_memory_bytes")
        if rss is not None:
            report.rss_mib.append((round(time.monotonic() - start, 1), rss / 2**20))
        try:
            report.healthy_after = (await client.get(url + "/health", timeout=10)).status_code == 200
        except Exception:
            report.healthy_after = False
    return report
