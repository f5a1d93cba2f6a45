"""Executes a BatchPlan as ONE forward pass over a packed (1, T) batch, then samples (greedy by
default; engine/model/sampler.py for requests that ask for more).

Two paths, one plan layout. On CPU: oneDNN-packed linears, the lean layers and miniserve's kernels
where this CPU runs them. On a GPU (or ``generic=True``, which forces it on CPU so tests cover it):
the stock transformers layers with the same ragged attention, KV slots in device memory, sampling
on the device, and no CPU kernel is built. Either way a call's duration comes from the device's
synchronised timer (engine/model/device.py).
"""

from __future__ import annotations

import gc
import inspect
import time
from collections.abc import Callable, Iterable, Mapping
from itertools import groupby

import torch

from engine.model import kernels
from engine.model.kernels import dispatch
from engine.model.attention import RaggedBatch, SlotKVCache
from engine.core.config import ModelConfig, SchedulerConfig
from engine.model.device import DeviceTimer, resolve
from engine.model.lean_qwen2 import LeanQwen2
from engine.model.loader import load_model, pack_linear_weights
from engine.model.prefix_store import PrefixKVStore
from engine.model.weights import released
from engine.model.sampler import needs_sampler, sample
from engine.core.plan import BatchPlan, StepResult
from engine.core.request import Request


def _torch_greedy(logits: torch.Tensor) -> torch.Tensor:
    return logits.float().argmax(dim=-1)  # bf16 argmax is slower than convert + argmax (docs/architecture.md)


def freeze_startup_objects() -> None:
    """Take what exists once a model is loaded (the model, torch and transformers' own objects:
    hundreds of thousands) out of the garbage collector's scans, as vLLM does after start-up.
    Every full collection re-walked all of them; where a call is bound by the Python that
    launches its kernels (a GPU), that tripled the engine's calls against the same calls timed
    back to back, and the simulator priced from the latter was that much too fast (figures in
    docs/architecture.md, benchmarks/call_in_loop.py). A frozen object is freed when its last
    reference goes, but a reference cycle through one is never collected, with all it reaches: so
    a runner's objects hold no cycle (tests/test_model_runner.py drops a runner of each linear
    choice and checks its weights are freed)."""
    gc.collect()
    gc.freeze()


def refuse_sliding_window(config) -> None:
    """A model with sliding-window layers (``use_sliding_window``) would attend over every key here:
    the ragged batch has no window, so its logits would be wrong past the window, silently."""
    sliding = [i for i, kind in enumerate(getattr(config, "layer_types", None) or ()) if kind != "full_attention"]
    if sliding:
        raise ValueError(f"this model's layers {sliding[:4]}{'...' if len(sliding) > 4 else ''} use "
                         f"{config.layer_types[sliding[0]]} (use_sliding_window=true, sliding_window="
                         f"{getattr(config, 'sliding_window', None)}), which miniserve's ragged attention does not "
                         f"implement; set use_sliding_window to false in config.json to serve it with full attention")


