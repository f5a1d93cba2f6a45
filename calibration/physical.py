"""The physical cost model: a call's duration from what the model config says it moves and computes.

Each term is a roofline time on a reference machine (memory bandwidth ``BW``, matmul throughput ``F``)
scaled by a fitted inefficiency (seconds measured per roofline second), so a profile fitted on one
model predicts another of the same family, and a machine with other limits, from shapes alone:

  layer              L                                   per-layer dispatch (Python, op launches)
  request_layer      R · L                               per request and layer (its attention call, packing)
  rows@K             max(W_dense/BW, 2·P_dense·T/F) · h_K(T)   the decoder's products over T rows
                   + max(W_lm/BW, 2·P_lm·S/F) · h_K(S)          and the lm_head's over S sampled rows
  decode_attention   Σ_decodes (c+1) · max(kv/BW, f/F)         each decode reads its KV once
  prefill_attention  Σ_chunks max((c+n)·kv/BW, n·(c+(n+1)/2)·f/F)

``h_K`` are hat functions over a product's rows (knots K) that sum to one everywhere (constant beyond
the last knot): the coefficients are one *efficiency curve over rows*, shared by every product (the
same kernels read every weight matrix), so the small-T behaviour this CPU shows (T=1 runs
matrix-vector kernels, T=2, 3, 7 are slower than T=4, 8) is one curve, not a per-model table. Within
one dtype the crossover row count F·bytes/(2·BW) is the same for every model, which is why the curve
transfers. ``kv`` is K and V bytes per token over all layers, ``f`` the attention FLOPs per
(query, key) pair over all layers and heads. Torch-free: the simulator imports it.
"""

from __future__ import annotations

import json
import math
from bisect import bisect_right
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from engine.core.plan import BatchPlan

from calibration.cost_model import TOKEN_KNOTS, AfterIdle, CostModel, ProfileMismatchError, before_call_s

BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
ROW_KNOTS: tuple[int, ...] = TOKEN_KNOTS  # sampled rows (SAMPLE_KNOTS) fall on these knots too
PHYSICAL_FEATURES: tuple[str, ...] = (("layer", "request_layer") + tuple(f"rows@{k}" for k in ROW_KNOTS)
                                      + ("decode_attention", "prefill_attention"))
_ROWS_AT = 2
_DECODE = _ROWS_AT + len(ROW_KNOTS)
_PREFILL = _DECODE + 1


@dataclass(frozen=True)
class PhysicalShape:
    """Parameter counts and per-token sizes of a Qwen2/Qwen3 config in one dtype."""

    layers: int
    dense_params: int  # decoder layers + final norm: every token meets them
    lm_head_params: int  # vocab × hidden: only sampled rows
    bytes_per_param: int
    kv_bytes_per_token: int  # K and V, all layers
    attn_flops_per_pair: int  # QKᵀ + PV, all layers and query heads
    model_type: str = "qwen2"  # qwen2 or qwen3: which small parameters a layer has (biases or q/k norms)

    @classmethod
    def of(cls, shape: dict, dtype: str) -> PhysicalShape:
        """From ``engine.core.model_shape.model_shape`` (config JSON keys) and a concrete dtype."""
        if dtype not in BYTES:
            raise ValueError(f"no byte size for dtype {dtype!r}; resolve model.dtype=auto first")
        h, inter, n = shape["hidden_size"], shape["intermediate_size"], shape["num_hidden_layers"]
        heads, kv_heads = shape["num_attention_heads"], shape["num_key_value_heads"]
        hd = shape["head_dim"] or h // heads
        attn = h * heads * hd * 2 + h * kv_heads * hd * 2  # q, o; k, v
        if shape["model_type"] == "qwen2":
            attn += heads * hd + 2 * kv_heads * hd  # q/k/v biases
        else:
            attn += 2 * hd  # qwen3's q/k RMSNorm
        per_layer = attn + 3 * h * inter + 2 * h
        bpp = BYTES[dtype]
        return cls(n, n * per_layer + h, shape["vocab_size"] * h, bpp, 2 * n * kv_heads * hd * bpp,
                   4 * n * heads * hd, shape["model_type"])

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Machine:
    """The limits the roofline terms are measured against: read bandwidth and matmul throughput."""

    memory_gb_s: float
    matmul_gflops: float

    def __post_init__(self) -> None:
        if not (0 < self.memory_gb_s < math.inf and 0 < self.matmul_gflops < math.inf):
            raise ValueError(f"a machine's limits must be finite and positive, got {self.memory_gb_s!r} GB/s and "
                             f"{self.matmul_gflops!r} GFLOP/s")

    def to_dict(self) -> dict:
        return asdict(self)


