"""A calibration sized to the machine it runs on: which shapes, how many warm-ups and repeats
fit the time budget.

The same grid costs ~2 minutes on a CPU with AVX-512 and ~10 on a 2-core AVX2 one, where a
256-token call takes seconds. Before measuring, two pilot calls (the grid's smallest and largest
call, each after a warm-up) price every shape linearly in its tokens (plus the call's weights stamp,
where calls are stamped: calibration.calibrate.plan_to_budget); the plan then cuts, in
this order, what buys the least accuracy per second while the predicted time is over:

1. mixed steps past ``min_mixed``, the last drawn first (a random draw of the continuous
   scheduler's steps, the costliest kind, and the best predicted from the others);
2. the own warm-up of every shape whose call is long (``long_call_s``), at once: what a first
   call adds (allocation, a kernel's setup) is milliseconds, within their noise, and they run
   after the warm-up pass of the short ones;
3. repeats of long calls beyond two, the longest first: a call of seconds varies by a few
   percent, a 0.1 s decode by 10–30%, so repeats pay off on the short ones.

Decodes and single prefill chunks are never cut: they are the axes every prediction stands on.
What time is left after the base rounds goes to extra rounds for the shapes that spread wide,
the shortest first (calibration.profiler.measure_shapes).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from calibration.grid import Shape


@dataclass(frozen=True)
class MeasurePlan:
    """The shapes to measure and each one's warm-ups and repeats, with the predicted time."""

    shapes: list[Shape]
    warmups: list[int]
    repeats: list[int]
    call_s: list[float]  # each kept shape's priced call
    predicted_s: float  # warm-ups and base rounds, by the prices
    budget_s: float | None  # what the measuring may take (None: no budget)
    cuts: list[str] = field(default_factory=list)  # what was cut to fit, in words

    def to_dict(self) -> dict:
        return {"shapes": len(self.shapes), "warmup_calls": sum(self.warmups), "repeat_calls": sum(self.repeats),
                "shapes_without_own_warmup": sum(w == 0 for w in self.warmups),
                "repeats_by_shape": self.repeats,  # the profile's measurements, in order, before the engine's
                "predicted_s": self.predicted_s if self.budget_s is not None else None,
                "budget_s": self.budget_s, "cuts": self.cuts}


def price_calls(shapes: list[Shape], small: tuple[int, float], large: tuple[int, float]) -> list[float]:
    """Each shape's call time, linear in its tokens through two timed calls ``(tokens, seconds)``
    (the grid's smallest and largest): rough, but a plan needs only the size of each cost."""
    (t0, s0), (t1, s1) = small, large
    slope = (s1 - s0) / (t1 - t0) if t1 > t0 else 0.0
    return [max(s0 + slope * (s.num_tokens - t0), 0.1 * s0) for s in shapes]


def plan_measurement(shapes: list[Shape], call_s: list[float], repeats: int, warmup: int, budget_s: float | None,
                     min_mixed: int = 12, long_call_s: float = 0.5) -> MeasurePlan:
    """Fit ``repeats`` rounds and ``warmup`` passes over ``shapes`` (priced at ``call_s``) into
    ``budget_s`` seconds by the cuts the module describes; no shape is cut below two repeats.
    Past the last cut the plan may still exceed the budget (``predicted_s`` says so)."""
    keep = list(range(len(shapes)))
    warm = [warmup] * len(shapes)
    reps = [repeats] * len(shapes)
    cuts: list[str] = []

    def cost() -> float:
        return sum((warm[i] + reps[i]) * call_s[i] for i in keep)

    if budget_s is not None and cost() > budget_s:
        mixed = [i for i in keep if shapes[i].kind == "mixed"]
        while len(mixed) > min_mixed and cost() > budget_s:
            keep.remove(mixed.pop())  # the last drawn first: what is kept is still a random draw
        if len(mixed) < sum(s.kind == "mixed" for s in shapes):
            cuts.append(f"mixed steps {sum(s.kind == 'mixed' for s in shapes)} → {len(mixed)}")
        long_calls = sorted((i for i in keep if call_s[i] >= long_call_s), key=lambda i: -call_s[i])
        if cost() > budget_s and warmup and long_calls:
            for i in long_calls:
                warm[i] = 0
            cuts.append(f"no own warm-up for {len(long_calls)} shapes whose call takes ≥ {long_call_s} s")
        fewer = 0
        for i in long_calls:
            if cost() <= budget_s or reps[i] <= 2:
                break
            reps[i] = 2
            fewer += 1
        if fewer:
            cuts.append(f"2 repeats instead of {repeats} for the {fewer} longest calls")
    return MeasurePlan([shapes[i] for i in keep], [warm[i] for i in keep], [reps[i] for i in keep],
                       [call_s[i] for i in keep], cost(), budget_s, cuts)
