"""The server as users run it: a real process on a loopback port, the tiny model, real HTTP."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time

import httpx
import pytest

from engine.loadgen.client import BenchConfig, run_bench
from engine.core.config import ModelConfig, SchedulerConfig
from engine.llm_engine import Engine
from engine.core.request import Request
from engine.serving.app import ServerConfig, parse_prometheus
from experiments.server_process import ServerProcess, free_port
from engine.observe.workload import LengthDist, WorkloadConfig, generate, make_requests
from tests.helpers import create_requests
from tests.test_results import check_vllm_keys

MODEL = ModelConfig(name="tiny", num_threads=1)  # one thread: the test machine's cores are shared
SCHEDULER = SchedulerConfig(name="continuous", max_num_seqs=4)
GOOD = {"prompt": [5, 6, 7], "max_tokens": 3, "ignore_eos": True}


def start(tmp_path_factory, scheduler: SchedulerConfig, **server) -> ServerProcess:
    log = tmp_path_factory.mktemp("server") / "server.log"
    proc = ServerProcess(MODEL, scheduler, ServerConfig(port=free_port(), log_level="warning", **server), log)
    proc.wait_healthy(120)
    return proc


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with start(tmp_path_factory, SCHEDULER, max_waiting=1024) as proc:
        yield proc


def metrics(url: str) -> dict[str, float]:
    return parse_prometheus(httpx.get(f"{url}/metrics").text)


def wait_for(predicate, what: str, limit_s: float = 30.0) -> None:
    """Poll until the condition holds (a bound against hanging, not a latency assertion)."""
    deadline = time.monotonic() + limit_s
    while not predicate():
        assert time.monotonic() < deadline, f"never saw: {what}"
        time.sleep(0.05)


def assert_serves(url: str) -> None:
    resp = httpx.post(f"{url}/v1/completions", json=GOOD)
    assert resp.status_code == 200, resp.text
    assert len(resp.json()["choices"][0]["token_ids"]) == 3


def test_streamed_tokens_equal_the_in_process_engine(server):
    requests = create_requests(6, prompt_len=10)
    engine = Engine(SCHEDULER, MODEL)
    offline = engine.run(create_requests(6, prompt_len=10))
    expected = {r.request_id: r.output_token_ids for r in engine.core.state.finished}
    assert sum(len(v) for v in expected.values()) == sum(r.output_tokens for r in offline.records) == 60

    result = asyncio.run(run_bench(requests, BenchConfig(url=server.url, progress=False)))
    got = {r.request_id: r.token_ids for r in result.records}
    assert got == expected
    assert all(r.finish_reason == "length" and len(r.token_times_s) == r.max_tokens for r in result.records)

    one = requests[1]
    body = httpx.post(f"{server.url}/v1/completions", json={
        "prompt": list(one.prompt_token_ids), "max_tokens": one.max_tokens, "ignore_eos": True}).json()
    assert body["choices"][0]["token_ids"] == expected[one.request_id]
    assert body["usage"] == {"prompt_tokens": 10, "completion_tokens": one.max_tokens,
                             "total_tokens": 10 + one.max_tokens}


def test_stream_is_sse_with_usage_and_done(server):
    with httpx.stream("POST", f"{server.url}/v1/completions",
                      json={**GOOD, "stream": True, "stream_options": {"include_usage": True}}) as resp:
        assert resp.headers["content-type"].startswith("text/event-stream")
        events = [line[len("data: "):] for line in resp.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert [c["choices"][0]["finish_reason"] for c in chunks[:3]] == [None, None, "length"]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 3


BAD_INPUTS = [
    (b'{"prompt": [1, 2', 400, "JSON"),
    (b"[1, 2, 3]", 400, "JSON object"),
    ({"max_tokens": 3}, 400, "prompt"),
    ({"prompt": 5}, 400, "prompt"),
    ({"prompt": [1, "two"]}, 400, "prompt[1]"),
    ({"prompt": [1, True]}, 400, "prompt[1]"),
    ({"prompt": [1, 2.5]}, 400, "prompt[1]"),
    ({"prompt": []}, 400, "prompt"),
    ({"prompt": ""}, 400, "prompt"),
    ({"prompt": [[1, 2], [3]]}, 400, "prompt"),
    ({"prompt": [1, 512]}, 400, "prompt[1]"),
    ({"prompt": [-1]}, 400, "prompt[0]"),
    ({"prompt": [10 ** 30]}, 400, "prompt[0]"),
    ({"prompt": [1], "max_tokens": 0}, 400, "max_tokens"),
    ({"prompt": [1], "max_tokens": -5}, 400, "max_tokens"),
    ({"prompt": [1], "max_tokens": "8"}, 400, "max_tokens"),
    ({"prompt": [1], "max_tokens": 2.0}, 400, "max_tokens"),
    ({"prompt": [1], "max_tokens": 10 ** 12}, 400, "max_tokens"),
    (b'{"prompt": [1], "max_tokens": NaN}', 400, "max_tokens"),
    ({"prompt": [1] * 2000, "max_tokens": 100}, 400, "max_tokens"),
    ({"prompt": [1] * 2048, "max_tokens": 1}, 400, "prompt"),
    ({"prompt": [1], "stream": "yes"}, 400, "stream"),
    ({"prompt": [1], "ignore_eos": 1}, 400, "ignore_eos"),
    ({"prompt": [1], "stream_options": {"include_usage": "x"}}, 400, "stream_options.include_usage"),
    ({"prompt": [1], "temperature": -1}, 400, "temperature"),
    (b'{"prompt": [1], "temperature": NaN}', 400, "temperature"),
    ({"prompt": [1], "temperature": 2.5}, 400, "temperature"),
    ({"prompt": [1], "top_p": 7}, 400, "top_p"),
    ({"prompt": [1], "logprobs": -3}, 400, "logprobs"),
    ({"prompt": [1], "stop": 42}, 400, "stop"),
    ({"prompt": [1], "best_of": 3}, 400, "best_of"),
    ({"prompt": [1], "logit_bias": {"5": 100}}, 400, "logit_bias"),
    ({"prompt": [1], "suffix": "end"}, 400, "suffix"),
    ({"prompt": [1], "presence_penalty": 0.5}, 400, "presence_penalty"),
    ({"prompt": [1], "presence_penalty": False}, 400, "presence_penalty"),
    (b'{"prompt": "a\\ud800b"}', 400, "prompt"),
    ({"prompt": [1], "max_tokens": "9" * 5_000_000}, 400, "max_tokens"),
    (b'{"prompt":[1],"x":' + b"[" * 100_000 + b"]" * 100_000 + b"}", 400, "nested"),
    (b'{"prompt":' + b"[" * 960 + b"1" + b"]" * 960 + b"}", 400, "nested"),
    ({"prompt": [1], "n": 2}, 400, "n"),
    ({"prompt": [1], "model": "gpt-4"}, 404, "model"),
]


@pytest.mark.parametrize("body,status,field", BAD_INPUTS, ids=[f"{i}-{f}" for i, (_, _, f) in enumerate(BAD_INPUTS)])
def test_bad_input_gets_4xx_naming_the_field_and_the_server_keeps_serving(server, body, status, field):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    resp = httpx.post(f"{server.url}/v1/completions", content=content,
                      headers={"content-type": "application/json"})
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert error["message"].startswith(field) or field in error["message"], error
    assert len(resp.content) < 1000  # a short prefix of the bad input, never all of it
    if field not in ("JSON", "JSON object", "nested"):
        assert error["param"] in (field, field.split("[")[0]), error
    assert_serves(server.url)


def test_disconnect_mid_stream_aborts_and_frees_the_slot(server):
    before = metrics(server.url)
    async def scenario() -> dict:
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
            # a neighbour that must finish untouched
            neighbour = asyncio.create_task(client.post("/v1/completions", json={**GOOD, "max_tokens": 200}))
            async with client.stream("POST", "/v1/completions",
                                     json={"prompt": [9, 8, 7], "max_tokens": 1900, "ignore_eos": True,
                                           "stream": True}) as resp:
                seen = 0
                async for line in resp.aiter_lines():
                    seen += line.startswith("data: ")
                    if seen == 3:
                        during = await asyncio.to_thread(metrics, server.url)
                        break  # leaving the block closes the connection mid-stream
            answer = await neighbour
        assert answer.status_code == 200 and len(answer.json()["choices"][0]["token_ids"]) == 200
        return during

    during = asyncio.run(scenario())
    assert during["miniserve:kv_slots_used"] >= 1 and during["miniserve:kv_blocks_used"] >= 1
    wait_for(lambda: metrics(server.url)["miniserve:requests_aborted_total"]
             == before["miniserve:requests_aborted_total"] + 1, "the request aborted")
    after = metrics(server.url)
    assert after["miniserve:kv_slots_used"] == 0 and after["miniserve:kv_blocks_used"] == 0
    assert after["miniserve:num_requests_running"] == 0
    # it was cut short: far fewer than its 1900 tokens were generated
    generated = after["miniserve:generation_tokens_total"] - before["miniserve:generation_tokens_total"]
    assert generated < 200 + 1900
    assert_serves(server.url)


def test_load_above_capacity_completes_with_nothing_lost(server):
    workload = WorkloadConfig(arrival="poisson", rate=1000.0, num_requests=300,
                              prompt=LengthDist(value=8), output=LengthDist(value=8))
    requests = make_requests(generate(workload), vocab_size=512, prefix="load")
    result = asyncio.run(run_bench(requests, BenchConfig(url=server.url, progress=False, timeout_s=120)))
    assert result.metrics["completed"] == 300 and result.metrics["failed"] == 0, result.metrics["errors"]
    assert all(len(r.token_ids) == 8 for r in result.records)
    assert result.metrics["total_output_tokens"] == 2400


def test_max_concurrency_caps_requests_in_flight(server):
    requests = create_requests(12, prompt_len=6, outputs=(6,), prefix="cap")
    result = asyncio.run(run_bench(requests, BenchConfig(url=server.url, progress=False, max_concurrency=3)))
    assert result.metrics["completed"] == 12
    spans = [(r.send_s, r.end_s) for r in result.records]
    most = max(sum(s <= t < e for s, e in spans) for t, _ in spans)
    assert most <= 3


def test_bench_app_takes_vllm_flags_and_writes_results_json(server, tmp_path):
    out = subprocess.run([sys.executable, "-m", "experiments.bench", "--base-url", server.url, "--request-rate", "50",
                          "--num-prompts", "6", "--max-concurrency", "2", "--goodput", "ttft:60000", "tpot:60000",
                          "--disable-tqdm", f"hydra.run.dir={tmp_path}"],
                         capture_output=True, text=True, timeout=300, check=False)
    assert out.returncode == 0, out.stderr
    results = json.loads((tmp_path / "results.json").read_text())
    check_vllm_keys(results)
    assert (results["completed"], results["max_concurrency"], results["request_rate"]) == (6, 2, 50.0)
    assert results["request_goodput"] == pytest.approx(results["request_throughput"])  # generous SLOs: all good
    assert "sent 6 requests" in out.stdout + out.stderr  # the one-line summary, no progress bar off a terminal
    assert "\r" not in (tmp_path / "bench.log").read_text()


def test_health_models_and_metrics_report_the_engine(server):
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}
    model = httpx.get(f"{server.url}/v1/models").json()["data"][0]
    assert (model["id"], model["vocab_size"], model["scheduler"], model["max_num_seqs"]) == ("tiny", 512, "continuous", 4)
    assert model["max_model_len"] == min(SCHEDULER.max_model_len, SCHEDULER.kv_capacity_tokens)
    assert httpx.get(f"{server.url}/v1/models/tiny").json() == model
    m = metrics(server.url)
    assert m["miniserve:healthy"] == 1
    assert m['miniserve:step_duration_seconds_bucket{le="+Inf"}'] == m["miniserve:step_duration_seconds_count"] > 0
    assert m['miniserve:step_duration_seconds_bucket{le="0.001"}'] <= m['miniserve:step_duration_seconds_bucket{le="0.01"}']


def test_overload_answers_429_loses_no_accepted_request_and_sigterm_exits_zero(tmp_path_factory):
    proc = start(tmp_path_factory, SchedulerConfig(name="continuous", max_num_seqs=2), max_waiting=4)
    try:
        n, max_tokens = 40, 200
        requests = [Request(f"o{i}", [3 + i, 4, 5], max_tokens) for i in range(n)]
        result = asyncio.run(run_bench(requests, BenchConfig(url=proc.url, progress=False)))
        codes = [r.status_code for r in result.records]
        accepted = [r for r in result.records if r.status_code == 200]
        assert set(codes) == {200, 429} and len(accepted) + codes.count(429) == n
        assert all("retry" in r.error for r in result.records if r.status_code == 429)
        assert all(r.ok and len(r.token_ids) == max_tokens for r in accepted)

        async def burst() -> list[httpx.Response]:
            async with httpx.AsyncClient(base_url=proc.url, timeout=60) as client:
                return await asyncio.gather(*(client.post("/v1/completions", json={**GOOD, "max_tokens": 50})
                                              for _ in range(12)))

        refused = [r for r in asyncio.run(burst()) if r.status_code == 429]
        assert refused and all(r.headers["retry-after"] == "1" and r.json()["error"]["type"] == "rate_limit_error"
                               for r in refused)
        codes += [429] * len(refused)
        m = metrics(proc.url)
        assert m['miniserve:requests_rejected_total{reason="queue_full"}'] == codes.count(429)
        assert m["miniserve:requests_finished_total"] == len(accepted) + 12 - len(refused)

        async def in_flight_then_sigterm() -> list[httpx.Response]:
            async with httpx.AsyncClient(base_url=proc.url, timeout=60) as client:
                tasks = [asyncio.create_task(client.post("/v1/completions", json={**GOOD, "max_tokens": 300}))
                         for _ in range(2)]
                await asyncio.to_thread(wait_for, lambda: metrics(proc.url)["miniserve:num_requests_running"] == 2,
                                        "both requests running")
                proc.proc.terminate()  # SIGTERM
                return await asyncio.gather(*tasks)

        answers = asyncio.run(in_flight_then_sigterm())
        assert proc.proc.wait(60) == 0
        assert all(a.status_code == 200 and len(a.json()["choices"][0]["token_ids"]) == 300 for a in answers)
        with pytest.raises(httpx.ConnectError):
            httpx.post(f"{proc.url}/v1/completions", json=GOOD)
    finally:
        proc.stop()


def test_a_taken_port_fails_before_the_model_is_built(tmp_path):
    """As vLLM's: the port is bound first, so a second server on it exits at once (uvicorn's status
    3), not after building and warming a model it cannot serve."""
    import socket

    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        log = tmp_path / "server.log"
        proc = ServerProcess(MODEL, SCHEDULER, ServerConfig(port=port, log_level="info"), log)
        assert proc.proc.wait(120) == 3
    text = log.read_text()
    assert "Address already in use" in text and "engine ready" not in text


def test_a_forced_quit_stops_the_engine_and_writes_the_trace(tmp_path):
    """A second SIGINT is uvicorn's force quit, which skips the app's own shutdown: the process
    ended with the engine thread inside a torch call and died by SIGABRT, without its trace."""
    import signal

    trace, log = tmp_path / "trace.json", tmp_path / "server.log"
    proc = ServerProcess(MODEL, SchedulerConfig(max_num_seqs=1), ServerConfig(port=free_port(), log_level="info",
                                                                              trace_path=str(trace)), log)
    try:
        proc.wait_healthy(120)

        async def cut_short() -> list:
            async with httpx.AsyncClient(base_url=proc.url, timeout=60) as client:
                tasks = [asyncio.create_task(client.post("/v1/completions", json={**GOOD, "max_tokens": 2000}))
                         for _ in range(4)]  # one running, three waiting
                await asyncio.to_thread(wait_for, lambda: metrics(proc.url)["miniserve:num_requests_running"] == 1,
                                        "a request running")
                proc.proc.send_signal(signal.SIGINT)
                await asyncio.sleep(0.5)
                proc.proc.send_signal(signal.SIGINT)
                return await asyncio.gather(*tasks, return_exceptions=True)

        asyncio.run(cut_short())
        assert proc.proc.wait(60) == 0
    finally:
        proc.stop()
    assert json.loads(trace.read_text())["traceEvents"]
    assert "terminate called" not in log.read_text()
