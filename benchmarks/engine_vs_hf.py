"""Our engine (continuous and static) against transformers' own generation, in one process.

Same seeded weights (a second, stock copy of the model for transformers), dtype, thread count and requests for every system:
- ``engine CB`` / ``engine static``: miniserve's Engine.run with the continuous / static scheduler.
- ``HF generate``: ``model.generate`` on FCFS groups of ``max_num_seqs`` requests, left-padded;
  each group runs to its longest output, only each request's own tokens are counted.
- ``HF CB``: transformers' continuous batching (``init_continuous_batching``, sdpa attention,
  explicit blocks and batch limits, no CUDA graphs), per-request ``max_new_tokens``.
Greedy, EOS disabled, so every system generates exactly the requested tokens (checked).
Workloads: the seed burst, and 32 requests (prompts lognormal ~256, outputs lognormal ~64) as a burst.

After every run the machine's limit is probed (calibration.roofline's bandwidth and matmul probes,
the fastest of 3) and the run is set against the workload's floor at those rates
(``workload_floor_s``: all its FLOPs at the matmul rate, or its longest request's calls at the
bandwidth): about the least time an engine could take here, however it batched. A system's time
over the floor is what it loses to this machine, and HF CB's is about the most engine_vs_hf_cb could
read here (an engine at the floor; approximate, since a call can beat a probe taken in a slow
moment). Engine runs also show their own steps' roofline (each call at its roofline_s): what
their schedule would take with every call at the limit.

Each workload runs in ``--repeats`` rounds, every system once a round, so a spell of the shared host
lands on one round's runs of every system rather than on one system's only run (a single long run
once read 1.71 where the runs either side read 3.3-3.8). Throughput is each system's median; the
ratio is the median over rounds of the round's own ratio, printed with every round's value.

    flock /tmp/miniserve-bench.lock python benchmarks/engine_vs_hf.py [--dtype bfloat16] [--threads 2]
    # the ratio alone, in under half the time:
    flock /tmp/miniserve-bench.lock python benchmarks/engine_vs_hf.py --workloads long --systems "engine CB,HF CB"

The last line is ``engine_vs_hf_cb=<engine CB tok/s ÷ HF CB tok/s>`` on the long-prompt workload.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time

import torch
from transformers import ContinuousBatchingConfig, GenerationConfig

from calibration.roofline import BandwidthProbe, Machine, MatmulProbe, ModelShape, roofline_s, workload_floor_s
from engine.core.config import ModelConfig, SchedulerConfig
from engine.llm_engine import Engine
from engine.model.loader import load_model
from engine.core.request import Request
from engine.observe.workload import LengthDist, WorkloadConfig, generate, make_requests

WORKLOADS = {
    "seed": (WorkloadConfig(), SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256)),
    "long": (WorkloadConfig(num_requests=32,
                            prompt=LengthDist(kind="lognormal", value=256, sigma=0.6, max=1536),
                            output=LengthDist(kind="lognormal", value=64, sigma=0.6, max=384)),
             SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=512, long_prefill_token_threshold=512)),
}


def fresh(requests: list[Request]) -> list[Request]:
    return [Request(r.request_id, list(r.prompt_token_ids), r.max_tokens) for r in requests]


def run_engine(engine: Engine, sched: SchedulerConfig, requests: list[Request]) -> tuple[float, dict, list]:
    engine.reset(sched)
    result = engine.run(fresh(requests))
    outputs = {r.request_id: list(r.output_token_ids) for r in engine.core.state.finished[-len(requests):]}
    return result.duration_s, outputs, [step.plan for step in result.steps]


def run_hf_generate(model, sched: SchedulerConfig, requests: list[Request]) -> tuple[float, dict, None]:
    outputs = {}
    start = time.perf_counter()
    for g in range(0, len(requests), sched.max_num_seqs):
        group = requests[g:g + sched.max_num_seqs]
        width = max(r.num_prompt_tokens for r in group)
        ids = torch.zeros(len(group), width, dtype=torch.long)
        mask = torch.zeros(len(group), width, dtype=torch.long)
        for i, r in enumerate(group):
            ids[i, width - r.num_prompt_tokens:] = torch.tensor(list(r.prompt_token_ids))
            mask[i, width - r.num_prompt_tokens:] = 1
        new = max(r.max_tokens for r in group)
        out = model.generate(input_ids=ids, attention_mask=mask, generation_config=GenerationConfig(
            do_sample=False, max_new_tokens=new, min_new_tokens=new, eos_token_id=None, pad_token_id=0))
        assert out.shape[1] == width + new, "HF generate stopped early"
        for i, r in enumerate(group):
            outputs[r.request_id] = out[i, width:width + r.max_tokens].tolist()
    return time.perf_counter() - start, outputs, None


STALL_S = 600


def run_hf_cb(model, sched: SchedulerConfig, requests: list[Request]) -> tuple[float, dict, None]:
    page = 64
    blocks = sum(-(-r.max_total_tokens // page) for r in requests) + sched.max_num_seqs
    manager = model.init_continuous_batching(
        generation_config=GenerationConfig(do_sample=False, eos_token_id=-1, max_new_tokens=1),
        continuous_batching_config=ContinuousBatchingConfig(
            page_size=page, num_blocks=blocks, max_batch_tokens=sched.max_num_batched_tokens,
            max_requests_per_batch=sched.max_num_seqs, use_cuda_graph=False, auto_switch_to_flash=False))
    manager.start()
    try:
        start = time.perf_counter()
        for r in requests:
            manager.add_request(list(r.prompt_token_ids), request_id=r.request_id, max_new_tokens=r.max_tokens,
                                eos_token_id=-1)
        outputs = {}
        while len(outputs) < len(requests):
            # a slow CPU (a Zen 1 EPYC here) finishes its first request minutes in: only ten
            # minutes without a result is a stall
            res = manager.get_result(timeout=STALL_S)
            if res is None:
                raise RuntimeError(f"HF continuous batching stalled: no result for {STALL_S} s")
            if res.is_finished():
                outputs[res.request_id] = list(res.generated_tokens)
        duration = time.perf_counter() - start
    finally:
        manager.stop(block=True)
    return duration, outputs, None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen2_5_0_5b")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3, help="rounds per workload, each system once a round")
    ap.add_argument("--workloads", default="seed,long")
    ap.add_argument("--systems", default="engine CB,engine static,HF generate,HF CB",
                    help="comma-separated; engine CB is always run (the others are compared with it)")
    args = ap.parse_args()
    if args.repeats < 1:
        raise SystemExit("--repeats: at least 1 round")
    chosen = {"engine CB", *(s.strip() for s in args.systems.split(",") if s.strip())}
    torch.set_num_threads(args.threads)
    logging.getLogger("ContinuousBatchingLogger").setLevel(logging.CRITICAL)  # psutil nags on CPU
    names = args.workloads.split(",")
    slots = max(WORKLOADS[w][1].max_num_seqs for w in names)  # the runner's KV slots are sized once
    model_config = ModelConfig(name=args.model, dtype=args.dtype, num_threads=args.threads)
    engine = Engine(SchedulerConfig(max_num_seqs=slots), model_config)
    model, _ = load_model(model_config)  # the same seeded weights, stock transformers modules
    model.set_attn_implementation("sdpa")
    shape = ModelShape.of(model)
    bandwidth, matmul = BandwidthProbe(model.dtype), MatmulProbe(model.dtype)
    vocab = engine.runner.vocab_size
    print(f"model={args.model} dtype={args.dtype} threads={torch.get_num_threads()} torch={torch.__version__}")

    def hf(fn):
        def run(sched, reqs):
            with torch.inference_mode():
                return fn(model, sched, reqs)
        return run

    systems = {
        "engine CB": lambda s, r: run_engine(engine, s, r),
        "engine static": lambda s, r: run_engine(engine, SchedulerConfig(**{**s.__dict__, "name": "static"}), r),
        "HF generate": hf(run_hf_generate),
        "HF CB": hf(run_hf_cb),
    }
    unknown = chosen - set(systems)
    if unknown:
        raise SystemExit(f"--systems: unknown {sorted(unknown)}; choose from {list(systems)}")
    systems = {n: fn for n, fn in systems.items() if n in chosen}
    ratio = {}
    for wname in names:
        wcfg, sched = WORKLOADS[wname]
        requests = make_requests(generate(wcfg), vocab_size=vocab, seed=wcfg.seed)
        want = {r.request_id: r.max_tokens for r in requests}
        total = sum(want.values())
        warm = make_requests(generate(WorkloadConfig(num_requests=sched.max_num_seqs)), vocab_size=vocab,
                             prefix="warm")
        print(f"\n[{wname}] {len(requests)} requests, prompt tokens {sum(r.num_prompt_tokens for r in requests)}, "
              f"output tokens {total}, max_num_seqs={sched.max_num_seqs} "
              f"max_num_batched_tokens={sched.max_num_batched_tokens}, {args.repeats} rounds")
        for fn in systems.values():
            fn(sched, warm)
        lengths = [(r.num_prompt_tokens, r.max_tokens) for r in requests]
        times, outs, over_floor = {name: [] for name in systems}, {}, {name: [] for name in systems}
        for round_ in range(args.repeats):
            for name, fn in systems.items():
                t, out, plans = fn(sched, requests)
                machine = Machine(bandwidth.measure(3), matmul.measure(3))  # the limit, just after the run
                got = {k: len(v) for k, v in out.items()}
                assert got == want, f"{name} generated {sum(got.values())} tokens, want {total}"
                times[name].append(t)
                outs[name] = out
                floor = workload_floor_s(lengths, shape, machine)
                over_floor[name].append(t / floor)
                steps = (f", its steps' roofline {sum(roofline_s(p, shape, machine) for p in plans):.4g} s"
                         if plans else "")
                print(f"  round {round_ + 1}: {name:14s} {t:9.4f} s  {t / floor:5.2f}x the floor ({floor:.4g} s at "
                      f"{machine.bandwidth_bytes_s / 1e9:.1f} GB/s, {machine.matmul_flops_s / 1e9:.1f} GFLOP/s{steps})",
                      flush=True)
        tok_s = {name: total / statistics.median(ts) for name, ts in times.items()}
        for name, ts in times.items():
            print(f"  {name:14s} {tok_s[name]:8.1f} output tok/s  (median {statistics.median(ts):.2f} s, "
                  f"{min(ts):.2f}-{max(ts):.2f}; {total} tokens verified)")
        print("  time over the workload's floor (median of rounds): " + ", ".join(
            f"{name} {statistics.median(x):.2f}x" for name, x in over_floor.items()))
        ref = outs["engine CB"]
        for name in systems:
            same = sum(outs[name][k] == ref[k] for k in ref)
            print(f"  greedy outputs identical to engine CB: {name:14s} {same}/{len(ref)} requests")
        pairs = [("engine CB", "HF CB"), ("engine CB", "HF generate"), ("engine static", "HF generate")]
        print("  by median tok/s: " + "   ".join(f"{a} / {b} = {tok_s[a] / tok_s[b]:.2f}" for a, b in pairs
                                                if a in tok_s and b in tok_s))
        if "HF CB" in times:
            rounds = [hf_s / engine_s for engine_s, hf_s in zip(times["engine CB"], times["HF CB"])]
            ratio[wname] = statistics.median(rounds)
            print(f"  engine CB / HF CB by round: {', '.join(f'{x:.2f}' for x in rounds)}; "
                  f"median {ratio[wname]:.2f}; an engine at the floor would read (HF CB's time over it): "
                  f"{statistics.median(over_floor['HF CB']):.2f}")
    if ratio:
        key = "long" if "long" in ratio else next(iter(ratio))
        print(f"engine_vs_hf_cb={ratio[key]:.2f}")


if __name__ == "__main__":
    main()
