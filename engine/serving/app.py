"""An OpenAI-compatible HTTP server around the engine (FastAPI + uvicorn).

``POST /v1/completions`` (token-id prompts always, text when the model has a tokenizer; streaming
as server-sent events), ``GET /v1/models``, ``GET /health`` (200 only after warm-up) and
``GET /metrics`` (Prometheus text). The engine runs in its own thread (engine_thread.py); this
module only parses, admits, and relays tokens. A client that goes away has its request
aborted at the next iteration boundary; SIGTERM stops accepting, lets in-flight requests finish
for up to ``graceful_timeout_s``, cancels the rest and exits 0.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import signal
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import anyio
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse
from starlette.responses import StreamingResponse

from engine.core.config import ModelConfig, SchedulerConfig
from engine.serving.engine_thread import EngineThread, Histogram, QueueFull, RequestSink, TokenEvent, clock
from engine.serving.protocol import ApiError, CompletionParams, check_limits, parse_completion, parse_json
from engine.core.request import Request as EngineRequest

log = logging.getLogger("miniserve.server")


@dataclass(frozen=True)
class ServerConfig:
    """How the server listens and admits. ``max_waiting`` bounds queued (not yet running)
    requests: past it a request gets 429 instead of an ever-growing queue."""

    host: str = "127.0.0.1"
    port: int = 8000
    max_waiting: int = 256
    warmup: bool = True
    graceful_timeout_s: float = 30.0
    trace_path: str | None = None
    served_model_name: str | None = None
    log_level: str = "info"
    access_log: bool = False

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError(f"server.port must be in [0, 65535], got {self.port}")
        if self.max_waiting < 1:
            raise ValueError(f"server.max_waiting must be >= 1, got {self.max_waiting}")
        if not self.graceful_timeout_s >= 0:
            raise ValueError(f"server.graceful_timeout_s must be >= 0, got {self.graceful_timeout_s}")


@dataclass
class _ServerState:
    engine: EngineThread
    model_name: str
    draining: bool = False
    rejected: dict[str, int] = field(default_factory=lambda: {"invalid": 0, "queue_full": 0, "unavailable": 0})
    ids: itertools.count = field(default_factory=itertools.count)


def _error(exc: ApiError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status)


class _EventStream(StreamingResponse):
    """SSE that always watches for the client leaving (whatever ASGI version the server speaks)
    and runs ``on_close`` once the stream ends, however it ends."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self._on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            async with anyio.create_task_group() as tg:
                async def stream() -> None:
                    try:
                        await self.stream_response(send)
                    except OSError:  # ASGI 2.4 servers raise on a write to a closed connection
                        pass
                    tg.cancel_scope.cancel()

                tg.start_soon(stream)
                await self.listen_for_disconnect(receive)
                tg.cancel_scope.cancel()
        finally:
            self._on_close()
            await self.body_iterator.aclose()


