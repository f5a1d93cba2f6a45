"""The policies on their own: the seed's call counts, shapes, and conservation under preemption."""

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.core.config import SchedulerConfig
from engine.core.request import Request, RequestStatus
from engine.core.scheduler import ContinuousScheduler, PlanBuilder, make_scheduler
from engine.core.state import ServingState
from tests.helpers import create_requests, drain


def seed_config(name: str, **kw) -> SchedulerConfig:
    return SchedulerConfig(name=name, max_num_seqs=8, **kw)


def test_serial_makes_one_call_per_token():
    plans, state = drain(seed_config("serial"), create_requests(16))
    assert sum(r.num_output_tokens for r in state.finished) == 160
    assert len(plans) == 160
    assert Counter(p.phase for p in plans) == {"prefill": 16, "decode": 144}
    assert {p.label for p in plans} == {"miniserve.serial.prefill batch=1", "miniserve.serial.decode batch=1"}


def test_static_batch_shrinks_without_refill():
    plans, state = drain(seed_config("static"), create_requests(16))
    assert sum(r.num_output_tokens for r in state.finished) == 160
    assert len(plans) == 32
    group = [p.num_requests for p in plans[:16]]
    assert plans[0].label == "miniserve.static.prefill batch=8"
    assert group[1:] == [8] * 3 + [6] * 4 + [4] * 4 + [2] * 4
    assert [p.num_requests for p in plans[16:]] == group
    assert plans[5].label == "miniserve.static.decode batch=6"


def test_static_admits_nothing_while_a_group_runs():
    config = seed_config("static")
    state = ServingState(config)
    scheduler = make_scheduler(config)
    for r in create_requests(16):
        state.add(r)
    t = 0.0
    while state.running or not t:
        plan = scheduler.schedule(state)
        assert len(state.waiting) == 8  # the second group waits for the whole first group
        t += 1
        state.apply(plan, None, t, t)


def test_continuous_refills_and_keeps_the_batch_full():
    plans, state = drain(seed_config("continuous"), create_requests(16))
    assert sum(r.num_output_tokens for r in state.finished) == 160
    # Replay to see the queue: while requests wait, every step has 8 active.
    config = seed_config("continuous")
    st_ = ServingState(config)
    sched = make_scheduler(config)
    for r in create_requests(16):
        st_.add(r)
    steps = 0
    while st_.has_unfinished:
        plan = sched.schedule(st_)
        if st_.waiting:
            assert plan.num_requests == 8
        steps += 1
        st_.apply(plan, None, steps, steps)
    # Call count the plan sequence implies. Steps from 1; a request admitted at step s with n output
    # tokens ends at step s + n - 1 (its prefill samples the first), and its seat refills the step
    # after. Outputs cycle 4, 16, 8, 12: r0, r4 end at 4 (r8, r9 in at 5); r2, r6 and r8 at 8 (r10-r12
    # in at 9); r3, r7 and r12 at 12 (r13-r15 in at 13); the last, r13 (16 tokens), ends at 12 + 16.
    assert steps == len(plans) == 12 + 16
    assert plans[0].label == "miniserve.continuous.step active=8 decode=0 prefill=8 tokens=96"
    assert plans[4].label == "miniserve.continuous.step active=8 decode=6 prefill=2 tokens=30"
    mixed = [p for p in plans if p.phase == "mixed"]
    assert mixed and all(p.num_decodes > 0 and p.num_prefills > 0 for p in mixed)


def test_continuous_chunks_long_prompts_within_budget():
    config = SchedulerConfig(name="continuous", max_num_seqs=4, max_num_batched_tokens=32,
                             long_prefill_token_threshold=10)
    plans, state = drain(config, create_requests(3, prompt_len=25, outputs=(3,)))
    first = plans[0]
    assert first.num_tokens == (10, 10, 10) and first.samples == (False, False, False)
    assert all(p.total_tokens <= 32 for p in plans)
    assert all(n <= 10 for p in plans for n in p.num_tokens)
    assert sum(r.num_output_tokens for r in state.finished) == 9


def test_continuous_decodes_come_first_and_partial_prefills_before_new_ones():
    config = SchedulerConfig(name="continuous", max_num_seqs=4, max_num_batched_tokens=12,
                             long_prefill_token_threshold=8)
    plans, _ = drain(config, create_requests(3, prompt_len=10, outputs=(5,)))
    # step 0: r0 gets 8, r1 gets 4; step 1: r0 finishes its prompt (2) before r1 (8) and r2 (2)
    assert plans[0].request_ids == ("r0", "r1") and plans[0].num_tokens == (8, 4)
    assert plans[1].request_ids == ("r0", "r1", "r2") and plans[1].num_tokens == (2, 6, 4)
    for p in plans:
        assert all(n == 1 for n in p.num_tokens[:p.num_decodes])


