"""The server's pieces in-process: health gating on warm-up, request parsing, the engine thread."""

from __future__ import annotations

import asyncio
import threading

import pytest
from fastapi.testclient import TestClient

from engine.core.config import ModelConfig, SchedulerConfig
from engine.serving.engine_thread import EngineClosed, EngineThread, QueueFull, RequestSink
from engine.llm_engine import Engine
from engine.serving.protocol import ApiError, check_limits, parse_chat, parse_completion
from engine.core.request import Request
from engine.serving.app import create_app, parse_prometheus

TINY = ModelConfig(name="tiny", num_threads=1)


def test_health_is_503_until_the_engine_has_warmed_up():
    go = threading.Event()

    def build() -> Engine:
        go.wait(30)
        engine = Engine(SchedulerConfig(max_num_seqs=2), TINY)
        engine.warmup()
        return engine

    thread = EngineThread(build, max_waiting=8)
    with TestClient(create_app(thread, "tiny"), base_url="http://127.0.0.1") as client:
        assert client.get("/health").status_code == 503
        refused = client.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 2})
        assert refused.status_code == 503 and "warming up" in refused.json()["error"]["message"]
        go.set()
        assert thread.ready.wait(60)
        assert client.get("/health").json() == {"status": "ok"}
        ok = client.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 2, "ignore_eos": True})
        assert ok.status_code == 200 and len(ok.json()["choices"][0]["token_ids"]) == 2
        m = parse_prometheus(client.get("/metrics").text)
        assert m['miniserve:requests_rejected_total{reason="unavailable"}'] == 1
        assert m["miniserve:requests_finished_total"] == 1


def test_submit_past_max_waiting_raises_queue_full_without_accepting():
    thread = EngineThread(lambda: Engine(SchedulerConfig(max_num_seqs=1), TINY), max_waiting=2)
    loop = asyncio.new_event_loop()  # not running: the thread is never started, nothing drains
    try:
        sink = RequestSink(loop)
        thread.submit(Request("a", [1], 1), sink)
        thread.submit(Request("b", [1], 1), sink)
        with pytest.raises(QueueFull):
            thread.submit(Request("c", [1], 1), sink)
    finally:
        loop.close()


def test_requests_drained_but_not_yet_stepped_still_count_against_max_waiting():
    """Between the inbox's drain and the step that delivers them, accepted requests sit in the
    core's arrivals: they must still fill the queue, or a long step lets twice max_waiting in."""
    thread = EngineThread(lambda: None, max_waiting=2)
    thread.engine = Engine(SchedulerConfig(max_num_seqs=1), TINY)  # the loop is never started
    loop = asyncio.new_event_loop()
    try:
        sink = RequestSink(loop)
        thread.submit(Request("a", [1], 1), sink)
        thread.submit(Request("b", [1], 1), sink)
        assert thread._drain(block=False)  # into the core, not yet stepped
        assert thread.stats.num_waiting == 2
        with pytest.raises(QueueFull):
            thread.submit(Request("c", [1], 1), sink)
    finally:
        loop.close()


class RecordingSink(RequestSink):
    """A sink that keeps its events in a list (no event loop needed)."""

    def __init__(self) -> None:
        self.events: list = []

    def put(self, event) -> None:
        self.events.append(event)


def run_with_broken(method: str, error: str) -> tuple[EngineThread, RecordingSink]:
    """An engine thread whose engine raises ``error`` from ``method``, after one request ("a") was
    submitted before the loop started; returns once the loop has ended."""
    def build() -> Engine:
        engine = Engine(SchedulerConfig(max_num_seqs=1), TINY)

        def broken(*args):
            raise RuntimeError(error)

        setattr(engine, method, broken)
        return engine

    thread, sink = EngineThread(build, max_waiting=4), RecordingSink()
    thread.submit(Request("a", [1], 1), sink)  # before the loop runs: no timing in what fails first
    thread.start()
    thread._thread.join(60)
    assert not thread._thread.is_alive() and error in thread.error
    return thread, sink


def test_once_the_engine_loop_has_failed_submit_refuses_instead_of_queueing_for_nobody():
    thread, sink = run_with_broken("step", "boom")
    assert [e.finish_reason for e in sink.events] == ["abort"] and "boom" in sink.events[0].error  # told, not lost
    with pytest.raises(EngineClosed, match="boom"):
        thread.submit(Request("b", [1], 1), sink)


def test_a_request_the_engine_fails_to_accept_is_answered_before_the_loop_fails():
    _, sink = run_with_broken("add_request", "bug in add")
    assert [e.finish_reason for e in sink.events] == ["error"] and "bug in add" in sink.events[0].error


def test_parse_accepts_token_ids_text_and_a_batch_of_one():
    p = parse_completion({"prompt": [3, 4], "max_tokens": 5, "stream": True, "unknown_field": {"x": 1},
                          "stream_options": {"include_usage": True}, "temperature": 0})
    assert (p.prompt_token_ids, p.max_tokens, p.stream, p.include_usage) == ([3, 4], 5, True, True)
    assert parse_completion({"prompt": "hi"}).prompt_text == "hi"
    assert parse_completion({"prompt": [[7, 8]]}).prompt_token_ids == [7, 8]


@pytest.mark.parametrize("ids,max_tokens,param", [([0, 99], 1, "prompt"), ([1] * 10, 1, "prompt"),
                                                  ([1] * 5, 6, "max_tokens")])
