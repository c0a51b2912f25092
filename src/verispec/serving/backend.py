"""What the HTTP layer talks to: a backend takes a parsed request and hands back its updates.

`LocalBackend` is one engine on its thread in this process (`verispec serve`); `serving/replicas.py`
routes to several engines running as Ray Serve replicas (`verispec serve --replicas N`). Both give
the API the same `Submission`: an asyncio queue of `Update`s and a way to cancel.
"""

from __future__ import annotations

import asyncio
import gc
from dataclasses import dataclass
from typing import Callable

from verispec.engine.engine import Request, Update
from verispec.engine.loop import EngineLoop
from verispec.errors import InvalidRequest
from verispec.serving import protocol


@dataclass
class Submission:
    expected: int                       # sequences that will finish (prompts × n)
    updates: asyncio.Queue              # of Update, filled from whichever thread or task runs it
    cancel: Callable[[], None]          # the client went away: free what it holds
    replica: str | None = None          # which replica serves it (None: a single engine)


def encode_request(engine, kind: str, parsed) -> list[list[int]]:
    """The token ids a parsed request asks for (InvalidRequest names the offending field)."""
    try:
        limit = engine.context_length * protocol.MAX_CHARS_PER_TOKEN        # checked before tokenizing
        if kind == "chat":
            if engine.tokenizer is None or not engine.tokenizer.chat_template:
                raise InvalidRequest("this model has no chat template; use /v1/completions", param="messages")
            protocol.check_length([m["content"] for m in parsed.messages], limit, "messages")
            return [engine.encode(engine.chat_prompt(parsed.messages))]
        protocol.check_length([p for p in parsed.prompts if isinstance(p, str)], limit, "prompt")
        return [engine.encode(p) for p in parsed.prompts]
    except InvalidRequest as err:
        if err.param is None:
            err.param = "messages" if kind == "chat" else "prompt"
        raise


class LocalBackend:
    """One engine, stepped by an EngineLoop thread in this process."""

    def __init__(self, loop: EngineLoop):
        self.loop = loop

    @property
    def queued(self) -> int:
        return self.loop.queued

    def submit(self, kind: str, parsed, rid: str) -> Submission:
        """Queue the request; raises InvalidRequest (nothing queued) when it cannot run. Call from the
        event loop that will read the updates."""
        prompts = encode_request(self.loop.engine, kind, parsed)
        updates: asyncio.Queue[Update] = asyncio.Queue()
        aio = asyncio.get_running_loop()
        self.loop.submit(Request(rid, prompts, parsed.params, lambda u: aio.call_soon_threadsafe(updates.put_nowait, u)))
        return Submission(len(prompts) * parsed.params.n, updates, lambda: self.loop.cancel(rid))

    def metrics(self, model: str, labels: str = "") -> str:
        e = self.loop.engine
        return e.stats.prometheus(len(e.scheduler.admitted), self.loop.queued, e.pool.usage(), e.pool.hits,
                                  e.pool.queries, model, labels)

    def stop(self) -> None:
        self.loop.stop()


def freeze_loaded_objects() -> int:
    """Move every object alive now (the loaded models' tokenizer tables and modules: ~300,000 tracked
    objects) out of the garbage collector's reach, for the life of the server. A full collection over
    them took 180–200 ms, a stall of several decode steps in whichever request it fell on; after this
    it scans only what requests allocate. Returns how many objects were frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
