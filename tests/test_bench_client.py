"""The load generator's bookkeeping: vLLM's definitions over what the client recorded."""

from __future__ import annotations

import math

import pytest

from engine.loadgen.client import (BenchConfig, BenchResult, HttpRecord, bench_metrics, format_summary,
                                   prompt_vocab_size, write_outputs)
from engine.observe.metrics import read_requests_csv


def record(rid: str, send: float, times: list[float], finish: str | None = "length", code: int = 200,
           error: str | None = None, arrival: float | None = None) -> HttpRecord:
    timing = None
    if times and arrival is not None:  # the engine saw the request `arrival` s after the send
        timing = {"arrival_s": 100.0 + send + arrival, "token_times_s": [100.0 + t - 0.001 for t in times]}
    return HttpRecord(rid, 4, len(times) or 3, send, send_s=send, end_s=(times[-1] if times else send),
                      token_times_s=times, token_ids=[1] * len(times), status_code=code, finish_reason=finish,
                      error=error, server_timing=timing, t0_abs=100.0)


def test_metrics_follow_vllm_definitions_and_count_failures():
    records = [record("a", 0.0, [0.5, 0.7, 0.9], arrival=0.002),
               record("b", 0.1, [0.3, 1.3], arrival=0.002),
               record("c", 0.2, [], finish=None, code=429, error="the waiting queue is full"),
               record("d", 0.3, [0.6, 0.8], finish="abort", error="server shutting down")]
    m = bench_metrics(records, duration_s=2.0, cfg=BenchConfig(goodput="ttft:300"))
    assert (m["completed"], m["failed"], m["rejected_429"]) == (2, 2, 1)
    assert m["total_output_tokens"] == 5 and m["output_throughput_tok_s"] == pytest.approx(2.5)
    assert m["ttft_s"]["mean"] == pytest.approx((0.5 + 0.2) / 2)
    assert m["tpot_s"]["mean"] == pytest.approx((0.2 + 1.0) / 2)  # (E2E - TTFT) / (n - 1)
    assert m["goodput_req_s"] == pytest.approx(0.5)  # only b meets TTFT <= 300 ms
    # engine saw it 2 ms after the send and the token 1 ms before the client: 3 ms overhead
    assert m["http_overhead_ttft_s"]["p50"] == pytest.approx(0.003)
    assert m["http_ingress_s"]["p50"] == pytest.approx(0.002)
    assert "Successful requests:" in format_summary(m)


def test_outputs_round_trip_through_engine_metrics(tmp_path):
    records = [record("a", 0.0, [0.5, 0.7]), record("c", 0.2, [], finish=None, code=429, error="full")]
    write_outputs(BenchResult(records, 1.0, bench_metrics(records, 1.0, BenchConfig())), tmp_path)
    back = {r.request_id: r for r in read_requests_csv(tmp_path / "requests.csv")}
    assert back["a"].token_times_s == (0.5, 0.7) and back["a"].status == "FINISHED_LENGTH"
    assert back["c"].status == "REJECTED" and back["c"].output_tokens == 0
    assert math.isnan(back["a"].first_scheduled_s)
    assert (tmp_path / "metrics.json").is_file() and (tmp_path / "http_requests.csv").is_file()


@pytest.mark.parametrize("bad", [{"max_concurrency": 0}, {"goodput": "ttft:-1"}, {"goodput": "latency:5"},
                                 {"timeout_s": 0.0}, {"vocab_size": 1}])
def test_bench_config_refuses_nonsense(bad):
    with pytest.raises(ValueError):
        BenchConfig(**bad)


def test_prompt_vocabulary_comes_from_the_server_or_the_config_and_a_server_without_one_is_named():
    miniserve = {"id": "qwen2_5_0_5b", "vocab_size": 151936}
    vllm = {"id": "Qwen/Qwen2.5-0.5B", "object": "model", "max_model_len": 32768}  # no vocab_size
    assert prompt_vocab_size(miniserve, BenchConfig()) == 151936
    assert prompt_vocab_size(vllm, BenchConfig(vocab_size=32000)) == 32000
    assert prompt_vocab_size(miniserve, BenchConfig(vocab_size=1000)) == 1000  # the config wins
    with pytest.raises(ValueError, match="bench.vocab_size"):
        prompt_vocab_size(vllm, BenchConfig())


def _stream(*chunks: str):
    """An OpenAI-compatible server answering every request with these SSE data lines."""
    import httpx

    body = "".join(f"data: {c}\n\n" for c in (*chunks, "[DONE]")).encode()
    return httpx.MockTransport(lambda request: httpx.Response(200, content=body,
                                                              headers={"content-type": "text/event-stream"}))


def _send_one(transport) -> HttpRecord:
    import asyncio
    import time

    import httpx

    from engine.core.request import Request
    from engine.loadgen.client import _send

    async def go() -> HttpRecord:
        rec = HttpRecord("r", 3, 5, 0.0)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            await _send(client, Request("r", [1, 2, 3], 5), rec, None, BenchConfig(), time.perf_counter())
        return rec
    return asyncio.run(go())


def test_a_text_stream_is_timed_per_chunk_and_counted_by_its_usage_as_vllms_bench_does():
    """vLLM's bench times every chunk with a choice (an empty text too: a special token) and takes
    the output length from usage; counted per non-empty text, 5 tokens in 4 chunks were 3, and a
    two-token chunk put a zero gap into ITL."""
    rec = _send_one(_stream('{"choices": [{"text": "a"}]}', '{"choices": [{"text": ""}]}',
                            '{"choices": [{"text": "bc"}]}', '{"choices": [{"text": "d", "finish_reason": "length"}]}',
                            '{"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 5}}'))
    assert rec.ok and rec.output_tokens == 5 and len(rec.token_times_s) == 4
    out = rec.to_request_record()
    assert out.output_tokens == 5 and len(out.itl_s) == 3
    assert out.tpot_s == pytest.approx((rec.token_times_s[-1] - rec.token_times_s[0]) / 4)
    m = bench_metrics([rec], 1.0, BenchConfig())
    assert m["completed"] == 1 and m["failed"] == 0 and m["total_output_tokens"] == 5


def test_token_ids_count_where_a_server_sends_no_usage():
    rec = _send_one(_stream('{"choices": [{"text": "ab", "token_ids": [4, 5]}]}',
                            '{"choices": [{"text": "c", "token_ids": [6], "finish_reason": "length"}]}'))
    assert rec.ok and rec.output_tokens == 3 and rec.token_ids == [4, 5, 6] and len(rec.token_times_s) == 2


@pytest.mark.parametrize("bad", ["[1, 2]", '"text"', '{"choices": 7}'])
def test_a_chunk_that_is_no_completion_chunk_fails_that_request_not_the_benchmark(bad):
    rec = _send_one(_stream('{"choices": [{"text": "a"}]}', bad))
    assert not rec.ok and "not an OpenAI completion chunk" in rec.error


def test_a_stream_that_finishes_without_a_token_is_failed_not_lost():
    rec = _send_one(_stream('{"choices": [], "usage": {"completion_tokens": 0}}',
                            '{"choices": [{"text": "", "finish_reason": "length"}]}'))
    m = bench_metrics([rec], 1.0, BenchConfig())
    assert (m["completed"], m["failed"]) == (0, 1)
