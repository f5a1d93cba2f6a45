"""The calibration's report: a table of fit errors and a figure of predicted vs measured calls."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from calibration.cost_model import slow_placement, weights_read_gb_s

NOISY_SPREAD = 0.10  # a median repeat spread past this: the report says the errors are the machine's


def _row(name: str, e: dict) -> str:
    return (f"{name:<22} {e['n']:>5} {100 * e['mape']:>8.2f} {100 * e['median_error']:>10.2f} "
            f"{100 * e['max_error']:>9.2f} {e['r2']:>7.3f}")


def error_table_text(result) -> str:
    """Per-call errors of the fit (train, held out, held out by kind) and of the roofline."""
    info = result.cost_model.info
    fit = info["fit"]
    lines = [f"{'calls':<22} {'n':>5} {'MAPE %':>8} {'median %':>10} {'worst %':>9} {'R²':>7}",
             _row("train", fit["train"]), _row("held out", fit["heldout"])]
    if "heldout_as_timed" in fit:  # the held-out calls' own times, not put at the usual bandwidth
        lines.append(_row("  held out, as timed", fit["heldout_as_timed"]))
    lines += [_row(f"  held out {k}", e) for k, e in fit["by_kind_heldout"].items()]
    lines.append(_row("roofline (held out)", fit["roofline_heldout"]))
    physical = info.get("physical")
    if physical:
        pfit = physical["fit"]
        lines += [_row("physical train", pfit["train"]), _row("physical held out", pfit["heldout"])]
        if "heldout_as_timed" in pfit:
            lines.append(_row("  held out, as timed", pfit["heldout_as_timed"]))
        lines += [_row(f"  held out {k}", e) for k, e in pfit["by_kind_heldout"].items()]
        lines.append(f"preferred for this model: {info.get('preferred')} (lower held-out MAPE); "
                     "other models and what-if hardware use the physical one")
    machine = info["roofline"]["machine"]
    ovh = info["step_overhead"]
    lines.append(f"\nmachine: {machine['bandwidth_bytes_s'] / 1e9:.1f} GB/s, "
                 f"{machine['matmul_flops_s'] / 1e9:.0f} GFLOP/s; measured/roofline median "
                 f"{fit['measured_over_roofline_median']:.2f}")
    lines.append(weights_line(info))
    lines.append(f"step overhead outside the model call: median {1e3 * ovh['median_s']:.2f} ms, "
                 f"{100 * ovh['share_of_busy']:.1f}% of model time ({ovh['steps']} steps)")
    grid = info["grid"]
    timed = sum(len(m["times_s"]) for m in info["measurements"] if m["kind"] != "engine")
    lines.append(f"grid {grid['name']}: {grid['calls']} shapes, {timed} timed calls, "
                 f"{grid['contended_retries']} contended calls re-measured, plus {grid.get('engine_calls', 0)} "
                 f"calls timed inside engine runs ({grid.get('engine_shapes', grid.get('engine_calls', 0))} shapes); "
                 f"{grid['wall_s']:.1f} s")
    # how far this machine moved one call while it measured, which no cost model can predict
    spread = info["noise"]["shape_spread"]  # (calibration.noise.noise_report)
    lines.append(f"repeats of one shape spread (max − min) / median: median {100 * spread['median']:.1f}%, "
                 f"90th percentile {100 * spread['p90']:.1f}%"
                 + ("; this machine was noisy while it measured: errors of that order are its noise, not the "
                    "model's (calibrate again when it is quieter)" if spread["median"] > NOISY_SPREAD else ""))
    usual = grid.get("at_usual_bandwidth")
    if usual:
        low, high = usual["call_stamps_p10_p90"]
        lines.append(f"every call stamped by a read of its weights ({usual['call_stamps']} stamps, p10–p90 "
                     f"{low:.1f}–{high:.1f} GB/s) and put at the usual {usual['usual_weights_gb_s']:.1f} by its "
                     f"memory-bound share: repeats' spread median {100 * usual['shape_spread_median_as_timed']:.1f}% "
                     f"as timed, {100 * usual['shape_spread_median_at_usual']:.1f}% at the usual bandwidth "
                     "(the fit and the held-out rows use the latter; 'as timed' above: the same rows as timed)")
    cuts = grid.get("budget", {}).get("cuts")
    if cuts:
        lines.append(f"cut to fit calibration.time_budget_s: {'; '.join(cuts)}")
    return "\n".join(lines)


def weights_line(info: dict) -> str:
    """This process's own decode weights' read rate beside a fresh buffer's of their dtype read the
    same way (calibration.roofline.MemoryStamp), and a warning where the weights read much slower:
    the profile's decode calls then ran slower than a process whose weights landed elsewhere."""
    weights = weights_read_gb_s(info)
    if weights is None:
        return "decode weights' own read rate not stamped (opaque packed copies, or not a CPU)"
    fresh = info["weights_read_gb_s"].get("fresh")
    if fresh is None:  # a profile stamped before the like-for-like buffer: no judgement
        return f"decode weights read at {weights:.1f} GB/s"
    line = f"decode weights read at {weights:.1f} GB/s, a fresh buffer of theirs at {fresh:.1f}"
    paired = info["weights_read_gb_s"].get("placement")
    if paired is not None:
        line += f" ({paired:.2f}x of it, read back to back)"
    slow = slow_placement(info)
    if slow is not None:
        line += (f": the weights read {100 * (1 - slow):.0f}% slower than fresh memory, where they "
                 "landed for this process's life, and its decode calls, so this profile's predictions of "
                 "them, are slower than a process whose weights did not (calibrate again: a new process)")
    return line


def plot_calibration(result, path: Path) -> None:
    """Left: predicted vs measured per call (log-log, fit and roofline). Right: relative residual
    of the fit by call kind against the call's token count."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import pandas as pd
    import seaborn as sns

    df = pd.DataFrame(result.cost_model.info["measurements"])
    df["split"] = np.where(df["heldout"], "held out", "fit")
    df["residual %"] = 100 * (df["predicted_s"] - df["median_s"]) / df["median_s"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 5))
    sns.scatterplot(data=df, x="median_s", y="predicted_s", hue="kind", style="split", ax=ax1)
    sns.scatterplot(data=df, x="median_s", y="roofline_s", color="grey", marker=".", ax=ax1, label="roofline")
    lo, hi = df[["median_s", "predicted_s", "roofline_s"]].min().min(), df[["median_s", "predicted_s"]].max().max()
    ax1.plot([lo, hi], [lo, hi], "k--", lw=1)
    ax1.set(xscale="log", yscale="log", xlabel="measured s (median)", ylabel="predicted s",
            title="per call: cost model and roofline vs measured")
    sns.scatterplot(data=df, x="tokens", y="residual %", hue="kind", style="split", ax=ax2, legend=False)
    ax2.axhline(0, color="k", lw=1)
    ax2.set(xscale="log", title="fit residual by shape (tokens in the call)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
