"""The dispatch table this machine chose (engine/model/kernels/dispatch.py): per dtype, each linear
candidate's time per row class and the one chosen, and each phase's attention (decodes, a prefill
chunk): miniserve's kernel against SDPA.

The first run on a machine measures it (a few seconds per dtype) and caches it beside the compiled
kernels; later runs print the cached table (``--remeasure`` times it again).

    flock /tmp/miniserve-bench.lock python benchmarks/dispatch_table.py [--dtypes float32,bfloat16]
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from engine.model.kernels import dispatch
from engine.model.kernels.features import cache_sizes, cpu_features, cpu_model


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--remeasure", action="store_true")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    torch.set_num_threads(args.threads)
    key = dispatch.machine_key()
    path = dispatch.table_path(key)
    if args.remeasure:
        path.unlink(missing_ok=True)
        dispatch._TABLES.clear()
    print(f"cpu: {cpu_model()}; features allowed: {sorted(cpu_features())}; caches: "
          + ", ".join(f"{k} {v >> 10} KiB" for k, v in cache_sizes().items()) + f"; threads {torch.get_num_threads()}")
    print(f"table: {path}")
    for d in args.dtypes.split(","):
        dtype = getattr(torch, d)
        table = dispatch.table(dtype)
        lin = table.timings[d]["linear"]
        cands = dispatch.linear_candidates(dtype)
        tuning = table.gemv_tuning(dtype)
        if not lin:  # one candidate runs here: taken without timing
            print(f"\n{d}: linears: only {', '.join(cands)} runs on this machine (not timed)")
        else:
            cols = cands + (["gemv_amx"] if "gemv_amx" in lin[str(dispatch.ROW_CLASSES[0])] else [])
            print(f"\n{d}: ms per pass over {table.timings[d].get('probe_mib', '?')} MiB of layers; gemv_amx: the "
                  f"gemv on AMX tiles, which it runs from {tuning.amx_rows or 'no'} rows on")
            print(f"{d}: {'rows':>5s} " + " ".join(f"{c:>10s}" for c in cols) + "   chosen")
            for rows, choice in zip(dispatch.ROW_CLASSES, table.linear[d]):
                t = lin[str(rows)]
                print(f"{d}: {rows:5d} " + " ".join(f"{1e3 * t[c]:10.3f}" for c in cols) + f"   {choice}")
        for rows, t in table.timings[d].get("gemv_prefetch", {}).items():  # "distance,l2" or "stream_rows"
            def name(key: str) -> str:
                if "," not in key:
                    return f"one sweep up to {key} rows"
                distance, l2 = key.split(",")
                return f"{int(distance) >> 10} KiB into {'L2' if l2 == '1' else 'L1'}" if int(distance) else "none"
            count = rows.removesuffix(dispatch.ONE_THREAD).removesuffix(dispatch.SWEEPS)
            where = f"{count} rows" + (" on one thread" if rows.endswith(dispatch.ONE_THREAD) else "")
            print(f"{d}: gemv tuning at {where}: " + ", ".join(f"{name(k)} {1e3 * s:.3f} ms" for k, s in t.items()))
        print(f"{d}: gemv tuning chosen: {tuning}")
        shapes = {"decode": "8 decodes x 256 keys", "prefill": "a 128-token chunk after 128"}
        for phase in dispatch.PHASES:
            att = table.timings[d]["attention"][phase]
            print(f"{d}: {phase} attention ({shapes[phase]}): "
                  + ", ".join(f"{c} {1e3 * t:.3f} ms" for c, t in att.items())
                  + f" -> {table.attention_choice(dtype, phase)}")
        print(f"dispatch_{d}=" + ",".join(f"{r}:{c}" for r, c in zip(dispatch.ROW_CLASSES, table.linear[d]))
              + "".join(f";{p}_attention:{table.attention_choice(dtype, p)}" for p in dispatch.PHASES))


if __name__ == "__main__":
    main()