def hats(x: float, knots: tuple[int, ...]) -> list[tuple[int, float]]:
    """(index, weight) of the non-zero hat functions at ``x``: a partition of unity, constant
    outside the knots, so each coefficient is the curve's value at its knot."""
    if x <= knots[0]:
        return [(0, 1.0)]
    if x >= knots[-1]:
        return [(len(knots) - 1, 1.0)]
    i = bisect_right(knots, x) - 1
    w = (x - knots[i]) / (knots[i + 1] - knots[i])
    return [(i, 1.0 - w), (i + 1, w)]


def _roof(bytes_: float, flops: float, m: Machine) -> float:
    return max(bytes_ / (m.memory_gb_s * 1e9), flops / (m.matmul_gflops * 1e9))


def dense_roofline_s(rows: int, s: PhysicalShape, m: Machine) -> float:
    return _roof(s.dense_params * s.bytes_per_param, 2 * s.dense_params * rows, m) if rows else 0.0


def lm_head_roofline_s(rows: int, s: PhysicalShape, m: Machine) -> float:
    return _roof(s.lm_head_params * s.bytes_per_param, 2 * s.lm_head_params * rows, m) if rows else 0.0


def decode_roofline_per_token_s(s: PhysicalShape, m: Machine) -> float:
    """Roofline seconds per context token a decode's attention reads."""
    return _roof(s.kv_bytes_per_token, s.attn_flops_per_pair, m)


def physical_features(plan: BatchPlan, s: PhysicalShape, m: Machine) -> list[float]:
    """The fit's feature row (PHYSICAL_FEATURES) of one plan: roofline seconds per term."""
    return physical_row(plan.num_decodes, plan.decode_context_sum, plan.prefill_chunks, plan.num_samples, s, m)


def physical_row(decodes: int, decode_context: int, chunks: tuple[tuple[int, int], ...], samples: int,
                 s: PhysicalShape, m: Machine) -> list[float]:
    """physical_features from a call's counts: decodes, Σ their context, (tokens, prior context)
    of each prefill chunk, sampled rows."""
    tokens = decodes + sum(n for n, _ in chunks)
    row = [0.0] * len(PHYSICAL_FEATURES)
    row[0] = s.layers
    row[1] = (decodes + len(chunks)) * s.layers
    dense = dense_roofline_s(tokens, s, m)
    for i, w in hats(tokens, ROW_KNOTS):
        row[_ROWS_AT + i] += dense * w
    if samples:
        lm = lm_head_roofline_s(samples, s, m)
        for i, w in hats(samples, ROW_KNOTS):
            row[_ROWS_AT + i] += lm * w
    row[_DECODE] = (decode_context + decodes) * decode_roofline_per_token_s(s, m)
    row[_PREFILL] = sum(_roof((c + n) * s.kv_bytes_per_token, n * (c + (n + 1) / 2) * s.attn_flops_per_pair, m)
                        for n, c in chunks)
    return row


