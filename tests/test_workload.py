"""Workloads: seeded, the existing kinds unchanged, closed loop and empirical lengths from a trace."""

import numpy as np
import pytest

from engine.observe.workload import PLACEHOLDER_STRIDE, LengthDist, WorkloadConfig, generate, iter_requests, make_requests

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
    assert f"trace {path} (miniserve): 30 rows read, 10 skipped (10 with no prompt or output tokens), 20 replayed" in caplog.text
    assert len(generate(WorkloadConfig(arrival="trace", path=str(path), num_requests=5))) == 5
    with pytest.raises(ValueError, match="only a trace"):
        WorkloadConfig(arrival="poisson", num_requests=None)


def test_clipped_lengths_are_counted(trace_path, caplog):
    with caplog.at_level("INFO", logger="engine.observe.workload"):
        wl = generate(WorkloadConfig(arrival="trace", path=trace_path, num_requests=None,
                                     prompt=LengthDist(max=150)))
    assert wl.prompt_tokens.tolist() == [100, 150, 150]
    assert "3 rows read, 0 skipped (none), 3 replayed, 2 with lengths clipped" in caplog.text
    cut = 300 + 200 - 2 * 150  # the fixture's prompts: 100, 300, 200
    assert wl.clipped == {"requests": 2, "prompt_tokens_cut": cut, "output_tokens_cut": 0,
                          "prompt_tokens_kept": 400, "output_tokens_kept": int(wl.output_tokens.sum())}


@pytest.mark.parametrize("text, error", [
    ("arrival_s,prompt_tokens,output_tokens\n0,10,5\n1,ten,5\n", "line 3: expected a time and two token counts"),
    ("arrival_s,prompt_tokens,output_tokens\n2,10,5\n1,10,5\n", "line 3: arrival 1.0 comes before"),
    ("arrival_s,prompt,output_tokens\n0,10,5\n", "line 1: header .* matches no trace format"),
    ("arrival_s,prompt_tokens,output_tokens\n0,10,5\n1,-3,5\n", "line 3: negative token count"),
    ("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.68,10,5\nyesterday,10,5\n",
     "line 3: expected a date"),
    ("Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n5.0,GPT-4,10,5,15,Conversation log\n"
     "4.0,GPT-4,10,5,15,Conversation log\n", "line 3: arrival 4.0 comes before"),
    ('{"timestamp": 0, "input_length": 10, "output_length": 5, "hash_ids": [1]}\n{"timestamp": 5, "input_length": 10}\n',
     "line 2: Mooncake rows need .* missing \\['output_length'\\]"),
    ('{"timestamp": 0, "input_length": 10, "output_length": 5, "hash_ids": [1]}\n{"timestamp": 5, "input_length": -10, '
     '"output_length": 5, "hash_ids": [1]}\n', "line 2: negative token count"),
    ('{"timestamp": 9, "input_length": 10, "output_length": 5, "hash_ids": [1]}\n{"timestamp": 5, "input_length": 10, '
     '"output_length": 5, "hash_ids": [1]}\n', "line 2: arrival 0.005 comes before"),
    ('{"timestamp": 0, "input_length": 10, "output_length": 5}\nnot json\n', "line 2: not JSON"),
    ("arrival_s,prompt_tokens,output_tokens\n", "holds no requests"),
    ("arrival_s,prompt_tokens,output_tokens\n0,0,5\n", "holds no requests"),
    ("arrival_s,prompt_tokens,output_tokens\n0,10,5\ninf,10,5\n", "line 3: arrival time inf is not a finite"),
    ("arrival_s,prompt_tokens,output_tokens\nnan,10,5\n", "line 2: arrival time nan is not a finite"),
])
def test_a_bad_trace_is_a_clear_error(tmp_path, text, error):
    path = tmp_path / "bad.csv"
    path.write_text(text)
    with pytest.raises(ValueError, match=error):
        generate(WorkloadConfig(arrival="trace", path=str(path), num_requests=None))
    with pytest.raises(ValueError, match="cannot read trace"):
        generate(WorkloadConfig(arrival="trace", path=str(tmp_path / "missing.csv"), num_requests=None))


