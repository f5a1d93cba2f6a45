"""How one request's next token is chosen: the OpenAI sampling fields, checked once, torch-free.

``None`` on a request means greedy with no log-probabilities, the seed's setting and the
fast path (the runner's argmax kernel). The simulator never reads these: token values do not
change step costs, and replay output lengths come from ``max_tokens`` with ``ignore_eos``.
"""

from __future__ import annotations

from dataclasses import dataclass

MAX_LOGPROBS = 20  # vLLM's default max_logprobs


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """``temperature`` 0 is greedy; ``top_k`` 0 or -1 and ``top_p`` 1 switch those filters off.
    ``seed`` makes the draws a function of (seed, output index), so batching, preemption and
    recompute do not change them. ``logprobs`` is how many alternatives to report per token
    (0: only the sampled token's own log-probability); None reports nothing."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    logprobs: int | None = None

    def __post_init__(self) -> None:
        if not 0.0 <= self.temperature <= 2.0:
            raise ValueError(f"temperature must be in [0, 2], got {self.temperature!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1, 0 (off) or positive, got {self.top_k!r}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
