"""A roofline baseline: each call's time if it ran at this machine's measured memory bandwidth or
matmul throughput, whichever binds. The fitted model is compared against it.

bytes = weights read once (lm_head only when a row is sampled) + KV read + KV written
FLOPs = 2·dense params·tokens + 2·lm_head params·sampled rows + attention (QKᵀ and PV)
"""

from __future__ import annotations

import mmap
import statistics
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Union

from engine.core.plan import BatchPlan

if TYPE_CHECKING:  # torch is imported where a probe runs: the simulator reads this module without it
    import torch

Device = Union[str, "torch.device"]
GPU_CALLS = 20  # a GPU probe's calls per timing


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

    def weight_bytes(self, sampled: bool) -> int:
        """The weights one call reads: the decoder layers always, the lm_head only when it samples."""
        return (self.dense_params + (self.lm_head_params if sampled else 0)) * self.bytes_per_param

    def linear_flops(self, tokens: int, sampled: int) -> int:
        """The products' FLOPs of a call of ``tokens`` tokens with ``sampled`` sampled rows."""
        return 2 * self.dense_params * tokens + 2 * self.lm_head_params * sampled

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
    bytes_moved = shape.weight_bytes(sampled > 0) + (kv_read + tokens) * shape.kv_bytes_per_token
    flops = shape.linear_flops(tokens, sampled) + shape.attn_flops_per_pair * pairs
    return bytes_moved, flops


def roofline_s(plan: BatchPlan, shape: ModelShape, machine: Machine) -> float:
    bytes_moved, flops = call_work(plan, shape)
    return max(bytes_moved / machine.bandwidth_bytes_s, flops / machine.matmul_flops_s)


def workload_floor_s(lengths: Sequence[tuple[int, int]], shape: ModelShape, machine: Machine) -> float:
    """The least time an engine could take over requests of these (prompt tokens, output tokens)
    on a machine of these rates, however it batched them: all their FLOPs at the matmul rate, or
    the longest request's calls (one per output token, each reading the weights) at the memory
    bandwidth, whichever is longer. Every schedule that computes each token once (no recompute
    after a preemption, no prefix-cache hits, one token per call) does the same FLOPs: a chunk's
    ``call_work`` pairs and samples add up to the request's whole. So a system's time over it is
    what that system loses to the machine — its batching, kernels and overhead together — and
    another system's time over it is about the most any engine could be ahead of that one here.
    About: the rates are probes', and a call can beat a probe taken in a slow moment."""
    if not lengths:
        return 0.0
    flops = 0.0
    for prompt, output in lengths:
        if prompt < 1 or output < 1:
            raise ValueError(f"a request needs a prompt and an output token, got ({prompt}, {output})")
        # the request's calls as the entries of one plan, so call_work counts them as any call:
        # its prefill, then each fed-back token at its context (the last one is sampled, never fed)
        served = BatchPlan.of("floor", [f"call{j}" for j in range(output)], [prompt] + [1] * (output - 1),
                              [0] + [prompt + j for j in range(output - 1)], [True] * output, 0)
        flops += call_work(served, shape)[1]
    calls = max(output for _, output in lengths)
    return max(flops / machine.matmul_flops_s, calls * shape.weight_bytes(True) / machine.bandwidth_bytes_s)


def best_s(fn: Callable[[], object], repeats: int = 5, device: Device = "cpu") -> float:
    """Fastest of ``repeats`` timed calls after one untimed: a machine's limit, not its noise. On a
    GPU a probe's call takes microseconds, less than a launch and a wait, so each timing covers a
    run of GPU_CALLS calls, waited for once (engine.model.device.DeviceTimer)."""
    from engine.model.device import DeviceTimer

    timer = DeviceTimer(device)
    calls = 1 if _on_cpu(device) else GPU_CALLS
    fn()
    times = []
    for _ in range(repeats):
        timer.start()
        for _ in range(calls):
            fn()
        times.append(timer.stop() / calls)
    return min(times)


def _on_cpu(device: Device) -> bool:
    return str(device) == "cpu"


def _onednn_runs(dtype: torch.dtype, device: Device) -> bool:
    """oneDNN's pre-packed linear exists for CPU tensors of ``dtype`` here (its bf16 path refuses
    CPUs without AVX-512 or AVX-NE-CONVERT)."""
    if not _on_cpu(device):
        return False
    from engine.model.kernels.dispatch import onednn_available
    return onednn_available(dtype)


MEMORY_STAMP_BYTES = 256 << 20  # a stamp's fresh buffer


