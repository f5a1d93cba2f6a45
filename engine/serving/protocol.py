"""The OpenAI ``/v1/completions`` request, checked field by field so every 4xx names its field.

Types are strict (``true`` is not a token id, ``"8"`` is not ``max_tokens``, NaN is nothing);
semantic limits (vocabulary, context length, KV capacity) are checked against the running
engine before a request is accepted. Fields this server does not know are ignored, as OpenAI
servers do; known fields with the wrong type or value are refused.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr, ValidationError


class ApiError(Exception):
    """An error answered as ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 type_: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.type = type_

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.status}}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: StrictBool = False


class CompletionBody(BaseModel):
    """The fields this server reads; ``prompt`` is checked by hand for clearer messages."""

    model_config = ConfigDict(extra="ignore")
    model: StrictStr | None = None
    prompt: Any = None
    max_tokens: StrictInt = Field(16, ge=1)
    ignore_eos: StrictBool = False
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    n: StrictInt = Field(1, ge=1, le=1)
    temperature: StrictFloat | StrictInt | None = Field(None, ge=0, le=0, allow_inf_nan=False)


@dataclass(frozen=True)
class CompletionParams:
    """A request that passed every check the HTTP layer can make."""

    prompt_token_ids: list[int] | None  # None when ``prompt_text`` must be tokenized
    prompt_text: str | None
    max_tokens: int
    ignore_eos: bool
    stream: bool
    include_usage: bool
    model: str | None


FIELD_HINTS = {
    "n": "only n=1 is supported",
    "temperature": "miniserve samples greedily; only temperature 0 is supported",
}


def parse_json(raw: bytes) -> dict:
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ApiError(400, f"request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise ApiError(400, f"request body must be a JSON object, got {type(body).__name__}")
    return body


def parse_completion(body: dict) -> CompletionParams:
    try:
        req = CompletionBody.model_validate(body)
    except ValidationError as exc:
        err = exc.errors()[0]
        param = ".".join(str(p) for p in err["loc"])
        top = str(err["loc"][0]) if err["loc"] else None
        hint = FIELD_HINTS.get(top, "")
        raise ApiError(400, f"{param}: {err['msg']} (got {err.get('input')!r})" + (f"; {hint}" if hint else ""),
                       param=param) from None
    ids, text = _parse_prompt(req.prompt)
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    return CompletionParams(ids, text, req.max_tokens, req.ignore_eos, req.stream, include_usage, req.model)


def _parse_prompt(prompt: Any) -> tuple[list[int] | None, str | None]:
    if prompt is None:
        raise ApiError(400, "prompt: field required (a string, or a list of token ids)", "prompt")
    if isinstance(prompt, str):
        if not prompt:
            raise ApiError(400, "prompt: must not be empty", "prompt")
        return None, prompt
    if isinstance(prompt, list):
        if not prompt:
            raise ApiError(400, "prompt: must not be empty", "prompt")
        if all(isinstance(t, str | list) for t in prompt):  # OpenAI's batch of prompts
            if len(prompt) == 1:
                return _parse_prompt(prompt[0])
            raise ApiError(400, "prompt: batched prompts are not supported; send one per request", "prompt")
        bad = [(i, t) for i, t in enumerate(prompt) if not isinstance(t, int) or isinstance(t, bool)]
        if bad:
            i, t = bad[0]
            raise ApiError(400, f"prompt[{i}]: token ids must be integers, got {t!r}", "prompt")
        return list(prompt), None
    raise ApiError(400, f"prompt: must be a string or a list of token ids, got {type(prompt).__name__}", "prompt")


def check_limits(prompt_token_ids: list[int], max_tokens: int, vocab_size: int, max_model_len: int,
                 kv_capacity_tokens: int) -> None:
    """What the engine could never serve, refused before acceptance with the field to blame."""
    bad = [(i, t) for i, t in enumerate(prompt_token_ids) if not 0 <= t < vocab_size]
    if bad:
        i, t = bad[0]
        raise ApiError(400, f"prompt[{i}]: token id {t} is outside the vocabulary [0, {vocab_size})", "prompt")
    n = len(prompt_token_ids)
    if n >= max_model_len:
        raise ApiError(400, f"prompt: {n} tokens leave no room for output in the model's context "
                            f"(max_model_len={max_model_len})", "prompt")
    limit = min(max_model_len, kv_capacity_tokens)
    if n + max_tokens > limit:
        raise ApiError(400, f"max_tokens: prompt ({n} tokens) + max_tokens ({max_tokens}) = {n + max_tokens} "
                            f"exceeds the model's context ({limit} tokens); at most {limit - n} here",
                       "max_tokens")

