"""The cost model: a call's duration as a non-negative linear function of features of its plan.

Torch-free, so the simulator can load a profile without the model. Features (per model call):
  const              1
  prefill_tokens     query tokens of prefill chunks (the dense matmul work)
  decode_tokens      decoding requests (one query token each)
  decode_context     Σ context of decoding requests (KV read by decode attention)
  prefill_attention  Σ chunk × (prior context + chunk / 2) (prefill attention work)
  num_requests       requests in the call (per-request attention and packing overhead)
  tokens@K           tent basis on the call's total tokens T at knots K: the dense matmuls' cost as a
                     piecewise-linear function of T. Measured on this CPU it is not linear, not even
                     monotone: T=1 runs matrix-vector kernels (~0.15 s on the 0.5B model), T=2, 3
                     and 7 cost up to three times that, T=4 and 8 less, and from ~16 tokens it grows
                     ~linearly; so every small T is a knot. So is the row count just past each one
                     up to which the engine's gemv may sweep the weights once for all rows (9, 13,
                     17: GemvTuning.stream_rows 8, 12 or 16 with AVX-512, 3 or 6 with AVX2, whose 4
                     and 7 are knots already, measured per machine): the cost steps
                     up there (fp32 13% from 16 to 17 rows on one CPU), which a tent from 16 to 24
                     priced as a straight line. Past that the gemv takes the rows in passes of its
                     register block (8 rows with AVX-512, 6 with AVX2: two 3-row passes), each pass reading every
                     weight again from cache, so the cost is a staircase: flat within a pass, a step
                     just past each multiple of the block (bf16 on a Zen 5: 24 → 25 rows +12%, 32 →
                     33 +15%, 48 → 49 +14%; a line from 32 to 64 priced 33-63 rows 8-12% short,
                     and a serving loop's mixed steps have any row count). Both sides of every such
                     step up to 65 rows, for both blocks (PASS_EDGES), are knots too, and a grid
                     times a prompt at each edge of this machine's block (the engine says which:
                     ModelRunner.pass_rows; both where it runs no gemv); the other block's knots
                     follow their measured neighbours (calibration.fit.knot_map).
  samples@K          the same on the number of sampled rows S (the lm_head matmul, skipped when S=0)
Tents are ``max(0, 1 − |x − K_i| / gap)`` between neighbouring knots and ``x / K_last`` past the last,
so a call larger than any measured one extrapolates proportionally (compute-bound).

Outside the fit, ``kv_copy_s_per_token`` charges prefix caching's copies (``plan.kv_copy_tokens``:
cached blocks loaded into a request's KV slot, computed prompt blocks stored), measured on their
own (calibration/kv_copy.py); a profile from before it charges nothing.
"""

from __future__ import annotations

import json
import math
import statistics
from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from engine.core.plan import BatchPlan

REGISTER_BLOCKS: tuple[int, ...] = (6, 8)  # the gemv's rows per pass: AVX2's, AVX-512's (gemv.cpp)


def pass_edges(blocks: Sequence[int] = REGISTER_BLOCKS) -> tuple[int, ...]:
    """The row counts on both sides of each step of the passes' staircase, past 16 rows up to 65."""
    return tuple(sorted({n for b in blocks for m in range(b, 65, b) if m > 16 for n in (m, m + 1)}))


PASS_EDGES: tuple[int, ...] = pass_edges()


def unmeasured_edges(edges: Sequence[int]) -> frozenset[int]:
    """The pass-edge knots a grid that timed ``edges`` left out (the other block's): a fit leaves
    them to their measured neighbours, as it does any knot no call pins, even where some call falls
    near one by chance (a multi-prompt of 3 × 12 tokens at 36): that call's noise would own a knot
    where this machine's cost has no step."""
    return frozenset(PASS_EDGES) - frozenset(edges)


TOKEN_KNOTS: tuple[int, ...] = tuple(sorted({1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 12, 13, 16, 17, 24, 32, 64, 128, 256}
                                            | set(PASS_EDGES)))
SAMPLE_KNOTS: tuple[int, ...] = (1, 2, 3, 4, 5, 6, 7, 8, 16, 32)
BASE_FEATURES: tuple[str, ...] = ("const", "prefill_tokens", "decode_tokens", "decode_context",
                                  "prefill_attention", "num_requests")
