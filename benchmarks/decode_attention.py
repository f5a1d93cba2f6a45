"""miniserve's attention kernel (engine/model/kernels/decode_attention.cpp) against SDPA, in one process.

1. One layer's decode attention as the engine calls it (engine.model.attention.ragged_attention over a
   SlotKVCache layer), for B requests at context C: SDPA over a masked view of the slots, then the
   kernel, alternating call by call. Prints ms per layer, GB/s of keys and values read, speedup.
2. One layer's attention for one prefill chunk of N tokens after C cached ones (the kernel: one row
   per token; SDPA: causal over the chunk's slot), alternating the same way.
3. Whole decode calls through ModelRunner, the kernel switched off and on call by call
   (benchmarks/calls.py): B=1, 8, 32 at context 256, B=8 at context 1024 and B=1 at 4096.

    flock /tmp/miniserve-bench.lock python benchmarks/decode_attention.py [--dtypes float32,bfloat16]
"""

from __future__ import annotations

import functools
import statistics

import torch
from calls import alternate, bench_runner, kernel_bench_args, time_alternating

from engine.model import kernels
from engine.model.attention import KERNEL_PHASES, RaggedBatch, ragged_attention
from engine.model.runner import ModelRunner

LAYER_SHAPES = [(1, 256), (8, 256), (32, 256), (8, 1024), (32, 1024), (1, 4096)]  # (requests, context)
CALL_SHAPES = [(1, 256), (8, 256), (32, 256), (8, 1024), (1, 4096)]
CHUNK_SHAPES = [(128, 0), (512, 0), (256, 256)]  # (chunk tokens, cached context)


def layer_rates(runner: ModelRunner, kernel, dtype: torch.dtype, repeats: int) -> None:
    cfg = runner.model.config
    heads, d = cfg.num_attention_heads, runner.cache.keys[0].shape[-1]
    keys, values = runner.cache.keys[0], runner.cache.values[0]
    keys.normal_(), values.normal_()  # finite, arbitrary: cost does not depend on values
    esize = torch.empty((), dtype=dtype).element_size()
    for b, ctx in LAYER_SHAPES:
        if b > keys.shape[0] or ctx + 1 > keys.shape[2]:
            continue
        slots = list(range(b))
        query = torch.randn(1, heads, b, d).to(dtype)
        batches = [RaggedBatch.build(slots, [1] * b, [ctx] * b, "ragged", k) for k in (None, kernel)]
        times = time_alternating([functools.partial(ragged_attention, None, query, keys, values, batch,
                                                    scaling=d ** -0.5) for batch in batches], repeats, warm=2)
        sdpa, mine = (statistics.median(t) for t in times)
        kv_bytes = 2 * b * cfg.num_key_value_heads * (ctx + 1) * d * esize
        print(f"  B={b:<3d} ctx={ctx:<5d} SDPA {1e3 * sdpa:6.3f} ms {kv_bytes / sdpa / 1e9:5.1f} GB/s | kernel "
              f"{1e3 * mine:6.3f} ms {kv_bytes / mine / 1e9:5.1f} GB/s | speedup "
              f"{statistics.median(a / c for a, c in zip(*times)):.2f}", flush=True)


def chunk_rates(runner: ModelRunner, kernel, dtype: torch.dtype, repeats: int) -> None:
    cfg = runner.model.config
    heads, d = cfg.num_attention_heads, runner.cache.keys[0].shape[-1]
    keys, values = runner.cache.keys[0], runner.cache.values[0]
    for n, ctx in CHUNK_SHAPES:
        query = torch.randn(1, heads, n, d).to(dtype)
        batches = [RaggedBatch.build([0], [n], [ctx], "ragged", k) for k in (None, kernel)]
        times = time_alternating([functools.partial(ragged_attention, None, query, keys, values, batch,
                                                    scaling=d ** -0.5) for batch in batches], repeats, warm=2)
        sdpa, mine = (statistics.median(t) for t in times)
        print(f"  chunk of {n:<4d} after {ctx:<4d} SDPA {1e3 * sdpa:6.3f} ms | kernel {1e3 * mine:6.3f} ms | speedup "
              f"{statistics.median(a / c for a, c in zip(*times)):.2f}", flush=True)


def model_calls(runner: ModelRunner, kernel, dtype_name: str, repeats: int) -> list[str]:
    if runner._lean is not None:
        runner._lean.stack = None  # the Python loop on both arms: the kernel's effect alone

    def switch(on: bool) -> None:
        runner.attention_kernel, runner.kernel_phases = (kernel, KERNEL_PHASES) if on else (None, frozenset())

    last = []
    for b, ctx in CALL_SHAPES:
        ab = alternate(runner, [ctx] * b, [1] * b, switch, repeats)
        print(ab.line(f"B={b} ctx={ctx}", "SDPA", "with kernel"), flush=True)
        if ctx == 256 and b in (8, 32):
            last.append(f"decode_attention_speedup_call_b{b}_{dtype_name}={ab.speedup:.2f}")
    return last


def main() -> None:
    args = kernel_bench_args(__doc__)
    last = []
    for d in args.dtypes.split(","):
        runner = bench_runner(args, d, max_model_len=4160)
        kernel = kernels.decode_attention(getattr(torch, d), runner.cache.keys[0].shape[-1])
        print(f"{d}: the dispatch table has the kernel attend {sorted(runner.kernel_phases) or 'no phase'} "
              "of a step here, SDPA the rest")
        if kernel is None:
            print(f"{d}: no attention kernel on this machine (fp32 needs AVX2, bf16 AVX-512, and a C++ "
                  "compiler); every step attends with SDPA")
            continue
        print(f"{d}: one layer's decode attention, SDPA and the kernel alternating (threads={torch.get_num_threads()})")
        layer_rates(runner, kernel, getattr(torch, d), args.repeats * 5)
        print(f"{d}: one layer's attention for one prefill chunk, SDPA and the kernel alternating")
        chunk_rates(runner, kernel, getattr(torch, d), args.repeats * 3)

        print(f"{d}: decode calls, kernel off/on alternating")
        last += model_calls(runner, kernel, d, args.repeats)
        del runner
    print(" ".join(last))


if __name__ == "__main__":
    main()
