"""Choose each sampled row's next token: greedy by default, else temperature / top-k / top-p.

Runs on the logits' device inside the same packed step as the forward pass. Rows whose request
has no ``SamplingParams`` (the default) take the argmax the runner passes in, so the greedy fast
path is unchanged; only sampled rows pay for a softmax.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from engine.core.request import Request
from engine.core.sampling import SamplingParams

_SEED_MIX = 0x9E3779B97F4A7C15  # spreads (seed, index) pairs over the generator's seed space


def needs_sampler(requests: Sequence[Request]) -> bool:
    return any(r.sampling is not None for r in requests)


def sample(logits: torch.Tensor, requests: Sequence[Request],
           greedy: Callable[[torch.Tensor], torch.Tensor]) -> list[int]:
    """One token per row of ``logits`` (row i belongs to ``requests[i]``); records log-probs on
    requests that asked for them."""
    tokens: list[int] = greedy(logits.contiguous()).tolist()
    logprobs = None
    for i, request in enumerate(requests):
        params = request.sampling
        if params is None:
            continue
        if not params.greedy:
            tokens[i] = _draw(logits[i], params, request.num_output_tokens)
        if params.logprobs is not None:
            if logprobs is None:
                logprobs = torch.log_softmax(logits.float(), dim=-1)
            request.output_logprobs.append(_entry(logprobs[i], tokens[i], params.logprobs))
    return tokens


def _generator(params: SamplingParams, index: int, device: torch.device) -> torch.Generator | None:
    if params.seed is None:
        return None  # torch's global generator: different on every run, as OpenAI's unseeded calls
    g = torch.Generator(device=device)
    g.manual_seed((params.seed * _SEED_MIX + index) % (1 << 63))
    return g


def filtered_probs(row: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution a draw uses: logits / temperature, then top-k, then top-p (nucleus). The
    row's maximum comes off before the division: any temperature the API accepts (> 0, however
    small) then leaves the most likely token at 0 and the rest finite or -inf, never inf - inf
    (a NaN the draw would raise on, failing the step of every request in it)."""
    x = row.float()
    x = (x - x.max()) / params.temperature
    if params.top_k > 0 and params.top_k < x.numel():
        kth = torch.topk(x, params.top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if params.top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True)
        before = torch.cumsum(sorted_p, dim=-1) - sorted_p  # mass of strictly more likely tokens
        drop = before >= params.top_p  # keeps the smallest set reaching top_p (never empty)
        probs = probs.scatter(0, order, sorted_p.masked_fill(drop, 0.0))
    return probs


def _draw(row: torch.Tensor, params: SamplingParams, index: int) -> int:
    probs = filtered_probs(row, params)
    return int(torch.multinomial(probs, 1, generator=_generator(params, index, row.device)).item())


def _entry(logprobs: torch.Tensor, token: int, k: int) -> tuple[float, tuple[tuple[int, float], ...]]:
    """(log-prob of the chosen token, its top-k alternatives as (id, log-prob), most likely first)."""
    top: tuple[tuple[int, float], ...] = ()
    if k > 0:
        values, ids = torch.topk(logprobs, k)
        top = tuple(zip(ids.tolist(), values.tolist()))
    return float(logprobs[token]), top
