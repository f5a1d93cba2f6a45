"""What a misbehaving client meets: body and connection limits, read deadlines, API key, Host
and Origin checks, OpenAI-shaped errors on every path, and a clean end for everything still
running when the shutdown grace period is over. Loopback only; every wait is bounded."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import httpx
import pytest
from fastapi.testclient import TestClient

from engine.core.config import SchedulerConfig
from engine.serving import app as app_module
from engine.serving.app import ServerConfig, create_app
from engine.serving.engine_thread import EngineThread
from tests.test_server import GOOD, assert_serves, metrics, start, wait_for

LIMITS = {"max_body_bytes": 1 << 20, "header_timeout_s": 1.0, "body_timeout_s": 1.0, "max_connections": 16}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with start(tmp_path_factory, SchedulerConfig(name="continuous", max_num_seqs=4), **LIMITS) as proc:
        yield proc


def raw_socket(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=10)
    return sock


def read_all(sock: socket.socket) -> bytes:
    """Everything until the server closes (bounded by the socket's timeout)."""
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except (ConnectionResetError, TimeoutError):
        pass
    return data


def error_of(response: bytes) -> dict:
    return json.loads(response.split(b"\r\n\r\n", 1)[1])["error"]


def test_body_over_the_limit_gets_413_naming_it_declared_or_chunked(server):
    big = b'{"prompt": [1], "pad": "' + b"x" * (2 << 20) + b'"}'
    declared = httpx.post(f"{server.url}/v1/completions", content=big, headers={"content-type": "application/json"})
    assert declared.status_code == 413 and str(1 << 20) in declared.json()["error"]["message"]
    chunked = httpx.post(f"{server.url}/v1/completions", content=iter([big[i:i + 65536]
                                                                      for i in range(0, len(big), 65536)]))
    assert chunked.status_code == 413 and "max_body_bytes" in chunked.json()["error"]["message"]
    assert_serves(server.url)


def test_incomplete_heads_are_closed_and_connections_are_capped(server):
    held = [raw_socket(server.url) for _ in range(LIMITS["max_connections"])]
    for sock in held:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # never finished
    time.sleep(0.2)
    extra = raw_socket(server.url)
    answer = read_all(extra)  # over the cap: answered and closed at once
    assert answer.startswith(b"HTTP/1.1 503") and "max_connections" in error_of(answer)["message"]
    t0 = time.monotonic()
    for sock in held:
        assert read_all(sock) == b""  # the server hung up on the unfinished head
        sock.close()
    assert time.monotonic() - t0 < 5.0  # header_timeout_s is 1 s; 60 s+ before
    assert_serves(server.url)


def test_a_stalled_body_gets_408_and_a_client_leaving_mid_upload_no_traceback(server):
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\ncontent-type: application/json\r\n"
            b"content-length: 1000\r\n\r\n")
    slow = raw_socket(server.url)
    slow.sendall(head + b'{"prompt": [1')
    answer = read_all(slow)
    assert answer.startswith(b"HTTP/1.1 408") and "body_timeout_s" in error_of(answer)["message"]
    gone = raw_socket(server.url)
    gone.sendall(head + b'{"prompt"')
    gone.close()
    time.sleep(0.3)
    assert_serves(server.url)
    assert "Traceback" not in server.log_path.read_text()


def test_routing_errors_are_openai_shaped_without_redirects_or_docs(server):
    for method, path, status in [("GET", "/nope", 404), ("GET", "/v1/completions", 405),
                                 ("POST", "/v1/completions/", 404), ("GET", "/docs", 404),
                                 ("GET", "/openapi.json", 404), ("GET", "/redoc", 404),
                                 ("GET", "/v1/models/other", 404)]:
        resp = httpx.request(method, f"{server.url}{path}", json=GOOD, follow_redirects=False)
        assert resp.status_code == status, (path, resp.text)
        assert set(resp.json()["error"]) == {"message", "type", "param", "code"}


def test_a_large_body_is_refused_beside_a_stream_that_runs_to_its_end(server):
    """A body near the limit, parsed and refused while a stream runs: the stream still gets every
    token. That the parse runs off the event loop is test_large_body_parse_runs_in_a_worker_thread's
    to check (a bound on the gaps between this stream's events timed the machine, not the server)."""
    async def scenario() -> tuple[int, list[dict]]:
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
            async def stream() -> list[dict]:
                async with client.stream("POST", "/v1/completions", json={
                        "prompt": [3], "max_tokens": 1500, "ignore_eos": True, "stream": True,
                        "stream_options": {"include_usage": True}}) as resp:
                    return [json.loads(line[6:]) async for line in resp.aiter_lines()
                            if line.startswith("data: ") and line != "data: [DONE]"]

            task = asyncio.create_task(stream())
            await asyncio.sleep(0.5)
            prompt = json.dumps({"prompt": [7] * 200_000, "max_tokens": 1}).encode()  # ~1 MB, under the limit
            big = await client.post("/v1/completions", content=prompt)
            return big.status_code, await task

    status, chunks = asyncio.run(scenario())
    assert status == 400  # far past the context; refused after parsing
    assert chunks[-1]["usage"]["completion_tokens"] == 1500
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"


