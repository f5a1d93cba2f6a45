"""This machine's memory-bandwidth history: every stamp a calibration took and the bandwidth every
validation run's calls saw, kept in one file per machine so a profile can carry more than its own
minutes of the machine (calibration.noise.RunNoise draws a replicate's run-wide bandwidth from it).

A shared host's memory speed drifts with its other tenants over hours (36–76 GB/s here against a
calibration's 40–44), so the bands need a history longer than any one calibration. The file lives
under ``~/.cache/miniserve/`` (``MINISERVE_BANDWIDTH_HISTORY_DIR`` moves it), named by a hash of
what the stamps depend on (CPU model, host, CPU count, threads, and the model with its dtype: a run's calls are
priced into a bandwidth through its own model, and a tiny model's calls are overhead, reading as
~5 GB/s on a 40 GB/s machine), like the kernels' dispatch table; a file whose key differs is
another machine's or model's and is ignored. Its callers (calibrate, validate)
run the engine, so the CPU's name comes from the engine's own reader (kernels.features.cpu_model)."""

from __future__ import annotations

import hashlib
import json
import os
import platform
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from engine.model.kernels.features import cpu_model

VERSION = 2  # 2: keyed by model too (version 1 files, which mixed a tiny model's runs in, are ignored)
KEEP = 2000  # newest entries kept: months of calibrations and validations
# the sources whose entries are the bandwidth a validate run's calls saw (calibration.noise.calls_gb_s),
# not a probe's stamp: "validate run" is how they were recorded before stamps got their own source
# (validate recorded a run's calls' bandwidth wherever one fitted, its stamp elsewhere)
CALLS_SOURCES = ("validate run's calls", "validate run")


def machine_key(threads: int, model: str) -> dict:
    """What a stamp is comparable across: the same CPU, host and thread count, and the same model
    (its config fingerprint, engine.model.loader.config_fingerprint)."""
    return {"version": VERSION, "cpu": cpu_model(), "host": platform.node(), "cpus": os.cpu_count(),
            "threads": int(threads), "model": model}


def history_path(key: dict) -> Path:
    root = Path(os.environ.get("MINISERVE_BANDWIDTH_HISTORY_DIR") or Path.home() / ".cache" / "miniserve")
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return root / f"bandwidth-{digest}.json"


@dataclass(frozen=True)
class Entry:
    t: float  # unix time
    gb_s: float
    source: str  # "calibration stamp", "validate calls", ...


def load(threads: int, model: str) -> list[Entry]:
    """This machine's entries for this model, oldest first; none for a missing, unreadable or other
    machine's or model's file."""
    key = machine_key(threads, model)
    try:
        data = json.loads(history_path(key).read_text())
    except (OSError, ValueError):
        return []
    if data.get("key") != key:
        return []
    return [Entry(**e) for e in data.get("entries", ())]


def record(threads: int, model: str, gb_s: Iterable[float], source: str) -> Path:
    """Append measurements (atomically: a concurrent reader sees the old file or the new one)."""
    key = machine_key(threads, model)
    path = history_path(key)
    now = time.time()
    entries = load(threads, model) + [Entry(now, float(x), source) for x in gb_s if x and x > 0]
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"key": key, "entries": [vars(e) for e in entries[-KEEP:]]}))
    tmp.replace(path)
    return path


def profile_history(threads: int, model: str, own: list[float], source: str = "calibration stamp") -> dict:
    """The profile's ``noise`` entries for the history: this machine's file so far plus ``own``
    (this calibration's stamps), which are then recorded in the file for later profiles."""
    entries = load(threads, model)
    past = [e.gb_s for e in entries]
    own = [float(x) for x in own if x and x > 0]
    path = record(threads, model, own, source)
    return {"memory_gb_s_history": [round(x, 2) for x in past + own],
            "memory_gb_s_history_from_calls": [e.source in CALLS_SOURCES for e in entries] + [False] * len(own),
            "memory_gb_s_history_source": f"{len(own)} calibration stamps + {len(past)} from this machine's history "
                                          f"({path.name})"}
