"""The scheduling policies. Each is pure: it reads and admits into a ServingState and returns the
next model call's plan. No torch, no simpy, no clock: the real engine and the simulator run
exactly this code, and only how long executing a plan takes differs between them.

- ``base.py``: the contract (``Scheduler.schedule``) and ``PlanBuilder``, a step's plan as it fills.
- ``static.py``: ``StaticScheduler`` (closed groups) and ``SerialScheduler`` (a group of one).
- ``continuous.py``: ``ContinuousScheduler`` (iteration-level batching, chunked prefill, preemption).
"""

from __future__ import annotations

from engine.core.config import SchedulerConfig
from engine.core.scheduler.base import PlanBuilder, Scheduler
from engine.core.scheduler.continuous import ContinuousScheduler
from engine.core.scheduler.static import SerialScheduler, StaticScheduler

SCHEDULERS: dict[str, type[Scheduler]] = {
    cls.name: cls for cls in (SerialScheduler, StaticScheduler, ContinuousScheduler)
}


def make_scheduler(config: SchedulerConfig) -> Scheduler:
    return SCHEDULERS[config.name](config)


__all__ = ["SCHEDULERS", "ContinuousScheduler", "PlanBuilder", "Scheduler", "SerialScheduler", "StaticScheduler",
           "make_scheduler"]