def test_check_limits_blames_the_right_field(ids, max_tokens, param):
    with pytest.raises(ApiError) as err:
        check_limits(ids, max_tokens, vocab_size=50, max_model_len=10, kv_capacity_tokens=64)
    assert err.value.param == param and err.value.status == 400
    check_limits([1] * 5, 5, vocab_size=50, max_model_len=10, kv_capacity_tokens=64)


def test_a_kv_pool_smaller_than_the_context_is_the_limit():
    """A request must fit the KV pool as well as the model's context: 20 + 20 tokens fit
    max_model_len=100 but not 32 tokens of KV, and are refused before acceptance naming 32."""
    limits = {"vocab_size": 50, "max_model_len": 100, "kv_capacity_tokens": 32}
    with pytest.raises(ApiError) as err:
        check_limits([1] * 20, 20, **limits)
    assert (err.value.status, err.value.param) == (400, "max_tokens")
    assert "(32 tokens)" in err.value.message and "at most 12" in err.value.message
    with pytest.raises(ApiError) as err:
        check_limits([1] * 40, 1, **limits)
    assert err.value.param == "prompt" and "max_model_len=32" in err.value.message
    assert check_limits([1] * 20, 12, **limits) == 12 and check_limits([1] * 20, None, **limits) == 12


def test_a_chat_max_completion_tokens_past_the_context_is_blamed_by_its_own_name():
    params = parse_chat({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                         "max_completion_tokens": 10 ** 9})
    assert (params.max_tokens, params.max_tokens_field) == (10 ** 9, "max_completion_tokens")
    with pytest.raises(ApiError) as err:
        check_limits([1] * 5, params.max_tokens, vocab_size=50, max_model_len=10, kv_capacity_tokens=64,
                     max_tokens_field=params.max_tokens_field)
    assert err.value.param == "max_completion_tokens" and err.value.message.startswith("max_completion_tokens")
    plain = parse_chat({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert (plain.max_tokens, plain.max_tokens_field) == (2, "max_tokens")


def test_tokenize_and_detokenize_round_trip_and_refuse_bad_bodies_by_field():
    """vLLM's routes on the tiny model's byte-level tokenizer: a text is one id per UTF-8 byte (the
    same byte, the same id), and those ids decode back to it; a bad body is a 400 naming its
    field, not a 500."""
    def build() -> Engine:
        engine = Engine(SchedulerConfig(max_num_seqs=2), TINY)
        engine.warmup()
        return engine

    thread = EngineThread(build, max_waiting=8)
    text = "naïve 中 ok"
    with TestClient(create_app(thread, "tiny"), base_url="http://127.0.0.1") as client:
        assert thread.ready.wait(60)
        tokens = client.post("/tokenize", json={"prompt": text, "add_special_tokens": False}).json()
        utf8 = text.encode()
        assert tokens["count"] == len(tokens["tokens"]) == len(utf8)
        assert len(set(zip(utf8, tokens["tokens"]))) == len(set(utf8)) == len(set(tokens["tokens"]))
        assert tokens["max_model_len"] == client.get("/v1/models/tiny").json()["max_model_len"]
        assert client.post("/detokenize", json={"tokens": tokens["tokens"]}).json() == {"prompt": text}
        vocab = client.get("/v1/models/tiny").json()["vocab_size"]
        for path, body, param in [("/tokenize", {"prompt": text, "add_special_tokens": "no"}, "add_special_tokens"),
                                  ("/tokenize", {"prompt": [104]}, "prompt"),
                                  ("/detokenize", {"tokens": "104"}, "tokens"),
                                  ("/detokenize", {"tokens": [104, vocab]}, "tokens")]:
            resp = client.post(path, json=body)
            assert resp.status_code == 400 and resp.json()["error"]["param"] == param, (path, body, resp.text)


def test_metrics_count_prefix_cache_queries_and_hits_under_vllms_names():
    def build() -> Engine:
        engine = Engine(SchedulerConfig(max_num_seqs=2, block_size=4, enable_prefix_caching=True), TINY)
        engine.warmup()
        return engine

    thread = EngineThread(build, max_waiting=8)
    with TestClient(create_app(thread, "tiny"), base_url="http://127.0.0.1") as client:
        assert thread.ready.wait(60)
        prompt = list(range(1, 11))
        for _ in range(2):  # the second finds the first's two full blocks cached
            body = {"prompt": prompt, "max_tokens": 2, "ignore_eos": True}
            assert client.post("/v1/completions", json=body).status_code == 200
        m = parse_prometheus(client.get("/metrics").text)
        assert m['vllm:prefix_cache_queries_total{model_name="tiny"}'] == 20
        assert m['vllm:prefix_cache_hits_total{model_name="tiny"}'] == 8
        assert m["miniserve:prefix_cache_hit_requests_total"] == 1


def test_the_port_is_bound_as_asyncio_binds_it_and_a_taken_one_is_refused():
    """serve() binds before the model is built (bind_sockets): one socket per address the name
    resolves to, IPv6 ones IPv6-only as asyncio's create_server makes them."""
    import socket

    from engine.serving.app import bind_sockets

    resolved = {info[4][:2] for info in socket.getaddrinfo("localhost", 0, type=socket.SOCK_STREAM)}
    sockets = bind_sockets("localhost", 0)
    try:
        assert {s.getsockname()[0] for s in sockets} == {host for host, _ in resolved}
        for s in sockets:
            if s.family == socket.AF_INET6:
                assert s.getsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY) == 1
        taken = sockets[0].getsockname()[1]
        sockets[0].listen()
        with pytest.raises(OSError):
            bind_sockets("127.0.0.1", taken) if sockets[0].family == socket.AF_INET else bind_sockets("::1", taken)
    finally:
        for s in sockets:
            s.close()