FEATURES: tuple[str, ...] = (BASE_FEATURES + tuple(f"tokens@{k}" for k in TOKEN_KNOTS)
                             + tuple(f"samples@{k}" for k in SAMPLE_KNOTS))


def tents(x: float, knots: tuple[int, ...]) -> list[float]:
    """Piecewise-linear (hat) basis of ``x``: at most two non-zero weights, summing to x/K_0 below
    the first knot, 1 between knots, x/K_last beyond the last."""
    out = [0.0] * len(knots)
    if x <= 0:
        return out
    if x <= knots[0]:
        out[0] = x / knots[0]
        return out
    if x >= knots[-1]:
        out[-1] = x / knots[-1]
        return out
    i = bisect_right(knots, x) - 1
    lo, hi = knots[i], knots[i + 1]
    w = (x - lo) / (hi - lo)
    out[i] = 1.0 - w
    out[i + 1] = w
    return out


_TOKENS_AT = len(BASE_FEATURES)  # where each tent basis starts in FEATURES
_SAMPLES_AT = _TOKENS_AT + len(TOKEN_KNOTS)


def _tent_dot(x: float, knots: tuple[int, ...], coefficients: Sequence[float], at: int) -> float:
    """``sum(coefficients[at + i] * tents(x, knots)[i])``, touching only the non-zero weights."""
    if x <= 0:
        return 0.0
    if x <= knots[0]:
        return coefficients[at] * x / knots[0]
    if x >= knots[-1]:
        return coefficients[at + len(knots) - 1] * x / knots[-1]
    i = bisect_right(knots, x) - 1
    lo, hi = knots[i], knots[i + 1]
    w = (x - lo) / (hi - lo)
    return coefficients[at + i] * (1.0 - w) + coefficients[at + i + 1] * w


def plan_quantities(plan: BatchPlan) -> tuple[int, int, int, float, int, int]:
    """What a call's cost depends on: (prefill tokens, decodes, Σ decode context, prefill
    attention, requests, sampled rows). Read from counts: the decodes a plan carries together are
    never listed."""
    prefill_tokens, prefill_attention = 0, 0.0
    d = plan.explicit_decodes
    tokens, contexts = plan.tokens, plan.contexts
    for n, c in zip(tokens[d:], contexts[d:]):  # plan.prefill_chunks, without the tuple
        prefill_tokens += n
        prefill_attention += n * (c + n / 2)
    lane = plan.lane_size  # num_decodes, decode_context_sum, num_requests, num_samples, inlined (per step)
    return (prefill_tokens, lane + d, plan.lane_context_sum + (sum(contexts[:d]) if d else 0), prefill_attention,
            lane + len(plan.ids), lane + sum(plan.sampled))


def plan_features(plan: BatchPlan) -> tuple[float, ...]:
    """The fit's feature row (FEATURES) of one plan."""
    prefill_tokens, decodes, decode_context, prefill_attention, requests, samples = plan_quantities(plan)
    return (1.0, float(prefill_tokens), float(decodes), float(decode_context), prefill_attention, float(requests),
            *tents(prefill_tokens + decodes, TOKEN_KNOTS), *tents(samples, SAMPLE_KNOTS))


def other_device_warning(measured_on: dict, run_on: dict) -> str | None:
    """A clear sentence when a profile was measured on another device (kind, or GPU/CPU model)
    than the run it is compared with (engine.model.device.describe's keys); None when they match
    or either does not say."""
    kind, name = measured_on.get("device"), measured_on.get("device_name")
    if kind is None:
        return None
    run_kind, run_name = run_on.get("device"), run_on.get("device_name")
    if kind == run_kind and (name is None or run_name is None or name == run_name):
        return None
    where = lambda k, n: f"{k} ({n})" if n else str(k)  # noqa: E731
    return (f"the calibration profile was measured on {where(kind, name)}, but this run is on "
            f"{where(run_kind, run_name)}: its call times are that device's, so simulated and real "
            f"times will differ; calibrate on this device for a like-for-like comparison")


