"""Ragged (per-request SDPA) vs masked (one SDPA, block-diagonal mask) attention, same plans.

Prints the median model-call time of each backend for decode-heavy and prefill-heavy plans on
the chosen model; the ratio says which backend the engine should use by default.
    python benchmarks/attention_backends.py [--model qwen2_5_0_5b] [--threads 2] [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics

from engine.core.config import ModelConfig, SchedulerConfig
from engine.model.runner import ModelRunner
from engine.core.plan import BatchPlan
from engine.core.request import Request


def prefilled(runner: ModelRunner, contexts: list[int], prefix: str) -> dict[str, Request]:
    """Requests whose first ``context`` tokens are already in the runner's KV slots."""
    reqs = {}
    for i, ctx in enumerate(contexts):
        r = Request(f"{prefix}{i}", [(i * 31 + j) % 1000 + 1 for j in range(ctx + 512)], 4)
        reqs[r.request_id] = r
        if ctx:
            runner.execute(BatchPlan("continuous", (r.request_id,), (ctx,), (0,), (False,), 0), reqs)
    return reqs


def time_plan(runner: ModelRunner, plan: BatchPlan, reqs: dict[str, Request], repeats: int) -> float:
    runner.execute(plan, reqs)  # warm this shape
    return statistics.median(runner.execute(plan, reqs).duration_s for _ in range(repeats))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen2_5_0_5b")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    cases = {
        "decode B=32 ctx=256": ([256] * 32, [1] * 32),
        "decode B=8 ctx=1024": ([1024] * 8, [1] * 8),
        "mixed 8 dec ctx=512 + 2x256 chunks ctx=512": ([512] * 10, [1] * 8 + [256] * 2),
        "prefill 512 fresh": ([0], [512]),
        "prefill 4x128 fresh": ([0] * 4, [128] * 4),
    }
    print(f"{'plan':48s} {'ragged ms':>10s} {'masked ms':>10s} {'masked/ragged':>14s}")
    for name, (contexts, chunks) in cases.items():
        times = {}
        for backend in ("ragged", "masked"):
            runner = ModelRunner(ModelConfig(name=args.model, dtype=args.dtype, num_threads=args.threads,
                                             attention=backend),
                                 SchedulerConfig(max_num_seqs=len(contexts), max_model_len=2048))
            reqs = prefilled(runner, contexts, "r")
            ids = tuple(reqs)
            nd = sum(1 for n in chunks if n == 1)
            plan = BatchPlan("continuous", ids, tuple(chunks), tuple(contexts),
                             tuple(n == 1 for n in chunks), nd)
            times[backend] = time_plan(runner, plan, reqs, args.repeats)
        print(f"{name:48s} {1e3 * times['ragged']:10.1f} {1e3 * times['masked']:10.1f} "
              f"{times['masked'] / times['ragged']:14.2f}")


if __name__ == "__main__":
    main()
