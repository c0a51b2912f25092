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
                    "counted from the server's usage. Targets this machine only. Either --url an existing "
                    "server, or --spawn ARGS (repeatable) to start `verispec serve ARGS` on a free port for "
                    "each configuration in turn, e.g. --spawn '--proposer none' --spawn '--proposer ngram'.")
    p.add_argument("--url", default=None, help="a running server (default http://127.0.0.1:8000 when no --spawn)")
    p.add_argument("--spawn", action="append", default=[], metavar="ARGS",
                   help="start `verispec serve ARGS` for this configuration (repeatable; one at a time)")
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


def _run_against(url: str, label: str, args, levels, prompts) -> list[dict]:
    import asyncio

    from verispec.bench.loadtest import format_rows, run_level, summarize

    model = args.model or _first_model(url)
    rows = []
    for c in levels:
        n = args.requests or max(4, c)
        print(f"[{label}] concurrency {c}: {n} requests …", file=sys.stderr, flush=True)
        results, wall = asyncio.run(run_level(url, model, prompts, c, n, args.max_tokens, args.time_limit))
        row = summarize(results, wall, c, args.slo_ttft, args.slo_tpot)
        row["server"] = label
        rows.append(row)
        print(format_rows(label, [row]).splitlines()[-1], file=sys.stderr, flush=True)
    return rows


def run(args) -> int:
    from verispec.bench.loadtest import check_loopback, format_rows

    levels = _levels(args.concurrency)
    if args.max_tokens < 1 or (args.requests is not None and args.requests < 1) or args.time_limit <= 0:
        raise VerispecError("--max-tokens, --requests and --time-limit must be positive")
    if args.url and args.spawn:
        raise VerispecError("give --url or --spawn, not both")
    prompts = _messages(args.prompts)
    all_rows: list[dict] = []
    if not args.spawn:
        url = (args.url or "http://127.0.0.1:8000").rstrip("/")
        check_loopback(url)
        _wait_healthy(url, None, timeout=10)
        all_rows += _run_against(url, url, args, levels, prompts)
    for spec in args.spawn:
        port = _free_port()
        url = f"http://127.0.0.1:{port}"
        cmd = [sys.executable, "-m", "verispec.cli.main", "serve", "--port", str(port), *shlex.split(spec)]
        print(f"starting: verispec serve --port {port} {spec}", file=sys.stderr, flush=True)
        proc = subprocess.Popen(cmd)
        try:
            _wait_healthy(url, proc)
            all_rows += _run_against(url, spec or "default", args, levels, prompts)
        finally:
            proc.send_signal(signal.SIGTERM)            # graceful drain
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
    by_server: dict[str, list[dict]] = {}
    for r in all_rows:
        by_server.setdefault(r["server"], []).append(r)
    tables = "\n\n".join(format_rows(label, rows) for label, rows in by_server.items())
    print(tables)
    command = invocation()
    if args.json_file:
        import torch

        from verispec import __version__
        from verispec.kernels import machine

        env = {"verispec": __version__, "torch": torch.__version__, "python": platform.python_version(),
               "cpus": os.cpu_count(), "platform": platform.platform(),
               **machine()}                                # the build the spawned servers share (same cache)
        with open(args.json_file, "w") as f:
            json.dump({"command": command, "environment": env, "max_tokens": args.max_tokens,
                       "slo": {"ttft_s": args.slo_ttft, "tpot_s": args.slo_tpot}, "rows": all_rows}, f, indent=2)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(f"# verispec loadtest report\n\nGenerated by `verispec loadtest` — do not edit by hand.\n\n"
                    f"Command: `{command}`\n\nmax_tokens {args.max_tokens}, greedy, streaming chat; goodput "
                    f"objectives TTFT ≤ {args.slo_ttft} s and TPOT ≤ {args.slo_tpot} s.\n\n{tables}\n")
    return 0
