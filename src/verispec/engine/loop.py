"""EngineLoop: an Engine stepped on a thread of its own, fed by other threads (the server's
request handlers): `submit` and `cancel` queue work, the loop adds it between steps."""

from __future__ import annotations

import queue
import threading

from verispec.engine.engine import Engine, Request, Update


class EngineLoop:
    """Runs an Engine on its own thread; `submit` and `cancel` are safe from any thread."""

    def __init__(self, engine: Engine, max_waiting: int = 256):
        self.engine = engine
        self.max_waiting = max_waiting
        self._inbox: queue.Queue = queue.Queue()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="verispec-engine", daemon=True)
        self.error: str | None = None

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._inbox.put(None)
        self._thread.join(timeout)

    @property
    def queued(self) -> int:
        return self.engine.scheduler.num_waiting + self._inbox.qsize()

    def submit(self, request: Request) -> None:
        self.engine.check(request.prompts, request.params)     # fail fast, in the caller's thread
        self._inbox.put(("add", request))

    def cancel(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id))

    def _drain(self, block: bool) -> None:
        try:
            item = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while item is not None:
            kind, arg = item
            if kind == "add":
                try:
                    self.engine.add(arg)
                except Exception as err:           # refused (or broken) request: tell it, keep serving
                    self.engine.abort(arg.id)
                    arg.sink(Update(arg.id, 0, "", [], finish_reason="error", error=str(err)))
            else:
                self.engine.abort(arg)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                item = None

    def _run(self) -> None:
        while not self._stop.is_set():
            self._drain(block=not self.engine.has_work)
            if not self.engine.has_work:
                continue
            try:
                self.engine.step()
            except Exception as err:       # keep serving: fail the live requests, not the process
                self.error = f"{type(err).__name__}: {err}"
                self.engine.fail_all(f"internal engine error: {self.error}")
                self.engine.stats.engine_errors += 1
