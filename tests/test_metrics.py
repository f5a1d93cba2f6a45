"""vLLM's metric definitions on hand-computable runs."""

import math

import pytest

from engine.observe.metrics import RequestRecord, distribution, read_requests_csv, summarize, write_requests_csv


def record(rid, arrival, times, prompt=10, first_scheduled=None):
    return RequestRecord(rid, arrival, arrival if first_scheduled is None else first_scheduled, tuple(times),
                         prompt, len(times))


def test_single_request_metrics_are_exact():
    r = record("a", 1.0, [1.5, 1.7, 1.9, 2.1], first_scheduled=1.2)
    assert r.ttft_s == pytest.approx(0.5)
    assert r.e2e_s == pytest.approx(1.1)
    assert r.tpot_s == pytest.approx(0.2)  # (1.1 - 0.5) / 3
    assert r.queue_s == pytest.approx(0.2)
    assert list(r.itl_s) == pytest.approx([0.2, 0.2, 0.2])
    m = summarize([r])
    assert m["duration_s"] == pytest.approx(1.1)
    assert m["output_throughput_tok_s"] == pytest.approx(4 / 1.1)
    assert m["total_token_throughput_tok_s"] == pytest.approx(14 / 1.1)
    assert m["ttft_s"]["p99"] == pytest.approx(0.5)


def test_one_token_requests_have_no_tpot_and_goodput_counts_slos():
    rs = [record("a", 0.0, [0.1]), record("b", 0.0, [0.4, 0.5, 0.6])]
    assert math.isnan(rs[0].tpot_s)
    m = summarize(rs, duration_s=1.0, slo_ttft_s=0.2)
    assert m["tpot_s"]["mean"] == pytest.approx(0.1)
    assert m["goodput_req_s"] == pytest.approx(1.0)
    assert m["request_throughput_req_s"] == pytest.approx(2.0)


def test_percentiles_follow_numpy_linear_interpolation():
    d = distribution([1, 2, 3, 4])
    assert d["p50"] == pytest.approx(2.5) and d["p99"] == pytest.approx(3.97) and d["mean"] == 2.5


def test_requests_csv_round_trips(tmp_path):
    rs = [record("a", 0.25, [0.5, 0.75]), record("b", 0.0, [0.125])]
    write_requests_csv(rs, tmp_path / "requests.csv")
    assert read_requests_csv(tmp_path / "requests.csv") == rs
