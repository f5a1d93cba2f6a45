"""Frozen settings shared by the engine, the simulator and the Hydra schemas."""

from __future__ import annotations

from dataclasses import dataclass, replace

SCHEDULER_NAMES = ("serial", "static", "continuous")


@dataclass(frozen=True)
class SchedulerConfig:
    """Limits a scheduler works within (vLLM names).

    ``num_kv_blocks`` × ``block_size`` is the KV capacity in tokens that the scheduler accounts
    for; the model runner sizes its cache from the same numbers, so running out of blocks in the
    scheduler is exactly running out of cache.

    ``enable_prefix_caching`` keeps computed full prompt blocks cached by content, so a request
    whose prompt starts like an earlier one's skips that part of its prefill
    (engine/core/block_pool.py). Off by default, unlike vLLM: the project's length-only workloads
    have no shared content, and off keeps every earlier run's plans exactly.
    """

    name: str = "continuous"
    max_num_seqs: int = 8
    max_num_batched_tokens: int = 256
    long_prefill_token_threshold: int = 128
    num_kv_blocks: int = 1024
    block_size: int = 16
    max_model_len: int = 2048
    enable_prefix_caching: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.enable_prefix_caching, bool):
            raise ValueError(f"scheduler.enable_prefix_caching must be true or false, got {self.enable_prefix_caching!r}")
        if self.name not in SCHEDULER_NAMES:
            raise ValueError(f"scheduler.name must be one of {SCHEDULER_NAMES}, got {self.name!r}")
        for field in ("max_num_seqs", "max_num_batched_tokens", "long_prefill_token_threshold",
                      "num_kv_blocks", "block_size", "max_model_len"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"scheduler.{field} must be a positive integer, got {value!r}")
        if self.name == "continuous" and self.max_num_batched_tokens < self.max_num_seqs:
            # every running request decodes a token per step within the budget, so the cap would
            # never bind: a sweep over it would silently measure the budget (vLLM refuses it too)
            raise ValueError(f"scheduler.max_num_batched_tokens ({self.max_num_batched_tokens}) must be at least "
                             f"scheduler.max_num_seqs ({self.max_num_seqs}): each running request decodes one "
                             "token per step within that budget")

    @property
    def kv_capacity_tokens(self) -> int:
        return self.num_kv_blocks * self.block_size

    def within(self, max_len: int | None) -> SchedulerConfig:
        """This config with ``max_model_len`` cut to ``max_len`` (a model's positions, a runner's KV
        slots) where it asks for more: a request past them cannot run, so none is accepted. The
        caller warns: the core logs nothing (logging imports the clock the core must not touch)."""
        return self if max_len is None or self.max_model_len <= max_len else replace(self, max_model_len=max_len)


MODEL_NAMES = ("tiny", "qwen2_5_0_5b", "qwen2_5_1_5b", "qwen3_0_6b")
DTYPES = ("auto", "float32", "bfloat16")  # auto: bf16 where the device has bf16 arithmetic (engine/model/device.py)
DEVICES = ("auto", "cpu", "cuda", "mps")  # auto: cuda, then mps, then cpu
ATTENTION_BACKENDS = ("ragged", "masked")


@dataclass(frozen=True)
class ModelConfig:
    """Which model the runner builds, and how it runs on this machine.

    With ``path`` unset, ``name`` picks a bundled real config and the weights are seeded random
    (cost depends on shapes, not values); with ``path`` set, a local checkpoint directory is
    loaded and the hub is never contacted. ``device`` and ``dtype`` may say ``auto``;
    ``engine.model.device.resolve`` turns them into what this machine has.
    """

    name: str = "tiny"
    path: str | None = None
    dtype: str = "float32"
    device: str = "auto"
    seed: int = 0
    num_threads: int | None = None
    attention: str = "ragged"

    def __post_init__(self) -> None:
        if self.path is None and self.name not in MODEL_NAMES:
            raise ValueError(f"model.name must be one of {MODEL_NAMES} (or set model.path), got {self.name!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"model.dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.device not in DEVICES:
            raise ValueError(f"model.device must be one of {DEVICES}, got {self.device!r}")
        if self.attention not in ATTENTION_BACKENDS:
            raise ValueError(f"model.attention must be one of {ATTENTION_BACKENDS}, got {self.attention!r}")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"model.num_threads must be >= 1, got {self.num_threads!r}")