@dataclass(frozen=True)
class PhysicalCostModel:
    """Seconds per model call from a model's shape, a machine's limits and fitted inefficiencies.
    The same interface as CostModel (predict, predict_decodes, decode_cost_terms), so the
    simulator's executor takes either."""

    coefficients: tuple[float, ...]
    shape: PhysicalShape
    machine: Machine
    step_overhead_s: float = 0.0
    fingerprint: str | None = None
    info: dict = field(default_factory=dict)
    # prefix caching's copies: measured seconds per token copied over the roofline time of moving
    # that token's KV once (calibration/kv_copy.py), so it scales to other shapes and machines
    kv_copy_efficiency: float = 0.0
    _decode_fixed: dict[int, float] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if len(self.coefficients) != len(PHYSICAL_FEATURES):
            raise ValueError(f"need {len(PHYSICAL_FEATURES)} coefficients, got {len(self.coefficients)}")
        if not all(0 <= c < math.inf for c in (*self.coefficients, self.step_overhead_s, self.kv_copy_efficiency)):
            raise ProfileMismatchError("efficiencies and step overhead must be finite and non-negative")

    @property
    def kv_copy_s_per_token(self) -> float:
        """Seconds per KV token loaded or stored (plan.kv_copy_tokens) on this shape and machine."""
        return self.kv_copy_efficiency * self.shape.kv_bytes_per_token / (self.machine.memory_gb_s * 1e9)

    def predict(self, plan: BatchPlan) -> float:
        if not plan.ids:
            return self.predict_decodes(plan.lane_size, plan.lane_context_sum)
        if not plan.num_prefills:
            return self.predict_decodes(plan.num_decodes, plan.decode_context_sum)
        call = sum(c * x for c, x in zip(self.coefficients, physical_features(plan, self.shape, self.machine)))
        return call + self.kv_copy_s_per_token * plan.kv_copy_tokens if plan.kv_copy_tokens else call

    def predict_decodes(self, num_decodes: int, context_sum: int) -> float:
        fixed, per_context = self.decode_cost_terms(num_decodes)
        return fixed + per_context * context_sum

    def decode_cost_terms(self, num_decodes: int) -> tuple[float, float]:
        """(fixed, per context token) of a decodes-only call: linear in the context."""
        per_context = self.coefficients[_DECODE] * decode_roofline_per_token_s(self.shape, self.machine)
        fixed = self._decode_fixed.get(num_decodes)
        if fixed is None:
            row = physical_row(num_decodes, 0, (), num_decodes, self.shape, self.machine)
            fixed = self._decode_fixed[num_decodes] = sum(c * x for c, x in zip(self.coefficients, row))
        return fixed, per_context

    @property
    def before_call_s(self) -> float:
        return before_call_s(self.info, self.step_overhead_s)

    @property
    def after_idle(self) -> AfterIdle:
        return AfterIdle.of(self.info)

    @property
    def memory_read_gb_s(self) -> float:
        """The bandwidth its memory-bound terms are priced at (the calibration's stamp, or a what-if)."""
        return self.machine.memory_gb_s

    def efficiencies(self) -> dict[str, float]:
        return dict(zip(PHYSICAL_FEATURES, self.coefficients))

    def with_machine(self, memory_gb_s: float | None = None, matmul_gflops: float | None = None) -> PhysicalCostModel:
        """The same fitted model on a machine with other limits (None keeps the calibration's)."""
        m = replace(self.machine, **{k: v for k, v in (("memory_gb_s", memory_gb_s), ("matmul_gflops", matmul_gflops))
                                     if v is not None})
        what_if = {**self.info.get("what_if", {}), **m.to_dict()}
        return replace(self, machine=m, info={**self.info, "what_if": what_if})

    def for_model(self, shape: PhysicalShape, fingerprint: str | None, note: dict) -> PhysicalCostModel:
        return replace(self, shape=shape, fingerprint=fingerprint, info={**self.info, "transfer": note})

    def to_dict(self) -> dict:
        """The profile's ``physical`` block."""
        return {"feature_names": list(PHYSICAL_FEATURES), "coefficients": list(self.coefficients),
                "shape": self.shape.to_dict(), "machine": self.machine.to_dict()}

    @classmethod
    def from_profile(cls, data: dict) -> PhysicalCostModel:
        """The physical model a profile carries, for the model it was calibrated on."""
        block = data.get("physical")
        if not block:
            raise ProfileMismatchError("this profile has no physical cost model (calibrated before it existed); "
                                       "recalibrate")
        if tuple(block["feature_names"]) != PHYSICAL_FEATURES:
            raise ProfileMismatchError("the profile's physical features are not this version's; recalibrate")
        shape, machine = PhysicalShape(**block["shape"]), Machine(**block["machine"])
        copy_roofline_s = shape.kv_bytes_per_token / (machine.memory_gb_s * 1e9)  # one token's KV, moved once
        return cls(tuple(block["coefficients"]), shape, machine, data.get("step_overhead_s", 0.0),
                   data.get("fingerprint"),
                   {k: v for k, v in data.items() if k not in ("feature_names", "coefficients", "physical")},
                   data.get("kv_copy_s_per_token", 0.0) / copy_roofline_s)


