"""The OpenAI request bodies (``/v1/completions``, ``/v1/chat/completions``, ``/tokenize``,
``/detokenize``), checked field by field so every 4xx names its field.

Types are strict (``true`` is not a token id, ``"8"`` is not ``max_tokens``, NaN is nothing);
semantic limits (vocabulary, context length, KV capacity) are checked against the running
engine before a request is accepted. Fields this server does not know are ignored, as vLLM
does, and named in a warning the first time each is seen (a typo such as ``max_token`` would
otherwise pass unnoticed); fields it knows but does not implement are refused with a 400 naming them unless they
carry their no-op value, so nothing is silently dropped. Messages quote at most a short prefix
of the offending input.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import (BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr,
                      ValidationError, model_validator)

from engine.core.sampling import MAX_LOGPROBS, SamplingParams

MAX_NESTING = 32  # deeper JSON is refused before anything walks it recursively
MAX_STOP = 16
QUOTE_CHARS = 40


class ApiError(Exception):
    """An error answered as ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 type_: str = "invalid_request_error", headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.type = type_
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.status}}


def quote(value: Any) -> str:
    """``repr`` of a bad input, cut to a short prefix: an error must not echo a 5 MB field."""
    text = repr(value) if not isinstance(value, (list, dict)) else _short_json(value)
    return text if len(text) <= QUOTE_CHARS else text[:QUOTE_CHARS] + f"... ({len(text)} chars)"


def _short_json(value: Any) -> str:
    try:
        return json.dumps(value)[:QUOTE_CHARS + 100]
    except (TypeError, ValueError, RecursionError):
        return type(value).__name__


NULL_IS_DEFAULT = frozenset({"stream", "n", "ignore_eos", "echo", "logprobs"})  # fields whose default is not null


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: StrictBool = False


