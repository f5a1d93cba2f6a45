"""What a scheduler asks for in one model call, and what executing it gives back."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

LaneIds = Callable[[], tuple[tuple[str, ...], tuple[int, ...]]]
PHASE_LABELED = ("serial", "static")  # policies whose calls the seed labelled by phase and batch


@dataclass(slots=True, eq=False)
class BatchPlan:
    """One model call: which requests run, how many tokens each, from which context.

    Entries are ordered decodes first, then prefill chunks. A plan has two parts:
    - the decode lane's part (``lane_size`` > 0): every lane member decodes one token, in running
      order. It is *counted* (``lane_size``, ``lane_context_sum``), not listed: the simulator times
      it from those two numbers, and its ids are read from the lane only when an executor asks
      (``request_ids`` and friends), which must happen before the step is applied;
    - explicit entries (``ids``, ``tokens``, ``contexts``, ``sampled``), of which the first
      ``explicit_decodes`` are decodes of requests outside the lane.
    A request appearing twice is caught where it would do harm (``ModelRunner.execute``, and the
    scheduler tests on every plan), not here: the simulator builds millions of plans. For the
    same reason it is not ``frozen`` (a frozen dataclass's __init__ costs 4x): nothing changes a
    plan once built, except ``materialize`` filling in the lane part's ids.
    """

    scheduler: str
    ids: tuple[str, ...] = ()
    tokens: tuple[int, ...] = ()
    contexts: tuple[int, ...] = ()
    sampled: tuple[bool, ...] = ()
    explicit_decodes: int = 0
    preempted_ids: tuple[str, ...] = ()
    lane_size: int = 0
    lane_context_sum: int = 0
    lane_ids: LaneIds | None = field(default=None, repr=False)  # the lane part's (ids, contexts), while current
    _lane_part: tuple[tuple[str, ...], tuple[int, ...]] | None = field(default=None, repr=False)
    # prefix caching (engine/core/block_pool.py): cached blocks to copy into a request's KV before
    # the call (its prefix hit), blocks the call completes to store after it, and their tokens
    kv_loads: tuple[tuple[str, tuple[int, ...]], ...] = ()  # (request, block ids)
    kv_saves: tuple[tuple[str, int, int], ...] = ()  # (request, block index, block id)
    kv_copy_tokens: int = 0  # tokens loaded + stored: what the copies cost

    def __post_init__(self) -> None:
        if self.lane_size and self.lane_ids is None:
            raise ValueError("a plan with a lane part needs the lane's ids")
        if not self.ids and not self.tokens and not self.contexts and not self.sampled:  # lane only
            if not self.lane_size:
                raise ValueError("BatchPlan must schedule at least one request")
            return
        if not (type(self.ids) is type(self.tokens) is type(self.contexts) is type(self.sampled) is tuple):
            self.ids, self.tokens, self.contexts, self.sampled = (
                tuple(self.ids), tuple(self.tokens), tuple(self.contexts), tuple(self.sampled))
        n = len(self.ids)
        if not (len(self.tokens) == len(self.contexts) == len(self.sampled) == n):
            raise ValueError("BatchPlan fields must have one entry per request")
        if not 0 <= self.explicit_decodes <= n:
            raise ValueError("explicit_decodes out of range")

    @classmethod
    def of(cls, scheduler: str, request_ids, num_tokens, context_lens, samples, num_decodes: int,
           preempted_ids: tuple[str, ...] = ()) -> BatchPlan:
        """A plan listed entry by entry (no lane part)."""
        return cls(scheduler, tuple(request_ids), tuple(num_tokens), tuple(context_lens), tuple(samples),
                   num_decodes, tuple(preempted_ids))

    # --- the lane part, listed on demand -------------------------------------------------------
    def _lane(self) -> tuple[tuple[str, ...], tuple[int, ...]]:
        part = self._lane_part
        if part is None:
            lane_ids = self.lane_ids  # set whenever lane_size is (__post_init__)
            part = self._lane_part = lane_ids() if lane_ids is not None and self.lane_size else ((), ())
        return part

    def materialize(self) -> BatchPlan:
        """List the lane part now (while the lane still holds this step), so the plan can be
        read after the step is applied: kept plans (traces, replays) are materialised."""
        self._lane()
        return self

    @property
    def request_ids(self) -> tuple[str, ...]:
        return self._lane()[0] + self.ids

    @property
    def num_tokens(self) -> tuple[int, ...]:
        return (1,) * self.lane_size + self.tokens

    @property
    def context_lens(self) -> tuple[int, ...]:
        return self._lane()[1] + self.contexts

    @property
    def samples(self) -> tuple[bool, ...]:
        return (True,) * self.lane_size + self.sampled

    # --- counts, without listing the lane ------------------------------------------------------
    @property
    def num_decodes(self) -> int:
        return self.lane_size + self.explicit_decodes

    @property
    def num_requests(self) -> int:
        return self.lane_size + len(self.ids)

    @property
    def num_prefills(self) -> int:
        return len(self.ids) - self.explicit_decodes

    @property
    def total_tokens(self) -> int:
        return self.lane_size + sum(self.tokens)

    @property
    def num_samples(self) -> int:
        return self.lane_size + sum(self.sampled)

    @property
    def decode_context_sum(self) -> int:
        """Σ contexts of the decodes: the KV that decode attention reads."""
        return self.lane_context_sum + sum(self.contexts[:self.explicit_decodes])

    @property
    def prefill_chunks(self) -> tuple[tuple[int, int], ...]:
        """(tokens, prior context) of each prefill chunk."""
        d = self.explicit_decodes
        return tuple(zip(self.tokens[d:], self.contexts[d:]))

    @property
    def phase(self) -> str:
        """'prefill', 'decode' or 'mixed' — serial and static calls are never mixed."""
        if self.num_prefills == 0:
            return "decode"
        return "prefill" if self.num_decodes == 0 else "mixed"

    @property
    def label_fields(self) -> dict[str, int]:
        """What the trace label says, as numbers (engine.observe.trace reads them back)."""
        return {"active": self.num_requests, "decode": self.num_decodes, "prefill": self.num_prefills,
                "tokens": self.total_tokens}

    @property
    def label(self) -> str:
        """The trace region name, as in the seed's profiles: a serial or static call names its
        phase and batch (``miniserve.static.decode batch=6``), any other step its mix
        (``miniserve.continuous.step active=8 decode=5 prefill=3 tokens=44``)."""
        if self.scheduler in PHASE_LABELED and self.phase != "mixed":
            return f"miniserve.{self.scheduler}.{self.phase} batch={self.num_requests}"
        return f"miniserve.{self.scheduler}.step " + " ".join(f"{k}={v}" for k, v in self.label_fields.items())

    def check_unique(self) -> None:
        ids = self.request_ids
        if len(set(ids)) != len(ids):
            raise ValueError(f"a request appears twice in one BatchPlan: {ids}")

    def _key(self) -> tuple:
        return (self.scheduler, self.request_ids, self.num_tokens, self.context_lens, self.samples,
                self.num_decodes, self.preempted_ids, self.kv_loads, self.kv_saves)

    def __eq__(self, other: object) -> bool:
        """Plans are equal when they ask for the same call, however their decodes are carried."""
        if not isinstance(other, BatchPlan):
            return NotImplemented
        return self._key() == other._key()

    __hash__ = None  # type: ignore[assignment]


class StepResult(NamedTuple):
    """What executing a plan produced: one token per sampling entry (None in simulation), how
    long the model call took, when its tokens came out and when the next step may start."""

    token_ids: tuple[int, ...] | None
    duration_s: float
    end_s: float = 0.0
    ready_s: float = 0.0