AnyCostModel = CostModel | PhysicalCostModel


@dataclass(frozen=True)
class WhatIf:
    """Other hardware limits for the physical model: ``calibration.what_if.memory_gb_s=…
    matmul_gflops=…``; unset keeps the calibration machine's."""

    memory_gb_s: float | None = None
    matmul_gflops: float | None = None

    def __post_init__(self) -> None:
        for name in ("memory_gb_s", "matmul_gflops"):
            v = getattr(self, name)
            if v is not None and not 0 < v < math.inf:
                raise ValueError(f"calibration.what_if.{name} must be finite and positive, got {v!r}")

    @property
    def active(self) -> bool:
        return self.memory_gb_s is not None or self.matmul_gflops is not None


def load_profile_for(path: str | Path, shape: dict, dtype: str, fingerprint: str,
                     what_if: WhatIf = WhatIf(), physical: bool = False) -> tuple[AnyCostModel, str | None]:
    """The cost model a profile gives for a model (``model_shape`` keys, concrete dtype, fingerprint):
    - the same model: the profile's preferred model (the empirical one unless the physical one was
      more accurate on the held-out calls), or the physical one when a what-if asks for other limits
      or ``physical`` says so;
    - another model: the physical model with that model's shape (a *transfer*), and a sentence saying
      so; a profile without a physical model is refused, as before.
    Returns the model and the sentence to log (None when nothing needs saying)."""
    data = json.loads(Path(path).read_text())
    same = data.get("fingerprint") == fingerprint
    note = None
    if same and not what_if.active and not physical and data.get("preferred", "empirical") == "empirical":
        return CostModel.load(path, expect_fingerprint=fingerprint), None
    if not same and not data.get("physical"):
        CostModel.load(path, expect_fingerprint=fingerprint)  # raises ProfileMismatchError, naming both
    cost = PhysicalCostModel.from_profile(data)
    if not same:
        src = data.get("model", {})
        transfer = {"from_model": src.get("name"), "from_dtype": src.get("dtype"),
                    "from_fingerprint": data.get("fingerprint"), "to_fingerprint": fingerprint, "to_dtype": dtype}
        cost = cost.for_model(PhysicalShape.of(shape, dtype), fingerprint, transfer)
        note = (f"transferring the physical cost model calibrated on {src.get('name')} ({src.get('dtype')}) "
                f"to this model's shape ({dtype}): call times are predicted from its bytes and FLOPs, not measured")
        if src.get("dtype") != dtype:
            note += (f"; the profile's dtype {src.get('dtype')} differs from {dtype}, so its efficiencies "
                     f"(and the matmul limit) belong to the other dtype")
    if what_if.active:
        cost = cost.with_machine(what_if.memory_gb_s, what_if.matmul_gflops)
        said = ", ".join(f"{k}={v:g}" for k, v in (("memory_gb_s", what_if.memory_gb_s),
                                                   ("matmul_gflops", what_if.matmul_gflops)) if v is not None)
        note = (note + "; " if note else "") + f"what-if hardware: {said} (physical cost model)"
    return cost, note


def at_run_bandwidth(cost: AnyCostModel, memory_gb_s: float | None) -> AnyCostModel:
    """The cost model priced at the read bandwidth a real run saw (validate.use_run_bandwidth):
    a slow spell of the host's memory during the real run is then not counted as simulator error.
    An empirical model is returned as is (it has no bandwidth term to move)."""
    if memory_gb_s is None or not isinstance(cost, PhysicalCostModel):
        return cost
    return cost.with_machine(memory_gb_s=memory_gb_s)
