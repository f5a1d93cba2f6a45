"""How fast the simulator runs: Poisson requests (prompt lognormal ~512, output lognormal ~128)
through the continuous scheduler (max_num_seqs 64), at 10k and 100k requests (1M with --million).

    flock /tmp/miniserve-bench.lock python benchmarks/sim_speed.py [--profile PROFILE] [--million] [--against DIR]

It runs the compiled core when one is built for these sources (``make compiled``, engine/compiled;
the first line says), plain Python otherwise or with MINISERVE_COMPILED=0.
Each size runs in a fresh process (clean peak-memory numbers), ``--repeats`` times; the median
wall time is reported. Without --profile the step costs are the explicit stand-in coefficients
below (printed), chosen only to set the load: simulator speed depends on how many requests are
active per step, not on what a step costs. ``--load`` sets the arrival rate as a fraction of the
measured saturation throughput. At 10k it also runs every step through ``schedule()`` with its
plan kept (no plan-less decode-only steps) and prints the ratio. Last line:
``sim_requests_per_s=<n>`` at 100k requests.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(HERE))

from calibration.cost_model import CostModel  # noqa: E402
from engine.core.config import SchedulerConfig  # noqa: E402
from engine.observe.workload import LengthDist, WorkloadConfig, generate, iter_requests, make_requests  # noqa: E402
from sim import CostModelExecutor, simulate  # noqa: E402
from sim.executors import cost_model_from  # noqa: E402

# seconds per unit of each plan feature (see calibration/cost_model.py)
STAND_IN = cost_model_from(step_overhead_s=1e-3, const=5e-3, prefill_tokens=2e-5, decode_tokens=5e-5,
                           decode_context=1e-8, prefill_attention=1e-9, num_requests=1e-5)
SCHEDULER = SchedulerConfig(name="continuous", max_num_seqs=64, max_num_batched_tokens=2048,
                            long_prefill_token_threshold=512, num_kv_blocks=16384, block_size=16,
                            max_model_len=4096)


def workload(n: int, rate: float) -> WorkloadConfig:
    return WorkloadConfig(arrival="poisson", num_requests=n, rate=rate, seed=0,
                          prompt=LengthDist(kind="lognormal", value=512, sigma=0.5, max=2048),
                          output=LengthDist(kind="lognormal", value=128, sigma=0.5, max=1024))


def cost_model(profile: str | None) -> CostModel:
    return CostModel.load(profile) if profile else STAND_IN


def run_once(n: int, rate: float, profile: str | None, keep_steps: bool = False) -> dict:
    """One simulation in this process: wall time of the simulation itself, and peak RSS.
    ``keep_steps`` keeps every plan, which also turns off the plan-less decode-only steps."""
    cost = cost_model(profile)
    requests = iter_requests(generate(workload(n, rate)))  # lazily: finished requests are freed
    t0 = time.perf_counter()
    result = simulate(requests, SCHEDULER, lambda: CostModelExecutor(cost), keep_token_times=False,
                      keep_steps=keep_steps)
    wall = time.perf_counter() - t0
    m = result.metrics()
    return {"n": n, "wall_s": wall, "sim_req_s": n / wall, "steps": result.num_steps,
            "mean_active_decodes": m["total_output_tokens"] / result.num_steps,
            "completed": m["completed"], "sim_throughput_req_s": m["request_throughput_req_s"],
            "ttft_p99_s": m["ttft_s"]["p99"], "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def saturation_rate(profile: str | None) -> float:
    """Requests per simulated second when everything arrives at once (the engine's capacity)."""
    cost = cost_model(profile)
    wl = workload(2000, 1.0)
    requests = make_requests(generate(WorkloadConfig(**{**wl.__dict__, "arrival": "burst"})))
    return simulate(requests, SCHEDULER, lambda: CostModelExecutor(cost), keep_token_times=False).metrics()[
        "request_throughput_req_s"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", help="a calibration profile.json (default: the stand-in coefficients)")
    ap.add_argument("--load", type=float, default=0.7, help="arrival rate / saturation throughput")
    ap.add_argument("--million", action="store_true", help="also run 1,000,000 requests")
    ap.add_argument("--repeats", type=int, default=3, help="runs per size below 1M (median reported)")
    ap.add_argument("--against", metavar="CHECKOUT",
                    help="another checkout (e.g. an older commit's worktree): each run alternates with one "
                         "there at the same rate, and both medians and their ratio are printed")
    ap.add_argument("--one", type=int, help=argparse.SUPPRESS)  # child: one run of this size
    ap.add_argument("--rate", type=float, help=argparse.SUPPRESS)
    ap.add_argument("--keep-steps", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print(json.dumps(run_once(args.one, args.rate, args.profile, args.keep_steps)))
        return

    from engine.compiled import status
    print(f"core: {status()}")
    if not args.profile:
        nonzero = {k: c for k, c in zip(STAND_IN.feature_names, STAND_IN.coefficients) if c}
        print(f"step costs: stand-in coefficients {nonzero}, overhead {STAND_IN.step_overhead_s} s "
              "(pass --profile for a calibrated model)")
    sat = saturation_rate(args.profile)
    rate = args.load * sat
    print(f"continuous, max_num_seqs {SCHEDULER.max_num_seqs}, max_num_batched_tokens "
          f"{SCHEDULER.max_num_batched_tokens}; saturation {sat:.2f} req/s; Poisson at {rate:.2f} req/s "
          f"({args.load:.0%} load)")
    def one(n: int, checkout: Path, *extra: str) -> dict:
        """One run in a fresh process of ``checkout``'s benchmark (its own code on its path)."""
        cmd = [sys.executable, str(checkout / "benchmarks" / "sim_speed.py"), "--one", str(n), "--rate", repr(rate),
               *extra] + (["--profile", str(Path(args.profile).resolve())] if args.profile else [])
        done = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=checkout)
        return json.loads(done.stdout.strip().splitlines()[-1])

    def median_wall(n: int, repeats: int, *extra: str) -> tuple[float, list[dict]]:
        runs, other = [], []
        for _ in range(repeats):
            runs.append(one(n, HERE, *extra))
            if args.against and not extra:  # alternate, so a slow spell of the machine hits both
                other.append(one(n, Path(args.against).resolve()))
        wall = statistics.median(r["wall_s"] for r in runs)
        if other:
            then = statistics.median(r["wall_s"] for r in other)
            print(f"n={n:>9,}  against {args.against}: {n / wall:,.0f} vs {n / then:,.0f} simulated req/s "
                  f"({then / wall:.2f}x), medians of {len(runs)} alternating runs")
        return wall, runs

    sizes = [10_000, 100_000] + ([1_000_000] if args.million else [])
    headline = None
    for n in sizes:
        wall, runs = median_wall(n, args.repeats if n < 1_000_000 else 1)
        r = runs[0]
        print(f"n={n:>9,}  wall {wall:8.2f} s (median of {len(runs)})  {n / wall:9,.0f} simulated req/s  "
              f"{r['steps']:,} steps  {r['mean_active_decodes']:.1f} tokens/step  "
              f"peak RSS {max(x['peak_rss_mb'] for x in runs):,.0f} MB  TTFT p99 {r['ttft_p99_s']:.3f} s")
        if n == 100_000:
            headline = n / wall
        if n == 10_000:
            planned, _ = median_wall(n, args.repeats, "--keep-steps")
            print(f"           every step through schedule() with its plan kept: {n / planned:,.0f} req/s; "
                  f"plan-less decode-only steps are {planned / wall:.2f}x faster")
    print(f"sim_requests_per_s={headline:.0f}")


if __name__ == "__main__":
    main()
