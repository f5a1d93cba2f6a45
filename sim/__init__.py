"""Discrete-event simulation of the engine: the same scheduler and state, SimPy for time."""

from __future__ import annotations

from engine.workload import Workload, WorkloadConfig, generate, make_requests
from sim.simulator import Simulation, SimResult, SimStep, simulate
from sim.timing import ConstantTimer, CostModelTimer, ReplayDivergedError, ReplayTimer

__all__ = ["ConstantTimer", "CostModelTimer", "ReplayDivergedError", "ReplayTimer", "SimResult", "SimStep",
           "Simulation", "simulate", "workload_requests"]


def workload_requests(workload: Workload | WorkloadConfig) -> tuple[list, int | None]:
    """Placeholder-prompt requests for a workload, and its closed-loop concurrency (or None)."""
    if isinstance(workload, WorkloadConfig):
        workload = generate(workload)
    return make_requests(workload), workload.concurrency
