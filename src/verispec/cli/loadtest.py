"""`verispec loadtest`: bounded closed-loop load on a local server, or on servers it starts itself."""

from __future__ import annotations

import json
import os
import platform
import shlex
import signal
import socket
import subprocess
import sys
import time

from verispec.cli import invocation
from verispec.errors import VerispecError


def add_parser(sub) -> None:
    p = sub.add_parser(
        "loadtest", help="measure TTFT, TPOT, ITL, latency, throughput and goodput of a local server",
        description="Send streaming chat requests from the prompt suite at each concurrency level and report "
                    "TTFT, TPOT, ITL and end-to-end latency (median, p99), throughput and goodput, tokens "
                    "counted from the server's usage. Targets this machine only. --url a running server "
                    "(repeatable), and/or --spawn ARGS (repeatable) to start `verispec serve ARGS` on a free port per "
                    "configuration, e.g. --spawn '--proposer none' --spawn '--proposer ngram': every server "
                    "starts first, then each level alternates between them (--rounds batches each, in "
                    "A B, B A order) so that their ratio is measured at the same moments.")
    p.add_argument("--url", action="append", default=[],
                   help="a running server on this machine (repeatable; default http://127.0.0.1:8000 when no --spawn)")
    p.add_argument("--spawn", action="append", default=[], metavar="ARGS",
                   help="start `verispec serve ARGS` for this configuration (repeatable; all run side by side, "
                        "only one is sent requests at a time)")
    p.add_argument("--rounds", type=int, default=2,
                   help="per level, how many times each configuration takes a turn (default 2; the level's "
                        "requests are split between its turns)")
    p.add_argument("--model", default=None, help="model id to send (default: the server's first model)")
    p.add_argument("--concurrency", default="1,4,16", help="comma-separated levels (default 1,4,16)")
    p.add_argument("--requests", type=int, default=None,
                   help="requests per level (default: max(4, concurrency))")
    p.add_argument("--max-tokens", type=int, default=64, help="max_tokens per request (default 64)")
    p.add_argument("--time-limit", type=float, default=300, help="seconds per level before no new requests start "
                                                                 "(default 300)")
    p.add_argument("--prompts", default=None, help="prompt suite (as for bench; default: the bundled suite)")
    p.add_argument("--slo-ttft", type=float, default=5.0, help="goodput objective: TTFT in seconds (default 5)")
    p.add_argument("--slo-tpot", type=float, default=0.5, help="goodput objective: TPOT in seconds (default 0.5)")
    p.add_argument("--soak", type=float, default=None, metavar="MINUTES",
                   help="instead of levels: a soak of one server — --concurrency streams (default 32) for MINUTES, "
                        "some hung up early (--disconnect); reports lost and garbled streams, KV blocks still "
                        "held when idle and the server's memory over time, and exits 1 if any check fails")
    p.add_argument("--disconnect", type=float, default=0.2,
                   help="soak: the fraction of requests hung up after 1–4 chunks (default 0.2)")
    p.add_argument("--json", dest="json_file", default=None, help="write every number to this file")
    p.add_argument("--markdown", default=None, help="write the tables to this file")
    p.set_defaults(run=run)


def _levels(text: str) -> list[int]:
    try:
        levels = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise VerispecError(f"--concurrency takes comma-separated integers, got {text!r}") from None
    if not levels or min(levels) < 1 or max(levels) > 256:
        raise VerispecError("--concurrency levels must be in 1 … 256")
    return levels


def _messages(path) -> list[list[dict]]:
    from verispec.bench.suites import load_suite

    out = []
    for p in load_suite(path):
        if p.messages:
            out.append(p.messages)
        elif p.prompt is not None:
            out.append([{"role": "user", "content": p.prompt}])
    if not out:
        raise VerispecError("the prompt suite has no text prompts to send")
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_healthy(url: str, proc: subprocess.Popen | None, timeout: float = 900) -> None:
    import httpx

    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc is not None and proc.poll() is not None:
            raise VerispecError(f"the server exited with status {proc.returncode} before it was ready")
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise VerispecError(f"{url} was not healthy within {timeout:.0f} s")


