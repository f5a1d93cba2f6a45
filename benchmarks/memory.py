"""Peak resident memory of a ModelRunner, one fresh process per measurement: after the model is built
and packed, and after a few calls (prefill 512, decodes), against one copy of the weights plus the KV slots
(issue 16's target: peak at most 1.5x one copy plus the KV slots), with the linear candidates the
runner kept a layout of the weights for.

Why fresh processes: ``ru_maxrss`` only grows, so each figure needs its own process.

    python benchmarks/memory.py [--models qwen2_5_0_5b,qwen2_5_1_5b] [--dtypes float32]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def child(model: str, dtype: str, threads: int, root: str) -> None:
    sys.path.insert(0, root)
    sys.path.insert(0, str(ROOT / "benchmarks"))  # calls.shape_plan: the same in every checkout
    import torch
    from calls import shape_plan

    from engine.core.config import ModelConfig, SchedulerConfig
    from engine.model.runner import ModelRunner

    sched = SchedulerConfig(max_num_seqs=8, max_model_len=1024)
    runner = ModelRunner(ModelConfig(name=model, dtype=dtype, num_threads=threads), sched)
    built = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    for contexts, chunks in (([0], [512]), ([256] * 8, [1] * 8)):
        plan, reqs = shape_plan(runner, contexts, chunks, f"m{len(contexts)}_")
        runner.execute(plan, reqs)
        runner.free(plan.request_ids)
    params = {id(p): p for p in runner.model.parameters()}
    weights = sum(p.numel() for p in params.values()) * next(iter(params.values())).element_size()
    cfg = runner.model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    kv = 2 * cfg.num_hidden_layers * sched.max_num_seqs * cfg.num_key_value_heads * 1024 * head_dim * \
        torch.empty((), dtype=getattr(torch, dtype)).element_size()
    lean = runner._lean
    layouts = sorted(set(lean.choices)) if lean is not None else ["stock model"]
    print(json.dumps({"layouts": layouts, "built": built, "peak": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                      "weights": weights, "kv": kv}))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="qwen2_5_0_5b,qwen2_5_1_5b")
    ap.add_argument("--dtypes", default="float32")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--root", default=str(ROOT), help="the checkout to measure (another one: before/after)")
    ap.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(*args.child, args.threads, args.root)
        return
    print(f"checkout {args.root}; peak RSS per fresh process (GB); one copy = the model's parameters' bytes; "
          f"KV = the slots' full size (committed when the runner starts)")
    for model in args.models.split(","):
        for dtype in args.dtypes.split(","):
            env = dict(os.environ, PYTHONPATH=args.root)
            out = subprocess.run([sys.executable, __file__, "--root", args.root, "--child", model, dtype,
                                  "--threads", str(args.threads)], capture_output=True, text=True, env=env,
                                 cwd=args.root)
            line = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
            if not line:
                print(f"{model} {dtype}: failed\n{out.stderr[-2000:]}")
                continue
            r = json.loads(line[-1])
            gb = 1e9
            print(f"{model} {dtype}: built {r['built'] / gb:5.2f} GB, peak {r['peak'] / gb:5.2f} GB; one copy "
                  f"{r['weights'] / gb:5.2f} GB, KV {r['kv'] / gb:4.2f} GB; peak / copy "
                  f"{r['peak'] / r['weights']:.2f}x, (peak - KV) / copy {(r['peak'] - r['kv']) / r['weights']:.2f}x "
                  f"(target <= 1.50x: {'met' if r['peak'] <= 1.5 * r['weights'] + r['kv'] else 'missed'}); "
                  f"linears on {'+'.join(r.get('layouts', ['?']))}", flush=True)


if __name__ == "__main__":
    main()
