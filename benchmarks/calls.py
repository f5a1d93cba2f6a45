"""Model calls of a chosen shape, and A/B timing of a kernel switched off and on, for the benchmarks.

Why alternate: the memory bandwidth this shared VM gets moves by up to 1.8x within minutes, so two
variants timed one after the other can differ by the spell they ran in; timed call by call, both
see the same one.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.core.config import ModelConfig, SchedulerConfig
from engine.model.runner import ModelRunner
from engine.core.plan import BatchPlan
from engine.core.request import Request


def shape_plan(runner: ModelRunner, contexts: list[int], chunks: list[int], tag: str):
    """A plan over requests whose first ``context`` tokens already sit in the runner's KV slots."""
    reqs = {}
    vocab = min(1000, runner.vocab_size - 1)  # token ids do not change a call's cost
    for i, (ctx, n) in enumerate(zip(contexts, chunks)):
        r = Request(f"{tag}{i}", [(i * 31 + j) % vocab + 1 for j in range(ctx + n + 1)], 4)
        reqs[r.request_id] = r
    ids = tuple(reqs)
    if any(contexts):
        runner.execute(BatchPlan("continuous", ids, tuple(contexts), (0,) * len(ids), (False,) * len(ids), 0), reqs)
    nd = sum(1 for n in chunks if n == 1)
    return BatchPlan("continuous", ids, tuple(chunks), tuple(contexts), (True,) * len(ids), nd), reqs


@dataclass
class AB:
    """One shape's calls with a kernel off and on, timed pair by pair."""

    off_s: list[float]
    on_s: list[float]
    max_logit_diff: float
    same_argmax: bool

    @property
    def speedup(self) -> float:
        return statistics.median(a / b for a, b in zip(self.off_s, self.on_s))

    def line(self, name: str, off: str, on: str) -> str:
        return (f"  {name:12s} {off} {1e3 * statistics.median(self.off_s):7.1f} ms | {on} "
                f"{1e3 * statistics.median(self.on_s):7.1f} ms | speedup {self.speedup:.2f} | "
                f"max |Δlogit| {self.max_logit_diff:.1e}, same argmax {self.same_argmax}")


def time_alternating(fns: list[Callable[[], object]], repeats: int, warm: int) -> list[list[float]]:
    """Wall seconds of each function, called in turn ``warm + repeats`` times; the first ``warm``
    rounds are not kept."""
    times: list[list[float]] = [[] for _ in fns]
    for i in range(warm + repeats):
        for fn, out in zip(fns, times):
            t = time.perf_counter()
            fn()
            if i >= warm:
                out.append(time.perf_counter() - t)
    return times


def alternate(runner: ModelRunner, contexts: list[int], chunks: list[int], switch: Callable[[bool], None],
              repeats: int, warm: int = 2) -> AB:
    """Time the shape's call ``repeats`` times each way, off and on in turn; ``switch(on)`` sets the
    kernel. The first ``warm`` pairs are not timed; the first pair's logits are compared."""
    plan, reqs = shape_plan(runner, contexts, chunks, f"ab{len(contexts)}_{max(contexts)}_{max(chunks)}_")
    times: dict[bool, list[float]] = {False: [], True: []}
    logits: dict[bool, torch.Tensor] = {}
    try:
        for i in range(repeats + warm):
            for on in (False, True):
                switch(on)
                result, lg = runner.execute(plan, reqs, return_logits=True)
                if i >= warm:
                    times[on].append(result.duration_s)
                logits.setdefault(on, lg.float())
    finally:
        switch(True)
        runner.free(plan.request_ids)
    diff = (logits[False] - logits[True]).abs().max().item()
    same = bool((logits[False].argmax(-1) == logits[True].argmax(-1)).all())
    return AB(times[False], times[True], diff, same)


def kernel_bench_args(description: str | None = None) -> argparse.Namespace:
    """The kernel benchmarks' common options, parsed, with torch's threads set."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--model", default="qwen2_5_0_5b")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=9)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    return args


# whole model calls the kernel A/B benchmarks time: decodes at context 256 and a prefill chunk
MODEL_CALL_SHAPES = [("decode B=1", [256], [1]), ("decode B=8", [256] * 8, [1] * 8),
                     ("decode B=32", [256] * 32, [1] * 32), ("prefill 128", [0], [128])]


def bench_runner(args: argparse.Namespace, dtype: str, max_model_len: int = 512) -> ModelRunner:
    """The benchmark's model (``kernel_bench_args``) in ``dtype``, with KV slots for 32 requests."""
    return ModelRunner(ModelConfig(name=args.model, dtype=dtype, num_threads=args.threads),
                       SchedulerConfig(max_num_seqs=32, max_model_len=max_model_len))
