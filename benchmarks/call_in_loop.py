"""A decode call inside the engine's step loop vs the same shape timed back to back, as the grid times it.

The calibration's grid times each shape back to back; the engine runs the same runner.execute between
scheduling steps. Where the two disagree, the simulator (priced from the grid) disagrees with real runs.
This serves B requests through the continuous engine and takes its decode-only calls of B rows: first
as the engine ran before its runner froze the objects of start-up out of the garbage collector's scans
(engine.model.runner.freeze_startup_objects, skipped at build and done after), then as it serves now,
under torch.profiler as the seed experiment serves its real rows, and with the collector off; then it
times the same shape back to back on the same runner. Per run it prints the collector's collections of
each generation and the time in them, and per call what was launched: device kernels, copies and
synchronisations (a GPU whose calls are bound by the host's launches shows a difference there), or CPU
operators. "wall ms" is the whole step for the engine (scheduling included), the execute call for the
grid. Figures in docs/architecture.md.

    python benchmarks/call_in_loop.py --device cuda [--model qwen2_5_0_5b] [--batch 8]
    flock /tmp/miniserve-bench.lock python benchmarks/call_in_loop.py --device cpu --model tiny
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout, not an installed copy

import torch  # noqa: E402

from calibration.grid import Shape  # noqa: E402
from calibration.profiler import ShapePool, make_runner  # noqa: E402
from engine.core.config import ModelConfig, SchedulerConfig  # noqa: E402
from engine.core.request import Request  # noqa: E402
from engine.llm_engine import Engine  # noqa: E402
from engine.model import runner as runner_module  # noqa: E402

# profiler events that say what a call asked of the device and where the host waited for it
COUNTED = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cudaMemcpyAsync", "cudaMemsetAsync",
           "cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "aten::_local_scalar_dense",
           "aten::copy_", "aten::to", "aten::index_put_", "aten::nonzero", "aten::scaled_dot_product_attention")


@contextmanager
def collections():
    """The garbage collector's collections while the block runs: [count, seconds] per generation."""
    seen = [[0, 0.0] for _ in range(3)]
    started = [0.0]

    def note(phase: str, info: dict) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            seen[info["generation"]][0] += 1
            seen[info["generation"]][1] += time.perf_counter() - started[0]

    gc.callbacks.append(note)
    try:
        yield seen
    finally:
        gc.callbacks.remove(note)


def engine_calls(engine: Engine, batch: int, ctx: int, steps: int, seed: int) -> tuple[list[float], list[float]]:
    """Device seconds of each decode-only call of ``batch`` rows in one engine run, and the wall
    seconds of its step."""
    g = torch.Generator().manual_seed(seed)
    vocab = engine.runner.vocab_size
    requests = [Request(f"loop{seed}-{i}", torch.randint(0, vocab, (ctx,), generator=g).tolist(), steps)
                for i in range(batch)]
    result = engine.run(requests)
    engine.reset()
    calls = [s for s in result.steps if s.plan.num_decodes == batch and len(s.plan.num_tokens) == batch]
    return [s.model_s for s in calls], [s.end_s - s.start_s for s in calls]


def grid_calls(pool: ShapePool, shape: Shape, n: int) -> tuple[list[float], list[float]]:
    """Device and wall seconds of ``n`` calls of ``shape`` back to back."""
    plan = shape.to_plan(pool.request_ids)
    device, host = [], []
    for _ in range(n):
        t0 = time.perf_counter()
        device.append(pool.runner.execute(plan, pool.requests).duration_s)
        host.append(time.perf_counter() - t0)
    return device, host


def counts_per_call(fn: Callable[[], int], device: str) -> Counter:
    """Profiler events of ``fn`` (which returns how many calls it made) per call."""
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA]
                                                          if device == "cuda" else [])
    with torch.profiler.profile(activities=activities) as prof:
        calls = fn()
    found = Counter({e.key: e.count for e in prof.key_averages() if e.key in COUNTED})
    kernels = sum(e.count for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA)
    if kernels:
        found["device kernels run"] = kernels
    return Counter({k: v / max(1, calls) for k, v in found.items()})