def other_kernels_warning(measured_on: dict, run_kernels: dict, run_device: str | None = None) -> str | None:
    """A clear sentence when the run's calls take other kernels than the profile's calls did
    (engine.model.runner.ModelRunner.kernels_used: miniserve's gemv, attention, layer ops, the
    layers in one call ...), e.g. under MINISERVE_KERNELS=0, a feature mask or a dispatch table
    measured anew; None when they match, either does not say, or the run is on another device
    than the profile (other_device_warning says that, and there every CPU kernel is off). Each
    kernel moves its calls by a few percent to several times (docs/architecture.md), which a
    simulation would count as its error. A kernel one side does not name (a profile from before
    it existed) is said to be not recorded there."""
    profiled = measured_on.get("kernels")
    if not profiled or not run_kernels:
        return None
    if run_device and measured_on.get("device") and run_device != measured_on["device"]:
        return None
    differ = sorted(k for k in set(profiled) | set(run_kernels) if bool(profiled.get(k)) != bool(run_kernels.get(k)))
    if not differ:
        return None
    said = lambda side, k: "not recorded" if k not in side else "on" if side[k] else "off"  # noqa: E731
    what = ", ".join(f"{k} {said(profiled, k)} there, {said(run_kernels, k)} here" for k in differ)
    return (f"the calibration profile's calls ran other kernels than this run's ({what}): its call "
            f"times are those kernels', so simulated and real times will differ by more than the "
            f"simulator's error; calibrate with the kernels this engine runs")


def before_call_s(info: dict, step_overhead_s: float) -> float:
    """The part of ``step_overhead_s`` a real step spends before its model call (scheduling,
    packing): its tokens come out that much after the step starts, plus the call. 0 for profiles
    from before it was measured. (Either cost model's, from the profile's info.)"""
    part = info.get("step_overhead", {}).get("before_call_median_s", 0.0)
    return min(max(part, 0.0), step_overhead_s)


@dataclass(frozen=True)
class AfterIdle:
    """What the first call after the engine sat idle costs more than the same call back to back, by
    how long it sat (calibration.profiler.measure_after_idle, at a few idle lengths): nothing below
    the shortest idle measured, the longest's extra past it, linear in log(idle) between two measured
    ones; never less after a longer idle (each extra is at least the shorter idles'). Why by length:
    on a shared host the caches and the core go to others while the engine sleeps, and the longer it
    sleeps the more there is to win back (docs/architecture.md has the figures)."""

    idle_s: tuple[float, ...] = ()
    extra_s: tuple[float, ...] = ()
    # the step around that call (calibration.profiler.measure_idle_steps): from the arrival that
    # ends the rest to the step's start (the loop wakes late), and from there to the call (None: a
    # busy step's, as profiles from before it was measured have it)
    wake_s: float = 0.0
    before_call_s: float | None = None

    @classmethod
    def of(cls, info: dict) -> AfterIdle:
        """From a profile's info; profiles from before the idle lengths have one, older ones none (a
        length of 0 or less would be no idle, and is left out)."""
        step = info.get("step_overhead") or {}
        wake = _seconds(step.get("idle_wake_median_s")) or 0.0  # unmeasured: none
        before = _seconds(step.get("idle_before_call_median_s"))
        part = info.get("after_idle")
        if not part:
            return cls(wake_s=wake, before_call_s=before)
        levels = sorted((level for level in (part["levels"] if "levels" in part else [part]) if level["idle_s"] > 0),
                        key=lambda level: level["idle_s"])
        extra, at_least = [], 0.0
        for level in levels:
            at_least = max(at_least, level["extra_s"])
            extra.append(at_least)
        return cls(tuple(level["idle_s"] for level in levels), tuple(extra), wake, before)

    def extra(self, idle_s: float) -> float:
        """Seconds the first call after ``idle_s`` of idle takes more."""
        if not self.idle_s or idle_s < self.idle_s[0]:
            return 0.0
        i = bisect_right(self.idle_s, idle_s) - 1
        if i + 1 >= len(self.idle_s):
            return self.extra_s[-1]
        lo, hi = math.log(self.idle_s[i]), math.log(self.idle_s[i + 1])
        share = (math.log(idle_s) - lo) / (hi - lo)
        return self.extra_s[i] + share * (self.extra_s[i + 1] - self.extra_s[i])


def _seconds(value: object) -> float | None:
    """A profile's measured duration, or None where it holds none (absent, null, NaN, negative)."""
    return float(value) if isinstance(value, (int, float)) and 0 <= value < math.inf else None