FORMATS = {  # one example of each format the README lists: the same three requests
    "miniserve": "arrival_s,prompt_tokens,output_tokens\n0.0,100,7\n0.5,300,9\n2.0,200,11\n",
    "splitwise": "arrived_at,num_prefill_tokens,num_decode_tokens\n10.0,100,7\n10.5,300,9\n12.0,200,11\n",
    "azure": ("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.0000000,100,7\n"
              "2023-11-16 18:15:46.5000000,300,9\n2023-11-16 18:15:48.0000000,200,11\n"),
    "azure2024": ("TIMESTAMP,ContextTokens,GeneratedTokens\n2024-05-10 00:00:00.000000+00:00,100,7\n"
                  "2024-05-10 00:00:00.500000+00:00,300,9\n2024-05-10 00:00:02.000000+00:00,200,11\n"),
    "burstgpt": ("Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
                 "5,ChatGPT,100,7,107,Conversation log\n5.5,ChatGPT,300,9,309,Conversation log\n"
                 "6,GPT-4,50,0,50,Conversation log\n7,GPT-4,200,11,211,API log\n"),
    "mooncake": ('{"timestamp": 1000, "input_length": 100, "output_length": 7, "hash_ids": [0]}\n'
                 '{"timestamp": 1500, "input_length": 300, "output_length": 9, "hash_ids": [0]}\n'
                 '{"timestamp": 3000, "input_length": 200, "output_length": 11, "hash_ids": [0]}\n'),
}


@pytest.mark.parametrize("name", list(FORMATS))
def test_every_trace_format_is_detected_and_read_alike(tmp_path, name):
    path = tmp_path / ("t.jsonl" if name == "mooncake" else "t.csv")
    path.write_text(FORMATS[name])
    wl = generate(WorkloadConfig(arrival="trace", path=str(path), num_requests=None))
    assert wl.arrival_s.tolist() == pytest.approx([0.0, 0.5, 2.0])
    assert wl.prompt_tokens.tolist() == [100, 300, 200] and wl.output_tokens.tolist() == [7, 9, 11]
    assert (wl.prompt_segments is not None) == (name == "mooncake")


def test_mooncake_hash_ids_become_equal_token_prefixes_and_scale_by_block(tmp_path):
    path = tmp_path / "mooncake.jsonl"
    path.write_text('{"timestamp": 0, "input_length": 1200, "output_length": 10, "hash_ids": [7, 8, 9]}\n'
                    '{"timestamp": 500, "input_length": 1100, "output_length": 5, "hash_ids": [7, 8, 3]}\n'
                    '{"timestamp": 900, "input_length": 600, "output_length": 5, "hash_ids": [4, 8]}\n')
    full = make_requests(generate(WorkloadConfig(arrival="trace", path=str(path), num_requests=None)))
    a, b, c = (r.prompt_token_ids for r in full)
    assert len(a) == 1200 and a[:1024] == b[:1024] and a[1024:1100] != b[1024:1100]
    # the same id after another prefix: the same tokens, but not the same cached block
    assert a[:512] != c[:512] and a[512:600] == c[512:600]
    assert full[0].block_hashes(16)[32] != full[2].block_hashes(16)[32]
    scaled = generate(WorkloadConfig(arrival="trace", path=str(path), num_requests=None, length_scale=1 / 32))
    assert scaled.prompt_tokens.tolist() == [38, 34, 19]  # 16 tokens per 512-token block, 176 → 6, 76 → 2
    sa, sb, _ = (r.prompt_token_ids for r in make_requests(scaled, vocab_size=512))
    assert sa[:32] == sb[:32] and sa[32:] != sb[32:] and max(sa) < 512


def test_generated_conversations_resend_their_history():
    wl = generate(WorkloadConfig(arrival="burst", num_requests=9, content="multi_turn", turns=3, turn_gap_s=1.0,
                                 prefix_tokens=16, prompt=LengthDist(kind="fixed", value=10),
                                 output=LengthDist(kind="fixed", value=4)))
    assert sorted(wl.prompt_tokens.tolist()) == [26] * 3 + [40] * 3 + [54] * 3  # +4 answer +10 message a turn
    reqs = make_requests(wl)
    by_len = {}
    for r in reqs:
        by_len.setdefault(len(r.prompt_token_ids), []).append(list(r.prompt_token_ids))
    for second in by_len[40]:  # each second turn starts with one first turn's whole prompt
        assert any(second[:26] == first for first in by_len[26])
    assert all(p[:16] == by_len[26][0][:16] for ps in by_len.values() for p in ps)  # one system prompt
    assert (np.diff(wl.arrival_s) >= 0).all()


def test_shared_system_prompts():
    wl = generate(WorkloadConfig(num_requests=6, content="shared_prefix", prefix_tokens=32, num_prefixes=2))
    reqs = make_requests(wl)
    assert wl.prompt_tokens.tolist() == [44] * 6
    assert reqs[0].prompt_token_ids[:32] == reqs[2].prompt_token_ids[:32] != reqs[1].prompt_token_ids[:32]
    assert reqs[0].prompt_token_ids[32:] != reqs[2].prompt_token_ids[32:]