def memory_read_gb_s(mem_bytes: int = MEMORY_STAMP_BYTES, repeats: int = 3, device: Device = "cpu") -> float:
    """Read bandwidth now, of fresh memory where the model's weights sit (the host's, or the GPU's):
    a quick stamp (~0.1 s) for a real run or a calibration. Decode calls run at memory speed, and on
    a shared host the bandwidth moves with other tenants (docs/architecture.md has this VM's range),
    so a simulated-vs-real gap with different stamps is the machine, not the model."""
    import torch

    buf = torch.ones(mem_bytes // 4, device=device)
    return mem_bytes / best_s(lambda: buf.sum(), repeats, device) / 1e9


def tensors_read_gb_s(tensors: Sequence[torch.Tensor], max_bytes: int = 512 << 20, repeats: int = 3,
                      device: Device = "cpu") -> float | None:
    """Read bandwidth of these tensors where they sit (a model's own weights), or None for none.

    Why beside ``memory_read_gb_s``: on a VM the memory a process's weights landed in can read
    slower than fresh memory for that process's whole life, its decode calls with it, while other
    processes at the same minutes, and every fresh buffer, read at the usual rate
    (docs/architecture.md has the figures): only a read of the weights themselves sees it. Past
    ``max_bytes`` the same leading share of every tensor is read, so the sample spans the model."""
    import torch

    total = sum(t.numel() * t.element_size() for t in tensors)
    if not total:
        return None
    share = min(1.0, max_bytes / total)
    sample = [t.reshape(-1)[:max(1, int(t.numel() * share))] for t in tensors]  # views of contiguous weights
    nbytes = sum(t.numel() * t.element_size() for t in sample)
    with torch.no_grad():
        return nbytes / best_s(lambda: [t.sum() for t in sample], repeats, device) / 1e9


def fresh_like_gb_s(tensors: Sequence[torch.Tensor], device: Device = "cpu") -> float | None:
    """A fresh buffer of these tensors' dtype read as ``tensors_read_gb_s`` reads them, or None for
    none: what a model's weights are judged against (a bf16 sum is slower than an fp32 one, so
    judged against ``memory_read_gb_s`` bf16 weights would look misplaced)."""
    import torch

    if not tensors:
        return None
    like = tensors[0]
    fresh = torch.ones(MEMORY_STAMP_BYTES // like.element_size(), dtype=like.dtype, device=device)
    return tensors_read_gb_s([fresh], device=device)


def placement_ratio(tensors: Sequence[torch.Tensor], device: Device = "cpu", pairs: int = 3
                    ) -> tuple[float, float] | None:
    """(these tensors' read rate over a fresh buffer's of their dtype, the fresh buffer's GB/s), each
    ratio from a read of both back to back, the median of ``pairs``; None for none. Why paired:
    placement is the process's for life, the host's bandwidth moves within seconds, and a weights
    stamp over a whole calibration set against one fresh read at its end mixes the two (a
    well-placed process once read 1.44× its fresh buffer that way; docs/architecture.md)."""
    ratios, fresh = [], []
    for _ in range(pairs):
        own, new = tensors_read_gb_s(tensors, device=device), fresh_like_gb_s(tensors, device)
        if own and new:
            ratios.append(own / new)
            fresh.append(new)
    if not ratios:
        return None
    return float(statistics.median(ratios)), float(statistics.median(fresh))


class MemoryStamp:
    """``with MemoryStamp(device, weights) as stamp: work`` — memory_read_gb_s just before and just
    after; given the weights the calls stream, also their own read rate before and after
    (tensors_read_gb_s)."""

    def __init__(self, device: Device = "cpu", weights: Sequence[torch.Tensor] = ()) -> None:
        self.device = device
        self.weights = list(weights)
        self.weights_before: float | None = None
        self.weights_after: float | None = None

    def __enter__(self) -> MemoryStamp:
        self.before = memory_read_gb_s(device=self.device)
        self.weights_before = tensors_read_gb_s(self.weights, device=self.device)
        return self

    def __exit__(self, *exc) -> None:
        self.after = memory_read_gb_s(device=self.device)
        self.weights_after = tensors_read_gb_s(self.weights, device=self.device)

    @property
    def gb_s(self) -> float:
        return (self.before + self.after) / 2

    @property
    def weights_gb_s(self) -> float | None:
        """The weights' read rate around the work, or None where none were given (or readable)."""
        if self.weights_before is None or self.weights_after is None:
            return None
        return (self.weights_before + self.weights_after) / 2


class BandwidthProbe:
    """This machine's read bandwidth for one dtype, kept ready so it can be measured again between
    model calls.

    The limit moves: on a shared host other tenants share the memory, and the same probe can read
    half as much a quarter of an hour later (docs/architecture.md). A call's roofline is only
    meaningful against a probe taken in the same spell, so benchmarks interleave the two.

    Probes: a sum over a buffer far larger than cache, torch's matrix-vector product, and oneDNN's
    pre-packed matrix-vector product over the same buffer (CPU, where oneDNN runs the dtype); the
    fastest of them, each best of ``repeats``. Best-of and fastest-of because noise only ever
    slows a probe down, and a limit must not be understated.
    """

    def __init__(self, dtype: torch.dtype, mem_bytes: int = 512 << 20, k: int = 896, device: Device = "cpu") -> None:
        import torch

        self.device = device
        esize = torch.empty((), dtype=dtype).element_size()
        rows = mem_bytes // esize // k
        self._buf = None
        with torch.inference_mode():
            if _on_cpu(device):
                # The read buffer sits in transparent huge pages: with 4 KiB pages the same sum varied
                # twofold from run to run (page placement; docs/architecture.md).
                self._buf = mmap.mmap(-1, rows * k * esize, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # (shared gets no THP)
                if hasattr(mmap, "MADV_HUGEPAGE"):
                    self._buf.madvise(mmap.MADV_HUGEPAGE)
                self._w = torch.frombuffer(self._buf, dtype=dtype).view(rows, k).normal_()
            else:
                self._w = torch.empty(rows, k, dtype=dtype, device=device).normal_()
            self._v = torch.randn(k, 1, dtype=dtype, device=device)
            self._packed = torch.ops.mkldnn._reorder_linear_weight(self._w, 1) if _onednn_runs(dtype, device) else None
        self.nbytes = rows * k * esize

    def measure(self, repeats: int = 5) -> float:
        """Bytes per second."""
        import torch

        w, v, flat, device = self._w, self._v, self._w.view(-1), self.device
        with torch.inference_mode():
            read_s = min(best_s(lambda: w @ v, repeats, device), best_s(lambda: flat.sum(), repeats, device))
            if self._packed is not None:
                pw, vt = self._packed, v.T
                read_s = min(read_s, best_s(
                    lambda: torch.ops.mkldnn._linear_pointwise(vt, pw, None, "none", [], ""), repeats))
        return self.nbytes / read_s

    def close(self) -> None:
        del self._w, self._v, self._packed
        if self._buf is not None:
            self._buf.close()


MATMUL_SHAPES = ((256, 896, 4864), (512, 4864, 896), (1024, 1024, 1024))  # (rows, k, n): model-like products


class MatmulProbe:
    """This machine's matmul throughput for one dtype, kept ready (operands built and packed once)
    so it can be measured again between model calls, as BandwidthProbe is: torch matmul or oneDNN's
    pre-packed linear, whichever is faster, on the fastest of ``MATMUL_SHAPES``."""

    def __init__(self, dtype: torch.dtype, device: Device = "cpu") -> None:
        import torch

        self.device = device
        self._products = []  # (FLOPs, [the ways to compute one product])
        with torch.inference_mode():
            for m, k, n in MATMUL_SHAPES:
                w, x = torch.randn(n, k, dtype=dtype, device=device), torch.randn(m, k, dtype=dtype, device=device)
                ways = [lambda x=x, w=w: x @ w.T]
                if _onednn_runs(dtype, device):
                    pw = torch.ops.mkldnn._reorder_linear_weight(w, m)
                    ways.append(lambda x=x, pw=pw: torch.ops.mkldnn._linear_pointwise(x, pw, None, "none", [], ""))
                self._products.append((2 * m * k * n, ways))

    def measure(self, repeats: int = 5) -> float:
        """FLOP/s: each product's fastest way, best of ``repeats``; the fastest product's rate."""
        import torch

        with torch.inference_mode():
            return max(flops / min(best_s(way, repeats, self.device) for way in ways)
                       for flops, ways in self._products)


def measure_matmul(dtype: torch.dtype, repeats: int = 5, device: Device = "cpu") -> float:
    """Matmul throughput (FLOP/s) on model-like shapes (MatmulProbe), best of ``repeats``."""
    return MatmulProbe(dtype, device).measure(repeats)


def measure_machine(dtype: torch.dtype, repeats: int = 5, mem_bytes: int = 512 << 20, device: Device = "cpu"
                    ) -> Machine:
    """This machine's limit for ``dtype`` on ``device`` now: read bandwidth and matmul throughput."""
    probe = BandwidthProbe(dtype, mem_bytes, device=device)
    try:
        bandwidth = probe.measure(repeats)
    finally:
        probe.close()
    return Machine(bandwidth, measure_matmul(dtype, repeats, device))
