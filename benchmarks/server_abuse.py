"""What a misbehaving client gets from the server: a table of bad inputs (tried / 4xx / 5xx /
hang) and the overload, disconnect and SIGTERM figures. Loopback only, every wait bounded.

    python benchmarks/server_abuse.py [--model tiny] [--max-waiting 16]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import tempfile
import time
from pathlib import Path

import httpx

from engine.core.config import ModelConfig, SchedulerConfig
from engine.serving.app import ServerConfig, parse_prometheus
from experiments.server_process import ServerProcess, free_port

HANG_S = 10.0


def bad_bodies() -> list[tuple[str, bytes]]:
    ok = {"prompt": [1, 2], "max_tokens": 2}
    cases: list[tuple[str, object]] = [
        ("not json", b"{"), ("array", b"[1]"), ("string", b'"x"'), ("empty", b""), ("NaN", b'{"prompt":[1],"max_tokens":NaN}'),
        ("nested 100k", b'{"prompt":[1],"x":' + b"[" * 100_000 + b"]" * 100_000 + b"}"),
        ("prompt nested 960", b'{"prompt":' + b"[" * 960 + b"1" + b"]" * 960 + b"}"),
        ("20 MB body", b'{"prompt":[1],"pad":"' + b"x" * (20 << 20) + b'"}'),
        ("5 MB max_tokens", {**ok, "max_tokens": "9" * (5 << 20)}), ("invalid utf-8", b'{"prompt":"\xff\xfe"}'),
    ]
    for field, values in {
        "prompt": [None, 5, [], "", [1, "a"], [1, True], [1.5], [[1], [2]], [-1], [10 ** 30], {"a": 1}],
        "max_tokens": [0, -1, "8", 2.0, 10 ** 12, True],
        "temperature": [-1, 3, "hot"], "top_p": [0, 7, -1], "top_k": [-2, 1.5], "seed": ["x", 2 ** 70],
        "n": [0, 2, "1"], "stream": ["yes", 1], "ignore_eos": [1, "no"], "logprobs": [-3, 99, "x"],
        "stop": [42, [1], [""], ["a"] * 20], "stop_token_ids": [[1.5], "x"], "echo": [1],
        "best_of": [2], "presence_penalty": [1], "frequency_penalty": [-1], "logit_bias": [{"1": 5}],
        "suffix": ["x"], "min_p": [0.5], "model": ["other", 5], "stream_options": [{"include_usage": "x"}, 5],
        "tools": [[{"type": "function"}]], "response_format": [{"type": "json_object"}],
    }.items():
        cases += [(f"{field}={json.dumps(v)[:20]}", {**ok, field: v}) for v in values]
    chat = [("chat no messages", {"max_tokens": 2}), ("chat image", {"messages": [{"role": "user", "content": [
        {"type": "image_url"}]}]}), ("chat bad role", {"messages": [{"role": "robot", "content": "x"}]}),
            ("chat top_logprobs alone", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2})]
    out = [(name, body if isinstance(body, bytes) else json.dumps(body).encode()) for name, body in cases]
    return out + [(f"/v1/chat/completions {n}", json.dumps(b).encode()) for n, b in chat]


def classify(status: int | None) -> str:
    return "hang" if status is None else "4xx" if 400 <= status < 500 else "5xx" if status >= 500 else str(status)


def try_bodies(url: str) -> list[tuple[str, str]]:
    rows = []
    with httpx.Client(timeout=HANG_S) as client:
        for name, body in bad_bodies():
            path = "/v1/chat/completions" if name.startswith("/v1/chat") else "/v1/completions"
            try:
                status = client.post(url + path, content=body, headers={"content-type": "application/json"}).status_code
            except httpx.TimeoutException:
                status = None
            rows.append((name, classify(status)))
        for method, path in [("GET", "/nope"), ("GET", "/v1/completions"), ("POST", "/v1/completions/"),
                             ("GET", "/docs"), ("GET", "/v1/models/other"), ("DELETE", "/v1/models")]:
            rows.append((f"{method} {path}", classify(client.request(method, url + path).status_code)))
        origin = client.post(url + "/v1/completions", content=b'{"prompt":[1]}',
                             headers={"content-type": "text/plain", "origin": "https://evil.example"})
        rows.append(("text/plain from a web page", classify(origin.status_code)))
        rows.append(("foreign Host", classify(client.get(url + "/health", headers={"host": "evil.example"}).status_code)))
    host, port = url.removeprefix("http://").split(":")
    for name, data in [("incomplete head", b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"),
                       ("stalled body", b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\ncontent-length: 50\r\n\r\n{")]:
        with socket.create_connection((host, int(port)), timeout=HANG_S + 20) as sock:
            sock.sendall(data)
            t0 = time.monotonic()
            answer = sock.recv(4096)
            result = classify(int(answer.split()[1])) if answer else "closed"  # hung up, nothing to answer
            rows.append((f"{name} (ended after {time.monotonic() - t0:.1f} s)", result))
    return rows


def metrics(url: str) -> dict[str, float]:
    return parse_prometheus(httpx.get(url + "/metrics").text)


async def overload(url: str, n: int) -> dict:
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=httpx.Limits(max_connections=n)) as client:
        answers = await asyncio.gather(*(client.post("/v1/completions", json={
            "prompt": [5, 6, 7], "max_tokens": 32, "ignore_eos": True}) for _ in range(n)), return_exceptions=True)
    ok = [a for a in answers if isinstance(a, httpx.Response) and a.status_code == 200]
    whole = sum(len(a.json()["choices"][0]["token_ids"]) == 32 for a in ok)
    codes = [a.status_code if isinstance(a, httpx.Response) else type(a).__name__ for a in answers]
    return {"sent": n, "200": len(ok), "whole": whole, "429": codes.count(429),
            "retry_after": all(a.headers.get("retry-after") == "1" for a in answers
                               if isinstance(a, httpx.Response) and a.status_code == 429),
            "other": len(codes) - len(ok) - codes.count(429)}


async def disconnect(url: str, n: int) -> dict:
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        async def one() -> None:
            async with client.stream("POST", "/v1/completions", json={
                    "prompt": [9, 8], "max_tokens": 1500, "ignore_eos": True, "stream": True}) as resp:
                async for line in resp.aiter_lines():
                    if line.startswith("data: "):
                        return
        await asyncio.gather(*(one() for _ in range(n)))
    t0 = time.monotonic()
    while metrics(url)["miniserve:kv_slots_used"] > 0 and time.monotonic() - t0 < HANG_S:
        await asyncio.sleep(0.02)
    return {"dropped_streams": n, "slots_free_after_s": round(time.monotonic() - t0, 3)}


async def sigterm(proc: ServerProcess, n: int, max_tokens: int) -> dict:
    body = {"prompt": [4, 5], "max_tokens": max_tokens, "ignore_eos": True}
    async with httpx.AsyncClient(base_url=proc.url, timeout=120) as client:
        async def stream() -> str:
            async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as resp:
                events = [line[6:] async for line in resp.aiter_lines() if line.startswith("data: ")]
            if events[-1:] != ["[DONE]"]:
                return "cut"
            return "error+[DONE]" if "error" in json.loads(events[-2]) else "whole"

        async def plain() -> str:
            try:
                resp = await client.post("/v1/completions", json=body)
            except httpx.HTTPError as exc:
                return type(exc).__name__
            return "whole" if resp.status_code == 200 else f"{resp.status_code} {resp.headers['content-type'][:16]}"

        tasks = [asyncio.create_task(plain()) for _ in range(n)] + [asyncio.create_task(stream()) for _ in range(n)]
        while metrics(proc.url)["miniserve:num_requests_running"] < min(2 * n, 4):
            await asyncio.sleep(0.05)
        t0 = time.monotonic()
        proc.proc.terminate()
        outcomes = await asyncio.gather(*tasks)
    rc = await asyncio.to_thread(proc.proc.wait, 120)
    return {"non_streaming": sorted(outcomes[:n]), "streams": sorted(outcomes[n:]), "exit": rc,
            "exit_after_s": round(time.monotonic() - t0, 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--max-waiting", type=int, default=16)
    ap.add_argument("--grace", type=float, default=1.0, help="graceful_timeout_s for the past-grace run")
    args = ap.parse_args()
    model = ModelConfig(name=args.model, num_threads=1)
    scheduler = SchedulerConfig(name="continuous", max_num_seqs=4, max_model_len=4096)
    log_dir = Path(tempfile.mkdtemp(prefix="abuse-"))

    def server(log: str, **kw) -> ServerProcess:
        proc = ServerProcess(model, scheduler, ServerConfig(port=free_port(), log_level="warning", **kw), log_dir / log)
        proc.wait_healthy(600)
        return proc

    with server("main.log", max_waiting=args.max_waiting, header_timeout_s=2.0, body_timeout_s=2.0) as proc:
        rows = try_bodies(proc.url)
        print(f"{'input':48} result")
        for name, result in rows:
            print(f"{name[:48]:48} {result}")
        counts = {k: sum(r == k for _, r in rows) for k in ("4xx", "closed", "200", "5xx", "hang")}
        print(f"tried {len(rows)}: " + ", ".join(f"{k} {v}" for k, v in counts.items()))
        print("overload:", asyncio.run(overload(proc.url, 300)))
        print("disconnect:", asyncio.run(disconnect(proc.url, 4)))
        print("traceback in log:", "Traceback" in (log_dir / "main.log").read_text())
    with server("grace.log", graceful_timeout_s=30.0) as proc:
        print("SIGTERM within grace (30 s):", asyncio.run(sigterm(proc, 2, 300)))
    with server("past.log", graceful_timeout_s=args.grace) as proc:
        print(f"SIGTERM past grace ({args.grace:g} s):", asyncio.run(sigterm(proc, 2, 4000)))
    print("logs:", log_dir)


if __name__ == "__main__":
    main()
