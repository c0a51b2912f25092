"""`verispec serve --replicas N`: N engines as Ray Serve deployments behind the same FastAPI app.

Each replica is a Ray Serve deployment of one replica (`verispec-replica-<i>`) that builds the
engine from the serve flags and runs it on its own EngineLoop, with its share of the CPU threads.
Ray Serve supervises them (health checks, restarts). The HTTP layer stays the one of `verispec
serve` (same endpoints, errors, streaming, API key), running in this process with `ReplicaRouter`
as its backend:

- prefix affinity: a request whose text starts like an earlier one's (a conversation's history, a
  shared system prompt) goes to the replica that served it, which holds that prefix in its cache,
  while that replica has room (fewer than --max-running requests in flight); otherwise, and for new
  prefixes, the replica with the fewest requests in flight. Prefixes are recognised on the text
  (the chat messages one by one, a completion prompt in 256-character pieces), so the router needs
  no tokenizer.
- faults: a replica that fails mid-stream ends its streams with an error update (an SSE `error`
  event); it is left out of routing until it answers a ping again (Ray Serve restarts it).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import time
from collections import OrderedDict
from dataclasses import fields

from verispec.engine.engine import Update
from verispec.errors import InvalidRequest, VerispecError

PIECE_CHARS = 256          # a completion prompt's prefix is recognised in pieces of this many characters
MAX_PREFIXES = 100_000     # prefix → replica entries kept (least recently used dropped)
RETRY_DEAD_S = 2.0         # how often a failed replica is pinged before it gets requests again


def prefix_keys(kind: str, parsed) -> list[bytes]:
    """Hash chain over the request's text, shortest prefix first: a chat's messages one by one, or
    the (first) completion prompt in PIECE_CHARS pieces. Equal keys = equal leading text."""
    if kind == "chat":
        parts = [json.dumps([m.get("role"), m.get("content")], ensure_ascii=False) for m in parsed.messages]
    else:
        prompt = parsed.prompts[0]
        text = prompt if isinstance(prompt, str) else json.dumps(prompt)
        parts = [text[i:i + PIECE_CHARS] for i in range(0, len(text), PIECE_CHARS)]
    keys, h = [], b""
    for part in parts:
        h = hashlib.sha256(h + part.encode("utf-8", "surrogatepass")).digest()
        keys.append(h)
    return keys


class Affinity:
    """Which replica served which prefix; picks a replica for a new request (counting only)."""

    def __init__(self, replicas: int, capacity: int):
        self.replicas, self.capacity = replicas, capacity
        self.owner: OrderedDict[bytes, int] = OrderedDict()
        self.in_flight = [0] * replicas
        self.down_since: dict[int, float] = {}

    def pick(self, keys: list[bytes]) -> tuple[int, bool]:
        """(replica, whether it was chosen for a known prefix)."""
        live = [i for i in range(self.replicas) if i not in self.down_since] or list(range(self.replicas))
        for key in reversed(keys[:-1] if len(keys) > 1 else keys):   # longest shared prefix first
            i = self.owner.get(key)
            if i is not None and i in live and self.in_flight[i] < self.capacity:
                return i, True
        return min(live, key=lambda i: (self.in_flight[i], i)), False

    def record(self, keys: list[bytes], replica: int) -> None:
        for key in keys:
            self.owner[key] = replica
            self.owner.move_to_end(key)
        while len(self.owner) > MAX_PREFIXES:
            self.owner.popitem(last=False)


def _is_task_error(err: Exception) -> bool:
    """An exception raised by the replica's code (it is alive), as opposed to the replica dying."""
    try:
        from ray.exceptions import RayActorError, RayTaskError
    except ImportError:
        return False
    return isinstance(err, RayTaskError) and not isinstance(err, RayActorError)


