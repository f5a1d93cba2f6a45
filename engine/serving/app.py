"""An OpenAI-compatible HTTP server around the engine (FastAPI + uvicorn).

``POST /v1/completions`` and ``/v1/chat/completions`` (text or token ids, streaming as
server-sent events), ``GET /v1/models[/{id}]``, vLLM's ``POST /tokenize`` and ``/detokenize``,
``GET /health`` (200 only after warm-up) and ``GET /metrics`` (Prometheus text). The engine runs
in its own thread (engine_thread.py); this module only parses, admits, and relays tokens
(responses.py); limits.py keeps a misbehaving client from stalling it. A client that goes away
has its request aborted at the next iteration boundary; SIGTERM stops accepting, lets in-flight
requests finish for up to ``graceful_timeout_s``, then ends the rest with an OpenAI error (a JSON
error, or an error event and ``[DONE]`` on a stream) and exits 0.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import resource
import signal
import socket
import threading
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import anyio
import jinja2
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.responses import StreamingResponse

from engine.core.config import ModelConfig, SchedulerConfig
from engine.core.request import Request as EngineRequest
from engine.serving.engine_thread import EngineClosed, EngineThread, QueueFull, RequestSink, clock
from engine.serving.limits import (LOOPBACK_HOSTS, ClientGone, Guard, error_response, guarded_h11,
                                   install_error_handlers, read_body)
from engine.serving.prometheus import parse_prometheus, prometheus_text
from engine.serving.protocol import (ApiError, CompletionParams, check_limits, parse_chat, parse_completion,
                                     parse_detokenize, parse_json, parse_tokenize, quote)
from engine.serving.responses import Generation

__all__ = ["ServerConfig", "create_app", "parse_prometheus", "serve"]

log = logging.getLogger("miniserve.server")

PARSE_ON_LOOP_BYTES = 64 * 1024  # larger bodies are parsed in a worker thread, off the event loop
SHUTDOWN_FLUSH_S = 3.0  # after the grace period: time for the error answers to reach clients
FORCED_STOP_S = 5.0  # how long a forced quit waits for the engine thread (a step, or a model still loading)


@dataclass(frozen=True)
class ServerConfig:
    """How the server listens and admits. ``max_waiting`` bounds queued (not yet running)
    requests: past it a request gets 429 instead of an ever-growing queue. The limits bound
    what one client can hold: body size, time to send the request head and body, open
    connections. ``allowed_hosts`` defaults to the loopback names when the server listens on
    loopback (against DNS rebinding) and to any host otherwise; browser requests (an
    ``Origin`` header) are refused unless their origin is listed."""

    host: str = "127.0.0.1"
    port: int = 8000
    max_waiting: int = 256
    warmup: bool = True
    graceful_timeout_s: float = 30.0
    trace_path: str | None = None
    served_model_name: str | None = None
    log_level: str = "info"
    access_log: bool = False
    api_key: str | None = None
    max_body_bytes: int = 8 * 1024 * 1024
    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    max_connections: int = 1024
    allowed_hosts: list[str] = field(default_factory=list)
    allowed_origins: list[str] = field(default_factory=list)
    enable_docs: bool = False

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError(f"server.port must be in [0, 65535], got {self.port}")
        if self.max_waiting < 1:
            raise ValueError(f"server.max_waiting must be >= 1, got {self.max_waiting}")
        if not self.graceful_timeout_s >= 0:
            raise ValueError(f"server.graceful_timeout_s must be >= 0, got {self.graceful_timeout_s}")
        for name in ("max_body_bytes", "max_connections"):
            if getattr(self, name) < 1:
                raise ValueError(f"server.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("header_timeout_s", "body_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"server.{name} must be > 0, got {getattr(self, name)}")
        if self.api_key is not None and not self.api_key:
            raise ValueError("server.api_key must not be empty (leave it null for no key)")

    def host_names(self) -> frozenset[str] | None:
        """The Host header names accepted; None accepts any."""
        if self.allowed_hosts:
            return frozenset(h.lower() for h in self.allowed_hosts)
        return LOOPBACK_HOSTS if self.host in LOOPBACK_HOSTS else None


@dataclass
class _ServerState:
    engine: EngineThread
    model_name: str
    config: ServerConfig
    draining: bool = False
    rejected: dict[str, int] = field(default_factory=lambda: {"invalid": 0, "queue_full": 0, "unavailable": 0})
    ids: itertools.count = field(default_factory=itertools.count)


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


def create_app(engine: EngineThread, model_name: str, on_shutdown: Callable[[], None] = lambda: None,
               config: ServerConfig | None = None) -> FastAPI:
    """The ASGI app; the engine thread starts with it and stops when it shuts down."""
    config = config or ServerConfig()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        yield
        app.state.s.draining = True
        await asyncio.to_thread(engine.stop)
        on_shutdown()
        log.info("engine stopped")

    docs = {} if config.enable_docs else {"docs_url": None, "redoc_url": None, "openapi_url": None}
    app = FastAPI(title="miniserve", lifespan=lifespan, redirect_slashes=False, **docs)
    app.state.s = state = _ServerState(engine, model_name, config)
    app.add_middleware(Guard, api_key=config.api_key, allowed_hosts=config.host_names(),
                       allowed_origins=frozenset(config.allowed_origins))
    install_error_handlers(app)

    def runner():
        return engine.engine.runner

    def model_card() -> dict:
        cfg = engine.engine.scheduler_config
        return {"id": model_name, "object": "model", "owned_by": "miniserve", "created": 0,
                "max_model_len": min(runner().max_model_len, cfg.kv_capacity_tokens),
                "vocab_size": runner().vocab_size, "scheduler": cfg.name, "max_num_seqs": cfg.max_num_seqs}

    def ready() -> None:
        if not engine.healthy:
            raise ApiError(503, engine.error or "the engine is warming up", type_="unavailable")

    async def off_loop_if_large(data: bytes, work: Callable[[dict], object]):
        """``work(parse_json(data))``; in a worker thread for a large body, whose parsing and
        per-token checks would otherwise stall every stream the event loop serves."""
        if len(data) > PARSE_ON_LOOP_BYTES:
            return await asyncio.to_thread(lambda: work(parse_json(data)))
        return work(parse_json(data))

    async def body_of(raw: Request) -> bytes:
        return await read_body(raw.receive, raw.headers.get("content-length"), config.max_body_bytes,
                               config.body_timeout_s)

    @app.get("/health")
    async def health():
        if engine.healthy and not state.draining:
            return {"status": "ok"}
        status = engine.error or ("draining" if state.draining else "warming up")
        return JSONResponse({"status": status}, status_code=503)

    @app.get("/v1/models")
    async def models():
        ready()
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        ready()
        if model_id != model_name:
            raise ApiError(404, f"model {quote(model_id)} is not served here (this server serves {model_name!r})",
                           "model", "not_found_error")
        return model_card()

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(prometheus_text(engine, state.rejected, model_name),
                                 media_type="text/plain; version=0.0.4")

    @app.post("/v1/completions")
    async def completions(raw: Request):
        return await generate(raw, "completion")

    @app.post("/v1/chat/completions")
    async def chat_completions(raw: Request):
        return await generate(raw, "chat")

    @app.post("/tokenize")
    async def tokenize(raw: Request):
        ready()
        text, messages, add_special = await off_loop_if_large(await body_of(raw), parse_tokenize)
        ids = _tokenize(runner().tokenizer, text, messages, add_special)
        return {"count": len(ids), "max_model_len": model_card()["max_model_len"], "tokens": ids}

    @app.post("/detokenize")
    async def detokenize(raw: Request):
        ready()
        tokenizer = _need_tokenizer(runner().tokenizer, "tokens")
        ids = await off_loop_if_large(await body_of(raw), lambda b: parse_detokenize(b, runner().vocab_size))
        return {"prompt": tokenizer.decode(ids)}

    async def generate(raw: Request, kind: str) -> Response:
        try:
            request, params, prompt_text = await off_loop_if_large(
                await body_of(raw), lambda body: _admit(body, kind, state, runner))
            sink = RequestSink(asyncio.get_running_loop())
            engine.submit(request, sink)
        except ClientGone:
            return Response(status_code=499)
        except QueueFull as exc:
            state.rejected["queue_full"] += 1
            return error_response(ApiError(429, f"{exc}; retry later", type_="rate_limit_error",
                                           headers={"Retry-After": "1"}))
        except EngineClosed as exc:  # the loop ended after _admit found it healthy
            state.rejected["unavailable"] += 1
            return error_response(ApiError(503, str(exc), type_="unavailable"))
        except ApiError as exc:
            state.rejected["unavailable" if exc.status == 503 else "invalid"] += 1
            return error_response(exc, close=exc.status in (408, 413))
        response = Generation(request, params, model_name, sink, runner().tokenizer, kind,
                              on_stop=lambda: engine.abort(request.request_id, stopped=True),
                              prompt_text=prompt_text)
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
            return Response(status_code=499)
        payload, status = waiter.result()
        return JSONResponse(payload, status_code=status)

    return app


def _need_tokenizer(tokenizer, param: str):
    if tokenizer is None:
        raise ApiError(400, f"{param}: this model's checkpoint has no tokenizer; send token ids", param)
    return tokenizer


def _tokenize(tokenizer, text: str | None, messages: list[dict] | None, add_special: bool = True) -> list[int]:
    if messages is None:
        return list(_need_tokenizer(tokenizer, "prompt").encode(text, add_special_tokens=add_special))
    tokenizer = _need_tokenizer(tokenizer, "messages")
    if not getattr(tokenizer, "chat_template", None):
        raise ApiError(400, "messages: this model's tokenizer has no chat template; use /v1/completions",
                       "messages")
    try:
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    except jinja2.TemplateError as exc:  # a checkpoint's template refusing the conversation (roles out of turn ...)
        raise ApiError(400, f"messages: the model's chat template refused them: {exc}", "messages") from None
    return list(ids)


def _admit(body: dict, kind: str, state: _ServerState, runner) -> tuple[EngineRequest, CompletionParams, str]:
    """Everything that can be refused before the request reaches the engine."""
    if state.draining:
        raise ApiError(503, "the server is shutting down", type_="unavailable")
    if not state.engine.healthy:
        raise ApiError(503, state.engine.error or "the engine is warming up", type_="unavailable")
    params = parse_completion(body) if kind == "completion" else parse_chat(body)
    if params.model is not None and params.model != state.model_name:
        raise ApiError(404, f"model: {quote(params.model)} is not served here (this server serves "
                            f"{state.model_name!r})", "model", "not_found_error")
    run = runner()
    ids = params.prompt_token_ids
    if ids is None:
        ids = _tokenize(run.tokenizer, params.prompt_text, params.messages)
        if not ids:
            raise ApiError(400, "prompt: the text tokenizes to no tokens", "prompt")
    cfg = state.engine.engine.scheduler_config
    max_tokens = check_limits(ids, params.max_tokens, run.vocab_size, run.max_model_len, cfg.kv_capacity_tokens,
                              params.max_tokens_field)
    stop_ids = params.stop_token_ids
    if kind == "chat" and run.tokenizer is not None and not params.ignore_eos:
        end = run.tokenizer.convert_tokens_to_ids("<|im_end|>")  # the template's end of a turn
        if isinstance(end, int) and end != getattr(run.tokenizer, "unk_token_id", None):
            params = _with(params, stop_token_ids=stop_ids | {end})
    request = EngineRequest(f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{next(state.ids)}", ids, max_tokens,
                            arrival_s=clock(), ignore_eos=params.ignore_eos, eos_token_id=run.eos_token_id,
                            sampling=params.sampling)
    prompt_text = ""
    if params.echo:
        prompt_text = params.prompt_text if params.prompt_text is not None else run.tokenizer.decode(ids) \
            if run.tokenizer is not None else ""
    return request, params, prompt_text


def _with(params: CompletionParams, **changes) -> CompletionParams:
    from dataclasses import replace
    return replace(params, **changes)


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
    traced: list[bool] = []

    def write_trace() -> None:  # once: the lifespan's shutdown, else after uvicorn returns
        if server.trace_path is not None and not traced:
            traced.append(True)
            path = Path(server.trace_path)
            path.parent.mkdir(parents=True, exist_ok=True)
            write_chrome_trace((s.trace_call for s in thread.steps), path)
            log.info("wrote %s (%d steps)", path, len(thread.steps))

    name = server.served_model_name or (Path(model.path).name if model.path else model.name)
    app = create_app(thread, name, on_shutdown=write_trace, config=server)
    _check_fd_limit(server.max_connections)
    # uvicorn's own deadline comes after ours: by then every answer has been ended cleanly
    config = uvicorn.Config(app, host=server.host, port=server.port, log_level=server.log_level,
                            access_log=server.access_log, lifespan="on",
                            timeout_graceful_shutdown=server.graceful_timeout_s + SHUTDOWN_FLUSH_S,
                            http=guarded_h11(server.header_timeout_s, server.max_connections),
                            h11_max_incomplete_event_size=64 * 1024)
    grace: list[threading.Timer] = []

    def draining() -> None:
        app.state.s.draining = True
        if not grace:  # the first signal starts the grace period; a second one is uvicorn's force-quit
            reason = (f"the server is shutting down and its grace period "
                      f"(server.graceful_timeout_s={server.graceful_timeout_s:g} s) has ended")
            grace.append(threading.Timer(server.graceful_timeout_s, thread.cancel_in_flight, (reason,)))
            grace[0].daemon = True
            grace[0].start()

    # uvicorn re-raises the signal it handled once it has shut down; with the default handler
    # that would kill the process after a clean shutdown, so the restored handler does nothing.
    try:  # the port first, as vLLM does: a taken one fails now, not after the model is built
        sockets = bind_sockets(server.host, server.port)
    except OSError as err:
        log.error("cannot listen on %s:%d: %s", server.host, server.port, err)
        return 3  # uvicorn's own status for a failed startup
    log.info("listening on http://%s:%d; the engine is built now (/health answers 503 until it is ready)",
             server.host, server.port)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    uvicorn_server = _Server(config, on_signal=draining)
    try:
        uvicorn_server.run(sockets=sockets)
    finally:
        for timer in grace:
            timer.cancel()
        # a forced quit (a second signal) skips the lifespan's shutdown: stop the engine and write
        # the trace here (both once); a process that ended with the engine thread inside a torch
        # call was killed by SIGABRT in the interpreter's teardown. A forced quit, or a second stop
        # of a thread the lifespan already waited on (a model still loading), waits briefly
        thread.stop(timeout_s=FORCED_STOP_S if uvicorn_server.force_exit or thread.stop_requested else 30.0)
        write_trace()
        if uvicorn_server.force_exit and not thread.alive:
            log.info("engine stopped (forced quit: requests in flight were cut)")
    if thread.alive:  # still building or warming the model
        log.error("the engine thread did not stop in time; exiting without it")
        logging.shutdown()
        os._exit(1)
    if thread.error is not None:
        log.error("%s", thread.error)
        return 1
    return 0


def bind_sockets(host: str, port: int) -> list[socket.socket]:
    """The sockets asyncio's create_server would bind for (host, port): one per address the name
    resolves to (``localhost``: 127.0.0.1 and ::1), IPv6 ones IPv6-only, the port reusable at
    once after a restart; made before the model is built so that a taken port fails at once."""
    sockets: list[socket.socket] = []
    try:
        for family, kind, proto, _, address in dict.fromkeys(
                socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)):
            sock = socket.socket(family, kind, proto)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6 and hasattr(socket, "IPPROTO_IPV6"):
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(address)
    except OSError:
        for sock in sockets:
            sock.close()
        raise
    return sockets


def _check_fd_limit(max_connections: int) -> None:
    """Raise the soft open-file limit to fit the connection cap (plus the process's own files),
    so the cap, not the kernel, is what a flood of connections meets."""
    need = max_connections + 256
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < need:
        target = need if hard == resource.RLIM_INFINITY else min(need, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        if target < need:
            log.warning("open-file limit %d is below server.max_connections + 256; lower the cap", target)
