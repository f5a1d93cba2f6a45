"""Reading request traces: the public formats, told apart by their header, and one error style.

Each row becomes (arrival seconds, prompt tokens, output tokens) and, where the trace carries
prompt identity (Mooncake's ``hash_ids``), the prompt's segments (engine/observe/prompts.py), so
equal block hashes become equal token prefixes. Formats (README, "Traces"):

| format | columns |
|---|---|
| miniserve | ``arrival_s,prompt_tokens,output_tokens`` (also the requests.csv a run writes) |
| Splitwise / Vidur | ``arrived_at,num_prefill_tokens,num_decode_tokens`` |
| Azure LLM inference 2023 / 2024 | ``TIMESTAMP,ContextTokens,GeneratedTokens`` (dates) |
| BurstGPT | ``Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type`` |
| Mooncake (JSONL) | ``{"timestamp": ms, "input_length", "output_length", "hash_ids": [...]}`` |

A row with no prompt or no output tokens is skipped and counted (BurstGPT logs failed requests
with 0 response tokens); a row that is not numbers, a negative length, times that go backwards,
a header no format matches and an empty trace are errors naming the file and line.
"""

from __future__ import annotations

import csv
import json
import math
import re
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import numpy as np

from engine.observe.prompts import MOONCAKE_BLOCK_TOKENS, Segments, mooncake_segments

# name -> (time column, prompt column, output column, time unit: seconds per unit or "date")
CSV_FORMATS: dict[str, tuple[str, str, str, float | str]] = {
    "miniserve": ("arrival_s", "prompt_tokens", "output_tokens", 1.0),
    "splitwise": ("arrived_at", "num_prefill_tokens", "num_decode_tokens", 1.0),
    "azure": ("TIMESTAMP", "ContextTokens", "GeneratedTokens", "date"),
    "burstgpt": ("Timestamp", "Request tokens", "Response tokens", 1.0),
}
SKIP_EMPTY = "with no prompt or output tokens"


@dataclass(frozen=True)
class TraceRows:
    """What reading a trace found: its format, rows in the file, rows left out (by reason), and the
    kept rows' arrays (times from the first kept row's clock) and segments (None: lengths only)."""

    path: str
    format: str
    rows: int
    skipped: dict[str, int]
    arrival_s: np.ndarray
    prompt_tokens: np.ndarray
    output_tokens: np.ndarray
    segments: tuple[Segments, ...] | None = None


def detect_format(path: str | Path) -> str:
    """The trace's format name: Mooncake if its first line is a JSON object, else the CSV format
    whose columns its header has."""
    first = _first_line(path)
    if first.lstrip().startswith("{"):
        return "mooncake"
    header = next(csv.reader([first]), [])
    for name, (t, p, o, _) in CSV_FORMATS.items():
        if {t, p, o} <= set(header):
            return name
    wanted = "; ".join(f"{name}: {t},{p},{o}" for name, (t, p, o, _) in CSV_FORMATS.items())
    raise ValueError(f"trace {path} line 1: header {header} matches no trace format (columns wanted — {wanted}; "
                     "or Mooncake JSONL)")


def _first_line(path: str | Path) -> str:
    try:
        with open(path, newline="", encoding="utf-8-sig") as f:  # a byte-order mark (Excel's) is no header
            for line in f:
                if line.strip():
                    return line
    except OSError as err:
        raise ValueError(f"cannot read trace {path}: {err.strerror}") from err
    raise ValueError(f"trace {path} holds no requests (it is empty)")


def read_rows(path: str | Path) -> TraceRows:
    """Every request of a trace file, in any supported format."""
    fmt = detect_format(path)
    rows, segments, skipped = [], [], {}
    if fmt == "mooncake":
        for line, (t, p, o, seg) in _mooncake_rows(path):
            if _keep(path, line, p, o, skipped):
                rows.append((t, p, o))
                segments.append(seg)
    else:
        for line, (t, p, o) in _csv_rows(path, fmt):
            if _keep(path, line, p, o, skipped):
                rows.append((t, p, o))
    if not rows:
        raise ValueError(f"trace {path} holds no requests" + (f" (skipped: {skipped})" if skipped else ""))
    arr = np.asarray(rows, dtype=float)
    return TraceRows(str(path), fmt, len(rows) + sum(skipped.values()), skipped, arr[:, 0] - arr[0, 0],
                     arr[:, 1].astype(np.int64), arr[:, 2].astype(np.int64),
                     tuple(segments) if fmt == "mooncake" else None)