def test_kv_exhaustion_preempts_the_newest_and_recomputes():
    # 6 blocks of 4 tokens: two requests of 8 + 8 output tokens cannot both stay resident.
    config = SchedulerConfig(name="continuous", max_num_seqs=4, num_kv_blocks=6, block_size=4,
                             max_num_batched_tokens=64, long_prefill_token_threshold=64)
    state = ServingState(config)
    scheduler = make_scheduler(config)
    for r in create_requests(3, prompt_len=8, outputs=(8,)):
        state.add(r)
    preempted, t = [], 0.0
    while state.has_unfinished:
        running_before = [r.request_id for r in state.running]
        plan = scheduler.schedule(state)
        for victim in plan.preempted_ids:  # always the newest of those still running
            assert victim == running_before.pop()
        preempted += plan.preempted_ids
        t += 1
        state.apply(plan, None, t, t)
        state.check_invariants()
    assert preempted, "the pool is too small for everyone: someone must be preempted"
    assert all(r.status == RequestStatus.FINISHED_LENGTH and r.num_output_tokens == 8 for r in state.finished)
    assert sum(r.num_preemptions for r in state.finished) == len(preempted)
    assert state.kv.num_free == 6


def test_a_step_that_preempts_admits_nothing():
    """As vLLM: the blocks a preemption frees go to the running requests that were short of them,
    not to a request admitted in the same step (the victim itself, back at the head of the queue,
    would take them at once). Chunks of 8 leave room to admit: without the rule it would."""
    config = SchedulerConfig(name="continuous", max_num_seqs=4, num_kv_blocks=8, block_size=4,
                             max_num_batched_tokens=64, long_prefill_token_threshold=8)
    state, scheduler = ServingState(config), make_scheduler(config)
    for r in create_requests(4, prompt_len=8, outputs=(16,)):
        state.add(r)
    preempting, t = 0, 0.0
    while state.has_unfinished:
        running_before = {r.request_id for r in state.running}
        plan = scheduler.schedule(state)
        if plan.preempted_ids:
            preempting += 1
            assert set(plan.request_ids) <= running_before - set(plan.preempted_ids), plan.label
        t += 1
        state.apply(plan, None, t, t)
        state.check_invariants()
    assert preempting, "the pool is too small for everyone: someone must be preempted"
    assert sorted(r.num_output_tokens for r in state.finished) == [16] * 4


def test_a_preempted_chunk_gives_its_tokens_back_to_the_step():
    """PlanBuilder's rule for any policy (the continuous one plans chunks oldest first, so its
    victims have no chunk planned yet): preempting a request whose chunk is already in the step
    takes the chunk out and gives its tokens back to the budget, which the step then spends on the
    work still there, within max_num_batched_tokens."""
    config = SchedulerConfig(name="continuous", max_num_seqs=4, num_kv_blocks=4, block_size=4,
                             max_num_batched_tokens=16, long_prefill_token_threshold=16)
    state = ServingState(config)
    old, mid, new = (Request(rid, list(range(2, 2 + n)), 4) for rid, n in (("old", 12), ("mid", 8), ("new", 8)))
    for r in (old, mid, new):  # running in this order: "new" is the newest
        state.add(r)
        state.admit(r)
    step = PlanBuilder(state, config.max_num_batched_tokens)
    assert step.reserve(new, 8)
    step.add_prefill(new, 8)  # 2 of the 4 blocks, 8 of the 16 tokens
    assert step.reserve(old, 12)  # 3 blocks, 2 free: the newest goes, its planned chunk with it
    assert step.preempted == ["new"] and step.budget == config.max_num_batched_tokens
    step.add_prefill(old, 12)
    assert step.budget == 4 and step.reserve(mid, 4)  # what is left only because "new"'s 8 came back
    step.add_prefill(mid, 4)
    plan = step.build("continuous")
    assert (plan.request_ids, plan.num_tokens, plan.preempted_ids) == (("old", "mid"), (12, 4), ("new",))
    assert plan.total_tokens == config.max_num_batched_tokens
    state.apply(plan, None, 0.0, 1.0)
    state.check_invariants()
    assert state.waiting[0] is new and new.num_computed_tokens == 0 and "new" not in state.kv.held
    assert (old.num_output_tokens, mid.num_computed_tokens) == (1, 4)