async def _disconnected(receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


def create_app(engine: EngineThread, model_name: str, on_shutdown: Callable[[], None] = lambda: None) -> FastAPI:
    """The ASGI app; the engine thread starts with it and stops when it shuts down."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        yield
        app.state.s.draining = True
        await asyncio.to_thread(engine.stop)
        on_shutdown()
        log.info("engine stopped")

    app = FastAPI(title="miniserve", lifespan=lifespan)
    app.state.s = state = _ServerState(engine, model_name)

    def runner():
        return engine.engine.runner

    @app.get("/health")
    async def health():
        if engine.healthy and not state.draining:
            return {"status": "ok"}
        status = engine.error or ("draining" if state.draining else "warming up")
        return JSONResponse({"status": status}, status_code=503)

    @app.get("/v1/models")
    async def models():
        if not engine.healthy:
            return _error(ApiError(503, "the engine is not ready", type_="unavailable"))
        cfg = engine.engine.scheduler_config
        return {"object": "list", "data": [{
            "id": model_name, "object": "model", "owned_by": "miniserve", "created": 0,
            "max_model_len": runner().max_model_len, "vocab_size": runner().vocab_size,
            "scheduler": cfg.name, "max_num_seqs": cfg.max_num_seqs}]}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(_prometheus_text(engine, state), media_type="text/plain; version=0.0.4")

    @app.post("/v1/completions")
    async def completions(raw: Request):
        try:
            request, params = _admit(await raw.body(), state, runner)
            sink = RequestSink(asyncio.get_running_loop())
            engine.submit(request, sink)
        except QueueFull as exc:
            state.rejected["queue_full"] += 1
            return _error(ApiError(429, f"{exc}; retry later", type_="rate_limit_error"))
        except ApiError as exc:
            state.rejected["unavailable" if exc.status == 503 else "invalid"] += 1
            return _error(exc)
        response = _Completion(request, params, model_name, sink, runner().tokenizer)
        abort = lambda: None if response.done else engine.abort(request.request_id)  # noqa: E731
        if params.stream:
            return _EventStream(response.sse(), on_close=abort)
        waiter = asyncio.ensure_future(response.collect())
        watcher = asyncio.ensure_future(_disconnected(raw.receive))
        await asyncio.wait({waiter, watcher}, return_when=asyncio.FIRST_COMPLETED)
        watcher.cancel()
        if not waiter.done():  # the client left before its answer was ready
            waiter.cancel()
            abort()
            return JSONResponse({}, status_code=499)
        body, status = waiter.result()
        return JSONResponse(body, status_code=status)

    return app


def _admit(raw: bytes, state: _ServerState, runner) -> tuple[EngineRequest, CompletionParams]:
    """Everything that can be refused before the request reaches the engine."""
    if state.draining:
        raise ApiError(503, "the server is shutting down", type_="unavailable")
    if not state.engine.healthy:
        raise ApiError(503, state.engine.error or "the engine is warming up", type_="unavailable")
    params = parse_completion(parse_json(raw))
    if params.model is not None and params.model != state.model_name:
        raise ApiError(404, f"model: {params.model!r} is not served here (this server serves "
                            f"{state.model_name!r})", "model", "not_found_error")
    run = runner()
    ids = params.prompt_token_ids
    if ids is None:
        if run.tokenizer is None:
            raise ApiError(400, "prompt: this model has no tokenizer (random weights, no checkpoint); "
                                "send the prompt as a list of token ids", "prompt")
        ids = list(run.tokenizer.encode(params.prompt_text))
        if not ids:
            raise ApiError(400, "prompt: the text tokenizes to no tokens", "prompt")
    cfg = state.engine.engine.scheduler_config
    check_limits(ids, params.max_tokens, run.vocab_size, run.max_model_len, cfg.kv_capacity_tokens)
    request = EngineRequest(f"cmpl-{next(state.ids)}", ids, params.max_tokens, arrival_s=clock(),
                            ignore_eos=params.ignore_eos, eos_token_id=run.eos_token_id)
    return request, params


class _Completion:
    """Turns one request's TokenEvents into OpenAI completion JSON or SSE chunks."""

    def __init__(self, request: EngineRequest, params: CompletionParams, model_name: str, sink: RequestSink,
                 tokenizer=None) -> None:
        self.request = request
        self.params = params
        self.model_name = model_name
        self.sink = sink
        self.created = int(time.time())
        self.done = False
        self.token_ids: list[int] = []
        self.token_times_s: list[float] = []
        self.first_scheduled_s: float | None = None
        self._decode = (lambda ids: tokenizer.decode(ids)) if tokenizer is not None else (lambda ids: "")

    async def events(self) -> AsyncIterator[TokenEvent]:
        while True:
            event = await self.sink.queue.get()
            self.token_ids += event.token_ids
            self.token_times_s += event.token_times_s
            if event.first_scheduled_s is not None:
                self.first_scheduled_s = event.first_scheduled_s
            if event.finish_reason is not None:
                self.done = True
            yield event
            if self.done:
                return

    def usage(self) -> dict:
        n_in, n_out = self.request.num_prompt_tokens, len(self.token_ids)
        return {"prompt_tokens": n_in, "completion_tokens": n_out, "total_tokens": n_in + n_out}

    def timing(self) -> dict:
        """Engine-side times (server perf_counter s), so a client can split off the HTTP overhead."""
        return {"arrival_s": self.request.arrival_s, "first_scheduled_s": self.first_scheduled_s,
                "token_times_s": self.token_times_s}

    def _head(self) -> dict:
        return {"id": self.request.request_id, "object": "text_completion", "created": self.created,
                "model": self.model_name}

    async def sse(self) -> AsyncIterator[str]:
        async for event in self.events():
            if event.error is not None and event.finish_reason == "error":
                yield _sse({"error": ApiError(400, event.error).body()["error"]})
                break
            chunk = {**self._head(), "choices": [{
                "index": 0, "text": self._decode(list(event.token_ids)), "token_ids": list(event.token_ids),
                "logprobs": None, "finish_reason": event.finish_reason}]}
            if event.finish_reason is not None:
                chunk["timing"] = self.timing()
                if event.error:
                    chunk["error"] = event.error
            yield _sse(chunk)
        if self.params.include_usage:
            yield _sse({**self._head(), "choices": [], "usage": self.usage()})
        yield "data: [DONE]\n\n"

    async def collect(self) -> tuple[dict, int]:
        finish = None
        async for event in self.events():
            finish = event.finish_reason
            if finish == "error":
                return ApiError(400, event.error).body(), 400
            if finish == "abort":
                return ApiError(503, event.error or "request aborted", type_="unavailable").body(), 503
        return {**self._head(), "choices": [{
            "index": 0, "text": self._decode(self.token_ids), "token_ids": self.token_ids,
            "logprobs": None, "finish_reason": finish}],
            "usage": self.usage(), "timing": self.timing()}, 200


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


def _prometheus_text(engine: EngineThread, state: _ServerState) -> str:
    s = engine.stats
    lines: list[str] = []

    def metric(name: str, kind: str, help_: str, samples: list[tuple[str, float]]) -> None:
        lines.extend([f"# HELP miniserve:{name} {help_}", f"# TYPE miniserve:{name} {kind}"])
        lines.extend(f"miniserve:{name}{labels} {value}" for labels, value in samples)

    def histogram(name: str, help_: str, h: Histogram) -> None:
        counts, count, total = list(h.counts), h.count, h.total
        samples = [(f'_bucket{{le="{b}"}}', c) for b, c in zip(h.buckets, counts)]
        samples += [('_bucket{le="+Inf"}', count), ("_sum", total), ("_count", count)]
        metric(name, "histogram", help_, samples)

    metric("healthy", "gauge", "1 once the engine is warmed up and serving", [("", int(engine.healthy))])
    metric("num_requests_waiting", "gauge", "Requests accepted and queued, not yet running",
           [("", s.num_waiting)])
    metric("num_requests_running", "gauge", "Requests in the running set", [("", s.num_running)])
    metric("kv_blocks_used", "gauge", "KV blocks held by requests", [("", s.kv_blocks_used)])
    metric("kv_blocks_total", "gauge", "KV blocks in the cache", [("", s.kv_blocks_total)])
    metric("kv_slots_used", "gauge", "Model-runner KV slots held by requests", [("", s.kv_slots_used)])
    metric("prompt_tokens_total", "counter", "Prompt tokens of accepted requests", [("", s.prompt_tokens)])
    metric("generation_tokens_total", "counter", "Output tokens generated", [("", s.generation_tokens)])
    metric("requests_finished_total", "counter", "Requests that finished (length or stop)", [("", s.finished)])
    metric("requests_aborted_total", "counter", "Requests cancelled (client gone, shutdown)", [("", s.aborted)])
    metric("requests_rejected_total", "counter", "Requests refused before acceptance",
           [(f'{{reason="{k}"}}', v) for k, v in state.rejected.items()])
    metric("steps_total", "counter", "Engine iterations by plan phase",
           [(f'{{phase="{k}"}}', v) for k, v in sorted(s.steps_by_phase.items())])
    histogram("step_duration_seconds", "One engine iteration: schedule, model call, apply", s.step_s)
    histogram("model_call_duration_seconds", "The model forward of one iteration", s.model_s)
    return "\n".join(lines) + "\n"


def parse_prometheus(text: str) -> dict[str, float]:
    """``name{labels}`` → value, for tests and the seed harness."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            out[key] = float(value)
    return out


class _Server(uvicorn.Server):
    """uvicorn's server, telling the app to refuse new work as soon as a signal arrives."""

    def __init__(self, config, on_signal: Callable[[], None]) -> None:
        super().__init__(config)
        self._on_signal = on_signal

    def handle_exit(self, sig: int, frame) -> None:
        self._on_signal()
        super().handle_exit(sig, frame)


def serve(model: ModelConfig, scheduler: SchedulerConfig, server: ServerConfig) -> int:
    """Build, warm up and serve until SIGTERM/SIGINT; returns the exit status (0 on a clean stop)."""
    from engine.llm_engine import Engine
    from engine.observe.trace import write_chrome_trace

    def build() -> Engine:
        engine = Engine(scheduler, model)
        if server.warmup:
            engine.warmup()
        return engine

    thread = EngineThread(build, server.max_waiting, keep_steps=server.trace_path is not None)

    def write_trace() -> None:
        if server.trace_path is not None:
            path = Path(server.trace_path)
            path.parent.mkdir(parents=True, exist_ok=True)
            write_chrome_trace((s.trace_call for s in thread.steps), path)
            log.info("wrote %s (%d steps)", path, len(thread.steps))

    name = server.served_model_name or (Path(model.path).name if model.path else model.name)
    app = create_app(thread, name, on_shutdown=write_trace)
    config = uvicorn.Config(app, host=server.host, port=server.port, log_level=server.log_level,
                            access_log=server.access_log, timeout_graceful_shutdown=server.graceful_timeout_s,
                            lifespan="on")

    def draining() -> None:
        app.state.s.draining = True

    # uvicorn re-raises the signal it handled once it has shut down; with the default handler
    # that would kill the process after a clean shutdown, so the restored handler does nothing.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    uvicorn_server = _Server(config, on_signal=draining)
    uvicorn_server.run()
    if thread.error is not None:
        log.error("%s", thread.error)
        return 1
    return 0
