"""Per-step CPU time outside the model call on the seed workload, and the gaps in its trace.

For each scheduler, after a warm-up, serve the seed burst twice:
1. untraced, with the step's phases timed: schedule (the policy), pack (execute() before and after
   the model region: token ids, layout, KV slots, .tolist()), model (the traced region: forward +
   greedy argmax), apply (state bookkeeping) and the rest of the loop; share = outside / model time;
2. under torch.profiler as the seed ran it: the gaps between model regions in the Chrome trace.

    flock /tmp/miniserve-bench.lock python benchmarks/step_overhead.py [--dtype float32] [--threads 2]

Target (issue 7): outside-the-model time ≤ 2% of busy (model) time on the seed workload.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

# it times the step loop's pieces by wrapping their methods, which compiled classes do not allow
os.environ["MINISERVE_COMPILED"] = "0"  # before engine is imported: the plain-Python core
from engine.core.config import ModelConfig, SchedulerConfig  # noqa: E402
from engine.llm_engine import Engine  # noqa: E402
from engine.observe.trace import summarize_trace  # noqa: E402
from engine.observe.workload import WorkloadConfig, generate, make_requests  # noqa: E402
from experiments.seed import _export_model_regions  # noqa: E402


def timed(acc: dict, key: str, fn):
    def wrapper(*a, **k):
        t = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            acc[key] += time.perf_counter() - t
    return wrapper


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen2_5_0_5b")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--schedulers", default="continuous,static,serial")
    args = ap.parse_args()
    workload = WorkloadConfig()
    engine = Engine(SchedulerConfig(), ModelConfig(name=args.model, dtype=args.dtype, num_threads=args.threads))
    print(f"model={args.model} dtype={args.dtype} threads={torch.get_num_threads()}  (seed burst: 16 requests)")
    print(f"{'scheduler':11s} {'steps':>5s} {'model s':>8s} {'schedule':>9s} {'pack':>8s} {'apply':>8s} "
          f"{'loop':>8s} {'outside/model':>14s} {'trace gaps':>11s} {'span':>7s} {'gap/span':>9s}")
    shares = {}
    for name in args.schedulers.split(","):
        engine.reset(SchedulerConfig(name=name))
        engine.warmup()
        requests = make_requests(generate(workload), vocab_size=engine.runner.vocab_size, seed=workload.seed)
        acc: dict[str, float] = defaultdict(float)
        scheduler, state, runner = engine.core.scheduler, engine.core.state, engine.runner
        scheduler.schedule = timed(acc, "schedule", scheduler.schedule)
        state.apply = timed(acc, "apply", state.apply)
        execute = runner.execute
        runner.execute = timed(acc, "execute", execute)
        result = engine.run(requests)
        del runner.execute
        model = sum(s.model_s for s in result.steps)
        total = result.steps[-1].end_s - result.steps[0].start_s
        pack = acc["execute"] - model
        loop = total - model - pack - acc["schedule"] - acc["apply"]
        outside = total - model
        shares[name] = outside / model

        engine.reset()
        requests = make_requests(generate(workload), vocab_size=engine.runner.vocab_size, seed=workload.seed,
                                 prefix="traced")
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "trace.json"
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                engine.run(requests)
            _export_model_regions(prof, path)
            trace = summarize_trace(path, engine.scheduler_config.max_num_seqs)
        print(f"{name:11s} {len(result.steps):5d} {model:8.3f} {1e3 * acc['schedule']:7.2f}ms {1e3 * pack:6.2f}ms "
              f"{1e3 * acc['apply']:6.2f}ms {1e3 * loop:6.2f}ms {100 * shares[name]:13.2f}% "
              f"{1e3 * trace.gap_s:9.2f}ms {trace.span_s:6.2f}s {100 * trace.gap_s / trace.span_s:8.2f}%", flush=True)
    print(" ".join(f"step_overhead_share_{k}={v:.4f}" for k, v in shares.items()))


if __name__ == "__main__":
    main()
