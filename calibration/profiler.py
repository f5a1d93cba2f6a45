"""Time the real ModelRunner on grid shapes, and the per-step time an Engine spends outside it.

How a shape with prior context is made real: a pool of requests first takes its KV slots through
one real forward (every request one token at context 0, as a prefill would), then every slot's
cache rows up to the longest context are filled with random values. A forward's cost depends on
shapes and on the memory it touches, not on the values, so the timed call — the runner's own
``execute`` of that plan, one packed forward over exactly those tokens and contexts — reads and
writes what a call after a real prefill would, without paying minutes of prefill to get there.
"""

from __future__ import annotations

import logging
import statistics
import time
from dataclasses import dataclass, replace

import numpy as np
import torch
from tqdm import tqdm

from calibration.contention import Interval
from calibration.grid import Shape
from engine.core.config import ModelConfig, SchedulerConfig
from engine.llm_engine import Engine
from engine.model.runner import ModelRunner
from engine.core.plan import BatchPlan
from engine.core.request import Request
from engine.observe.workload import LengthDist, WorkloadConfig, generate, make_requests

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Measurement:
    shape: Shape
    plan: BatchPlan
    times_s: tuple[float, ...]

    @property
    def median_s(self) -> float:
        return statistics.median(self.times_s)

    @property
    def spread(self) -> float:
        """(max − min) / median of the repeats: how noisy this shape was."""
        return (max(self.times_s) - min(self.times_s)) / self.median_s


class ShapePool:
    """A runner whose KV slots hold ``num_slots`` requests at any context below ``max_len``."""

    def __init__(self, runner: ModelRunner, num_slots: int, max_len: int, seed: int = 0) -> None:
        self.runner = runner
        g = torch.Generator().manual_seed(seed)
        prompt_len = max_len + 1
        self.request_ids = [f"calib-{i}" for i in range(num_slots)]
        self.requests = {rid: Request(rid, torch.randint(0, runner.vocab_size, (prompt_len,), generator=g).tolist(),
                                      1) for rid in self.request_ids}
        runner.execute(BatchPlan("calibration", tuple(self.request_ids), (1,) * num_slots, (0,) * num_slots,
                                 (False,) * num_slots, 0), self.requests)
        with torch.no_grad():
            for store in runner.cache.keys + runner.cache.values:
                part = store[:, :, 1:max_len + 1]  # drawn on the CPU (g is a CPU generator), copied to the device
                part.copy_(torch.randn(part.shape, generator=g, dtype=part.dtype))

    def execute(self, plan: BatchPlan) -> tuple[float, bool]:
        """The call's duration, and whether other processes used the CPU meanwhile."""
        with Interval() as iv:
            duration = self.runner.execute(plan, self.requests).duration_s
        return duration, iv.contended

    def release(self) -> None:
        self.runner.free(self.request_ids)


def make_runner(model_config: ModelConfig, num_slots: int, max_len: int) -> ModelRunner:
    return ModelRunner(model_config, SchedulerConfig(max_num_seqs=num_slots, max_model_len=max_len + 2))


def measure_shapes(pool: ShapePool, shapes: list[Shape], repeats: int, warmup: int = 1, seed: int = 0,
                   progress: bool = True, max_retries: int = 3) -> tuple[list[Measurement], int]:
    """Warm-up passes, then ``repeats`` rounds over all shapes in a fresh random order each round,
    so slow spells on a shared machine spread over shapes instead of landing on one.

    A call during which other processes used the CPU is measured again (up to ``max_retries``).
    Returns the measurements and how many calls were retried. The progress bar shows on a terminal
    only (a log file gets no carriage-return updates), then one summary line is logged.
    """
    plans = [s.to_plan(pool.request_ids) for s in shapes]
    times: list[list[float]] = [[] for _ in shapes]
    rng = np.random.default_rng(seed)
    retried = 0
    start = time.perf_counter()
    bar = tqdm(total=len(shapes) * (warmup + repeats), desc="calibrating", unit="call",
               disable=None if progress else True)
    for r in range(warmup + repeats):
        for i in rng.permutation(len(shapes)):
            t, contended = pool.execute(plans[i])
            for _ in range(max_retries if r >= warmup else 0):
                if not contended:
                    break
                retried += 1
                t, contended = pool.execute(plans[i])
            if r >= warmup:
                times[i].append(t)
            bar.update()
    bar.close()
    log.info(f"measured {len(shapes)} shapes × {warmup} warm-up + {repeats} repeats in "
             f"{time.perf_counter() - start:.1f} s, {retried} calls measured again (CPU contended)")
    return [Measurement(s, p, tuple(t)) for s, p, t in zip(shapes, plans, times)], retried


@dataclass(frozen=True)
class OverheadSummary:
    """Per-step wall time outside the model call: scheduling, packing, sampling, bookkeeping."""

    median_s: float
    mean_s: float
    p90_s: float
    steps: int
    share_of_busy: float  # Σ overhead / Σ model time

    def to_dict(self) -> dict:
        return self.__dict__.copy()


def step_overheads(steps) -> list[float]:
    """``end − start − model`` of each step plus the gap to the next step's start."""
    out = []
    for i, s in enumerate(steps):
        gap = steps[i + 1].start_s - s.end_s if i + 1 < len(steps) else 0.0
        out.append(s.end_s - s.start_s - s.model_s + gap)
    return out


def measure_engine_runs(runner: ModelRunner, max_num_seqs: int,
                        runs: int = 2) -> tuple[OverheadSummary, list[Measurement]]:
    """Serve a small burst (mixed prompt lengths, not the seed's) through the continuous Engine on
    this runner: the time outside the model call, from its StepRecords, and its model calls as
    measurements of kind "engine". Calls inside a serving loop run some percent slower than the
    same shapes timed back to back on the grid (caches, allocator, the Python between calls), so
    the fit learns from them too and the error table scores them."""
    config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=64, long_prefill_token_threshold=32)
    engine = Engine(config, runner.model_config, runner=runner)
    workload = WorkloadConfig(num_requests=2 * max_num_seqs, prompt=LengthDist("uniform", low=4, high=40),
                              output=LengthDist("uniform", low=2, high=10), seed=7)
    overheads: list[float] = []
    calls: list[Measurement] = []
    busy = 0.0
    for k in range(runs + 1):  # the first run is a warm-up
        requests = make_requests(generate(workload), vocab_size=runner.vocab_size, seed=k, prefix=f"ovh{k}")
        result = engine.run(requests)
        engine.reset()
        if k:
            overheads += step_overheads(result.steps)
            busy += sum(s.model_s for s in result.steps)
            calls += [Measurement(Shape.of_plan(s.plan, "engine"), s.plan, (s.model_s,)) for s in result.steps]
    arr = np.asarray(overheads)
    summary = OverheadSummary(float(np.median(arr)), float(arr.mean()), float(np.percentile(arr, 90)), len(arr),
                              float(arr.sum() / busy))
    return summary, calls


def threads_of(model_config: ModelConfig) -> ModelConfig:
    """Timings are only comparable at a known thread count: make it explicit."""
    if model_config.num_threads is None:
        return replace(model_config, num_threads=torch.get_num_threads())
    return model_config
