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


# top-p looks for its set among this many most likely tokens before it selects over the whole vocabulary
NUCLEUS_PROBE = 256
# the radix select's digits of a non-negative float32's bits (its order as an int32), high to low
_DIGITS = ((23, 0xFF), (15, 0xFF), (7, 0xFF), (0, 0x7F))


def kept_tokens(row: torch.Tensor, params: SamplingParams) -> tuple[torch.Tensor | None, torch.Tensor]:
    """The tokens a draw chooses among and their weights (the probabilities, not renormalised):
    logits / temperature, then the top-k most likely (exactly k where the k-th is tied), then top-p
    (nucleus); ``ids`` None means the whole vocabulary, weights indexed by token (0 for a dropped
    one). The row's maximum comes off before the division: any temperature the API accepts (> 0,
    however small) then leaves the most likely token at 0 and the rest finite or -inf, never
    inf - inf (a NaN the draw would raise on, failing the step of every request in it). No sort of
    the whole vocabulary (the slowest part of a sampled row on a CPU, docs/architecture.md): the
    nucleus is looked for among the most likely few hundred, else selected by its threshold."""
    x = row.float()
    x = (x - x.max()) / params.temperature
    ids = None
    if 0 < params.top_k < x.numel():
        x, ids = torch.topk(x, params.top_k)  # most likely first
    probs = torch.softmax(x, dim=-1)
    if params.top_p >= 1.0:
        return ids, probs
    every = probs if ids is None else None  # the whole vocabulary's, unless top-k cut it
    if every is not None:
        probs, ids = torch.topk(every, min(NUCLEUS_PROBE, every.numel()))
    mass = torch.cumsum(probs, dim=-1)
    if every is not None and mass[-1] < params.top_p:  # a nucleus wider than the probe
        return None, torch.where(every >= _nucleus_threshold(every, params.top_p), every, 0.0)
    # a token stays while the mass of strictly more likely ones is under top_p: the smallest set
    # reaching top_p (never empty: the first token's is 0)
    keep = mass - probs < params.top_p
    return ids[keep], probs[keep]


def _nucleus_threshold(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """The probability t with less than top_p of the mass above it and at least top_p at or above
    it: the nucleus is every token with p >= t (ties at t all kept). A radix select on the bits,
    8 at a time (7 for the last): each digit's mass among the candidates left, then only the digit
    where the mass from the top reaches top_p."""
    acc = _accumulator(probs.device)
    cand_bits, cand_p = probs.view(torch.int32), probs.to(acc)
    above = 0.0  # the mass of the tokens more likely than every candidate
    for shift, mask in _DIGITS:
        digit = (cand_bits >> shift) & mask
        mass = torch.zeros(mask + 1, dtype=acc, device=probs.device).index_add_(0, digit, cand_p)
        at_least = mass.flip(0).cumsum(0).flip(0) + above  # the mass at this digit or higher
        reach = at_least >= top_p
        # the highest digit reaching top_p; none does where the float32 probabilities sum to less
        # than a top_p near 1: then the lowest, and so on down, so every token is kept
        d = int(reach.sum()) - 1 if bool(reach.any()) else int(digit.min())
        if d < mask:
            above = float(at_least[d + 1])
        inside = torch.nonzero(digit == d).squeeze(1)
        cand_bits, cand_p = cand_bits[inside], cand_p[inside]
    return cand_bits[:1].view(torch.float32)


def _accumulator(device: torch.device) -> torch.dtype:
    return torch.float32 if device.type == "mps" else torch.float64  # MPS has no float64


def filtered_probs(row: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution a draw uses over the whole vocabulary (kept_tokens' weights, 0 elsewhere)."""
    ids, weights = kept_tokens(row, params)
    if ids is None:
        return weights
    return torch.zeros(row.numel(), dtype=weights.dtype, device=row.device).index_put_((ids,), weights)


def _draw(row: torch.Tensor, params: SamplingParams, index: int) -> int:
    """One token by inverse CDF: a single uniform draw against the kept weights' running sum
    (torch.multinomial draws an exponential per vocabulary entry)."""
    ids, weights = kept_tokens(row, params)
    acc = _accumulator(row.device)
    cdf = torch.cumsum(weights, dim=-1, dtype=acc)
    u = torch.rand(1, generator=_generator(params, index, row.device), device=row.device, dtype=acc)
    # the first entry whose running sum passes u: a zero weight's sum equals its predecessor's, so
    # it is never chosen
    i = torch.searchsorted(cdf, u * cdf[-1], right=True).clamp_(max=cdf.numel() - 1)
    return int((i if ids is None else ids[i]).item())


def _entry(logprobs: torch.Tensor, token: int, k: int) -> tuple[float, tuple[tuple[int, float], ...]]:
    """(log-prob of the chosen token, its top-k alternatives as (id, log-prob), most likely first)."""
    top: tuple[tuple[int, float], ...] = ()
    if k > 0:
        values, ids = torch.topk(logprobs, k)
        top = tuple(zip(ids.tolist(), values.tolist()))
    return float(logprobs[token]), top
