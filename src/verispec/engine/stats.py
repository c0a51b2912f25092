"""Engine counters and their Prometheus text exposition (the server's `GET /metrics`).

Speculation counts are not kept twice: every sequence's own `SpecMetrics` (its `spec` output) is
added to one running total when the sequence leaves, and the exposition reads that total.

Names follow vLLM's where they overlap (prefix `vllm:` replaced by `verispec:`), so existing
dashboards need only a prefix change:
  spec_decode_num_drafts, spec_decode_num_draft_tokens, spec_decode_num_accepted_tokens,
  spec_decode_num_accepted_tokens_per_pos{position}, time_to_first_token_seconds,
  time_per_output_token_seconds, num_requests_running, num_requests_waiting, kv_cache_usage_perc,
  num_preemptions, prompt_tokens, generation_tokens.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from verispec.engine.metrics import SpecMetrics
from verispec.engine.sequence import Sequence

BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


@dataclass
class Histogram:
    """Cumulative-bucket histogram in constant memory."""

    counts: list[int] = field(default_factory=lambda: [0] * len(BUCKETS))
    total: float = 0.0
    count: int = 0

    def append(self, value: float) -> None:
        for i, b in enumerate(BUCKETS):
            if value <= b:
                self.counts[i] += 1
        self.total += value
        self.count += 1


@dataclass
class EngineStats:
    requests_received: int = 0
    requests_finished: dict[str, int] = field(default_factory=dict)   # finish reason -> count
    prompt_tokens: int = 0
    generation_tokens: int = 0
    spec: SpecMetrics = field(default_factory=lambda: SpecMetrics("all", "-"))   # sequences that left
    preemptions: int = 0
    engine_errors: int = 0
    ttft: Histogram = field(default_factory=Histogram)
    tpot: Histogram = field(default_factory=Histogram)
    e2e: Histogram = field(default_factory=Histogram)

    def record_left(self, seq: Sequence, arrival: float, first_token: float | None) -> None:
        """A sequence left (finished or cancelled): add its speculation counts; count a finished one."""
        self.spec.add(seq.metrics)
        if not seq.finished:
            return
        now = time.perf_counter()
        self.requests_finished[seq.finish_reason] = self.requests_finished.get(seq.finish_reason, 0) + 1
        self.prompt_tokens += len(seq.prompt_ids)
        n = len(seq.generated)
        self.generation_tokens += n
        self.e2e.append(now - arrival)
        if first_token is not None and n > 1:
            self.tpot.append((now - first_token) / (n - 1))

    def prometheus(self, running: int, waiting: int, kv_usage: float, prefix_hits: int,
                   prefix_queries: int, model: str, labels: str = "") -> str:
        """labels: more label pairs for every sample, e.g. 'replica="0"'."""
        label = f'model_name="{model}"' + (f",{labels}" if labels else "")
        lines: list[str] = []

        def metric(name: str, kind: str, help_: str, samples: list[tuple[str, float]]) -> None:
            lines.append(f"# HELP verispec:{name} {help_}")
            lines.append(f"# TYPE verispec:{name} {kind}")
            for labels, value in samples:
                lines.append(f"verispec:{name}{{{labels}}} {value}")

        def histogram(name: str, help_: str, h: Histogram) -> None:
            lines.append(f"# HELP verispec:{name} {help_}")
            lines.append(f"# TYPE verispec:{name} histogram")
            for b, n in zip(BUCKETS, h.counts):
                lines.append(f'verispec:{name}_bucket{{{label},le="{b}"}} {n}')
            lines.append(f'verispec:{name}_bucket{{{label},le="+Inf"}} {h.count}')
            lines.append(f"verispec:{name}_sum{{{label}}} {h.total}")
            lines.append(f"verispec:{name}_count{{{label}}} {h.count}")

        metric("num_requests_running", "gauge", "Sequences admitted (prefilling or decoding).", [(label, running)])
        metric("num_requests_waiting", "gauge", "Sequences waiting for admission.", [(label, waiting)])
        metric("kv_cache_usage_perc", "gauge", "Fraction of KV cache blocks held by live sequences.",
               [(label, round(kv_usage, 6))])
        metric("prefix_cache_queries", "counter", "Full prompt blocks looked up in the prefix cache.",
               [(label, prefix_queries)])
        metric("prefix_cache_hits", "counter", "Full prompt blocks served from the prefix cache.",
               [(label, prefix_hits)])
        metric("num_preemptions", "counter", "Sequences preempted (recomputed later) for lack of KV blocks.",
               [(label, self.preemptions)])
        metric("prompt_tokens", "counter", "Prompt tokens of finished sequences.", [(label, self.prompt_tokens)])
        metric("generation_tokens", "counter", "Generated tokens of finished sequences.",
               [(label, self.generation_tokens)])
        metric("request_success", "counter", "Finished sequences by finish reason.",
               [(f'{label},finished_reason="{r}"', n) for r, n in sorted(self.requests_finished.items())]
               or [(f'{label},finished_reason="stop"', 0)])
        metric("spec_decode_num_drafts", "counter", "Sequence-rounds that proposed draft tokens.",
               [(label, self.spec.drafting_rounds)])
        metric("spec_decode_num_draft_tokens", "counter", "Draft tokens proposed.", [(label, self.spec.proposed)])
        metric("spec_decode_num_accepted_tokens", "counter", "Draft tokens accepted.",
               [(label, self.spec.accepted)])
        metric("spec_decode_num_accepted_tokens_per_pos", "counter", "Draft tokens accepted at each position.",
               [(f'{label},position="{i}"', n) for i, n in enumerate(self.spec.position_accepted)]
               or [(f'{label},position="0"', 0)])
        metric("engine_errors", "counter", "Engine steps that failed (their requests got an error).",
               [(label, self.engine_errors)])
        histogram("time_to_first_token_seconds", "Arrival to first generated token.", self.ttft)
        histogram("time_per_output_token_seconds", "Mean time between output tokens after the first.", self.tpot)
        histogram("e2e_request_latency_seconds", "Arrival to last token.", self.e2e)
        return "\n".join(lines) + "\n"
