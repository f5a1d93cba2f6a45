"""One request's TokenEvents as an OpenAI answer: a completion or a chat completion, whole
(JSON) or streamed (server-sent events). Text comes from a TextStream, so the streamed pieces
add up to the non-streamed text and stop strings end the answer wherever they fall."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Callable
from typing import Literal

from engine.core.request import Request as EngineRequest
from engine.serving.detokenize import TextStream, decodes_bytewise, text_decoder
from engine.serving.engine_thread import RequestSink, TokenEvent
from engine.serving.protocol import ApiError, CompletionParams


class Generation:
    """Consumes one request's events; ``on_stop`` tells the engine a stop ended it early."""

    def __init__(self, request: EngineRequest, params: CompletionParams, model_name: str, sink: RequestSink,
                 tokenizer, kind: Literal["completion", "chat"], on_stop: Callable[[], None],
                 prompt_text: str = "") -> None:
        self.request = request
        self.params = params
        self.model_name = model_name
        self.sink = sink
        self.kind = kind
        self.on_stop = on_stop
        self.created = int(time.time())
        self.done = False
        self.finish_reason: str | None = None
        self.error: ApiError | None = None
        self.token_times_s: list[float] = []
        self.logprobs: list = []
        self.first_scheduled_s: float | None = None
        self._tokenizer = tokenizer
        self._token_text = lambda i: tokenizer.decode([i]) if tokenizer else ""
        self.text = TextStream(text_decoder(tokenizer), params.stop, params.stop_token_ids,
                               bytewise=decodes_bytewise(tokenizer))
        self.echo = prompt_text if params.echo else ""

    @property
    def token_ids(self) -> list[int]:
        return self.text.token_ids

    async def events(self) -> AsyncIterator[list[int]]:
        """The new output token ids of each event, until the answer is complete."""
        while not self.done:
            event: TokenEvent = await self.sink.queue.get()
            if event.first_scheduled_s is not None:
                self.first_scheduled_s = event.first_scheduled_s
            new: list[int] = []
            for token, t, lp in zip(event.token_ids, event.token_times_s, event.logprobs or [None] * len(event.token_ids)):
                new.append(token)
                self.token_times_s.append(t)
                if lp is not None:
                    self.logprobs.append(lp)
                if self.text.add(token):
                    self.done, self.finish_reason = True, "stop"
                    self.on_stop()
                    break
            if not self.done and event.finish_reason is not None:
                self.done, self.finish_reason = True, event.finish_reason
                if event.error is not None or event.finish_reason == "abort":
                    self.error = _event_error(event)
            yield new

    def usage(self) -> dict:
        n_in, n_out = self.request.num_prompt_tokens, len(self.token_ids)
        return {"prompt_tokens": n_in, "completion_tokens": n_out, "total_tokens": n_in + n_out}

    def timing(self) -> dict:
        """Engine-side times (server perf_counter s), so a client can split off the HTTP overhead."""
        return {"arrival_s": self.request.arrival_s, "first_scheduled_s": self.first_scheduled_s,
                "token_times_s": self.token_times_s}

    def _head(self, chunk: bool) -> dict:
        obj = {"completion": "text_completion", "chat": "chat.completion.chunk" if chunk else "chat.completion"}
        return {"id": self.request.request_id, "object": obj[self.kind], "created": self.created,
                "model": self.model_name}

    # --- log-probabilities in the two OpenAI shapes -----------------------------------------------
    def _completion_logprobs(self, start: int, end: int, offset: int) -> dict | None:
        if self.params.sampling is None or self.params.sampling.logprobs is None:
            return None
        out: dict = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for token, (lp, top) in zip(self.token_ids[start:end], self.logprobs[start:end]):
            piece = self._token_text(token)
            out["tokens"].append(piece)
            out["token_logprobs"].append(lp)
            ranked: dict[str, float] = {}
            for i, v in top:  # texts of different ids can coincide: the higher-ranked one stays
                ranked.setdefault(self._token_text(i), v)
            ranked.setdefault(piece, lp)  # the chosen token always, as OpenAI and vLLM give it
            out["top_logprobs"].append(ranked)
            out["text_offset"].append(offset)
            offset += len(piece)
        return out

    def _chat_logprobs(self, start: int, end: int) -> dict | None:
        if self.params.sampling is None or self.params.sampling.logprobs is None:
            return None

        def item(token: int, lp: float) -> dict:
            text = self._token_text(token)
            return {"token": text, "logprob": lp, "bytes": list(text.encode())}

        return {"content": [{**item(t, lp), "top_logprobs": [item(i, v) for i, v in top]}
                            for t, (lp, top) in zip(self.token_ids[start:end], self.logprobs[start:end])]}

    def _choice(self, text: str, ids: list[int], start: int, finish: str | None, chunk: bool,
                offset: int = 0) -> dict:
        end = start + len(ids)
        if self.kind == "completion":
            return {"index": 0, "text": text, "token_ids": ids,
                    "logprobs": self._completion_logprobs(start, end, offset), "finish_reason": finish}
        message = {"content": text} if chunk else {"role": "assistant", "content": text}
        return {"index": 0, "delta" if chunk else "message": message, "token_ids": ids,
                "logprobs": self._chat_logprobs(start, end), "finish_reason": finish}

    # --- the two ways out --------------------------------------------------------------------------
    async def sse(self) -> AsyncIterator[str]:
        sent = 0
        offset = 0
        if self.kind == "chat":
            yield _sse({**self._head(True), "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                                         "logprobs": None, "finish_reason": None}]})
        elif self.echo:
            yield _sse({**self._head(True), "choices": [self._choice(self.echo, [], 0, None, True)]})
            offset = len(self.echo)
        async for _ in self.events():
            if self.error is not None:
                yield _sse(self.error.body())
                break
            ids = self.token_ids[sent:]
            piece = self.text.pending(final=self.done)
            finish = self.finish_reason if self.done else None
            chunk = {**self._head(True), "choices": [self._choice(piece, ids, sent, finish, True, offset)]}
            if self.done:
                chunk["timing"] = self.timing()
            yield _sse(chunk)
            offset += len(piece)
            sent = len(self.token_ids)
        if self.params.include_usage and self.error is None:
            yield _sse({**self._head(True), "choices": [], "usage": self.usage()})
        yield "data: [DONE]\n\n"

    async def collect(self) -> tuple[dict, int]:
        async for _ in self.events():
            pass
        if self.error is not None:
            return self.error.body(), self.error.status
        text = self.echo + self.text.pending(final=True)
        return {**self._head(False), "choices": [self._choice(text, self.token_ids, 0, self.finish_reason, False,
                                                              len(self.echo))],
                "usage": self.usage(), "timing": self.timing()}, 200


def _event_error(event: TokenEvent) -> ApiError:
    if event.finish_reason == "error":
        return ApiError(400, event.error or "request refused")
    return ApiError(503, event.error or "request aborted", type_="unavailable")


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'), ensure_ascii=False)}\n\n"
