"""Token ids to text for one response, incrementally, with OpenAI's stop rules.

Streamed pieces must concatenate to exactly the non-streamed text, ``decode(all ids)`` trimmed at
the stop, byte for byte. Decoding each token alone breaks that (a CJK character split over two
byte tokens comes out as two U+FFFD); decoding the whole output again after every token keeps it
but costs O(n) per token, O(n²) per response, on the event loop every client shares (seconds of
CPU for a response of a few thousand tokens).

A byte-level decoder (GPT-2's ``ByteLevel``, which every Qwen checkpoint uses, and the bundled
byte tokenizer) lays the tokens' bytes end to end and decodes them as UTF-8. UTF-8 resynchronises
after every complete character, so once the text decoded so far ends in a real character (not
U+FFFD, which a later byte may still complete), nothing after it can change it: that text is
settled, and only the tokens after it are decoded again. Bytes that never make a character (a
random-weight model samples them) settle too, once later tokens show they decode apart the same.
Each token then costs the decode of a few tokens. Any other decoder (SentencePiece's leading-space rule, WordPiece's clean-up) may
rewrite earlier text in the light of later tokens, so it keeps the whole decode per token.

Text that ends in U+FFFD may still become a character, and text that could be the start of a
stop string may still be cut: ``pending`` holds both back until they are settled, and at the end
sends everything left.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence

from tokenizers import decoders

REPLACEMENT = "\ufffd"
INCOMPLETE_TOKENS = 3  # an incomplete UTF-8 character has at most 3 bytes, so spans at most 3 tokens


_BYTEWISE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tokenizer -> decodes_bytewise, asked once


def text_decoder(tokenizer) -> Callable[[list[int]], str]:
    """The response text of output ids: special tokens left out (no tokenizer: no text)."""
    if tokenizer is None:
        return lambda ids: ""
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=True)


def decodes_bytewise(tokenizer) -> bool:
    """True when ``tokenizer.decode`` is UTF-8 over the tokens' bytes laid end to end: a ByteLevel
    decoder, and no clean-up of spaces before punctuation afterwards (transformers 5 skips it for
    BPE even where a config asks for it, as Llama 3's does; asked, not assumed, once per tokenizer)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or not isinstance(backend.decoder, decoders.ByteLevel):
        return False
    if tokenizer not in _BYTEWISE:
        probe = "a . b , c !"
        _BYTEWISE[tokenizer] = text_decoder(tokenizer)(tokenizer.encode(probe, add_special_tokens=False)) == probe
    return _BYTEWISE[tokenizer]


class TextStream:
    """Feeds on output token ids; knows the text so far and when a stop was hit.

    ``bytewise`` (see ``decodes_bytewise``) lets it settle text and decode only the tokens after
    it; without it every token decodes the whole output again.
    """

    def __init__(self, decode: Callable[[list[int]], str], stop: Sequence[str] = (),
                 stop_token_ids: frozenset[int] = frozenset(), bytewise: bool = False) -> None:
        self._decode = decode
        self._bytewise = bytewise
        self.stop = tuple(s for s in stop if s)
        self.stop_token_ids = stop_token_ids
        self._holdback = max((len(s) for s in self.stop), default=1) - 1
        self.token_ids: list[int] = []  # every output token, the stopping one included
        self._settled: list[str] = []  # the text that can no longer change, in pieces
        self._settled_len = 0
        self._recent = ""  # the settled text's last ``_holdback`` characters, where a stop string may begin
        self._tail_ids: list[int] = []  # the tokens after the settled text (all of them unless bytewise)
        self._tail = ""  # their text
        self._unsent: list[str] = []  # settled text ``pending`` has not handed out yet
        self._sent = 0  # characters handed out by ``pending``
        self._cut: str | None = None  # the whole text, once a stop string has cut it
        self.stopped = False

    @property
    def text(self) -> str:
        if self._cut is not None:
            return self._cut
        return "".join(self._settled) + self._tail

    def add(self, token_id: int) -> bool:
        """One more output token; True once a stop token or stop string has ended the output."""
        if self.stopped:
            return True
        self.token_ids.append(token_id)
        if token_id in self.stop_token_ids:
            self.stopped = True
            return True
        if self._bytewise and self._tail_ids and not self._decode([token_id]):
            return False  # no bytes (a skipped special token, an id with no text): nothing changes
        self._tail_ids.append(token_id)
        self._tail = self._decode(self._tail_ids)
        if self._bytewise and not self._tail:
            self._tail_ids = []  # no bytes yet, so nothing to settle
        window_start = self._settled_len - len(self._recent)
        # a trailing U+FFFD may be half a character still: a stop string must not match it
        window = self._recent + self._tail.rstrip(REPLACEMENT)
        if self._bytewise and self._tail:
            if not self._tail.endswith(REPLACEMENT):
                self._settle(len(self._tail_ids), self._tail)
            elif len(self._tail_ids) > INCOMPLETE_TOKENS:
                self._settle_before_the_last_tokens()
        if self.stop:
            hits = [i for i in (window.find(s) for s in self.stop) if i >= 0]
            if hits:
                # OpenAI leaves the stop string out
                self._cut = self.text[:window_start + min(hits)]
                self.stopped = True
        return self.stopped

    def _settle_before_the_last_tokens(self) -> None:
        """The tail ends in U+FFFD: a character still incomplete, or bytes that never make one (a
        random-weight model samples them), which would keep the tail growing. An incomplete
        character's bytes sit in the last INCOMPLETE_TOKENS tokens (each carries a byte), so the
        tokens before them settle if they decode apart exactly as together: a split inside a
        character never does (its pieces decode to more U+FFFD than the whole)."""
        head_ids = self._tail_ids[:-INCOMPLETE_TOKENS]
        head = self._decode(head_ids)
        if head + self._decode(self._tail_ids[-INCOMPLETE_TOKENS:]) == self._tail:
            self._settle(len(head_ids), head)

    def _settle(self, num_ids: int, text: str) -> None:
        """The tail's first ``num_ids`` tokens, whose text is ``text``, can no longer change."""
        already_sent = max(0, self._sent - self._settled_len)
        if already_sent < len(text):
            self._unsent.append(text[already_sent:])
        self._settled.append(text)
        self._settled_len += len(text)
        recent = self._recent + text
        self._recent = recent[-self._holdback:] if self._holdback else ""
        self._tail_ids, self._tail = self._tail_ids[num_ids:], self._tail[len(text):]

    def pending(self, final: bool) -> str:
        """Text not yet handed out that can no longer change (all of it when ``final``)."""
        if self._cut is not None:
            piece = self._cut[self._sent:]
            self._sent += len(piece)
            return piece
        end = self._settled_len + len(self._tail)
        if not final and not self.stopped:
            # a trailing U+FFFD may still become a character, and that character may end a stop
            # string (a U+FFFD in settled text is final)
            end = self._settled_len + len(self._tail.rstrip(REPLACEMENT)) - self._holdback
        if end <= self._sent:
            return ""
        unsent_settled = "".join(self._unsent)
        available = unsent_settled + self._tail[max(0, self._sent - self._settled_len):]
        piece = available[:end - self._sent]
        rest = unsent_settled[len(piece):]
        self._unsent = [rest] if rest else []
        self._sent = end
        return piece