def stamped_gb_s(stamp: dict | None) -> float | None:
    """A calibration's read rate from its stamps (calibration.roofline.MemoryStamp around it, and
    ``rounds``: one after each measuring round, where the profile has them): their median, what
    the calls felt over the calibration. The mean of the two around it alone where there are no
    rounds (older profiles): either can fall in a slow spell of a few seconds, and every real run
    judged against it then looks faster or slower than the calibration was (docs/architecture.md
    has a case). None without both."""
    stamp = stamp or {}
    if stamp.get("before") is None or stamp.get("after") is None:
        return None
    rounds = [float(x) for x in stamp.get("rounds") or () if x is not None and x > 0]
    if not rounds:
        return (stamp["before"] + stamp["after"]) / 2
    return float(statistics.median([stamp["before"], stamp["after"], *rounds]))


def weights_read_gb_s(info: dict) -> float | None:
    """The read rate of the calibrating process's own weights over its calibration
    (``stamped_gb_s``), or None for profiles from before it was stamped or whose decode weights
    were opaque. (Either cost model's, from the profile's info.)"""
    return stamped_gb_s(info.get("weights_read_gb_s"))


SLOW_PLACEMENT = 0.85  # the weights reading slower than this share of fresh memory: misplaced


def slow_placement(info: dict) -> float | None:
    """The share of a fresh buffer's read rate the calibrating process's own weights read at, where
    it is below SLOW_PLACEMENT: they landed in slow memory for that process's life, and its decode
    calls with them (docs/architecture.md). Judged by reads of both back to back (``placement``,
    calibration.roofline.placement_ratio); a profile from before that, by the weights' stamp over
    the calibration against the fresh buffer's. None where they read well or it cannot say."""
    stamp = info.get("weights_read_gb_s") or {}
    ratio = stamp.get("placement")
    if ratio is None:
        weights, fresh = weights_read_gb_s(info), stamp.get("fresh")
        if weights is None or not fresh:
            return None
        ratio = weights / fresh
    return float(ratio) if ratio < SLOW_PLACEMENT else None


def slow_placement_warning(info: dict) -> str | None:
    """A clear sentence for a profile measured by a process whose weights sat in slow memory: every
    simulation priced by it is that much slow on decodes, and a validation against it flags its
    real runs, so a user hears it before spending the runs (the calibration's report says it too)."""
    slow = slow_placement(info)
    if slow is None:
        return None
    return (f"the calibration profile's own weights read {100 * (1 - slow):.0f}% slower than a fresh buffer of "
            "theirs: the process that measured it had them in slow memory, so its decode calls, and every "
            "simulation priced by it, are slower than a process whose weights landed elsewhere; calibrate again "
            "(a new process), or validate with use_run_bandwidth=true, which prices each row by its runs' "
            "weights against these")


class ProfileMismatchError(ValueError):
    """A calibration profile measured for another model, dtype or feature set."""


