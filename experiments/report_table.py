"""Plain-text tables for the terminal (no extra dependency)."""

from __future__ import annotations


def format_table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    line = lambda cells: "  ".join(str(c).rjust(w) for c, w in zip(cells, widths))  # noqa: E731
    return "\n".join([line(header), line(["-" * w for w in widths]), *map(line, rows)])


def format_seed_table(results: dict, max_num_seqs: int) -> str:
    """The seed's result table: work, calls, throughput, latency and occupancy per scheduler."""
    header = ["scheduler", "out tok", "calls (pre/dec)", "out tok/s", "TTFT mean/p50/p99 s",
              "E2E mean/p50/p99 s", f"at max={max_num_seqs}", "below max", "gaps ms"]
    rows = []
    for name, r in results.items():
        t, e = r["ttft_s"], r["e2e_s"]
        rows.append([
            name, r["output_tokens"], f"{r['model_calls']} ({r['prefill_calls']}/{r['decode_calls']})",
            f"{r['output_throughput_tok_s']:.2f}",
            f"{t['mean']:.3f}/{t['p50']:.3f}/{t['p99']:.3f}", f"{e['mean']:.3f}/{e['p50']:.3f}/{e['p99']:.3f}",
            f"{100 * r['occupancy_at_max']:.1f}%", f"{100 * (1 - r['occupancy_at_max']):.1f}%",
            f"{1000 * r['gap_s']:.1f}",
        ])
    return format_table(header, rows)


def format_side_by_side(real: dict, sim: dict) -> str:
    """Real and simulated seed rows next to each other, with the simulator's relative error."""

    def err(r: float | None, s: float | None) -> str:
        return f"{100 * (s - r) / r:+.1f}%" if r and s is not None else "n/a"

    def show(fmt: str, value) -> str:
        return "n/a" if value is None else fmt.format(value)

    header = ["scheduler", "metric", "real", "sim", "sim err"]
    rows = []
    for name, r in real.items():
        s = sim[name]
        for label, get, fmt in (
            ("out tok/s", lambda x: x["output_throughput_tok_s"], "{:.2f}"),
            ("model calls", lambda x: x["model_calls"], "{:d}"),
            ("TTFT p50 s", lambda x: x["ttft_s"]["p50"], "{:.3f}"),
            ("TTFT p99 s", lambda x: x["ttft_s"]["p99"], "{:.3f}"),
            ("E2E p50 s", lambda x: x["e2e_s"]["p50"], "{:.3f}"),
            ("E2E p99 s", lambda x: x["e2e_s"]["p99"], "{:.3f}"),
            ("occupancy at max", lambda x: x["occupancy_at_max"], "{:.3f}"),
            # real: around the run; sim: over its calibration (the median of its stamps). Decode
            # runs at memory speed, so a gap here explains a gap above (calibration.roofline.MemoryStamp)
            ("memory GB/s", lambda x: x.get("memory_read_gb_s"), "{:.0f}"),
            # the process's own decode weights: slower than the line above where they landed in slow memory
            ("weights GB/s", lambda x: x.get("weights_read_gb_s"), "{:.0f}"),
        ):
            rows.append([name, label, show(fmt, get(r)), show(fmt, get(s)), err(get(r), get(s))])
    return format_table(header, rows)
