"""The seed's trace analysis, computed from a file: a recorded profiler trace and a hand-made one."""

import json

import pytest
import torch

from engine.core.config import ModelConfig, SchedulerConfig
from engine.llm_engine import Engine
from engine.observe.trace import parse_label, read_calls, summarize_trace, write_chrome_trace
from tests.helpers import create_requests


def test_labels_parse_into_shapes():
    c = parse_label("miniserve.continuous.step active=8 decode=5 prefill=3 tokens=44")
    assert (c.active, c.decodes, c.prefills, c.tokens, c.phase) == (8, 5, 3, 44, "mixed")
    s = parse_label("miniserve.static.decode batch=6")
    assert (s.active, s.decodes, s.prefills, s.phase) == (6, 6, 0, "decode")
    assert parse_label("miniserve.serial.prefill batch=1").phase == "prefill"
    assert parse_label("aten::mm") is None
    assert parse_label("miniserve.static.decode batch=") is None


def test_every_plan_label_parses_back_to_its_own_numbers_whatever_the_scheduler_is_called():
    from engine.core.plan import BatchPlan
    for name in ("continuous", "serial", "static", "my_policy"):
        plan = BatchPlan.of(name, ("a", "b", "c"), (1, 1, 7), (4, 9, 0), (True, True, True), 2)
        if name in ("serial", "static"):  # their calls are never mixed
            plan = BatchPlan.of(name, ("a", "b"), (1, 1), (4, 9), (True, True), 2)
        call = parse_label(plan.label)
        assert (call.active, call.decodes, call.prefills) == (plan.num_requests, plan.num_decodes, plan.num_prefills)


def test_hand_made_trace_gives_the_seed_arithmetic(tmp_path):
    # busy 3 s at active 8 and 1 s at active 2; gaps of 0.5 s and 0.25 s
    calls = [("miniserve.static.prefill batch=8", 0.0, 1.0), ("miniserve.static.decode batch=8", 1.5, 2.0),
             ("miniserve.static.decode batch=2", 3.75, 1.0)]
    write_chrome_trace(calls, tmp_path / "t.json")
    s = summarize_trace(tmp_path / "t.json", max_num_seqs=8)
    assert s.model_calls == 3 and s.prefill_calls == 1 and s.decode_calls == 2
    assert s.busy_s == pytest.approx(4.0)
    assert s.occupancy_at_max == pytest.approx(0.75)
    assert s.gap_s == pytest.approx(0.75) and s.max_gap_s == pytest.approx(0.5)
    assert s.span_s == pytest.approx(4.75)
    assert s.active_histogram == {8: 2, 2: 1}


def test_recorded_profiler_trace_matches_the_engine_steps(tmp_path):
    engine = Engine(SchedulerConfig(name="static", max_num_seqs=8), ModelConfig(name="tiny"))
    engine.warmup()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        result = engine.run(create_requests(16))
    prof.export_chrome_trace(str(tmp_path / "trace.json"))
    calls = read_calls(tmp_path / "trace.json")
    assert [c.label for c in calls] == [s.plan.label for s in result.steps]
    s = summarize_trace(tmp_path / "trace.json", max_num_seqs=8)
    assert s.model_calls == 32 and s.prefill_calls == 2 and s.decode_calls == 30
    assert s.active_histogram == {8: 8, 6: 8, 4: 8, 2: 8}
    for call, step in zip(calls, result.steps):
        assert call.dur_s == pytest.approx(step.model_s, rel=0.5, abs=2e-3)
    raw = json.loads((tmp_path / "trace.json").read_text())
    assert any(e.get("cat") == "user_annotation" for e in raw["traceEvents"])
