"""Chrome traces of model calls: written by the simulator, by torch.profiler for the engine,
and read by one analysis — the seed's, computed from the file."""

from __future__ import annotations

import json
import re
from collections import Counter, defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

LABEL_RE = re.compile(r"^miniserve\.(?P<scheduler>\w+)\.(?P<phase>\w+) (?P<args>(\w+=\d+ ?)+)$")


@dataclass(frozen=True)
class Call:
    label: str
    start_s: float
    dur_s: float
    active: int
    decodes: int
    prefills: int
    tokens: int | None

    @property
    def phase(self) -> str:
        if self.prefills == 0:
            return "decode"
        return "prefill" if self.decodes == 0 else "mixed"


def parse_label(label: str, start_s: float = 0.0, dur_s: float = 0.0) -> Call | None:
    """A model call from its region name (BatchPlan.label): ``miniserve.<scheduler>.<phase>``
    followed by numbers, either the step's mix (BatchPlan.label_fields: active, decode,
    prefill, tokens) or, for a call of one phase, its ``batch``."""
    m = LABEL_RE.match(label)
    if m is None:
        return None
    args = {k: int(v) for k, v in (kv.split("=", 1) for kv in m["args"].split())}
    if {"active", "decode", "prefill"} <= args.keys():
        return Call(label, start_s, dur_s, args["active"], args["decode"], args["prefill"], args.get("tokens"))
    if "batch" not in args or m["phase"] not in ("prefill", "decode"):
        return None
    batch = args["batch"]
    decodes = batch if m["phase"] == "decode" else 0
    return Call(label, start_s, dur_s, batch, decodes, batch - decodes, None)


def read_calls(path: Path) -> list[Call]:
    """Model-call regions of a Chrome trace (torch.profiler's or the simulator's), in time order."""
    data = json.loads(Path(path).read_text())
    events = data["traceEvents"] if isinstance(data, dict) else data
    calls = []
    for ev in events:
        if ev.get("ph") != "X" or not str(ev.get("name", "")).startswith("miniserve."):
            continue
        call = parse_label(ev["name"], float(ev["ts"]) / 1e6, float(ev["dur"]) / 1e6)
        if call is not None:
            calls.append(call)
    calls.sort(key=lambda c: c.start_s)
    return calls


def write_chrome_trace(calls: Iterable[tuple[str, float, float]], path: Path, process_name: str = "miniserve") -> None:
    """(label, start_s, dur_s) regions as a Chrome trace, in the same shape torch.profiler writes."""
    events = [{"name": "process_name", "ph": "M", "pid": 0, "tid": 0, "args": {"name": process_name}}]
    events += [{"name": label, "cat": "user_annotation", "ph": "X", "pid": 0, "tid": 0,
                "ts": start * 1e6, "dur": dur * 1e6} for label, start, dur in calls]
    Path(path).write_text(json.dumps({"traceEvents": events}))


@dataclass
class TraceSummary:
    """The seed's analysis: call counts and shapes, busy time by active size, occupancy, gaps."""

    max_num_seqs: int
    model_calls: int = 0
    calls_by_phase: dict[str, int] = field(default_factory=dict)
    calls_by_label: dict[str, int] = field(default_factory=dict)
    active_histogram: dict[int, int] = field(default_factory=dict)
    busy_s_by_active: dict[int, float] = field(default_factory=dict)
    busy_s: float = 0.0
    span_s: float = 0.0
    gap_s: float = 0.0
    max_gap_s: float = 0.0

    @property
    def occupancy_at_max(self) -> float:
        """Share of model busy time spent with ``max_num_seqs`` requests active."""
        return self.busy_s_by_active.get(self.max_num_seqs, 0.0) / self.busy_s if self.busy_s else 0.0

    @property
    def prefill_calls(self) -> int:
        """Calls that carry prompt work (pure prefill or mixed)."""
        return self.calls_by_phase.get("prefill", 0) + self.calls_by_phase.get("mixed", 0)

    @property
    def decode_calls(self) -> int:
        return self.calls_by_phase.get("decode", 0)

    def to_dict(self) -> dict:
        return {
            "model_calls": self.model_calls, "prefill_calls": self.prefill_calls,
            "decode_calls": self.decode_calls, "calls_by_phase": self.calls_by_phase,
            "calls_by_label": self.calls_by_label,
            "active_histogram": {str(k): v for k, v in sorted(self.active_histogram.items())},
            "busy_s_by_active": {str(k): v for k, v in sorted(self.busy_s_by_active.items())},
            "busy_s": self.busy_s, "span_s": self.span_s, "gap_s": self.gap_s, "max_gap_s": self.max_gap_s,
            "occupancy_at_max": self.occupancy_at_max, "occupancy_below_max": 1.0 - self.occupancy_at_max,
        }


def summarize_calls(calls: list[Call], max_num_seqs: int) -> TraceSummary:
    busy: dict[int, float] = defaultdict(float)
    for c in calls:
        busy[c.active] += c.dur_s
    gaps = [max(0.0, b.start_s - (a.start_s + a.dur_s)) for a, b in zip(calls, calls[1:])]
    return TraceSummary(
        max_num_seqs=max_num_seqs,
        model_calls=len(calls),
        calls_by_phase=dict(Counter(c.phase for c in calls)),
        calls_by_label=dict(Counter(c.label for c in calls)),
        active_histogram=dict(Counter(c.active for c in calls)),
        busy_s_by_active=dict(busy),
        busy_s=sum(c.dur_s for c in calls),
        span_s=(calls[-1].start_s + calls[-1].dur_s - calls[0].start_s) if calls else 0.0,
        gap_s=sum(gaps),
        max_gap_s=max(gaps, default=0.0),
    )


def summarize_trace(path: Path, max_num_seqs: int) -> TraceSummary:
    return summarize_calls(read_calls(path), max_num_seqs)
