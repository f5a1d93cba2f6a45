"""Prompts with content: a prompt as segments whose ids name their tokens.

A segment is ``(content id, tokens)``: its token ids are a deterministic function of the id, so
two prompts that start with the same segments start with the same tokens, which is what prefix
caching keys on, in the real engine and the simulator alike. Mooncake's ``hash_ids`` (one id per
512-token block) are segment ids as they stand; the generators here make shared system prompts
and multi-turn conversations (each turn resends the history: earlier user messages and the
earlier answers, as the client saw them). Token ids fall in ``[0, CONTENT_VOCAB)``, inside every
supported model's vocabulary.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

Segments = tuple[tuple[int, int], ...]  # (content id, tokens)
CONTENT_VOCAB = 512  # the tiny test model's vocabulary; a 16-token block repeats with odds 512^-16
MOONCAKE_BLOCK_TOKENS = 512
_MASK = (1 << 64) - 1
_M1, _M2, _M3 = (np.uint64(c) for c in (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB))


def segment_tokens(content_id: int, n: int) -> np.ndarray:
    """The first ``n`` token ids of content ``content_id`` (a splitmix-style hash of (id, position))."""
    j = np.arange(n, dtype=np.uint64)
    x = np.full(n, content_id & _MASK, dtype=np.uint64) * _M1 + j * _M2
    x ^= x >> np.uint64(31)
    x *= _M3
    x ^= x >> np.uint64(29)
    return (x % np.uint64(CONTENT_VOCAB)).astype(np.int64)


def expand(segments: Segments) -> list[int]:
    """A prompt's token ids."""
    return np.concatenate([segment_tokens(cid, n) for cid, n in segments]).tolist()


def num_tokens(segments: Segments) -> int:
    return sum(n for _, n in segments)


def mooncake_segments(hash_ids: Sequence[int], input_length: int, line: int,
                      block_tokens: int = MOONCAKE_BLOCK_TOKENS) -> Segments:
    """A Mooncake row's prompt: one segment per hash id (512 tokens, the last one what is left of
    ``input_length``); tokens the ids do not cover get a segment of their own (the line's)."""
    out, left = [], max(0, input_length)
    for h in hash_ids:
        if left <= 0:
            break
        n = min(block_tokens, left)
        out.append((int(h), n))
        left -= n
    if left > 0:
        out.append((-line, left))  # negative: never a Mooncake id
    return tuple(out)


def scale_segments(segments: Segments, scale: float, max_tokens: int) -> Segments:
    """Each segment ``scale`` times as long (at least one token), cut at ``max_tokens``: equal
    segments stay equal, so shared prefixes survive fitting a trace to a CPU."""
    out, total = [], 0
    for cid, n in segments:
        n = max(1, int(round(n * scale))) if scale != 1.0 else n
        n = min(n, max_tokens - total)
        if n <= 0:
            break
        out.append((cid, n))
        total += n
    return tuple(out)


def shared_prefix(user_tokens: Sequence[int], prefix_tokens: int, num_prefixes: int) -> list[Segments]:
    """Request i: system prompt ``i % num_prefixes`` (``prefix_tokens`` long) then its own message."""
    system = [(1 + k, prefix_tokens) for k in range(num_prefixes)]
    base = 1 + num_prefixes
    return [((system[i % num_prefixes],) if prefix_tokens else ()) + ((base + i, int(n)),)
            for i, n in enumerate(user_tokens)]


def multi_turn(starts: Sequence[float], turns: int, gaps: np.ndarray, user_tokens: np.ndarray,
               output_tokens: np.ndarray, prefix_tokens: int, max_prompt: int
               ) -> tuple[np.ndarray, list[Segments], np.ndarray]:
    """Conversations starting at ``starts``, ``turns`` turns each: turn k arrives ``gaps[c, k]``
    after turn k−1 and sends the system prompt (``prefix_tokens``, shared by all), every earlier
    user message and answer, and a new message. A conversation ends early when its next prompt
    would pass ``max_prompt``. Returns (arrival, prompt segments, output tokens) in arrival order."""
    rows: list[tuple[float, Segments, int]] = []
    next_id = 2
    for c, t in enumerate(starts):
        history: Segments = ((1, prefix_tokens),) if prefix_tokens else ()
        for k in range(turns):
            t += gaps[c, k] if k else 0.0
            user = (next_id, int(user_tokens[c, k]))
            next_id += 1
            prompt = history + (user,)
            if num_tokens(prompt) > max_prompt:
                break
            out = int(output_tokens[c, k])
            rows.append((float(t), prompt, out))
            history = prompt + ((next_id, out),)  # the answer, as resent by the client
            next_id += 1
    rows.sort(key=lambda r: r[0])
    return (np.asarray([r[0] for r in rows]), [r[1] for r in rows],
            np.asarray([r[2] for r in rows], dtype=np.int64))
