"""The real engine loop on the tiny model: the seed's counts, conservation, bad input."""

import pytest

from engine.core.config import ModelConfig, SchedulerConfig
from engine.llm_engine import Engine
from engine.core.request import Request
from tests.helpers import create_requests, drain


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine(SchedulerConfig(name="continuous", max_num_seqs=8), ModelConfig(name="tiny"))


@pytest.mark.parametrize("name,calls", [("serial", 160), ("static", 32), ("continuous", 28)])
def test_seed_burst_tokens_and_calls(engine, name, calls):
    config = SchedulerConfig(name=name, max_num_seqs=8)
    engine.reset(config)
    result = engine.run(create_requests(16))
    assert sum(r.output_tokens for r in result.records) == 160
    assert len(result.steps) == calls
    expected_plans, _ = drain(config, create_requests(16))  # the pure policy, no model
    assert [s.plan for s in result.steps] == expected_plans
    m = result.metrics()
    assert m["completed"] == 16 and m["total_output_tokens"] == 160
    assert m["output_throughput_tok_s"] == pytest.approx(160 / result.duration_s)
    assert engine.runner.num_slots_used == 0  # the last step's requests are freed when the run ends
    for r in result.records:
        assert list(r.token_times_s) == sorted(r.token_times_s)
        assert r.arrival_s <= r.first_scheduled_s <= r.token_times_s[0]


def test_step_records_are_ordered_and_contain_the_model_call(engine):
    engine.reset(SchedulerConfig(name="continuous", max_num_seqs=4))
    result = engine.run(create_requests(6))
    for prev, step in zip(result.steps, result.steps[1:]):
        assert prev.end_s <= step.start_s
    for step in result.steps:
        assert 0 < step.model_s <= step.end_s - step.start_s


def test_arrivals_are_replayed_on_the_clock(engine):
    engine.reset(SchedulerConfig(name="continuous", max_num_seqs=4))
    early = create_requests(2, prefix="early")
    late = [Request("late", [5, 6, 7], 2, arrival_s=0.3)]
    result = engine.run(early + late)
    by_id = {r.request_id: r for r in result.records}
    assert by_id["late"].first_scheduled_s >= 0.3
    assert by_id["late"].token_times_s[0] >= 0.3
    assert len(result.records) == 3


def test_greedy_outputs_do_not_depend_on_the_scheduler(engine):
    outputs = {}
    for name in ("serial", "static", "continuous"):
        engine.reset(SchedulerConfig(name=name, max_num_seqs=4, max_num_batched_tokens=16,
                                     long_prefill_token_threshold=5))
        engine.run(create_requests(6, prompt_len=9))
        outputs[name] = {r.request_id: r.output_token_ids for r in engine.core.state.finished}
    assert outputs["serial"] == outputs["static"] == outputs["continuous"]


def test_preemption_under_kv_pressure_keeps_outputs_exact(engine):
    reference = Engine(SchedulerConfig(name="serial"), ModelConfig(name="tiny"), runner=engine.runner)
    reference.run(create_requests(5, prompt_len=8, outputs=(12,)))
    expected = {r.request_id: r.output_token_ids for r in reference.state.finished}
    engine.reset(SchedulerConfig(name="continuous", max_num_seqs=4, num_kv_blocks=10, block_size=4))
    result = engine.run(create_requests(5, prompt_len=8, outputs=(12,)))
    assert sum(r.num_preemptions for r in result.records) > 0
    assert {r.request_id: r.output_token_ids for r in engine.core.state.finished} == expected


def test_a_request_past_the_models_positions_is_refused_though_the_config_allows_it(caplog):
    """scheduler.max_model_len above max_position_embeddings: the KV slots stop at the model's
    positions, so such a request failed mid-run in the kernel, taking the run's others with it."""
    with caplog.at_level("WARNING", logger="miniserve.engine"):
        engine = Engine(SchedulerConfig(name="continuous", max_num_seqs=2, max_model_len=8192), ModelConfig(name="tiny"))
    positions = engine.runner.max_model_len
    assert "scheduler.max_model_len=8192 is longer than this runner's KV slots" in caplog.text
    assert positions < 8192
    assert engine.scheduler_config.max_model_len == positions
    with pytest.raises(ValueError, match=f"exceeds max_model_len \\({positions}\\)"):
        engine.run(create_requests(1) + [Request("long", [1] * 8, positions)])
    assert len(engine.run(create_requests(1)).records) == 1


def test_bad_requests_fail_before_anything_runs(engine):
    engine.reset(SchedulerConfig(name="continuous", max_model_len=64))
    good = create_requests(2)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.run(good + [Request("oov", [1, 99999], 2)])
    with pytest.raises(ValueError, match="exceeds max_model_len"):
        engine.run(good + [Request("long", list(range(60)), 8)])
    with pytest.raises(ValueError, match="unique"):
        engine.run(good + create_requests(1))
    assert not engine.core.state.has_unfinished
    result = engine.run(good)  # nothing was half-accepted: the same requests still run
    assert len(result.records) == 2
