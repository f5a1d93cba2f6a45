"""What a prefix-cache hit costs in this engine against what it saves: seconds per token to copy
KV between a request's slot and the prefix store (engine/model/prefix_store.py), each way, and
seconds per token of the prefill it replaces (a 512-token prompt, and a 128-token chunk after
384 cached tokens, the shape a hit leaves).

    flock /tmp/miniserve-bench.lock python benchmarks/prefix_copy.py [--model qwen2_5_0_5b] [--threads 2]

Last line: ``prefix_copy_s_per_hit_token=<load> save=<save> prefill_s_per_token=<prefill>``.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from calibration.kv_copy import measure_kv_copy
from engine.core.config import ModelConfig, SchedulerConfig
from engine.core.plan import BatchPlan
from engine.core.request import Request
from engine.model.runner import ModelRunner


def prefill_s(runner: ModelRunner, tokens: int, context: int, repeats: int) -> float:
    """Median seconds of a prefill chunk of ``tokens`` after ``context`` tokens already in the slot."""
    g = torch.Generator().manual_seed(0)
    times = []
    for k in range(repeats + 1):
        rid = f"p{k}"
        request = Request(rid, torch.randint(0, runner.vocab_size, (context + tokens,), generator=g).tolist(), 1)
        plans = ([BatchPlan.of("bench", [rid], [context], [0], [False], 0)] if context else []) + [
            BatchPlan.of("bench", [rid], [tokens], [context], [True], 0)]
        for plan in plans:
            duration = runner.execute(plan, {rid: request}).duration_s
        runner.free([rid])
        if k:
            times.append(duration)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2_5_0_5b")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    runner = ModelRunner(ModelConfig(name=args.model, dtype=args.dtype, num_threads=args.threads),
                         SchedulerConfig(max_num_seqs=2, max_model_len=1100))
    copy = measure_kv_copy(runner, repeats=args.repeats)
    whole = prefill_s(runner, 512, 0, args.repeats) / 512
    tail = prefill_s(runner, 128, 384, args.repeats) / 128
    print(f"model {args.model} {args.dtype}, {args.threads} threads, block {copy.block_size}, sizes {copy.sizes}")
    print(f"copy store → slot (a hit):            {copy.load_s_per_token * 1e6:8.2f} µs/token "
          f"(+{copy.load_fixed_s * 1e6:.0f} µs a call)")
    print(f"copy slot → store (a computed block):  {copy.save_s_per_token * 1e6:8.2f} µs/token "
          f"(+{copy.save_fixed_s * 1e6:.0f} µs a call)")
    print(f"prefill, 512-token prompt:             {whole * 1e6:8.2f} µs/token")
    print(f"prefill, 128 tokens after 384:         {tail * 1e6:8.2f} µs/token")
    print(f"a hit token costs {copy.load_s_per_token / whole:.2%} of computing it; storing a block "
          f"adds {copy.save_s_per_token / whole:.2%} to computing it")
    print(f"prefix_copy_s_per_hit_token={copy.load_s_per_token:.3e} save={copy.save_s_per_token:.3e} "
          f"prefill_s_per_token={whole:.3e}")


if __name__ == "__main__":
    main()
