"""The OpenAI-compatible HTTP layer (FastAPI): validation, streaming, errors; the engine does the rest.

Endpoints: POST /v1/completions, POST /v1/chat/completions, GET /v1/models, GET /health, GET /metrics.
Every error has the OpenAI shape {"error": {"message", "type", "param", "code"}}; an error after a
stream has started is sent as an SSE `error` event, never a silent cut.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import os
import threading
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from verispec.errors import InvalidRequest
from verispec.serving import protocol
from verispec.engine.engine import Engine
from verispec.engine.loop import EngineLoop
from verispec.serving.backend import LocalBackend, Submission


class ApiError(Exception):
    def __init__(self, status: int, message: str, type_: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def response(self) -> JSONResponse:
        return JSONResponse(protocol.error_body(self.message, self.type, self.param, self.code), status_code=self.status)


def invalid(err: InvalidRequest) -> ApiError:
    return ApiError(400, str(err), "invalid_request_error", err.param, err.code)


@dataclass
class ServerConfig:
    model_name: str
    api_key: str | None = None
    max_waiting: int = 256            # queued sequences beyond which requests get 429
    max_body_bytes: int = 4 << 20
    default_max_tokens: int = 512     # chat requests without max_tokens (completions default to 16)
    aliases: list[str] = field(default_factory=list)


class ServerState:
    """load: builds the engine (served by a LocalBackend), or any backend with the same methods
    (the Ray replicas' router)."""

    def __init__(self, config: ServerConfig, load: Callable[[], Engine | object]):
        self.config = config
        self._load = load
        self.backend = None
        self.load_error: str | None = None
        self.started = time.time()
        self._thread = threading.Thread(target=self._start, name="verispec-load", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _start(self) -> None:
        try:
            loaded = self._load()
            if isinstance(loaded, Engine):
                loop = EngineLoop(loaded, self.config.max_waiting)
                loop.start()
                loaded = LocalBackend(loop)
            self.backend = loaded
        except Exception as err:                 # reported by /health and every request
            self.load_error = f"{type(err).__name__}: {err}"

    def ready(self):
        if self.load_error:
            raise ApiError(503, f"the model failed to load: {self.load_error}", "server_error", code="model_load_failed")
        if self.backend is None:
            raise ApiError(503, "the model is still loading; retry shortly", "server_error", code="model_loading")
        return self.backend

    def stop(self) -> None:
        if self.backend is not None:
            self.backend.stop()


def create_app(config: ServerConfig, load: Callable[[], Engine | object]) -> FastAPI:
    state = ServerState(config, load)

    @asynccontextmanager
    async def lifespan(app):
        state.start()
        yield
        state.stop()

    app = FastAPI(title="verispec", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.verispec = state

    @app.exception_handler(ApiError)
    async def _api_error(request, err: ApiError):
        return err.response()

    @app.exception_handler(404)
    async def _not_found(request, err):
        return ApiError(404, f"no route {request.method} {request.url.path}", "invalid_request_error",
                        code="not_found").response()

    @app.exception_handler(405)
    async def _bad_method(request, err):
        return ApiError(405, f"method {request.method} is not allowed on {request.url.path}",
                        "invalid_request_error", code="method_not_allowed").response()

    def authorize(request: Request) -> None:
        if config.api_key is None:
            return
        header = request.headers.get("authorization", "")
        given = header[7:] if header.lower().startswith("bearer ") else ""
        if not hmac.compare_digest(given.encode(), config.api_key.encode()):
            raise ApiError(401, "invalid or missing API key (send 'Authorization: Bearer <key>')",
                           "authentication_error", code="invalid_api_key")

    async def read_json(request: Request) -> dict:
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > config.max_body_bytes:
            raise ApiError(413, f"request body over {config.max_body_bytes} bytes", "invalid_request_error",
                           code="request_too_large")
        raw = b""
        async for part in request.stream():
            raw += part
            if len(raw) > config.max_body_bytes:
                raise ApiError(413, f"request body over {config.max_body_bytes} bytes", "invalid_request_error",
                               code="request_too_large")
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as err:
            raise ApiError(400, f"request body is not valid UTF-8 ({err.reason} at byte {err.start})",
                           "invalid_request_error", code="invalid_utf8") from None
        try:
            body = protocol.parse_json(text)
        except json.JSONDecodeError as err:
            raise ApiError(400, f"request body is not valid JSON: {err.msg} (line {err.lineno}, column {err.colno})",
                           "invalid_request_error", code="invalid_json") from None
        except InvalidRequest as err:
            raise ApiError(400, str(err), "invalid_request_error", code="invalid_json") from None
        if not isinstance(body, dict):
            raise ApiError(400, "request body must be a JSON object", "invalid_request_error", code="invalid_json")
        return body

    def check_model(name: str | None) -> str:
        served = [config.model_name, *config.aliases]
        if name is None or name in served:
            return config.model_name
        raise ApiError(404, f"the model '{name}' does not exist; this server serves {', '.join(served)}",
                       "invalid_request_error", param="model", code="model_not_found")

    # -- routes ---------------------------------------------------------------------------
    @app.get("/health")
    async def health():
        if state.load_error:
            return JSONResponse({"status": "error", "error": state.load_error}, status_code=503)
        if state.backend is None:
            return JSONResponse({"status": "loading"}, status_code=503)
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models(request: Request):
        authorize(request)
        state.ready()
        created = int(state.started)
        return {"object": "list", "data": [{"id": name, "object": "model", "created": created, "owned_by": "verispec"}
                                           for name in [config.model_name, *config.aliases]]}

    @app.get("/metrics")
    async def metrics():
        text = state.ready().metrics(config.model_name)
        if asyncio.iscoroutine(text):
            text = await text
        return PlainTextResponse(text + _process_metrics(), media_type="text/plain; version=0.0.4")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handle(request, "completion")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await handle(request, "chat")

    async def handle(request: Request, kind: str):
        authorize(request)
        backend = state.ready()
        body = await read_json(request)
        try:
            parsed = protocol.parse_chat(body, config.default_max_tokens) if kind == "chat" \
                else protocol.parse_completion(body)
        except InvalidRequest as err:
            if err.param is None:
                err.param = "messages" if kind == "chat" else "prompt"
            raise invalid(err) from None
        model = check_model(parsed.model)
        if backend.queued >= config.max_waiting:
            raise ApiError(429, f"the server is busy ({backend.queued} requests queued); retry later",
                           "rate_limit_error", code="queue_full")
        rid = protocol.new_id(kind)
        try:
            sub = backend.submit(kind, parsed, rid)
            if asyncio.iscoroutine(sub):
                sub = await sub
        except InvalidRequest as err:
            raise invalid(err) from None
        headers = {"x-verispec-replica": sub.replica} if sub.replica is not None else {}
        if parsed.stream:
            return StreamingResponse(stream(sub, kind, rid, model, parsed), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **headers})
        response = await collect(request, sub, kind, rid, model, parsed.params.n)
        response.headers.update(headers)
        return response

    async def collect(request: Request, sub: Submission, kind: str, rid: str, model: str, n: int):
        updates, expected = sub.updates, sub.expected
        texts: dict[int, list[str]] = {i: [] for i in range(expected)}
        finish: dict[int, str] = {}
        prompt_tokens: dict[int, int] = {}
        completion_tokens = 0
        spec = {"drafted": 0, "accepted": 0, "rounds": 0}
        done = False
        try:
            while len(finish) < expected:
                try:
                    u = await asyncio.wait_for(updates.get(), timeout=1.0)
                except asyncio.TimeoutError:
                    if await request.is_disconnected():
                        return PlainTextResponse("", status_code=499)
                    continue
                if u.error:
                    raise ApiError(500, u.error, "server_error", code="engine_error")
                texts[u.index].append(u.text)
                if u.finish_reason:
                    finish[u.index] = u.finish_reason
                    prompt_tokens[u.index] = u.prompt_tokens
                    completion_tokens += u.completion_tokens
                    _add_spec(spec, u.spec)
            done = True
        finally:
            if not done:                       # disconnected or failed: free its blocks now
                sub.cancel()
        prompt_total = sum(prompt_tokens[i] for i in range(0, expected, n))     # each prompt once, not n times
        choices = [protocol.choice(kind, i, "".join(texts[i]), finish[i]) for i in range(expected)]
        return JSONResponse(protocol.response(kind, rid, model, choices,
                                              protocol.usage(prompt_total, completion_tokens), spec))

    async def stream(sub: Submission, kind: str, rid: str, model: str, parsed):
        updates, expected = sub.updates, sub.expected
        created = int(time.time())
        finished, completion_tokens = 0, 0
        prompt_tokens: dict[int, int] = {}
        spec = {"drafted": 0, "accepted": 0, "rounds": 0}
        done = False
        try:
            if kind == "chat":
                roles = [protocol.chunk_choice(kind, i, None, None, role=True) for i in range(expected)]
                yield _sse(protocol.chunk(kind, rid, model, created, roles))
            while finished < expected:
                u = await updates.get()
                if u.error:
                    yield "event: error\ndata: " + json.dumps(protocol.error_body(
                        u.error, "server_error", code="engine_error")) + "\n\n"
                    done = True
                    return
                if u.finish_reason:
                    finished += 1
                    completion_tokens += u.completion_tokens
                    prompt_tokens[u.index] = u.prompt_tokens
                    _add_spec(spec, u.spec)
                if u.text or u.finish_reason:
                    yield _sse(protocol.chunk(kind, rid, model, created,
                                              [protocol.chunk_choice(kind, u.index, u.text, u.finish_reason)]))
            if parsed.include_usage:
                n = parsed.params.n
                prompt_total = sum(prompt_tokens[i] for i in range(0, expected, n))
                yield _sse(protocol.chunk(kind, rid, model, created, [],
                                          protocol.usage(prompt_total, completion_tokens), spec))
            yield "data: [DONE]\n\n"
            done = True
        finally:
            if not done:                       # the client went away: free its blocks now
                sub.cancel()

    return app


def _add_spec(total: dict, spec: dict | None) -> None:
    if spec:
        total["proposer"] = spec["proposer"]
        for key in ("drafted", "accepted", "rounds"):
            total[key] += spec[key]


def _sse(obj: dict) -> str:
    return "data: " + json.dumps(obj, ensure_ascii=False) + "\n\n"


def _process_metrics() -> str:
    """This process's resident memory, under Prometheus's standard name (Linux; nothing elsewhere)."""
    try:
        pages = int(open("/proc/self/statm").read().split()[1])
    except (OSError, ValueError, IndexError):
        return ""
    return ("# HELP process_resident_memory_bytes Resident memory size in bytes.\n"
            "# TYPE process_resident_memory_bytes gauge\n"
            f"process_resident_memory_bytes {pages * os.sysconf('SC_PAGE_SIZE')}\n")
