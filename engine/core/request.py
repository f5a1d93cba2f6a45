"""A request and its life cycle, in vLLM's vocabulary."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import IntEnum
from typing import TYPE_CHECKING

from engine.core.block_pool import block_hashes

if TYPE_CHECKING:
    from engine.core.lane import DecodeLane
    from engine.core.sampling import SamplingParams


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


@dataclass(eq=False, slots=True)
class Request:
    """One generation request.

    ``num_computed_tokens`` catching up to ``num_tokens`` covers prefill, chunked prefill, decode
    and recompute after preemption alike, so no separate phase flag is needed. The simulator
    passes ``range(n)`` as the prompt: only its length matters there, and it costs no memory.

    While the request decodes every step it sits in the state's DecodeLane, which keeps its
    progress (computed tokens, outputs, token times) relative to the lane's step clock; the
    properties below read it the same either way. ``output_token_ids`` holds sampled values
    and so stays empty in simulation, where tokens have none.

    ``sampling`` None is greedy (the seed's setting). ``output_logprobs`` gets one entry per
    output token when ``sampling.logprobs`` is set; the model runner writes it, because the
    state's ``apply`` sees token ids only.
    """

    request_id: str
    prompt_token_ids: Sequence[int]
    max_tokens: int
    arrival_s: float = 0.0
    ignore_eos: bool = True
    eos_token_id: int | None = None
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    first_scheduled_s: float | None = None
    finished_s: float | None = None
    num_preemptions: int = 0
    sampling: SamplingParams | None = None
    output_logprobs: list = field(default_factory=list)
    # prefix caching, summed over admissions (a preempted request is looked up again): tokens
    # looked up (its num_tokens then) and tokens found cached, which it did not compute
    num_lookup_tokens: int = field(default=0, init=False)
    num_cached_tokens: int = field(default=0, init=False)
    _block_hashes: list[int] | None = field(default=None, init=False, repr=False)
    # progress, explicit; or, in a lane, minus the lane's clock (times: those before joining)
    _computed: int = field(default=0, init=False, repr=False)
    _num_output: int = field(default=0, init=False, repr=False)
    _times: list[float] = field(default_factory=list, init=False, repr=False)
    lane: DecodeLane | None = field(default=None, init=False, repr=False)
    lane_joined: int = field(default=0, init=False, repr=False)  # the lane's clock when it joined
    admit_seq: int = field(default=0, init=False, repr=False)  # running order: admission count
    # (first index in token_times_s, count) of the tokens each stay in a lane gave: every gap
    # inside a run but its first is one lane step (the simulator counts those per step)
    lane_runs: list[tuple[int, int]] = field(default_factory=list, init=False, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 1:
            raise ValueError(f"request {self.request_id}: max_tokens must be a positive integer, "
                             f"got {self.max_tokens!r}")
        if len(self.prompt_token_ids) == 0:
            raise ValueError(f"request {self.request_id}: prompt must hold at least one token")
        if not self.arrival_s >= 0.0:  # also rejects NaN
            raise ValueError(f"request {self.request_id}: arrival_s must be >= 0, got {self.arrival_s!r}")

    @property
    def num_computed_tokens(self) -> int:
        """Tokens whose KV is cached."""
        lane = self.lane
        return self._computed if lane is None else self._computed + lane.clock

    @num_computed_tokens.setter
    def num_computed_tokens(self, value: int) -> None:
        if self.lane is not None:
            raise RuntimeError(f"request {self.request_id} is in the decode lane, which owns its progress")
        self._computed = value

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        lane = self.lane
        return self._num_output if lane is None else self._num_output + lane.clock

    @property
    def token_times_s(self) -> list[float]:
        """When each output token came out."""
        lane = self.lane
        return self._times if lane is None else self._times + lane.times_since(self.lane_joined)

    @property
    def num_tokens(self) -> int:
        """Tokens whose KV the request needs: prompt plus every output token so far."""
        lane = self.lane  # num_output_tokens, inlined: read per request per step
        return len(self.prompt_token_ids) + (self._num_output if lane is None else self._num_output + lane.clock)

    @property
    def max_total_tokens(self) -> int:
        return len(self.prompt_token_ids) + self.max_tokens

    @property
    def is_decoding(self) -> bool:
        """Everything but the newest output token is in the KV cache: one token to go."""
        if self.lane is not None:
            return True
        n = self._num_output
        return n > 0 and self._computed == len(self.prompt_token_ids) + n - 1

    def block_hashes(self, block_size: int) -> list[int]:
        """Chained content hashes of the prompt's full blocks (engine.core.block_pool), computed
        once: only prompt blocks are cached, since a simulated request's outputs have no values."""
        hashes = self._block_hashes
        if hashes is None:
            hashes = self._block_hashes = block_hashes(self.prompt_token_ids, block_size)
        return hashes

    def token_ids(self, start: int, count: int) -> list[int]:
        """Token ids ``[start, start + count)`` of prompt followed by output."""
        n_prompt = len(self.prompt_token_ids)
        if start + count <= n_prompt:
            return list(self.prompt_token_ids[start:start + count])
        head = list(self.prompt_token_ids[start:n_prompt]) if start < n_prompt else []
        out_start = max(0, start - n_prompt)
        return head + self.output_token_ids[out_start:start + count - n_prompt]

    def append_output(self, token_id: int | None, now_s: float) -> None:
        """One sampled token (``None`` in simulation, where it has no value) at ``now_s``."""
        if self.lane is not None:
            raise RuntimeError(f"request {self.request_id} is in the decode lane, which owns its progress")
        self._num_output += 1
        self._times.append(now_s)
        if token_id is not None:
            self.output_token_ids.append(token_id)

    def gaps_outside_lane_steps(self) -> list[float]:
        """Inter-token gaps that no step reported as uniform (``ServingState.last_uniform_gaps``):
        the first gap of each stay in the decode lane (from the token before it) and every gap
        outside one. Together with the uniform gaps they are every gap exactly once."""
        times = self._times if self.lane is None else self.token_times_s
        gaps = []
        i = 1
        for first, count in self.lane_runs:
            gaps += [times[j] - times[j - 1] for j in range(i, first + 1)]
            i = max(i, first + count)
        gaps += [times[j] - times[j - 1] for j in range(i, len(times))]
        return gaps

    def stop_reason(self) -> RequestStatus | None:
        """The finished status this request has reached, if any."""
        if self.num_output_tokens >= self.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if (not self.ignore_eos and self.eos_token_id is not None and self.output_token_ids
                and self.output_token_ids[-1] == self.eos_token_id):
            return RequestStatus.FINISHED_STOPPED
        return None
