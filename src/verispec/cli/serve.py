"""`verispec serve`: the OpenAI-compatible server (needs the `serve` extra: fastapi, uvicorn)."""

from __future__ import annotations

import signal
import sys

from verispec.cli.generate import add_model_args
from verispec.errors import VerispecError


def add_parser(sub) -> None:
    p = sub.add_parser(
        "serve", help="serve an OpenAI-compatible API with continuous batching and speculation",
        description="Serve /v1/completions, /v1/chat/completions (streaming and not), /v1/models, /health "
                    "and /metrics. Requests are batched continuously; every step is one batched "
                    "speculative round, K chosen per sequence (0 when speculation does not pay).")
    add_model_args(p)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only; "
                                                       "0.0.0.0 exposes the server)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    p.add_argument("--served-model-name", default=None,
                   help="the model id clients send (default: the model's name)")
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' (default: no key; or set VERISPEC_API_KEY)")
    p.add_argument("--kv-cache-mb", type=float, default=1024,
                   help="memory for the paged KV cache of target + draft, in MiB (default 1024)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block (default 16)")
    p.add_argument("--max-running", type=int, default=16,
                   help="most sequences decoding at once (default 16)")
    p.add_argument("--prefill-chunk", type=int, default=256,
                   help="most prompt tokens prefilled per step, so long prompts do not stall streams (default 256)")
    p.add_argument("--max-waiting", type=int, default=256,
                   help="queued sequences beyond which requests get HTTP 429 (default 256)")
    p.add_argument("--replicas", type=int, default=None,
                   help="run N engines as Ray Serve replicas behind this server, with prefix-affinity routing "
                        "(needs: pip install 'verispec[serve,ray]'; docs/SCALING.md)")
    p.add_argument("--threads-per-replica", type=int, default=None,
                   help="CPU threads each replica uses (default: the machine's cores divided among the replicas)")
    p.add_argument("--ray-address", default=None,
                   help="join this Ray cluster (default: start a local Ray instance bound to 127.0.0.1)")
    p.add_argument("--log-level", default="warning", choices=["critical", "error", "warning", "info", "debug"])
    p.set_defaults(run=run)


def _check(args) -> None:
    if not 0 < args.port < 65536:
        raise VerispecError(f"--port must be in 1 … 65535, got {args.port}")
    for name in ("kv_cache_mb", "block_size", "max_running", "prefill_chunk", "max_waiting"):
        if getattr(args, name) <= 0:
            raise VerispecError(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")


def _check_replicas(args) -> None:
    if args.replicas is None:
        if args.threads_per_replica is not None or args.ray_address is not None:
            raise VerispecError("--threads-per-replica and --ray-address go with --replicas N")
        return
    if not 1 <= args.replicas <= 64:
        raise VerispecError(f"--replicas must be in 1 … 64, got {args.replicas}")
    if args.threads_per_replica is not None and not 1 <= args.threads_per_replica <= 1024:
        raise VerispecError(f"--threads-per-replica must be in 1 … 1024, got {args.threads_per_replica}")
    try:
        import ray  # noqa: F401
        from ray import serve  # noqa: F401
    except ImportError:
        raise VerispecError("--replicas needs Ray Serve: pip install 'verispec[serve,ray]'") from None


def run(args) -> int:
    import os

    _check(args)
    _check_replicas(args)
    try:
        import uvicorn

        from verispec.serving.api import ServerConfig, create_app
    except ImportError as err:
        raise VerispecError(f"verispec serve needs the serve extra ({err.name} is missing): "
                            "pip install 'verispec[serve]'") from None
    from verispec.cli.generate import build_llm

    name = args.served_model_name or os.path.basename(str(args.model)).removesuffix(".gguf")
    config = ServerConfig(name, api_key=args.api_key or os.environ.get("VERISPEC_API_KEY"),
                          max_waiting=args.max_waiting)

    router = None
    if args.replicas is not None:
        # Ray starts here, on the main thread: its processes are bound to the thread that starts them.
        from verispec.serving.replicas import start_replicas

        threads = args.threads_per_replica or max(1, (os.cpu_count() or 1) // args.replicas)
        print(f"verispec: starting {args.replicas} Ray Serve replicas of {args.model} ({threads} threads each) …",
              file=sys.stderr, flush=True)
        router = start_replicas(args, args.replicas, threads, args.ray_address)
        print(f"verispec: serving {name} on http://{args.host}:{args.port}/v1 from {args.replicas} replicas",
              file=sys.stderr, flush=True)

    def load():
        if router is not None:
            return router
        llm = build_llm(args)
        engine = llm.engine(kv_budget_mb=args.kv_cache_mb, block_size=args.block_size,
                            max_running=args.max_running, prefill_budget=args.prefill_chunk)
        print(f"verispec: serving {name} on http://{args.host}:{args.port}/v1 "
              f"(proposer {llm.proposer_name}, k={llm.k}, {engine.pool.usable} KV blocks of {args.block_size})",
              file=sys.stderr, flush=True)
        from verispec.serving.backend import freeze_loaded_objects

        freeze_loaded_objects()
        return engine

    app = create_app(config, load)
    print(f"verispec: loading {args.model} …", file=sys.stderr, flush=True)
    # uvicorn drains in-flight requests on SIGTERM/SIGINT, then re-raises the signal to the handler
    # that was installed before it: make that a clean exit, not a death by signal.
    signal.signal(signal.SIGTERM, _exit_drained)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, timeout_graceful_shutdown=30)
    return 0


def _exit_drained(signum, frame):
    print("verispec: drained, exiting", file=sys.stderr, flush=True)
    sys.exit(0)