def _first_model(url: str) -> str:
    import httpx

    return httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]


def _level(url: str, label: str, args, c: int, requests: int, prompts) -> tuple[list, float]:
    import asyncio

    from verispec.bench.loadtest import run_level

    model = args.model or _first_model(url)
    print(f"[{label}] concurrency {c}: {requests} requests …", file=sys.stderr, flush=True)
    return asyncio.run(run_level(url, model, prompts, c, requests, args.max_tokens, args.time_limit))


def _interleaved(servers: list[tuple[str, str]], args, levels, prompts) -> list[dict]:
    """Every level: each server takes `rounds` turns, alternating A B, B A, …; one row per server and
    level from all its turns (wall = the sum of its turns)."""
    from verispec.bench.loadtest import format_rows, summarize

    rows = []
    for c in levels:
        total = args.requests or max(4, c)
        per_turn = [total // args.rounds + (1 if r < total % args.rounds else 0) for r in range(args.rounds)]
        results: dict[str, list] = {label: [] for _, label in servers}
        walls: dict[str, float] = {label: 0.0 for _, label in servers}
        for r, n in enumerate(per_turn):
            if n == 0:
                continue
            for url, label in (servers if r % 2 == 0 else servers[::-1]):
                got, wall = _level(url, label, args, c, n, prompts)
                results[label] += got
                walls[label] += wall
        for _, label in servers:
            row = summarize(results[label], walls[label], c, args.slo_ttft, args.slo_tpot)
            row["server"] = label
            rows.append(row)
            print(format_rows(label, [row]).splitlines()[-1], file=sys.stderr, flush=True)
    return rows


def _ratios(rows: list[dict], labels: list[str]) -> str:
    """Each configuration against the first, level by level (same moments, so drift cancels)."""
    if len(labels) < 2:
        return ""
    by = {(r["server"], r["concurrency"]): r for r in rows}
    lines = [f"ratios vs {labels[0]!r} (measured interleaved): throughput, TTFT p99"]
    for label in labels[1:]:
        for (server, c), row in by.items():
            base = by.get((labels[0], c))
            if server != label or base is None:
                continue
            tput = (row["throughput_tok_s"] / base["throughput_tok_s"]) if base["throughput_tok_s"] else None
            t0, t1 = base["ttft_s"]["p99"], row["ttft_s"]["p99"]
            lines.append(f"  {label!r} at concurrency {c}: throughput {tput:.2f}x, TTFT p99 "
                         f"{(t1 / t0) if t0 and t1 else float('nan'):.2f}x" if tput is not None else
                         f"  {label!r} at concurrency {c}: no throughput")
    return "\n".join(lines)


def _soak(servers: list[tuple[str, str]], args, prompts, procs) -> int:
    import asyncio

    from verispec.bench.run import machine_line
    from verispec.bench.soak import soak

    url, label = servers[0]
    concurrency = 32 if args.concurrency == "1,4,16" else _levels(args.concurrency)[0]
    model = args.model or _first_model(url)

    def progress(report, elapsed: float) -> None:
        rss = f", RSS {report.rss_mib[-1][1]:.0f} MiB" if report.rss_mib else ""
        print(f"\r[{label}] soak {elapsed / 60:.1f}/{args.soak:.1f} min: {report.completed} complete, "
              f"{report.hung_up} hung up, {len(report.lost)} lost, {len(report.garbled)} garbled{rss}   ",
              end="", file=sys.stderr, flush=True)

    report = asyncio.run(soak(url, model, prompts, concurrency, args.soak * 60, args.max_tokens, args.disconnect,
                              sample_s=10, progress=progress))
    print(file=sys.stderr)
    if procs and procs[0].poll() is not None:
        report.healthy_after = False
    text = report.format()
    print(text)
    if args.json_file:
        with open(args.json_file, "w") as f:
            json.dump({"command": invocation(), "environment": _environment(), "server": label,
                       "max_tokens": args.max_tokens, "disconnect": args.disconnect, **report.to_dict()}, f, indent=2)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(f"# verispec soak report\n\nGenerated by `verispec loadtest --soak` — do not edit by hand.\n\n"
                    f"Command: `{invocation()}`\n\n{machine_line(_environment())}\n\n```\n{text}\n```\n")
    return 0 if report.passed else 1


def _environment() -> dict:
    import torch

    from verispec import __version__
    from verispec.kernels import machine

    return {"verispec": __version__, "torch": torch.__version__, "python": platform.python_version(),
            "cpus": os.cpu_count(), "platform": platform.platform(),
            **machine()}                                # the build the spawned servers share (same cache)


def run(args) -> int:
    from verispec.bench.loadtest import check_loopback, format_rows
    from verispec.bench.run import machine_line

    levels = _levels(args.concurrency)
    if args.soak is not None:
        if not 0 < args.soak <= 24 * 60 or not 0 <= args.disconnect <= 1:
            raise VerispecError("--soak takes minutes in (0, 1440] and --disconnect a fraction in [0, 1]")
        if len(args.url) + len(args.spawn) > 1 or len(levels) > 1:
            raise VerispecError("--soak runs against one server (one --url or --spawn) at one --concurrency")
    if args.max_tokens < 1 or (args.requests is not None and args.requests < 1) or args.time_limit <= 0:
        raise VerispecError("--max-tokens, --requests and --time-limit must be positive")
    if args.rounds < 1:
        raise VerispecError("--rounds must be positive")
    prompts = _messages(args.prompts)
    servers, procs = [], []
    for url in args.url or ([] if args.spawn else ["http://127.0.0.1:8000"]):
        url = url.rstrip("/")
        check_loopback(url)
        _wait_healthy(url, None, timeout=10)
        servers.append((url, url))
    try:
        for spec in args.spawn:
            port = _free_port()
            url = f"http://127.0.0.1:{port}"
            cmd = [sys.executable, "-m", "verispec.cli.main", "serve", "--port", str(port), *shlex.split(spec)]
            print(f"starting: verispec serve --port {port} {spec}", file=sys.stderr, flush=True)
            procs.append(subprocess.Popen(cmd))
            _wait_healthy(url, procs[-1])           # one load at a time: loads do not compete for the cores
            servers.append((url, spec or "default"))
        if args.soak is not None:
            return _soak(servers, args, prompts, procs)
        all_rows = _interleaved(servers, args, levels, prompts)
    finally:
        for proc in procs:
            proc.send_signal(signal.SIGTERM)            # graceful drain
        for proc in procs:
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
    by_server: dict[str, list[dict]] = {}
    for r in all_rows:
        by_server.setdefault(r["server"], []).append(r)
    tables = "\n\n".join(format_rows(label, rows) for label, rows in by_server.items())
    ratios = _ratios(all_rows, [label for _, label in servers])
    tables += ("\n\n" + ratios) if ratios else ""
    print(tables)
    command = invocation()
    if args.json_file:
        with open(args.json_file, "w") as f:
            json.dump({"command": command, "environment": _environment(), "max_tokens": args.max_tokens,
                       "interleaved": {"rounds": args.rounds, "order": "A B, B A, … per level"},
                       "slo": {"ttft_s": args.slo_ttft, "tpot_s": args.slo_tpot}, "rows": all_rows}, f, indent=2)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(f"# verispec loadtest report\n\nGenerated by `verispec loadtest` — do not edit by hand.\n\n"
                    f"Command: `{command}`\n\n{machine_line(_environment())}\n\nmax_tokens {args.max_tokens}, greedy, streaming chat; goodput "
                    f"objectives TTFT ≤ {args.slo_ttft} s and TPOT ≤ {args.slo_tpot} s.\n\n{tables}\n")
    return 0