class ModelRunner:
    """Owns the model and its KV slots; knows nothing about queues or policies."""

    def __init__(self, model_config: ModelConfig, scheduler_config: SchedulerConfig, *,
                 generic: bool = False) -> None:
        self.model_config = model_config = resolve(model_config)  # device and dtype concrete
        self.device = torch.device(model_config.device)
        self.model, self.tokenizer = load_model(model_config)
        refuse_sliding_window(self.model.config)
        self.generic = generic or self.device.type != "cpu"
        cfg = self.model.config
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        # each phase of a step (decodes, prefill chunks) attends with miniserve's kernel where this CPU
        # runs it and it was measured faster for that phase (engine/model/kernels), else with SDPA; the
        # generic path never asks for (or builds) a kernel
        self.attention_kernel, self.kernel_phases = ((None, frozenset()) if self.generic
                                                     else dispatch.attention_kernel(self.model.dtype, head_dim))
        self._lean = None
        if not self.generic:
            # the same arithmetic with less Python per layer, each product on the kernel measured
            # fastest here (engine/model/lean_qwen2.py, kernels/dispatch.py); stock layers elsewhere,
            # their linears on oneDNN's pre-packed weights (faster at decode sizes; docs). Only the
            # ragged backend's steps attend on the kernel (what the layers in one call run)
            if LeanQwen2.supports(self.model):
                ragged = model_config.attention == "ragged"
                self._lean = LeanQwen2(self.model, self.attention_kernel if ragged else None)
            else:
                pack_linear_weights(self.model)
        self.vocab_size: int = cfg.vocab_size
        self.eos_token_id: int | None = cfg.eos_token_id if isinstance(cfg.eos_token_id, int) else None
        self.max_model_len = min(scheduler_config.max_model_len, cfg.max_position_embeddings)
        self.cache = SlotKVCache(cfg.num_hidden_layers, scheduler_config.max_num_seqs, cfg.num_key_value_heads,
                                 self.max_model_len, head_dim, self.model.dtype,
                                 device=self.device if self.generic else None)
        self.greedy = (None if self.generic else kernels.argmax_rows(self.model.dtype)) or _torch_greedy
        # the stock forward takes the KV slots as `cache` (later transformers 5.x) or `past_key_values`
        # (5.17 and earlier): under the other name it would attend over this step's keys alone
        self._cache_arg = "cache" if "cache" in inspect.signature(self.model.forward).parameters else "past_key_values"
        self.timer = DeviceTimer(self.device)
        self._free_slots = list(range(scheduler_config.max_num_seqs - 1, -1, -1))
        self._slot_of: dict[str, int] = {}
        self.clock: Callable[[], float] = time.perf_counter  # what a step's end is stamped with
        self.prefix_store: PrefixKVStore | None = None  # cached prefix blocks' KV (prefix caching)
        self.prefix_owner: object | None = None  # whose cached blocks the store holds (Engine.claim_runner)
        if scheduler_config.enable_prefix_caching:
            self.prepare_prefix_store(scheduler_config.num_kv_blocks, scheduler_config.block_size)
        freeze_startup_objects()

    @property
    def pass_rows(self) -> int | None:
        """Rows per pass where this runner's products run on miniserve's gemv (kernels.gemv_pass_rows:
        a call's cost steps up just past each multiple); None where none do (oneDNN, F.linear, stock
        layers, a GPU), whose blocking this engine does not know."""
        lean = self._lean
        if lean is None or lean.gemv is None or all(dispatch.choice_for_rows(lean.choices, rows) != "gemv"
                                                    for rows in range(17, 66)):
            return None
        return kernels.gemv_pass_rows()

    def prepare_prefix_store(self, num_blocks: int, block_size: int) -> None:
        """Room for ``num_blocks`` cached prefix blocks (engine/model/prefix_store.py), for an
        engine whose scheduler caches prefixes; a store already big enough is kept."""
        store = self.prefix_store
        if store is None or store.block_size != block_size or len(store.keys[0]) < num_blocks:
            self.prefix_store = PrefixKVStore.like(self.cache, num_blocks, block_size)

    def kernels_used(self) -> dict[str, bool]:
        """Which of miniserve's CPU kernels this runner's calls run (a profile records it)."""
        lean = self._lean
        return {"gemv": lean is not None and "gemv" in lean.choices,
                "decode_attention": self.attention_kernel is not None and "decode" in self.kernel_phases,
                "prefill_attention": self.attention_kernel is not None and "prefill" in self.kernel_phases,
                "layer_ops": lean is not None and lean.ops is not kernels.TORCH_LAYER_OPS,
                "gate_up_silu": lean is not None and lean.gate_up is not None,  # SiLU·up in the gemv's product
                "decoder_layers": lean is not None and lean.stack is not None,  # the layers in one call
                "argmax": self.greedy is not _torch_greedy}

    def decode_weights(self) -> list[torch.Tensor]:
        """The weights a one-row decode call streams, where they can be read as tensors (LeanQwen2's
        chosen copies; on the stock layers their linears' weights unless oneDNN's packed copies
        replaced them). Nothing on a GPU: where its memory lands is not the host's placement problem
        this stamps (calibration.roofline.tensors_read_gb_s), and a sum per weight there would time
        launches."""
        if self.device.type != "cpu":
            return []
        if self._lean is not None:
            return self._lean.decode_weights()
        return [m.weight for m in self.model.modules()
                if isinstance(m, torch.nn.Linear) and not released(m.weight)]

    @property
    def num_slots_used(self) -> int:
        """KV slots held by requests now (the server's /metrics shows it)."""
        return len(self._slot_of)

    def free(self, request_ids: Iterable[str]) -> None:
        """Return the KV slots of finished, aborted or preempted requests."""
        for rid in request_ids:
            slot = self._slot_of.pop(rid, None)
            if slot is not None:
                self._free_slots.append(slot)

    def _slot(self, request_id: str, context_len: int, cached_len: int = 0) -> int:
        slot = self._slot_of.get(request_id)
        if slot is None:
            if context_len != cached_len:
                raise RuntimeError(f"request {request_id} resumes at {context_len} tokens but holds no KV slot")
            slot = self._slot_of[request_id] = self._free_slots.pop()
        return slot

    def _copy_prefixes(self, plan: BatchPlan, saves: bool) -> None:
        """Prefix caching: hit blocks from the store into their request's slot (before the
        forward), or the prompt blocks the forward completed from the slot to the store (after)."""
        store = self.prefix_store
        if store is None:
            raise RuntimeError("the plan copies cached prefix blocks, but this runner has no prefix store "
                               "(prepare_prefix_store)")
        if not saves:
            for rid, block_ids in plan.kv_loads:
                store.load(self.cache, self._slot_of[rid], block_ids)
            return
        for rid, blocks in groupby(plan.kv_saves, key=lambda save: save[0]):
            blocks = list(blocks)
            first = blocks[0][1]
            if [b[1] for b in blocks] != list(range(first, first + len(blocks))):
                raise ValueError(f"request {rid}: saved prefix blocks must be consecutive, got {blocks}")
            store.save(self.cache, self._slot_of[rid], first, [b[2] for b in blocks])

    @torch.inference_mode()
    def execute(self, plan: BatchPlan, requests: Mapping[str, Request], start_s: float | None = None, *,
                return_logits: bool = False) -> StepResult | tuple[StepResult, torch.Tensor]:
        """The executor of real runs (engine.core.engine_core.Executor): one packed forward pass,
        greedy sampling; its tokens come out at ``self.clock()`` after the call."""
        plan.check_unique()  # two entries of one request would write the same KV slot
        token_ids: list[int] = []
        sample_rows: list[int] = []
        sampled: list[Request] = []
        slots: list[int] = []
        cached = {}  # requests starting from a prefix hit: tokens the store gives them
        if plan.kv_loads:
            if self.prefix_store is None:
                raise RuntimeError("the plan loads cached prefix blocks, but this runner has no prefix store "
                                   "(prepare_prefix_store)")
            cached = {rid: len(ids) * self.prefix_store.block_size for rid, ids in plan.kv_loads}
        for rid, n, ctx, samples in zip(plan.request_ids, plan.num_tokens, plan.context_lens, plan.samples):
            token_ids += requests[rid].token_ids(ctx, n)
            slots.append(self._slot(rid, ctx, cached.get(rid, 0)))
            if samples:
                sample_rows.append(len(token_ids) - 1)
                sampled.append(requests[rid])
        batch = RaggedBatch.build(slots, list(plan.num_tokens), list(plan.context_lens),
                                  self.model_config.attention, self.attention_kernel, self.kernel_phases,
                                  device=self.device if self.generic else None)
        self.cache.start_step(batch)
        input_ids = torch.tensor([token_ids], dtype=torch.long, device=self.device)
        # every row sampled (a decodes-only step): no gather of the last hidden states
        rows = (None if len(sample_rows) == len(token_ids)
                else torch.tensor(sample_rows, dtype=torch.long, device=self.device))
        with torch.profiler.record_function(plan.label):
            self.timer.start()
            if plan.kv_loads:
                self._copy_prefixes(plan, saves=False)
            if self._lean is not None:
                logits = self._lean(input_ids, batch.positions, batch, self.cache, rows)
            else:
                logits = self.model(
                    input_ids=input_ids,
                    position_ids=batch.positions[None],
                    attention_mask={"full_attention": batch, "sliding_attention": batch},
                    use_cache=False,
                    logits_to_keep=0 if rows is None else rows,  # 0: every row
                    **{self._cache_arg: self.cache},
                ).logits[0]
                self.cache.check_written()
            if plan.kv_saves:
                self._copy_prefixes(plan, saves=True)
            if needs_sampler(sampled):
                next_tokens = sample(logits, sampled, self.greedy)
            else:
                next_tokens = self.greedy(logits.contiguous()).tolist()
            duration = self.timer.stop()  # synchronised: the region ends when the device is done
        end = self.clock()
        result = StepResult(tuple(next_tokens), duration, end, end)
        return (result, logits.float()) if return_logits else result
