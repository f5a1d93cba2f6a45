"""Discrete-event simulation of the engine: the same scheduler and state, SimPy for time."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

import engine  # noqa: F401  first, so a compiled build of sim.records is found (engine/compiled)
from engine.core.request import Request
from engine.observe.workload import Workload, WorkloadConfig, generate, iter_requests, make_requests
from sim.simulator import Simulation, SimResult, simulate
from sim.executors import ConstantExecutor, CostModelExecutor, ReplayDivergedError, ReplayExecutor

__all__ = ["ConstantExecutor", "CostModelExecutor", "ReplayDivergedError", "ReplayExecutor", "SimResult",
           "Simulation", "simulate", "workload_requests"]


def workload_requests(workload: Workload | WorkloadConfig, lazy: bool = False
                      ) -> tuple[Iterable[Request], int | None]:
    """Placeholder-prompt requests for a workload, and its closed-loop concurrency (or None).

    ``lazy``: a generator in arrival order instead of a list, so that a finished request (and its
    per-token lists) is garbage as soon as the simulator has logged it — for million-request runs.
    """
    if isinstance(workload, WorkloadConfig):
        workload = generate(workload)
    in_order = workload.concurrency is not None or bool(np.all(np.diff(workload.arrival_s) >= 0))
    if lazy and in_order:
        return iter_requests(workload), workload.concurrency
    return make_requests(workload), workload.concurrency