def test_placeholder_prompts_share_nothing():
    reqs = make_requests(generate(WorkloadConfig(num_requests=3)))
    assert len({r.block_hashes(4)[0] for r in reqs}) == 3


def test_placeholder_requests_are_the_workload_row_by_row():
    wl = generate(WorkloadConfig(num_requests=50, arrival="poisson", rate=3.0, seed=4))
    reqs = list(iter_requests(wl, prefix="p"))
    assert [r.request_id for r in reqs] == [f"p-{i}" for i in range(50)]
    assert [r.arrival_s for r in reqs] == wl.arrival_s.tolist()
    assert [r.max_tokens for r in reqs] == wl.output_tokens.tolist()
    assert [r.num_prompt_tokens for r in reqs] == wl.prompt_tokens.tolist()
    assert all(r.prompt_token_ids == range(i * PLACEHOLDER_STRIDE, i * PLACEHOLDER_STRIDE + r.num_prompt_tokens)
               for i, r in enumerate(reqs))
    with_ids = list(iter_requests(wl, vocab_size=100, seed=1, prefix="p"))  # values drawn, same rows
    assert [(r.request_id, r.arrival_s, r.num_prompt_tokens) for r in with_ids] == \
        [(r.request_id, r.arrival_s, r.num_prompt_tokens) for r in reqs]
    assert all(isinstance(r.prompt_token_ids, list) and max(r.prompt_token_ids) < 100 for r in with_ids)


@pytest.mark.parametrize("bad", [{"sigma": -1.0}, {"sigma": float("nan")}])
def test_a_lognormal_sigma_must_be_a_finite_non_negative_number(bad):
    with pytest.raises(ValueError, match="sigma"):
        LengthDist(kind="lognormal", value=32, **bad)


@pytest.mark.parametrize("arrival", ["poisson", "gamma"])
def test_open_loop_arrivals_end_at_n_over_rate_as_vllms_bench_sends_them(arrival):
    """vLLM's get_request draws a gap before every request, the first too, and scales their sum so
    the last request is sent at n / rate: a short run offers the rate asked for, whatever the
    seed (unscaled, 16 requests at 4/s ended at 3.67 s on average, 2.96-7.12 req/s across seeds)."""
    for seed in range(5):
        wl = generate(WorkloadConfig(arrival=arrival, num_requests=16, rate=4.0, burstiness=0.25, seed=seed))
        assert wl.arrival_s[-1] == pytest.approx(4.0) and wl.arrival_s[0] > 0
        assert (np.diff(wl.arrival_s) >= 0).all()
    # a tiny shape's draws can underflow to exactly 0: then the requests arrive at once, not at NaN
    tiny = [generate(WorkloadConfig(arrival="gamma", num_requests=1, rate=2.0, burstiness=1e-3, seed=s)).arrival_s
            for s in range(20)]
    assert all(np.isfinite(a).all() for a in tiny) and any(a[0] == 0 for a in tiny)


def test_timestamps_python_3_10_refuses_are_made_readable():
    """3.10's fromisoformat takes 3 or 6 fraction digits and no 'Z' (3.11 takes any): Azure
    exports have 7, re-exported ones 1-5, some a 'Z'."""
    from engine.observe.traces import _date_s, _iso_310

    assert _iso_310("2023-11-16 18:15:46.68059") == "2023-11-16 18:15:46.680590"
    assert _iso_310("2023-11-16 18:15:46.6805912") == "2023-11-16 18:15:46.680591"
    assert _iso_310("2024-05-10T00:00:00Z") == "2024-05-10T00:00:00+00:00"
    assert _iso_310("2024-05-10 00:00:00.5+00:00") == "2024-05-10 00:00:00.500000+00:00"
    assert _date_s("2024-05-10T00:00:01.25Z") - _date_s("2024-05-10 00:00:00+00:00") == pytest.approx(1.25)


@pytest.mark.parametrize("name", ["miniserve", "azure", "mooncake"])
def test_a_byte_order_mark_is_not_part_of_the_header(tmp_path, name):
    path = tmp_path / ("t.jsonl" if name == "mooncake" else "t.csv")
    path.write_text("\ufeff" + FORMATS[name], encoding="utf-8")  # as Excel exports UTF-8
    wl = generate(WorkloadConfig(arrival="trace", path=str(path), num_requests=None))
    assert wl.prompt_tokens.tolist() == [100, 300, 200]