def _keep(path, line: int, p: int, o: int, skipped: dict[str, int]) -> bool:
    if p < 0 or o < 0:
        raise ValueError(f"trace {path} line {line}: negative token count (prompt {p}, output {o})")
    if p == 0 or o == 0:
        skipped[SKIP_EMPTY] = skipped.get(SKIP_EMPTY, 0) + 1
        return False
    return True


def _in_order(path, line: int, t: float, last: float) -> float:
    if not math.isfinite(t):
        raise ValueError(f"trace {path} line {line}: arrival time {t} is not a finite number")
    if t < last:
        raise ValueError(f"trace {path} line {line}: arrival {t} comes before the previous row's {last}")
    return t


def _date_s(raw: str) -> float:
    """An Azure trace's timestamp in seconds (_iso_310)."""
    return datetime.fromisoformat(_iso_310(raw)).timestamp()


def _iso_310(raw: str) -> str:
    """A timestamp as Python 3.10's fromisoformat reads it (3.11 takes any ISO form): Azure's
    fractions have 7 digits, re-exported ones 1-5 (3.10 takes 3 or 6), and a UTC 'Z' is +00:00."""
    text = _FRACTION.sub(lambda m: "." + m.group(1)[:6].ljust(6, "0"), raw.strip())
    return text[:-1] + "+00:00" if text.endswith(("Z", "z")) else text


_FRACTION = re.compile(r"\.(\d+)")


def _csv_rows(path: str | Path, fmt: str):
    t_col, p_col, o_col, unit = CSV_FORMATS[fmt]
    last = -float("inf")
    with open(path, newline="", encoding="utf-8-sig") as f:
        for line, r in enumerate(csv.DictReader(f), start=2):
            try:
                raw = r[t_col]
                t = _date_s(raw) if unit == "date" else float(raw) * unit
                p, o = int(r[p_col]), int(r[o_col])
            except (TypeError, ValueError, AttributeError):
                what = "a date" if unit == "date" else "a time"
                raise ValueError(f"trace {path} line {line}: expected {what} and two token counts in "
                                 f"{t_col}, {p_col}, {o_col}, got {[r.get(c) for c in (t_col, p_col, o_col)]}") from None
            last = _in_order(path, line, t, last)
            yield line, (t, p, o)


def _mooncake_rows(path: str | Path):
    """Mooncake's JSONL: ``timestamp`` in ms, ``input_length``, ``output_length``, ``hash_ids``
    (one id per 512-token block of the prompt, equal ids meaning an equal prefix)."""
    last = -float("inf")
    with open(path, encoding="utf-8-sig") as f:
        for line, text in enumerate(f, start=1):
            if not text.strip():
                continue
            try:
                r = json.loads(text)
            except json.JSONDecodeError as err:
                raise ValueError(f"trace {path} line {line}: not JSON ({err.msg})") from None
            missing = [k for k in ("timestamp", "input_length", "output_length") if not isinstance(r, dict) or k not in r]
            if missing:
                raise ValueError(f"trace {path} line {line}: Mooncake rows need timestamp, input_length, "
                                 f"output_length (and hash_ids); missing {missing}")
            hash_ids = r.get("hash_ids", [])
            try:
                t, p, o = float(r["timestamp"]) / 1000.0, int(r["input_length"]), int(r["output_length"])
                hash_ids = [int(h) for h in hash_ids]
            except (TypeError, ValueError):
                raise ValueError(f"trace {path} line {line}: expected numbers in timestamp, input_length, "
                                 f"output_length and hash_ids, got {text.strip()[:200]}") from None
            last = _in_order(path, line, t, last)
            yield line, (t, p, o, mooncake_segments(hash_ids, p, line, MOONCAKE_BLOCK_TOKENS))
