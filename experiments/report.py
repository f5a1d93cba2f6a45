"""Figures and a markdown summary from run directories (reads files only, never runs anything).

    python -m experiments.report [sweep_dir=multirun/DATE/TIME] [validate_dir=DIR] [seed_dir=DIR]
        [prefix_dir=DIR] ["goodput=ttft:2000 tpot:200"] [hydra.run.dir=OUT]

Any subset of the four inputs. Writes PNGs and summary.md (embedding them) into OUT.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import hydra
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402
import seaborn as sns  # noqa: E402
from hydra.core.hydra_config import HydraConfig  # noqa: E402

from engine.observe.metrics import read_requests_csv  # noqa: E402
from engine.observe.results import Goodput  # noqa: E402
from engine.observe.trace import read_calls  # noqa: E402
from experiments.schema import register, to_object  # noqa: E402


@dataclass
class ReportApp:
    sweep_dir: str | None = None
    validate_dir: str | None = None
    seed_dir: str | None = None
    prefix_dir: str | None = None  # an experiments.prefix output dir
    goodput: str | None = None  # SLO lines on the sweep's latency panels, vLLM's --goodput syntax (ms)


register("report_schema", ReportApp)


def load_sweep(sweep_dir: Path) -> pd.DataFrame:
    """One row per job: what it was (job.json) and its headline metrics (metrics.json)."""
    rows = []
    for job_file in sorted(sweep_dir.glob("**/job.json")):
        job = json.loads(job_file.read_text())
        m = json.loads((job_file.parent / "metrics.json").read_text())
        rows.append({**{k: v for k, v in job.items() if not isinstance(v, dict)}, "dir": str(job_file.parent),
                     "output_tok_s": m["output_throughput_tok_s"], "ttft_p50_s": m["ttft_s"]["p50"],
                     "ttft_p99_s": m["ttft_s"]["p99"], "tpot_p99_s": m["tpot_s"]["p99"],
                     "e2e_p50_s": m["e2el_s"]["p50"], "e2e_p99_s": m["e2el_s"]["p99"],
                     "prefix_hit_rate": m.get("prefix_hit_rate", 0.0)})
    if not rows:
        raise FileNotFoundError(f"no job.json under {sweep_dir}: is it an experiments.sweep output dir?")
    return pd.DataFrame(rows)


RATE_PANELS = (("output_tok_s", "output tok/s", None), ("ttft_p99_s", "TTFT p99 (s)", "ttft_ms"),
               ("tpot_p99_s", "TPOT p99 (s)", "tpot_ms"), ("e2e_p99_s", "E2E p99 (s)", "e2el_ms"))


def plot_rate_curves(df: pd.DataFrame, path: Path, goodput: Goodput = Goodput()) -> None:
    """Throughput and p99 latencies (log) against arrival rate (log); a column per batch cap, a
    line per scheduler, sim and real overlaid. Each configuration's simulated saturation rate is a
    dotted vertical in its scheduler's colour (the knee sits there); SLOs are grey horizontals."""
    caps = sorted(df["max_num_seqs"].unique())
    schedulers = list(dict.fromkeys(df["scheduler"]))
    colours = dict(zip(schedulers, sns.color_palette(n_colors=len(schedulers))))
    backends = list(dict.fromkeys(df["backend"]))
    styles = dict(zip(backends, ("-", "--", ":")))
    fig, axes = plt.subplots(len(RATE_PANELS), len(caps), figsize=(3.6 * len(caps), 2.4 * len(RATE_PANELS)),
                             sharex="col", sharey="row", squeeze=False)
    for j, cap in enumerate(caps):
        at_cap = df[df["max_num_seqs"] == cap]
        for i, (column, label, slo) in enumerate(RATE_PANELS):
            ax = axes[i, j]
            for (scheduler, backend), g in at_cap.groupby(["scheduler", "backend"], sort=False):
                g = g.sort_values("rate")
                ax.plot(g["rate"], g[column], styles[backend], marker="o", ms=3, color=colours[scheduler],
                        label=f"{scheduler} ({backend})")
            if "saturation_req_s" in at_cap:
                for scheduler, sat in at_cap.groupby("scheduler")["saturation_req_s"].first().dropna().items():
                    ax.axvline(sat, color=colours[scheduler], ls=":", lw=1)
            if slo and getattr(goodput, slo) is not None:
                ax.axhline(getattr(goodput, slo) / 1e3, color="grey", lw=1, ls="--")
            ax.set_xscale("log")
            if column != "output_tok_s":
                ax.set_yscale("log")
            if j == 0:
                ax.set_ylabel(label)
            if i == 0:
                ax.set_title(f"max_num_seqs={cap}", fontsize=9)
            if i == len(RATE_PANELS) - 1:
                ax.set_xlabel("arrival rate (req/s)")
            ax.grid(True, which="major", lw=0.3)
    handles, labels = axes[0, 0].get_legend_handles_labels()
    handles.append(plt.Line2D([], [], color="black", ls=":", lw=1))
    labels.append("saturation (simulated burst)")
    if goodput:
        handles.append(plt.Line2D([], [], color="grey", ls="--", lw=1))
        labels.append(f"SLO ({goodput.spec()})")
    fig.legend(handles, labels, loc="lower center", ncol=min(4, len(labels)), fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_latency_cdfs(run_dirs: dict[str, Path], path: Path) -> None:
    """TTFT and E2E CDFs, one line per run."""
    rows = []
    for name, d in run_dirs.items():
        for r in read_requests_csv(d / "requests.csv"):
            rows += [{"run": name, "metric": "TTFT (s)", "value": r.ttft_s},
                     {"run": name, "metric": "E2E (s)", "value": r.e2e_s}]
    g = sns.displot(pd.DataFrame(rows), x="value", hue="run", col="metric", kind="ecdf", height=3,
                    facet_kws={"sharex": False})
    g.figure.savefig(path, dpi=110)
    plt.close(g.figure)


def plot_active_over_time(traces: dict[str, Path], path: Path) -> None:
    """Requests in each model call over time: the static batch's 8-6-4-2 staircase, continuous refill."""
    fig, axes = plt.subplots(len(traces), 1, figsize=(8, 1.8 * len(traces)), sharex=True, squeeze=False)
    for ax, (name, trace) in zip(axes[:, 0], traces.items()):
        calls = read_calls(trace)
        t0 = calls[0].start_s if calls else 0.0
        ax.bar([c.start_s - t0 for c in calls], [c.active for c in calls], width=[c.dur_s for c in calls],
               align="edge", color=sns.color_palette()[0])
        ax.set_ylabel(name, rotation=0, ha="right")
    axes[-1, 0].set_xlabel("time (s)")
    fig.suptitle("active requests per model call")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_seed_occupancy(seed: dict, path: Path) -> None:
    """The seed's occupancy bars: share of model busy time at each active batch size."""
    rows = [{"scheduler": name, "active": int(a), "share": t / r["busy_s"]}
            for name, r in seed.items() for a, t in r["busy_s_by_active"].items()]
    df = pd.DataFrame(rows).pivot_table(index="scheduler", columns="active", values="share", fill_value=0.0)
    df = df.reindex([n for n in seed if n in df.index])
    ax = df.plot(kind="barh", stacked=True, figsize=(7, 2.5), colormap="viridis")
    ax.set_xlabel("share of model busy time")
    ax.legend(title="active", bbox_to_anchor=(1.0, 1.0), fontsize=7)
    ax.figure.tight_layout()
    ax.figure.savefig(path, dpi=110)
    plt.close(ax.figure)


def plot_sim_vs_real(validation: pd.DataFrame, path: Path) -> None:
    """Each metric of each validated run: simulated against real, on log axes around y = x."""
    g = sns.relplot(data=validation, x="real", y="sim", hue="scheduler", style="workload", col="metric",
                    col_wrap=4, height=2.4, facet_kws={"sharex": False, "sharey": False})
    for ax in g.axes.flat:
        lo = min(ax.get_xlim()[0], ax.get_ylim()[0])
        hi = max(ax.get_xlim()[1], ax.get_ylim()[1])
        ax.plot([lo, hi], [lo, hi], color="grey", lw=0.8)
    g.figure.savefig(path, dpi=110)
    plt.close(g.figure)


PREFIX_PANELS = (("ttft_p50_s", "TTFT p50 (s)"), ("ttft_p99_s", "TTFT p99 (s)"), ("output_tok_s", "output tok/s"),
                 ("prefill_tokens", "prefill tokens computed"))


def plot_prefix(table: dict[str, dict], path: Path) -> None:
    """experiments.prefix: caching off vs on, real beside simulated, one panel per metric."""
    rows = []
    for name, r in table.items():
        if "error" in name:
            continue
        caching, side = name.split()
        rows += [{"caching": caching, "run": side, "metric": label, "value": r[key]} for key, label in PREFIX_PANELS]
    df = pd.DataFrame(rows)
    g = sns.catplot(df, x="caching", y="value", hue="run", col="metric", kind="bar", sharey=False, height=3,
                    aspect=0.9, col_wrap=4)
    g.set_titles("{col_name}")
    g.set_axis_labels("prefix caching", "")
    g.figure.savefig(path, dpi=110)
    plt.close(g.figure)


def build_report(app: ReportApp, out_dir: Path) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    lines = ["# miniserve report", ""]

    def figure(title: str, name: str) -> None:
        lines.extend([f"## {title}", "", f"![{title}]({name})", ""])

    if app.seed_dir:
        seed_dir = Path(app.seed_dir)
        seed = json.loads((seed_dir / "seed.json").read_text())
        if (seed_dir / "seed_sim.json").is_file():  # simulated rows beside the real ones
            seed |= {f"{n} (sim)": r for n, r in json.loads((seed_dir / "seed_sim.json").read_text()).items()}
        traces = {n: seed_dir / r["trace"] for n, r in seed.items()}  # each run's files sit beside its trace
        plot_seed_occupancy(seed, out_dir / "seed_occupancy.png")
        figure("Seed burst: busy time by active batch size", "seed_occupancy.png")
        plot_active_over_time(traces, out_dir / "seed_active.png")
        figure("Seed burst: active requests per model call", "seed_active.png")
        plot_latency_cdfs({n: t.parent for n, t in traces.items()}, out_dir / "seed_latency_cdf.png")
        figure("Seed burst: latency CDFs", "seed_latency_cdf.png")
    if app.sweep_dir:
        df = load_sweep(Path(app.sweep_dir))
        df.to_csv(out_dir / "sweep.csv", index=False)
        plot_rate_curves(df, out_dir / "sweep_rate_curves.png", Goodput.parse(app.goodput))
        figure("Throughput and p99 latency against arrival rate", "sweep_rate_curves.png")
    if app.validate_dir:
        validation = pd.read_csv(Path(app.validate_dir) / "validation.csv")
        plot_sim_vs_real(validation, out_dir / "sim_vs_real.png")
        figure("Simulated against real", "sim_vs_real.png")
        worst = validation.groupby("metric")["rel_error"].agg(lambda s: s.abs().max())
        lines += ["| metric | worst error (relative; occupancy in points) |", "|---|---|"]
        lines += [f"| {metric} | {err:.1%} |" for metric, err in worst.items()] + [""]
    if app.prefix_dir:
        table = json.loads((Path(app.prefix_dir) / "prefix.json").read_text())["table"]
        plot_prefix(table, out_dir / "prefix.png")
        figure("Prefix caching off and on, real and simulated", "prefix.png")
        from experiments.prefix import table_text  # the app's own table: one format for both
        lines += [table_text(table), ""]
    if len(lines) == 2:
        raise ValueError("nothing to report: give sweep_dir, validate_dir, seed_dir and/or prefix_dir")
    summary = out_dir / "summary.md"
    summary.write_text("\n".join(lines))
    return summary


@hydra.main(version_base="1.3", config_path="../conf", config_name="report")
def main(cfg) -> None:
    app: ReportApp = to_object(cfg)
    print(f"wrote {build_report(app, Path(HydraConfig.get().runtime.output_dir))}")


if __name__ == "__main__":
    main()