class _Sampling(BaseModel):
    """Fields both endpoints share."""

    model_config = ConfigDict(extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _null_is_the_default(cls, data: Any) -> Any:
        """OpenAI's schema lets a client send null for these (some send every field): it means the default."""
        if isinstance(data, dict) and any(data.get(k, 0) is None for k in NULL_IS_DEFAULT):
            return {k: v for k, v in data.items() if not (v is None and k in NULL_IS_DEFAULT)}
        return data

    model: StrictStr | None = None
    max_tokens: StrictInt | None = Field(None, ge=1)
    ignore_eos: StrictBool = False
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    n: StrictInt = Field(1, ge=1, le=1)
    temperature: StrictFloat | StrictInt | None = Field(None, ge=0, le=2, allow_inf_nan=False)
    top_p: StrictFloat | StrictInt | None = Field(None, gt=0, le=1, allow_inf_nan=False)
    top_k: StrictInt | None = Field(None, ge=-1)
    seed: StrictInt | None = Field(None, ge=-(2 ** 63), lt=2 ** 63)
    stop: StrictStr | list[StrictStr] | None = Field(None)
    stop_token_ids: list[StrictInt] | None = Field(None, max_length=MAX_STOP)


class CompletionBody(_Sampling):
    prompt: Any = None
    max_tokens: StrictInt | None = Field(16, ge=1)
    logprobs: StrictInt | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: StrictBool = False


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: StrictStr | list[dict] | None = None


class ChatBody(_Sampling):
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_completion_tokens: StrictInt | None = Field(None, ge=1)
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = Field(None, ge=0, le=MAX_LOGPROBS)


# Known OpenAI/vLLM fields this server does not implement, with the values that mean "off".
UNSUPPORTED = {
    "best_of": (None, 1), "presence_penalty": (None, 0), "frequency_penalty": (None, 0),
    "repetition_penalty": (None, 1), "logit_bias": (None, {}), "suffix": (None, ""), "min_p": (None, 0),
    "min_tokens": (None, 0), "use_beam_search": (None, False), "tools": (None, []), "functions": (None, []),
    "tool_choice": (None, "none"), "response_format": (None, {"type": "text"}), "guided_json": (None,),
    "guided_regex": (None,), "guided_choice": (None,), "guided_grammar": (None,), "prompt_logprobs": (None,),
    "parallel_tool_calls": (None,), "audio": (None,), "modalities": (None, ["text"]), "prediction": (None,),
}


@dataclass(frozen=True)
class CompletionParams:
    """A request that passed every check the HTTP layer can make."""

    prompt_token_ids: list[int] | None  # None when ``prompt_text`` must be tokenized
    prompt_text: str | None
    max_tokens: int | None  # None: as many as the context allows
    ignore_eos: bool
    stream: bool
    include_usage: bool
    model: str | None
    sampling: SamplingParams | None = None  # None: greedy, no log-probs (the fast path)
    stop: tuple[str, ...] = ()
    stop_token_ids: frozenset[int] = frozenset()
    echo: bool = False
    messages: list[dict] | None = None  # chat: rendered with the model's template at admission
    max_tokens_field: str = "max_tokens"  # the field max_tokens came from, for errors (chat: max_completion_tokens)


def parse_json(raw: bytes) -> dict:
    """The body as a JSON object, nested at most MAX_NESTING deep (what validation walks recursively)."""
    too_deep = ApiError(400, f"request body is nested deeper than {MAX_NESTING} levels")
    try:
        body = json.loads(raw)
    except RecursionError:  # the parser's own bound, far past ours
        raise too_deep from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise ApiError(400, f"request body is not valid JSON: {quote(str(exc))}") from None
    if not isinstance(body, dict):
        raise ApiError(400, f"request body must be a JSON object, got {type(body).__name__}")
    # a bracket inside a string (a text prompt's) is no nesting: measure the parsed body, where
    # there are enough brackets for it to matter
    if raw.count(b"[") + raw.count(b"{") > MAX_NESTING and _depth(body) > MAX_NESTING:
        raise too_deep
    if _SURROGATE_ESCAPE.search(raw):
        _refuse_lone_surrogates(body)
    return body


# \ud800-\udfff: JSON's escape for half of a UTF-16 pair. A whole pair decodes to one character; a
# half alone parses to a string no tokenizer or response can encode (it failed deep in the
# tokenizer as a 500)
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def _refuse_lone_surrogates(body: dict) -> None:
    """A 400 naming the top-level field whose text (a value or a key anywhere below it) holds one."""
    for key, value in body.items():
        stack = [key, value]
        while stack:
            item = stack.pop()
            if isinstance(item, dict):
                stack += [*item.keys(), *item.values()]
            elif isinstance(item, list):
                stack += item
            elif isinstance(item, str) and not _encodes(item):
                field = key[:QUOTE_CHARS].encode("utf-8", "backslashreplace").decode("utf-8")
                raise ApiError(400, f"{field}: text is not valid Unicode (a lone UTF-16 surrogate escape)", field)


def _encodes(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _depth(value: Any) -> int:
    """How deep lists and dicts nest in a parsed JSON value, without recursion."""
    deepest = 0
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if depth > deepest:
            deepest = depth
        children = item.values() if isinstance(item, dict) else item
        stack.extend((child, depth + 1) for child in children if isinstance(child, list | dict))
    return deepest


log = logging.getLogger("miniserve.server")
_WARNED_UNKNOWN: set[str] = set()  # the first QUOTE_CHARS characters of unknown field names already logged
MAX_WARNED_UNKNOWN = 256  # names kept: a client inventing names cannot grow the set (nor, cut, with long ones)


def _warn_unknown(model: type[BaseModel], body: dict) -> None:
    new = [k[:QUOTE_CHARS] for k in body if k not in model.model_fields and k not in UNSUPPORTED]
    new = [k for k in dict.fromkeys(new) if k not in _WARNED_UNKNOWN][:MAX_WARNED_UNKNOWN - len(_WARNED_UNKNOWN)]
    if new:
        _WARNED_UNKNOWN.update(new)
        log.warning("ignored request fields this server does not know (logged once each): %s",
                    ", ".join(quote(k) for k in new))


def _validate(model: type[BaseModel], body: dict) -> BaseModel:
    _warn_unknown(model, body)
    for name, allowed in UNSUPPORTED.items():
        if name in body and not _one_of(body[name], allowed):
            raise ApiError(400, f"{name}: not supported by miniserve (got {quote(body[name])}); "
                                f"leave it out or send {allowed[-1]!r}", name)
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        err = exc.errors()[0]
        param = ".".join(str(p) for p in err["loc"] if not _UNION_TAG.fullmatch(str(p)))
        top = str(err["loc"][0]) if err["loc"] else None
        hint = FIELD_HINTS.get(top, "")
        raise ApiError(400, f"{param}: {err['msg']} (got {quote(err.get('input'))})" + (f"; {hint}" if hint else ""),
                       param=top if top in ("prompt", "messages") else param) from None


def _one_of(value: Any, allowed: tuple) -> bool:
    """``value in allowed`` with JSON's types kept apart: false is not 0, true is not 1."""
    return any(value == a and isinstance(value, bool) == isinstance(a, bool) for a in allowed)


_UNION_TAG = re.compile(r"(str|int|float|bool|none|[\w-]+\[.*\]|function-.*)")  # pydantic's union branch names
FIELD_HINTS = {
    "n": "only n=1 is supported",
    "stop": f"a string or a list of at most {MAX_STOP} strings",
}


def _sampling(req: _Sampling, logprobs: int | None) -> SamplingParams | None:
    temperature = float(req.temperature) if req.temperature is not None else 0.0
    params = SamplingParams(temperature=temperature, top_p=float(req.top_p) if req.top_p is not None else 1.0,
                            top_k=req.top_k or 0, seed=req.seed, logprobs=logprobs)
    return None if params == SamplingParams() else params


def _include_usage(req: _Sampling) -> bool:
    if req.stream_options is not None and not req.stream:  # as OpenAI and vLLM refuse it
        raise ApiError(400, "stream_options: only allowed when stream is true", "stream_options")
    return bool(req.stream_options and req.stream_options.include_usage)


def _stops(req: _Sampling) -> tuple[tuple[str, ...], frozenset[int]]:
    stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
    if len(stop) > MAX_STOP:
        raise ApiError(400, f"stop: at most {MAX_STOP} stop strings, got {len(stop)}", "stop")
    if any(not s for s in stop):
        raise ApiError(400, "stop: stop strings must not be empty", "stop")
    return stop, frozenset(req.stop_token_ids or ())


def parse_completion(body: dict) -> CompletionParams:
    req: CompletionBody = _validate(CompletionBody, body)  # type: ignore[assignment]
    ids, text = _parse_prompt(req.prompt)
    if req.echo and req.logprobs is not None:
        raise ApiError(400, "echo: echo with logprobs (prompt log-probabilities) is not supported", "echo")
    include_usage = _include_usage(req)
    stop, stop_ids = _stops(req)
    return CompletionParams(ids, text, req.max_tokens, req.ignore_eos, req.stream, include_usage, req.model,
                            _sampling(req, req.logprobs), stop, stop_ids, req.echo)


def parse_chat(body: dict) -> CompletionParams:
    req: ChatBody = _validate(ChatBody, body)  # type: ignore[assignment]
    if req.top_logprobs is not None and not req.logprobs:
        raise ApiError(400, "top_logprobs: needs logprobs: true", "top_logprobs")
    messages = []
    for i, m in enumerate(req.messages):
        content = m.content
        if isinstance(content, list):
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise ApiError(400, f"messages[{i}].content: only text parts are supported", "messages")
            content = "".join(p["text"] for p in content)
        messages.append({"role": m.role, "content": content or ""})
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    include_usage = _include_usage(req)
    stop, stop_ids = _stops(req)
    field = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    return CompletionParams(None, None, getattr(req, field), req.ignore_eos, req.stream, include_usage, req.model,
                            _sampling(req, logprobs), stop, stop_ids, messages=messages, max_tokens_field=field)


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
            if len(prompt) == 1 and (isinstance(prompt[0], str) or _flat_ints(prompt[0])):
                return _parse_prompt(prompt[0])
            raise ApiError(400, "prompt: batched prompts are not supported; send one per request", "prompt")
        bad = [(i, t) for i, t in enumerate(prompt) if not isinstance(t, int) or isinstance(t, bool)]
        if bad:
            i, t = bad[0]
            raise ApiError(400, f"prompt[{i}]: token ids must be integers, got {quote(t)}", "prompt")
        return list(prompt), None
    raise ApiError(400, f"prompt: must be a string or a list of token ids, got {type(prompt).__name__}", "prompt")


def _flat_ints(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(t, int) for t in value)


def parse_tokenize(body: dict) -> tuple[str | None, list[dict] | None, bool]:
    """vLLM's ``/tokenize``: ``{"prompt": str}`` or ``{"messages": [...]}``; -> (text, messages, add_special)."""
    add_special = body.get("add_special_tokens", True)
    if not isinstance(add_special, bool):
        raise ApiError(400, f"add_special_tokens: must be a boolean, got {quote(add_special)}", "add_special_tokens")
    if "messages" in body:
        return None, parse_chat({"messages": body["messages"]}).messages, add_special
    prompt = body.get("prompt")
    if not isinstance(prompt, str):
        raise ApiError(400, f"prompt: must be a string, got {quote(prompt)}", "prompt")
    return prompt, None, add_special


def parse_detokenize(body: dict, vocab_size: int) -> list[int]:
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
        raise ApiError(400, f"tokens: must be a list of token ids, got {quote(tokens)}", "tokens")
    check_vocab(tokens, vocab_size, "tokens")
    return tokens


def check_vocab(token_ids: list[int], vocab_size: int, param: str = "prompt") -> None:
    bad = [(i, t) for i, t in enumerate(token_ids) if not 0 <= t < vocab_size]
    if bad:
        i, t = bad[0]
        raise ApiError(400, f"{param}[{i}]: token id {quote(t)} is outside the vocabulary [0, {vocab_size})", param)


def check_limits(prompt_token_ids: list[int], max_tokens: int | None, vocab_size: int, max_model_len: int,
                 kv_capacity_tokens: int, max_tokens_field: str = "max_tokens") -> int:
    """What the engine could never serve, refused before acceptance with the field to blame
    (``max_tokens_field``: where the request put max_tokens); returns ``max_tokens``, filled in
    to the context left when the client left it out."""
    check_vocab(prompt_token_ids, vocab_size)
    n = len(prompt_token_ids)
    limit = min(max_model_len, kv_capacity_tokens)
    if n >= limit:
        raise ApiError(400, f"prompt: {n} tokens leave no room for output in the model's context "
                            f"(max_model_len={limit})", "prompt")
    if max_tokens is None:
        return limit - n
    if n + max_tokens > limit:
        raise ApiError(400, f"{max_tokens_field}: prompt ({n} tokens) + {max_tokens_field} ({max_tokens}) = "
                            f"{n + max_tokens} exceeds the model's context ({limit} tokens); at most {limit - n} here",
                       max_tokens_field)
    return max_tokens
