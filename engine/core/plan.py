"""What a scheduler asks for in one model call, and what the call gives back."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class BatchPlan:
    """One model call: ``{request_id: num_scheduled_tokens}`` plus the context each starts from.

    Entries are ordered decodes first, then prefill chunks. Parallel tuples rather than one
    object per entry keep the simulator fast; everything else is derived.
    ``samples[i]`` says whether entry i reaches the end of its sequence and so yields a token.
    A request appearing twice is caught where it would do harm (``ModelRunner.execute``, and
    the scheduler tests on every plan), not here: the simulator builds millions of plans.
    """

    scheduler: str
    request_ids: tuple[str, ...]
    num_tokens: tuple[int, ...]
    context_lens: tuple[int, ...]
    samples: tuple[bool, ...]
    num_decodes: int
    preempted_ids: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        n = len(self.request_ids)
        if not (len(self.num_tokens) == len(self.context_lens) == len(self.samples) == n):
            raise ValueError("BatchPlan fields must have one entry per request")
        if n == 0:
            raise ValueError("BatchPlan must schedule at least one request")
        if not 0 <= self.num_decodes <= n:
            raise ValueError("num_decodes out of range")

    def check_unique(self) -> None:
        if len(set(self.request_ids)) != len(self.request_ids):
            raise ValueError(f"a request appears twice in one BatchPlan: {self.request_ids}")

    @property
    def num_scheduled_tokens(self) -> Mapping[str, int]:
        return dict(zip(self.request_ids, self.num_tokens))

    @property
    def num_requests(self) -> int:
        return len(self.request_ids)

    @property
    def num_prefills(self) -> int:
        return len(self.request_ids) - self.num_decodes

    @property
    def total_tokens(self) -> int:
        return sum(self.num_tokens)

    @property
    def num_prefill_tokens(self) -> int:
        return sum(self.num_tokens[self.num_decodes:])

    @property
    def decode_ids(self) -> tuple[str, ...]:
        return self.request_ids[:self.num_decodes]

    @property
    def prefill_ids(self) -> tuple[str, ...]:
        return self.request_ids[self.num_decodes:]

    @property
    def num_samples(self) -> int:
        return sum(self.samples)

    @property
    def phase(self) -> str:
        """'prefill', 'decode' or 'mixed' — serial and static calls are never mixed."""
        if self.num_decodes == len(self.request_ids):
            return "decode"
        return "prefill" if self.num_decodes == 0 else "mixed"

    @property
    def label(self) -> str:
        """The trace region name, as in the seed's profiles."""
        if self.scheduler == "continuous":
            return (f"miniserve.continuous.step active={self.num_requests} decode={self.num_decodes} "
                    f"prefill={self.num_prefills} tokens={self.total_tokens}")
        return f"miniserve.{self.scheduler}.{self.phase} batch={self.num_requests}"


@dataclass(frozen=True)
class StepResult:
    """What executing a plan produced: one token per sampling entry, and how long it took."""

    token_ids: tuple[int, ...] | None
    duration_s: float
