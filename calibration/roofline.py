"""A roofline baseline: each call's time if it ran at this machine's measured memory bandwidth or
matmul throughput, whichever binds. The fitted model is compared against it.

bytes = weights read once (lm_head only when a row is sampled) + KV read + KV written
FLOPs = 2·dense params·tokens + 2·lm_head params·sampled rows + attention (QKᵀ and PV)
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

from engine.plan import BatchPlan


@dataclass(frozen=True)
class ModelShape:
    """What the roofline needs to know about the model (torch-free, stored in the profile)."""

    dense_params: int  # decoder layers and final norm: touched by every token
    lm_head_params: int  # vocab × hidden: touched only for sampled rows
    bytes_per_param: int
    kv_bytes_per_token: int  # K and V, all layers
    attn_flops_per_pair: int  # QKᵀ + PV flops per (query, key) pair, all layers and heads

    @classmethod
    def of(cls, model) -> ModelShape:
        cfg = model.config
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        bpp = next(model.parameters()).element_size()
        lm = model.get_output_embeddings().weight.numel()
        embed = model.get_input_embeddings().weight.numel()
        total = sum(p.numel() for p in model.parameters())  # tied weights counted once
        tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
        dense = total - embed - (0 if tied else lm)
        layers = cfg.num_hidden_layers
        return cls(dense, lm, bpp, 2 * layers * cfg.num_key_value_heads * head_dim * bpp,
                   4 * layers * cfg.num_attention_heads * head_dim)

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Machine:
    bandwidth_bytes_s: float
    matmul_flops_s: float

    def to_dict(self) -> dict:
        return asdict(self)


def call_work(plan: BatchPlan, shape: ModelShape) -> tuple[float, float]:
    """(bytes moved, FLOPs) of one call."""
    tokens = plan.total_tokens
    sampled = plan.num_samples
    kv_read = sum(c + n for n, c in zip(plan.num_tokens, plan.context_lens))
    pairs = sum(n * (c + (n + 1) / 2) for n, c in zip(plan.num_tokens, plan.context_lens))
    bytes_moved = (shape.dense_params + (shape.lm_head_params if sampled else 0)) * shape.bytes_per_param \
        + (kv_read + tokens) * shape.kv_bytes_per_token
    flops = 2 * shape.dense_params * tokens + 2 * shape.lm_head_params * sampled + shape.attn_flops_per_pair * pairs
    return bytes_moved, flops


def roofline_s(plan: BatchPlan, shape: ModelShape, machine: Machine) -> float:
    bytes_moved, flops = call_work(plan, shape)
    return max(bytes_moved / machine.bandwidth_bytes_s, flops / machine.matmul_flops_s)


def best_s(fn, repeats: int = 5) -> float:
    """Fastest of ``repeats`` timed calls after one untimed: a machine's limit, not its noise."""
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def measure_machine(dtype, repeats: int = 5, mem_bytes: int = 512 << 20) -> Machine:
    """Best-of-``repeats`` read bandwidth (the faster of a matrix-vector product and a sum over
    a buffer far larger than cache: a decode reads weights that way) and matmul throughput on
    model-like shapes."""
    import torch

    def best(fn) -> float:
        return best_s(fn, repeats)

    with torch.inference_mode():
        esize = torch.empty((), dtype=dtype).element_size()
        k = 896
        w = torch.randn(mem_bytes // esize // k, k, dtype=dtype)
        v = torch.randn(k, 1, dtype=dtype)
        flat = w.view(-1)
        bw = w.numel() * esize / min(best(lambda: w @ v), best(lambda: flat.sum()))
        flops = 0.0
        for m, kk, n in ((256, 896, 4864), (512, 4864, 896), (1024, 1024, 1024)):
            a, b = torch.randn(m, kk, dtype=dtype), torch.randn(kk, n, dtype=dtype)
            flops = max(flops, 2 * m * kk * n / best(lambda: a @ b))
    return Machine(bw, flops)