class ReplicaRouter:
    """The API's backend for N Ray Serve replicas (see the module docstring)."""

    def __init__(self, handles: list, capacity: int, on_stop=None):
        self.handles = handles
        self.affinity = Affinity(len(handles), capacity)
        self.prefix_routed = 0
        self._on_stop = on_stop

    @property
    def queued(self) -> int:
        return 0            # each replica queues its own; a full one refuses with 429

    async def submit(self, kind: str, parsed, rid: str):
        from verispec.serving.backend import Submission

        await self._revive()
        keys = prefix_keys(kind, parsed)
        for _ in range(len(self.handles)):                 # a replica that fails to answer: the next one
            replica, affine = self.affinity.pick(keys)
            self.affinity.in_flight[replica] += 1          # counted now: concurrent requests spread out
            stream = self.handles[replica].options(stream=True).generate.remote(kind, parsed, rid)
            try:
                head = await stream.__anext__()             # validation happens on the replica
                break
            except Exception:
                self.affinity.in_flight[replica] -= 1
                self.affinity.down_since[replica] = time.monotonic()
        else:
            raise VerispecError("no replica is answering; Ray Serve is restarting them")
        if "invalid" in head:
            self.affinity.in_flight[replica] -= 1
            raise InvalidRequest(head["invalid"], param=head.get("param"), code=head.get("code"))
        self.prefix_routed += affine
        self.affinity.record(keys, replica)
        updates: asyncio.Queue[Update] = asyncio.Queue()

        async def pump():
            try:
                async for item in stream:
                    updates.put_nowait(Update(**item))
            except asyncio.CancelledError:
                stream.cancel()
                raise
            except Exception as err:                       # the replica died (or failed) mid-stream
                if not _is_task_error(err):
                    self.affinity.down_since[replica] = time.monotonic()
                for i in range(head["expected"]):
                    updates.put_nowait(Update(rid, i, "", [], finish_reason="error",
                                              error=f"replica {replica} failed mid-stream: {type(err).__name__}"))
            finally:
                self.affinity.in_flight[replica] -= 1

        task = asyncio.ensure_future(pump())
        return Submission(head["expected"], updates, task.cancel, replica=str(replica))

    async def _revive(self) -> None:
        """Ping replicas marked down (no more than every RETRY_DEAD_S); a reply puts one back."""
        now = time.monotonic()
        for i, since in list(self.affinity.down_since.items()):
            if now - since < RETRY_DEAD_S:
                continue
            try:
                await asyncio.wait_for(self.handles[i].ping.remote(), timeout=1.0)
                del self.affinity.down_since[i]
            except Exception:
                self.affinity.down_since[i] = now

    async def metrics(self, model: str) -> str:
        """Every replica's exposition with a replica label, merged under one HELP/TYPE per metric,
        plus the router's own counters."""
        families: OrderedDict[str, list[str]] = OrderedDict()
        for i, h in enumerate(self.handles):
            try:
                text = await asyncio.wait_for(h.metrics.remote(model, f'replica="{i}"'), timeout=5)
            except Exception:
                continue
            name = None
            for line in text.splitlines():
                if line.startswith("# HELP "):
                    name = line.split()[2]
                    families.setdefault(name, [line, None])
                elif line.startswith("# TYPE "):
                    families[name][1] = families[name][1] or line
                elif line:
                    families[name].append(line)
        lines = [line for fam in families.values() for line in fam if line]
        lines += ["# HELP verispec:router_prefix_routed Requests sent to the replica holding their prefix.",
                  "# TYPE verispec:router_prefix_routed counter",
                  f'verispec:router_prefix_routed{{model_name="{model}"}} {self.prefix_routed}',
                  "# HELP verispec:router_replicas_up Replicas currently taking requests.",
                  "# TYPE verispec:router_replicas_up gauge",
                  f'verispec:router_replicas_up{{model_name="{model}"}} '
                  f'{len(self.handles) - len(self.affinity.down_since)}']
        return "\n".join(lines) + "\n"

    def stop(self) -> None:
        if self._on_stop is not None:
            self._on_stop()


class Replica:
    """The body of one replica's deployment: an engine on its loop, built from the serve flags."""

    def __init__(self, args, threads: int):
        import torch

        from verispec.cli.generate import build_llm
        from verispec.engine.loop import EngineLoop
        from verispec.serving.backend import LocalBackend, freeze_loaded_objects

        torch.set_num_threads(threads)
        llm = build_llm(args)
        engine = llm.engine(kv_budget_mb=args.kv_cache_mb, block_size=args.block_size,
                            max_running=args.max_running, prefill_budget=args.prefill_chunk)
        freeze_loaded_objects()
        loop = EngineLoop(engine, args.max_waiting)
        loop.start()
        self.backend = LocalBackend(loop)

    def ping(self) -> int:
        return os.getpid()

    def metrics(self, model: str, labels: str) -> str:
        return self.backend.metrics(model, labels)

    async def generate(self, kind: str, parsed, rid: str):
        """First item: {"expected": n} or {"invalid": message, "param", "code"}; then Update fields."""
        try:
            sub = self.backend.submit(kind, parsed, rid)
        except InvalidRequest as err:
            yield {"invalid": str(err), "param": err.param, "code": err.code}
            return
        yield {"expected": sub.expected}
        finished = 0
        try:
            while finished < sub.expected:
                u = await sub.updates.get()
                finished += u.finish_reason is not None
                yield {f.name: getattr(u, f.name) for f in fields(u) if f.name != "seq"}
        finally:
            if finished < sub.expected:        # the router cancelled (client gone): free the blocks
                sub.cancel()


def start_replicas(args, replicas: int, threads_per_replica: int, ray_address: str | None) -> ReplicaRouter:
    """Start (or join) Ray, deploy the replicas, and return the router over them."""
    try:
        import ray
        from ray import serve
    except ImportError:
        raise VerispecError("--replicas needs Ray Serve: pip install 'verispec[serve,ray]'") from None
    own = ray_address is None
    if own:
        ray.init(address="local", include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False,
                 num_cpus=max(os.cpu_count() or 1, replicas))
    else:
        ray.init(address=ray_address, log_to_driver=False)
    serve.start(proxy_location="Disabled")           # HTTP is this process's FastAPI app
    env = {"OMP_NUM_THREADS": str(threads_per_replica), "VERISPEC_REPLICA": "1"}
    deployment = serve.deployment(Replica, ray_actor_options={"num_cpus": 0, "runtime_env": {"env_vars": env}},
                                  health_check_period_s=2, health_check_timeout_s=10, max_ongoing_requests=1000)
    handles = []
    for i in range(replicas):
        app = deployment.options(name=f"verispec-replica-{i}").bind(args, threads_per_replica)
        handles.append(serve.run(app, name=f"verispec-replica-{i}", route_prefix=None))

    def stop() -> None:
        try:
            serve.shutdown()
        finally:
            if own:
                ray.shutdown()

    return ReplicaRouter(handles, args.max_running, stop)