def test_scheduler_never_runs_a_request_past_its_blocks():
    config = SchedulerConfig(name="static", max_num_seqs=8, num_kv_blocks=10, block_size=4)
    plans, state = drain(config, create_requests(4, prompt_len=8, outputs=(8,)))
    # each request reserves 4 blocks up front: only two fit at a time
    assert max(p.num_requests for p in plans) == 2
    assert len(state.finished) == 4


@pytest.mark.parametrize("name", ["serial", "static", "continuous"])
def test_nothing_to_do_returns_none(name):
    config = SchedulerConfig(name=name)
    assert make_scheduler(config).schedule(ServingState(config)) is None


# random configs (tight budgets, chunks and KV pools that preempt) and request lengths; a budget
# is at least the cap (SchedulerConfig refuses less)
CONFIGS = st.builds(
    lambda name, max_num_seqs, budget, chunk, num_blocks, block_size: SchedulerConfig(
        name=name, max_num_seqs=max_num_seqs, max_num_batched_tokens=max(budget, max_num_seqs),
        long_prefill_token_threshold=chunk,
        num_kv_blocks=max(num_blocks, -(-60 // block_size)), block_size=block_size),  # 60 tokens fit alone
    name=st.sampled_from(["serial", "static", "continuous"]), max_num_seqs=st.integers(1, 8),
    budget=st.integers(1, 64), chunk=st.integers(1, 32), num_blocks=st.integers(15, 40),
    block_size=st.sampled_from([1, 2, 4, 16]))
LENGTHS = st.lists(st.tuples(st.integers(1, 40), st.integers(1, 20)), min_size=1, max_size=25)


@settings(max_examples=60, deadline=None)
@given(config=CONFIGS, lengths=LENGTHS)
def test_every_token_is_produced_once_and_no_request_is_lost(config, lengths):
    requests = [Request(f"q{i}", list(range(p)), o) for i, (p, o) in enumerate(lengths)]
    plans, state = drain(config, requests)
    assert sorted(r.request_id for r in state.finished) == sorted(r.request_id for r in requests)
    for r in state.finished:
        assert r.num_output_tokens == r.max_tokens
        assert len(r.token_times_s) == r.max_tokens
    assert sum(p.num_samples for p in plans) == sum(o for _, o in lengths)  # one token per sampling entry
    computed = sum(p.total_tokens for p in plans)
    recomputed = sum(r.num_preemptions for r in state.finished)
    assert computed >= sum(p + o - 1 for p, o in lengths)
    if recomputed == 0:
        assert computed == sum(p + o - 1 for p, o in lengths)
    assert state.kv.num_free == config.num_kv_blocks and not state.kv.held


@settings(max_examples=80, deadline=None)
@given(config=CONFIGS, lengths=LENGTHS)
def test_the_decode_lane_changes_no_plan_and_no_token_time(config, lengths):
    """The lane is only a faster way to run the same policy: flushing it before every step (so
    every decode is reserved, planned and advanced request by request) gives the same run."""
    runs = []
    for flush in (False, True):
        requests = [Request(f"q{i}", list(range(p)), o) for i, (p, o) in enumerate(lengths)]
        plans, state = drain(config, requests, flush_lane=flush)
        runs.append((plans, {r.request_id: (r.token_times_s, r.num_preemptions, r.first_scheduled_s)
                             for r in state.finished}))
    assert runs[0] == runs[1]


@pytest.mark.parametrize("flush_lane", [False, True])
def test_eos_stops_a_decoding_request_with_its_token_and_length_wins_a_tie(flush_lane):
    config = SchedulerConfig(name="continuous", max_num_seqs=4)
    state, scheduler = ServingState(config), make_scheduler(config)
    script = {"e0": [1, 2, 7], "e1": [1, 2, 3, 4, 7], "e2": [1, 2, 3, 4, 5]}  # 7 is EOS; max_tokens 5
    for rid in script:
        state.add(Request(rid, [1, 2, 3], 5, ignore_eos=False, eos_token_id=7))
    t = 0.0
    while state.has_unfinished:
        if flush_lane:
            state.decode_one_by_one()
        plan = scheduler.schedule(state)
        tokens = [script[rid][state.requests[rid].num_output_tokens]
                  for rid, sampled in zip(plan.request_ids, plan.samples) if sampled]
        state.apply(plan, tokens, t, t + 1.0)
        state.check_invariants()
        t += 1.0
    done = {r.request_id: r for r in state.finished}
    assert done["e0"].status == RequestStatus.FINISHED_STOPPED and done["e0"].output_token_ids == [1, 2, 7]
    assert done["e0"].token_times_s == [1.0, 2.0, 3.0]
    assert done["e1"].status == RequestStatus.FINISHED_LENGTH and done["e1"].output_token_ids == [1, 2, 3, 4, 7]
    assert done["e2"].status == RequestStatus.FINISHED_LENGTH and done["e2"].num_output_tokens == 5
    assert state.kv.num_free == config.num_kv_blocks


def test_bad_requests_get_clear_errors_and_queue_is_untouched():
    config = SchedulerConfig(name="continuous", max_model_len=64, num_kv_blocks=8, block_size=4)
    state = ServingState(config)
    ok = create_requests(2)
    for r in ok:
        state.add(r)
    with pytest.raises(ValueError, match="max_tokens must be a positive integer"):
        Request("bad", [1, 2], 0)
    with pytest.raises(ValueError, match="max_tokens must be a positive integer"):
        Request("bad", [1, 2], -3)
    with pytest.raises(ValueError, match="prompt must hold at least one token"):
        Request("bad", [], 4)
    with pytest.raises(ValueError, match="exceeds max_model_len"):
        state.add(Request("long", list(range(60)), 10))
    with pytest.raises(ValueError, match="KV blocks"):
        state.add(Request("big", list(range(30)), 10))
    with pytest.raises(ValueError, match="already in flight"):
        state.add(Request("r0", [1], 1))
    assert [r.request_id for r in state.waiting] == ["r0", "r1"]


def test_abort_frees_blocks_and_forgets_the_request():
    config = SchedulerConfig(name="continuous", max_num_seqs=4)
    state = ServingState(config)
    scheduler = ContinuousScheduler(config)
    for r in create_requests(3):
        state.add(r)
    plan = scheduler.schedule(state)
    state.apply(plan, None, 0.0, 1.0)
    aborted = state.abort("r1", 1.5)  # a decoding request: it leaves the lane
    assert aborted is not None and aborted.status == RequestStatus.FINISHED_ABORTED
    assert "r1" not in state.kv.held and "r1" not in state.requests
    state.check_invariants()
    plan = scheduler.schedule(state)  # the lane's step (r0, r2) ...
    assert plan.request_ids == ("r0", "r2") and plan.num_decodes == 2
    state.abort("r0", 2.0)  # ... and r0's client goes away while the call runs
    state.apply(plan, None, 2.0, 3.0)
    state.check_invariants()
    t = 3.0
    while state.has_unfinished:
        state.apply(scheduler.schedule(state), None, t, t + 1.0)
        t += 1.0
    by_id = {r.request_id: r for r in state.finished}
    assert by_id["r2"].num_output_tokens == by_id["r2"].max_tokens == len(by_id["r2"].token_times_s)
    assert by_id["r2"].token_times_s[:2] == [1.0, 3.0]
    assert by_id["r0"].num_output_tokens == 1 and state.kv.num_free == config.num_kv_blocks


@pytest.mark.parametrize("name", ["continuous", "static", "serial"])
def test_an_abort_mid_call_and_one_in_the_queue_free_everything_under_every_policy(name):
    """Between a plan and its apply (the client leaves while the call runs) the last request the
    plan runs is aborted, and with it the last one waiting: the step applies without it, neither
    is scheduled again, the others finish whole and every KV block is free at the end."""
    config = SchedulerConfig(name=name, max_num_seqs=4)
    state, scheduler = ServingState(config), make_scheduler(config)
    for r in create_requests(6):
        state.add(r)
    aborted, t = [], 0.0
    while state.has_unfinished:
        plan = scheduler.schedule(state)
        ids = plan.request_ids
        assert not set(ids) & set(aborted)
        if t == 1.0:  # the second step: every policy has a request in the call and one waiting
            aborted = [ids[-1], state.waiting[-1].request_id]
            for rid in aborted:
                assert state.abort(rid, t + 0.5).status == RequestStatus.FINISHED_ABORTED
        state.apply(plan, None, t, t + 1.0)
        state.check_invariants()
        assert not set(aborted) & (set(state.kv.held) | set(state.requests))
        t += 1.0
    assert len(aborted) == 2 and state.kv.num_free == config.num_kv_blocks and not state.kv.held
    done = {r.request_id: r for r in state.finished}
    assert len(done) == 6 and {rid for rid, r in done.items() if r.status == RequestStatus.FINISHED_ABORTED} \
        == set(aborted)
    assert all(r.num_output_tokens == r.max_tokens for rid, r in done.items() if rid not in aborted)
