"""Small builders shared by the tests (vLLM's ``create_requests`` style)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from engine.core.config import SchedulerConfig
from engine.core.plan import BatchPlan
from engine.core.request import Request
from engine.core.scheduler import make_scheduler
from engine.core.state import ServingState

SEED_OUTPUTS = (4, 16, 8, 12)
REPO_ROOT = Path(__file__).resolve().parent.parent


@contextmanager
def on_threads(threads: int) -> Iterator[None]:
    """torch's threads (the kernels' parallel_for) set to ``threads`` for the block, then as they
    were. torch is imported here, not at the top: the scheduler tests use this module without it."""
    import torch

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        yield
    finally:
        torch.set_num_threads(before)


def create_requests(num: int, prompt_len: int = 12, outputs=SEED_OUTPUTS, arrival_s: float = 0.0,
                    prefix: str = "r") -> list[Request]:
    return [Request(f"{prefix}{i}", [(7 * i + j) % 500 + 2 for j in range(prompt_len)], outputs[i % len(outputs)],
                    arrival_s=arrival_s) for i in range(num)]


def drain(config: SchedulerConfig, requests: list[Request], check: bool = True,
          flush_lane: bool = False) -> tuple[list[BatchPlan], ServingState]:
    """Run the pure scheduler to completion with one (fake) step per plan; no model involved.
    ``flush_lane`` empties the decode lane before every step: every request is then scheduled
    and advanced on its own, the lane's O(1) path never runs."""
    state = ServingState(config)
    scheduler = make_scheduler(config)
    for r in requests:
        state.add(r)
    plans = []
    t = 0.0
    while state.has_unfinished:
        if flush_lane:
            state.decode_one_by_one()
        plan = scheduler.schedule(state)
        assert plan is not None, "work is waiting but nothing was scheduled"
        plan.materialize()  # kept past its step
        t += 1.0
        plan.check_unique()
        if config.name == "continuous":
            assert plan.total_tokens <= config.max_num_batched_tokens
        state.apply(plan, None, t - 1.0, t)
        if check:
            state.check_invariants()
        plans.append(plan)
        assert len(plans) < 100_000
    return plans, state


def write_pid_then_sleep(path: str, seconds: float) -> None:
    """A fresh-process job (tests/test_fresh_process.py): say who runs it, then run long."""
    import os
    import time  # here, not at the top: test_torch_free imports these helpers with no clock

    Path(path).write_text(str(os.getpid()))
    time.sleep(seconds)
