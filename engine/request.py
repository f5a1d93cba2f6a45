"""A request and its life cycle, in vLLM's vocabulary."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import IntEnum


class RequestStatus(IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_LENGTH = 3
    FINISHED_STOPPED = 4
    FINISHED_ABORTED = 5

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_LENGTH


@dataclass(eq=False)
class Request:
    """One generation request.

    ``num_computed_tokens`` catching up to ``num_tokens`` covers prefill, chunked prefill, decode
    and recompute after preemption alike, so no separate phase flag is needed. The simulator
    passes ``range(n)`` as the prompt: only its length matters there, and it costs no memory.
    """

    request_id: str
    prompt_token_ids: Sequence[int]
    max_tokens: int
    arrival_s: float = 0.0
    ignore_eos: bool = True
    eos_token_id: int | None = None
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    output_token_ids: list[int] = field(default_factory=list)
    token_times_s: list[float] = field(default_factory=list)
    first_scheduled_s: float | None = None
    finished_s: float | None = None
    num_preemptions: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 1:
            raise ValueError(f"request {self.request_id}: max_tokens must be a positive integer, "
                             f"got {self.max_tokens!r}")
        if len(self.prompt_token_ids) == 0:
            raise ValueError(f"request {self.request_id}: prompt must hold at least one token")
        if not self.arrival_s >= 0.0:  # also rejects NaN
            raise ValueError(f"request {self.request_id}: arrival_s must be >= 0, got {self.arrival_s!r}")

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        """Tokens whose KV the request needs: prompt plus every output token so far."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def max_total_tokens(self) -> int:
        return len(self.prompt_token_ids) + self.max_tokens

    @property
    def is_decoding(self) -> bool:
        """Everything but the newest output token is in the KV cache: one token to go."""
        return bool(self.output_token_ids) and self.num_computed_tokens == self.num_tokens - 1

    def token_ids(self, start: int, count: int) -> list[int]:
        """Token ids ``[start, start + count)`` of prompt followed by output."""
        n_prompt = len(self.prompt_token_ids)
        if start + count <= n_prompt:
            return list(self.prompt_token_ids[start:start + count])
        head = list(self.prompt_token_ids[start:n_prompt]) if start < n_prompt else []
        out_start = max(0, start - n_prompt)
        return head + self.output_token_ids[out_start:start + count - n_prompt]

    def append_output(self, token_id: int, now_s: float) -> None:
        self.output_token_ids.append(token_id)
        self.token_times_s.append(now_s)

    def stop_reason(self) -> RequestStatus | None:
        """The finished status this request has reached, if any."""
        if len(self.output_token_ids) >= self.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if (not self.ignore_eos and self.eos_token_id is not None and self.output_token_ids
                and self.output_token_ids[-1] == self.eos_token_id):
            return RequestStatus.FINISHED_STOPPED
        return None
