"""Benchmark a running server: ``python -m experiments.bench bench.url=http://127.0.0.1:8000
workload.arrival=poisson workload.rate=4 workload.num_requests=200 [bench.max_concurrency=8]``
(also the ``miniserve-bench`` console script). ``vllm bench serve``'s flags work too
(engine/loadgen/vllm_args.py). Writes requests.csv, metrics.json, results.json (vLLM's
``--save-result`` keys) and http_requests.csv into the Hydra run dir and prints vLLM's summary table."""

from __future__ import annotations

import asyncio
import logging
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig

from engine.loadgen.client import (BenchConfig, fetch_model_info, format_summary, prompt_vocab_size, run_bench,
                                   write_outputs)
from engine.loadgen.vllm_args import vllm_to_overrides
from engine.observe.results import Goodput, write_results_json
from engine.observe.workload import Workload, WorkloadConfig, generate, make_requests
from experiments.schema import register, to_object


@dataclass
class BenchApp:
    workload: WorkloadConfig = field(default_factory=WorkloadConfig)
    bench: BenchConfig = field(default_factory=BenchConfig)


register("bench_schema", BenchApp)


def closed_loop_cap(workload: Workload, cap: int | None) -> int | None:
    """The client's cap on requests in flight: a closed loop's clients (``workload.concurrency``: all
    requests ready at once, each finish frees a slot for the next), else ``bench.max_concurrency``."""
    if workload.concurrency is None:
        return cap
    if cap is not None and cap != workload.concurrency:
        raise ValueError(f"workload=closed_loop runs workload.concurrency={workload.concurrency} clients, and "
                         f"bench.max_concurrency={cap} would cap them otherwise: set one of them")
    return workload.concurrency


def bench(app: BenchApp, out_dir: Path) -> dict:
    info = asyncio.run(fetch_model_info(app.bench.url))
    workload = generate(app.workload)
    cfg = replace(app.bench, max_concurrency=closed_loop_cap(workload, app.bench.max_concurrency))
    requests = make_requests(workload, vocab_size=prompt_vocab_size(info, cfg), seed=app.workload.seed,
                             prefix="bench")
    result = asyncio.run(run_bench(requests, cfg, model=info["id"]))
    write_outputs(result, out_dir)
    write_results_json(out_dir / "results.json", result.metrics, backend="openai", label="miniserve",
                       model_id=info["id"], workload=app.workload, goodput=Goodput.parse(cfg.goodput),
                       max_concurrency=cfg.max_concurrency)
    return result.metrics


@hydra.main(version_base="1.3", config_path="../conf", config_name="bench")
def hydra_main(cfg) -> None:
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per request otherwise
    app: BenchApp = to_object(cfg)
    out_dir = Path(HydraConfig.get().runtime.output_dir)
    metrics = bench(app, out_dir)
    print(format_summary(metrics))
    print(f"wrote {out_dir / 'metrics.json'} and {out_dir / 'results.json'}")


def main() -> None:
    """vLLM's flags become Hydra overrides, then Hydra runs the app."""
    try:
        sys.argv = [sys.argv[0], *vllm_to_overrides(sys.argv[1:])]
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    hydra_main()


if __name__ == "__main__":
    main()