def ms(xs: list[float]) -> str:
    return f"{statistics.median(xs) * 1e3:8.2f}" if xs else "     n/a"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2_5_0_5b")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--ctx", type=int, default=40)
    ap.add_argument("--steps", type=int, default=24)
    args = ap.parse_args()
    model = ModelConfig(name=args.model, device=args.device, dtype=args.dtype, num_threads=args.threads)
    max_len = args.ctx + args.steps + 2
    real_freeze = runner_module.freeze_startup_objects
    runner_module.freeze_startup_objects = lambda: None  # built as before the freeze
    try:
        runner = make_runner(model, args.batch, max_len)
    finally:
        runner_module.freeze_startup_objects = real_freeze
    device = runner.device.type
    config = SchedulerConfig(max_num_seqs=args.batch, max_num_batched_tokens=max(256, args.batch * args.ctx),
                             long_prefill_token_threshold=args.ctx, max_model_len=runner.max_model_len)
    engine = Engine(config, runner.model_config, runner=runner)
    engine_calls(engine, args.batch, args.ctx, 4, seed=0)  # warm-up
    with collections() as thawed_gc:
        thawed = engine_calls(engine, args.batch, args.ctx, args.steps, seed=1)
    real_freeze()  # as the runner does at build now
    with collections() as loop_gc:
        loop = engine_calls(engine, args.batch, args.ctx, args.steps, seed=2)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
        profiled = engine_calls(engine, args.batch, args.ctx, args.steps, seed=3)
    gc.disable()
    no_gc = engine_calls(engine, args.batch, args.ctx, args.steps, seed=4)
    gc.enable()
    shape = Shape("decode", decode_contexts=(args.ctx + args.steps // 2,) * args.batch)
    pool = ShapePool(runner, args.batch, max_len)
    grid_calls(pool, shape, 3)
    with collections() as grid_gc:
        grid = grid_calls(pool, shape, args.steps)
    # contexts that differ by request: SDPA's decode call then takes a mask
    ragged_shape = Shape("decode", decode_contexts=tuple(args.ctx + i % 8 for i in range(args.batch)))
    grid_calls(pool, ragged_shape, 3)
    ragged = grid_calls(pool, ragged_shape, args.steps)
    grid_count = counts_per_call(lambda: len(grid_calls(pool, shape, 4)[0]), device)
    pool.release()
    loop_count = counts_per_call(lambda: len(engine_calls(engine, args.batch, args.ctx, 6, seed=5)[0]), device)
    print(f"{runner.model_config.name} on {device} ({runner.model_config.dtype}), decode B={args.batch} "
          f"at ~{args.ctx + args.steps // 2} tokens of context; median ms over {args.steps} calls")
    print(f"{'where':30s} {'device ms':>9s} {'wall ms':>8s}   collections gen 0/1/2 (ms in them) in the run")
    for name, (d, w), seen in (("grid (back to back)", grid, grid_gc),
                               ("grid, contexts differ", ragged, None),
                               ("engine, start-up not frozen", thawed, thawed_gc),
                               ("engine step loop (as served)", loop, loop_gc),
                               ("engine, under torch.profiler", profiled, None),
                               ("engine, collector off", no_gc, None)):
        made = "" if seen is None else "   " + " / ".join(f"{n} ({t * 1e3:.1f})" for n, t in seen)
        print(f"{name:30s} {ms(d):>9s} {ms(w):>8s}{made}")
    if grid[0] and loop[0] and thawed[0]:
        print(f"engine / grid, device time: {statistics.median(loop[0]) / statistics.median(grid[0]):.2f}x as served, "
              f"{statistics.median(thawed[0]) / statistics.median(grid[0]):.2f}x not frozen")
    print("\nper call (the engine's figure spreads its run's prefill and host work over its decode calls):")
    print(f"{'event':36s} {'grid':>8s} {'engine':>8s}")
    for key in sorted(set(grid_count) | set(loop_count)):
        print(f"{key:36s} {grid_count.get(key, 0):8.1f} {loop_count.get(key, 0):8.1f}")


if __name__ == "__main__":
    main()
