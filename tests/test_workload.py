"""Workloads: seeded, the existing kinds unchanged, closed loop and empirical lengths from a trace."""

import numpy as np
import pytest

from engine.observe.workload import LengthDist, WorkloadConfig, generate, make_requests

TRACE = "arrival_s,prompt_tokens,output_tokens\n0.0,100,7\n0.5,300,9\n2.0,200,11\n"


@pytest.fixture
def trace_path(tmp_path):
    path = tmp_path / "trace.csv"
    path.write_text(TRACE)
    return str(path)


def test_default_is_still_the_seed_burst():
    wl = generate(WorkloadConfig())
    assert len(wl) == 16 and wl.concurrency is None
    assert (wl.arrival_s == 0).all() and (wl.prompt_tokens == 12).all()
    assert wl.output_tokens.tolist() == [4, 16, 8, 12] * 4


@pytest.mark.parametrize("arrival", ["poisson", "gamma", "closed_loop"])
def test_seeded_and_reproducible(arrival):
    cfg = WorkloadConfig(arrival=arrival, num_requests=50, rate=3.0, burstiness=0.5, concurrency=4, seed=7,
                         prompt=LengthDist(kind="lognormal", value=512, sigma=0.5),
                         output=LengthDist(kind="uniform", low=2, high=9))
    a, b = generate(cfg), generate(cfg)
    assert np.array_equal(a.arrival_s, b.arrival_s) and np.array_equal(a.prompt_tokens, b.prompt_tokens)
    assert not np.array_equal(a.prompt_tokens, generate(WorkloadConfig(**{**cfg.__dict__, "seed": 8})).prompt_tokens)
    assert ((a.output_tokens >= 2) & (a.output_tokens <= 9)).all()


def test_closed_loop_carries_its_concurrency_and_leaves_arrivals_to_the_run():
    wl = generate(WorkloadConfig(arrival="closed_loop", num_requests=10, concurrency=3))
    assert wl.concurrency == 3 and (wl.arrival_s == 0).all()
    with pytest.raises(ValueError, match="concurrency"):
        WorkloadConfig(arrival="closed_loop", concurrency=0)


def test_gamma_burstiness_spreads_gaps_at_the_same_rate():
    def gaps(burstiness):
        wl = generate(WorkloadConfig(arrival="gamma", num_requests=20000, rate=5.0, burstiness=burstiness, seed=1))
        return np.diff(wl.arrival_s)
    smooth, bursty = gaps(1.0), gaps(0.2)
    assert smooth.mean() == pytest.approx(0.2, rel=0.05) and bursty.mean() == pytest.approx(0.2, rel=0.05)
    assert bursty.std() > 1.8 * smooth.std()  # CV = 1/sqrt(shape): 2.24 vs 1


def test_empirical_lengths_come_from_the_trace(trace_path):
    cfg = WorkloadConfig(arrival="poisson", num_requests=500, rate=2.0,
                         prompt=LengthDist(kind="empirical", path=trace_path, column="prompt_tokens"),
                         output=LengthDist(kind="empirical", path=trace_path, column="output_tokens", max=10))
    wl = generate(cfg)
    assert set(wl.prompt_tokens.tolist()) == {100, 200, 300}
    assert set(wl.output_tokens.tolist()) == {7, 9, 10}  # 11 clipped to max
    with pytest.raises(ValueError, match="path"):
        LengthDist(kind="empirical")
    with pytest.raises(ValueError, match="column"):
        LengthDist(kind="empirical", path=trace_path, column="arrival_s")


def test_trace_replay_and_placeholder_prompts(trace_path):
    wl = generate(WorkloadConfig(arrival="trace", path=trace_path, num_requests=10, time_scale=2.0,
                                 length_scale=0.5))
    assert wl.arrival_s.tolist() == [0.0, 0.25, 1.0]
    assert wl.prompt_tokens.tolist() == [50, 150, 100] and wl.output_tokens.tolist() == [4, 4, 6]
    reqs = make_requests(wl)
    assert [r.num_prompt_tokens for r in reqs] == [50, 150, 100] and isinstance(reqs[0].prompt_token_ids, range)


def test_splitwise_trace_columns_are_read(tmp_path):
    path = tmp_path / "splitwise.csv"
    path.write_text("arrived_at,num_prefill_tokens,num_decode_tokens\n3.5,374,44\n7.8,396,109\n")
    wl = generate(WorkloadConfig(arrival="trace", path=str(path), num_requests=100))
    assert wl.arrival_s.tolist() == pytest.approx([0.0, 4.3]) and wl.output_tokens.tolist() == [44, 109]


def test_a_trace_replays_whole_unless_num_requests_is_set_and_says_so(tmp_path, caplog):
    path = tmp_path / "t.csv"
    path.write_text("arrival_s,prompt_tokens,output_tokens\n" + "".join(f"{i},10,{i % 3}\n" for i in range(30)))
    with caplog.at_level("INFO", logger="engine.observe.workload"):
        whole = generate(WorkloadConfig(arrival="trace", path=str(path), num_requests=None))
    assert len(whole) == 20  # the ten rows with output 0 are left out
    assert f"trace {path}: 30 rows read, 10 skipped (10 with no prompt or output tokens), 20 replayed" in caplog.text
    assert len(generate(WorkloadConfig(arrival="trace", path=str(path), num_requests=5))) == 5
    with pytest.raises(ValueError, match="only a trace"):
        WorkloadConfig(arrival="poisson", num_requests=None)


def test_clipped_lengths_are_counted(trace_path, caplog):
    with caplog.at_level("INFO", logger="engine.observe.workload"):
        wl = generate(WorkloadConfig(arrival="trace", path=trace_path, num_requests=None,
                                     prompt=LengthDist(max=150)))
    assert wl.prompt_tokens.tolist() == [100, 150, 150]
    assert "3 rows read, 0 skipped (none), 3 replayed, 2 with lengths clipped" in caplog.text


@pytest.mark.parametrize("text, error", [
    ("arrival_s,prompt_tokens,output_tokens\n0,10,5\n1,ten,5\n", "line 3: expected a time and two token counts"),
    ("arrival_s,prompt_tokens,output_tokens\n2,10,5\n1,10,5\n", "line 3: arrival 1.0 comes before"),
    ("arrival_s,prompt,output_tokens\n0,10,5\n", "no prompt_tokens column"),
    ("arrival_s,prompt_tokens,output_tokens\n", "holds no requests"),
    ("arrival_s,prompt_tokens,output_tokens\n0,0,5\n", "holds no requests"),
])
def test_a_bad_trace_is_a_clear_error(tmp_path, text, error):
    path = tmp_path / "bad.csv"
    path.write_text(text)
    with pytest.raises(ValueError, match=error):
        generate(WorkloadConfig(arrival="trace", path=str(path), num_requests=None))
    with pytest.raises(ValueError, match="cannot read trace"):
        generate(WorkloadConfig(arrival="trace", path=str(tmp_path / "missing.csv"), num_requests=None))