# --- in-process: checks that run before any route, with an engine that never starts ----------------
def _app(**server) -> TestClient:
    def build():
        raise RuntimeError("no engine in this test")

    return TestClient(create_app(EngineThread(build, max_waiting=4), "tiny", config=ServerConfig(**server)),
                      base_url="http://127.0.0.1:8000")


def test_api_key_is_required_on_the_api_routes_only():
    with _app(api_key="s3cret") as client:
        assert client.get("/v1/models").status_code == 401
        assert client.get("/v1/models", headers={"Authorization": "Bearer wrong"}).json()["error"]["code"] == 401
        assert client.get("/v1/models", headers={"Authorization": "Bearer s3cret"}).status_code == 503  # no engine
        assert client.post("/tokenize", json={"prompt": "x"}).status_code == 401
        assert client.get("/health").status_code == 503 and client.get("/metrics").status_code == 200


def test_browser_origins_and_foreign_hosts_are_refused():
    with _app() as client:
        text_plain = {"content-type": "text/plain", "origin": "https://evil.example"}
        resp = client.post("/v1/completions", content=json.dumps(GOOD), headers=text_plain)
        assert resp.status_code == 403 and resp.json()["error"]["type"] == "permission_error"
        assert client.get("/health", headers={"host": "rebound.evil.example"}).status_code == 403
        assert client.get("/metrics", headers={"host": "localhost:8000"}).status_code == 200
    with _app(allowed_origins=["http://localhost:3000"]) as client:
        assert client.get("/metrics", headers={"origin": "http://localhost:3000"}).status_code == 200
    with _app(host="0.0.0.0") as client:
        assert client.get("/metrics", headers={"host": "10.1.2.3:8000"}).status_code == 200


def test_large_body_parse_runs_in_a_worker_thread(monkeypatch):
    threads = []
    real = app_module.parse_json

    def spy(raw: bytes) -> dict:
        threads.append(threading.current_thread())
        return real(raw)

    monkeypatch.setattr(app_module, "parse_json", spy)
    with _app() as client:
        client.post("/v1/completions", json={"prompt": [1], "pad": "x" * 100})
        client.post("/v1/completions", json={"prompt": [1], "pad": "x" * (app_module.PARSE_ON_LOOP_BYTES + 1)})
    assert len(threads) == 2 and threads[0] is not threads[1]


# --- shutdown past the grace period ---------------------------------------------------------------
def test_requests_running_past_the_grace_period_end_with_an_error_not_a_cut(tmp_path_factory):
    scheduler = SchedulerConfig(name="continuous", max_num_seqs=4, max_model_len=4096)
    proc = start(tmp_path_factory, scheduler, graceful_timeout_s=0.5, **LIMITS)
    long = {"prompt": [4, 5], "max_tokens": 4000, "ignore_eos": True}
    try:
        async def scenario():
            async with httpx.AsyncClient(base_url=proc.url, timeout=60) as client:
                async def stream() -> list[str]:
                    async with client.stream("POST", "/v1/completions", json={**long, "stream": True}) as resp:
                        return [line[6:] async for line in resp.aiter_lines() if line.startswith("data: ")]

                tasks = [asyncio.create_task(client.post("/v1/completions", json=long)) for _ in range(2)]
                tasks += [asyncio.create_task(stream()) for _ in range(2)]
                await asyncio.to_thread(wait_for, lambda: metrics(proc.url)["miniserve:num_requests_running"] == 4,
                                        "four requests running")
                stalled = raw_socket(proc.url)  # an upload that never finishes must not hold the exit
                stalled.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\ncontent-length: 99\r\n\r\n{")
                t0 = time.monotonic()
                proc.proc.terminate()
                results = await asyncio.gather(*tasks)
                stalled.close()
                return results, t0

        (plain_a, plain_b, stream_a, stream_b), t0 = asyncio.run(scenario())
        assert proc.proc.wait(30) == 0
        assert time.monotonic() - t0 < 10.0
        for answer in (plain_a, plain_b):
            assert answer.status_code == 503 and "graceful_timeout_s" in answer.json()["error"]["message"]
        for events in (stream_a, stream_b):
            assert events[-1] == "[DONE]"
            assert "graceful_timeout_s" in json.loads(events[-2])["error"]["message"]
        assert "Traceback" not in proc.log_path.read_text()
    finally:
        proc.stop()
