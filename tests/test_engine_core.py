"""The one step loop on its own (no model, no SimPy): what it frees, what it repeats, what it refuses."""

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.core.config import SchedulerConfig
from engine.core.engine_core import EngineCore
from engine.core.plan import BatchPlan, StepResult
from engine.core.request import Request, RequestStatus
from tests.helpers import create_requests
from tests.test_scheduler import CONFIGS, LENGTHS


class FakeExecutor:
    """Calls whose duration depends on the plan's shape (so a different plan moves every later
    time); remembers what it was asked to free."""

    def __init__(self) -> None:
        self.freed: list[str] = []
        self.plans: list[BatchPlan] = []

    def execute(self, plan, requests, start_s):
        assert all(rid not in self.freed or rid in requests for rid in plan.request_ids)
        self.plans.append(plan.materialize())
        end = start_s + 0.01 + 0.001 * plan.total_tokens + 1e-5 * plan.decode_context_sum
        return StepResult(None, end - start_s, end, end + 0.002)

    def free(self, request_ids):
        self.freed += request_ids


def run(config, requests, repeat: bool, abort: str | None = None):
    core = EngineCore(config, repeat_decode_steps=repeat)
    executor = FakeExecutor()
    for r in requests:
        core.add(r)
    now, steps = 0.0, 0
    while core.has_unfinished:
        launched = core.launch(now, executor)
        if launched is None:
            now = core.arrivals.next_arrival_s
            assert now is not None, "work is waiting but nothing was scheduled"
            continue
        plan, result = launched
        core.land(plan, result, now)
        core.state.check_invariants()
        now = result.ready_s
        steps += 1
        if abort is not None and steps == 3:
            core.abort(abort, now)
        assert steps < 100_000
    core.launch(now, executor)  # hands over what the last step released
    return core, executor


@settings(max_examples=60, deadline=None)
@given(config=CONFIGS, lengths=LENGTHS, gaps=st.lists(st.floats(0.0, 0.2), min_size=25, max_size=25))
def test_repeating_decode_steps_changes_no_plan_and_no_token_time(config, lengths, gaps):
    """The step loop repeats a decodes-only step without asking the scheduler while nothing
    changed; asking it every step gives the same run, to the last token time."""
    runs = []
    for repeat in (True, False):
        t, requests = 0.0, []
        for i, (p, o) in enumerate(lengths):
            t += gaps[i]
            requests.append(Request(f"q{i}", list(range(p)), o, arrival_s=t))
        core, executor = run(config, requests, repeat)
        runs.append((executor.plans, {r.request_id: (r.token_times_s, r.num_preemptions) for r in core.state.finished}))
    assert runs[0] == runs[1]


@settings(max_examples=40, deadline=None)
@given(config=CONFIGS, lengths=LENGTHS)
def test_every_request_is_freed_exactly_once_after_its_last_call(config, lengths):
    requests = [Request(f"q{i}", list(range(p)), o) for i, (p, o) in enumerate(lengths)]
    core, executor = run(config, requests, repeat=True)
    preemptions = sum(len(p.preempted_ids) for p in executor.plans)
    counts = Counter(executor.freed)
    assert set(counts) == {r.request_id for r in requests}
    assert sum(counts.values()) == len(requests) + preemptions
    for rid, n in counts.items():  # freed once per preemption, and once at the end
        assert n == 1 + sum(p.preempted_ids.count(rid) for p in executor.plans)


@pytest.mark.parametrize("name", ["continuous", "static", "serial"])
@pytest.mark.parametrize("victim", ["r0", "r3"])
def test_an_abort_is_freed_by_the_next_launch_and_never_scheduled_again(name, victim):
    """Under every policy, after the third step: r0 (4 tokens) still runs under each; r3 runs
    under continuous and static (one group of 4) and waits under serial. run() checks the
    invariants after every step."""
    config = SchedulerConfig(name=name, max_num_seqs=4)
    core, executor = run(config, create_requests(4), repeat=True, abort=victim)
    plans_after = executor.plans[3:]
    assert executor.freed.count(victim) == 1 and all(victim not in p.request_ids for p in plans_after)
    assert executor.freed.index(victim) < len(executor.freed) - 3  # freed at once, not with the last finishes
    done = {r.request_id: r for r in core.state.finished}
    assert set(done) == {"r0", "r1", "r2", "r3"} and done[victim].status == RequestStatus.FINISHED_ABORTED
    assert done[victim].num_output_tokens == (0 if (name, victim) == ("serial", "r3") else 3)  # one per step
    assert all(r.num_output_tokens == r.max_tokens for rid, r in done.items() if rid != victim)
    assert core.state.kv.num_free == config.num_kv_blocks and not core.state.kv.held


def test_a_plans_counted_decodes_are_listed_only_while_its_step_is_in_flight():
    config = SchedulerConfig(name="continuous", max_num_seqs=4)
    core = EngineCore(config)
    for r in create_requests(3):
        core.add(r)
    executor = FakeExecutor()
    plan, result = core.launch(0.0, executor)
    core.land(plan, result, 0.0)
    plan, result = core.launch(1.0, executor)  # the three decode together: counted, not listed
    assert plan.lane_size == 3 and plan.ids == () and plan.decode_context_sum == 3 * 12
    kept = executor.plans[-1]
    core.land(plan, result, 1.0)
    assert kept.request_ids == ("r0", "r1", "r2")  # materialised while in flight
    plan, result = core.launch(2.0, executor)
    unread = BatchPlan("continuous", lane_size=plan.lane_size, lane_context_sum=plan.lane_context_sum,
                       lane_ids=plan.lane_ids)
    core.land(plan, result, 2.0)
    with pytest.raises(RuntimeError, match="read after its step was applied"):
        unread.request_ids


def test_bad_and_duplicate_requests_are_refused_and_nothing_accepted_is_lost():
    core = EngineCore(SchedulerConfig(name="continuous", max_model_len=64))
    ok = create_requests(2, arrival_s=5.0)
    for r in ok:
        core.add(r)
    with pytest.raises(ValueError, match="already in flight"):
        core.add(Request("r0", [1, 2], 2))
    with pytest.raises(ValueError, match="exceeds max_model_len"):
        core.add(Request("long", list(range(60)), 10))
    assert [r.request_id for r in core.arrivals] == ["r0", "r1"] and core.has_unfinished


def test_a_request_already_served_is_refused_not_served_again_with_its_old_times():
    from sim import ConstantExecutor, simulate

    requests = create_requests(2)
    first = simulate(requests, SchedulerConfig(name="continuous"), lambda: ConstantExecutor(0.1))
    assert len(first.records) == 2
    # a Request carries its run's progress: a second run would have reported the first one's times
    with pytest.raises(ValueError, match="r0: already served or in progress .FINISHED_LENGTH"):
        simulate(requests, SchedulerConfig(name="continuous"), lambda: ConstantExecutor(0.2))
    core = EngineCore(SchedulerConfig(name="continuous"))
    core.add(fresh := create_requests(1, prefix="new")[0])
    with pytest.raises(ValueError, match="already served"):
        core.add(requests[1])
    assert [r.request_id for r in core.arrivals] == [fresh.request_id]  # what was accepted stays