@dataclass(frozen=True)
class CostModel:
    """Seconds per model call, plus the per-step time spent outside the call."""

    coefficients: tuple[float, ...]
    step_overhead_s: float = 0.0
    feature_names: tuple[str, ...] = FEATURES
    fingerprint: str | None = None  # engine.core.model_shape.config_fingerprint of what was measured
    info: dict = field(default_factory=dict)  # fit errors, device, threads, torch version, date ...
    kv_copy_s_per_token: float = 0.0  # prefix caching's copies, per token loaded or stored
    _decode_fixed: dict[int, float] = field(default_factory=dict, init=False, repr=False, compare=False)
    _tokens_part: dict[int, float] = field(default_factory=dict, init=False, repr=False, compare=False)
    _samples_part: dict[int, float] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if tuple(self.feature_names) != FEATURES:
            raise ProfileMismatchError(f"profile features {list(self.feature_names)} are not this version's "
                                       f"{list(FEATURES)}; recalibrate")
        if len(self.coefficients) != len(FEATURES):
            raise ValueError(f"need {len(FEATURES)} coefficients, got {len(self.coefficients)}")
        # a NaN (a hand-edited or damaged profile) fails too, rather than every metric
        if not all(0 <= c < math.inf for c in (*self.coefficients, self.step_overhead_s, self.kv_copy_s_per_token)):
            raise ProfileMismatchError("cost coefficients and step overhead must be finite and non-negative")

    def predict(self, plan: BatchPlan) -> float:
        """Duration of the model call that executes ``plan``, in seconds: the coefficients times
        plan_features(plan), computed without building the feature row (at most two weights of
        each tent basis are non-zero)."""
        if not plan.ids:  # decodes together and nothing else: most steps of a simulation
            return self.predict_decodes(plan.lane_size, plan.lane_context_sum)
        if not plan.num_prefills:
            return self.predict_decodes(plan.num_decodes, plan.decode_context_sum)
        prefill_tokens, decodes, decode_context, prefill_attention, requests, samples = plan_quantities(plan)
        c = self.coefficients
        return (c[0] + c[1] * prefill_tokens + c[2] * decodes + c[3] * decode_context + c[4] * prefill_attention
                + c[5] * requests + self._tokens_tent(prefill_tokens + decodes) + self._samples_tent(samples)
                + self.kv_copy_s_per_token * plan.kv_copy_tokens)

    def _tokens_tent(self, tokens: int) -> float:
        """The tokens@K terms of a call of ``tokens`` tokens, remembered per count."""
        part = self._tokens_part.get(tokens)
        if part is None:
            part = self._tokens_part[tokens] = _tent_dot(tokens, TOKEN_KNOTS, self.coefficients, _TOKENS_AT)
        return part

    def _samples_tent(self, samples: int) -> float:
        """The samples@K terms of a call sampling ``samples`` rows, remembered per count."""
        part = self._samples_part.get(samples)
        if part is None:
            part = self._samples_part[samples] = _tent_dot(samples, SAMPLE_KNOTS, self.coefficients, _SAMPLES_AT)
        return part

    def predict_decodes(self, num_decodes: int, context_sum: int) -> float:
        """``predict`` of a call that decodes ``num_decodes`` requests (contexts summing to
        ``context_sum``) and nothing else: most of a simulation's steps, so the part that depends
        on the count alone is remembered per count."""
        fixed = self._decode_fixed.get(num_decodes)
        if fixed is None:
            fixed = self.decode_cost_terms(num_decodes)[0]
        return fixed + self.coefficients[3] * context_sum

    def decode_cost_terms(self, num_decodes: int) -> tuple[float, float]:
        """A decodes-only call of ``num_decodes`` requests costs ``fixed + per_context × Σ context``:
        (fixed, per_context). Linear in the context, so a simulator can time a run of such
        steps without a plan per step."""
        fixed = self._decode_fixed.get(num_decodes)
        if fixed is None:
            c = self.coefficients
            fixed = self._decode_fixed[num_decodes] = (
                c[0] + c[2] * num_decodes + c[5] * num_decodes + self._tokens_tent(num_decodes)
                + self._samples_tent(num_decodes))
        return fixed, self.coefficients[3]

    @property
    def memory_read_gb_s(self) -> float | None:
        """The read bandwidth over its calibration (``stamped_gb_s``), or None for a profile from
        before stamps: decode cost moves with it on a shared machine."""
        return stamped_gb_s(self.info.get("memory_read_gb_s"))

    @property
    def before_call_s(self) -> float:
        return before_call_s(self.info, self.step_overhead_s)

    @property
    def after_idle(self) -> AfterIdle:
        return AfterIdle.of(self.info)

    def to_dict(self) -> dict:
        return {"feature_names": list(self.feature_names), "coefficients": list(self.coefficients),
                "step_overhead_s": self.step_overhead_s, "kv_copy_s_per_token": self.kv_copy_s_per_token,
                "fingerprint": self.fingerprint, **self.info}

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path, expect_fingerprint: str | None = None) -> CostModel:
        """Read a profile; refuse one measured for a different model or dtype."""
        data = json.loads(Path(path).read_text())
        fingerprint = data.get("fingerprint")
        if expect_fingerprint is not None and fingerprint != expect_fingerprint:
            raise ProfileMismatchError(
                f"profile {path} was measured for model fingerprint {fingerprint} "
                f"({data.get('model', {}).get('name', '?')}, {data.get('model', {}).get('dtype', '?')}) "
                f"but this run uses {expect_fingerprint}; calibrate this model first")
        info = {k: v for k, v in data.items()
                if k not in ("feature_names", "coefficients", "step_overhead_s", "fingerprint", "kv_copy_s_per_token")}
        return cls(tuple(data["coefficients"]), data.get("step_overhead_s", 0.0),
                   tuple(data.get("feature_names", ())), fingerprint, info, data.get("kv_copy_s_per_token", 0.0))
