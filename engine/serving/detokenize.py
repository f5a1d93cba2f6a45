"""Token ids to text for one response, incrementally, with OpenAI's stop rules.

Streamed pieces must concatenate to exactly the non-streamed text. Decoding each chunk's tokens
alone breaks that (a CJK character split over two byte tokens comes out as two U+FFFD), so the
whole output is decoded again after every token and only its new, settled tail is sent: text
that ends in U+FFFD may still become a character, and text that could be the start of a stop
string may still be cut. At the end everything left is sent, so the concatenation equals
``decode(all ids)`` trimmed at the stop, byte for byte, whatever the tokenizer.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

REPLACEMENT = "\ufffd"


class TextStream:
    """Feeds on output token ids; knows the text so far and when a stop was hit."""

    def __init__(self, decode: Callable[[list[int]], str], stop: Sequence[str] = (),
                 stop_token_ids: frozenset[int] = frozenset()) -> None:
        self._decode = decode
        self.stop = tuple(s for s in stop if s)
        self.stop_token_ids = stop_token_ids
        self._holdback = max((len(s) for s in self.stop), default=1) - 1
        self.token_ids: list[int] = []  # every output token, the stopping one included
        self._text_ids: list[int] = []  # the tokens that make the text (a stop token does not)
        self.text = ""
        self.sent = 0  # characters of ``text`` handed out by ``pending``
        self.stopped = False

    def add(self, token_id: int) -> bool:
        """One more output token; True once a stop token or stop string has ended the output."""
        if self.stopped:
            return True
        self.token_ids.append(token_id)
        if token_id in self.stop_token_ids:
            self.stopped = True
            return True
        self._text_ids.append(token_id)
        self.text = self._decode(self._text_ids)
        if self.stop:
            hits = [i for i in (self.text.find(s) for s in self.stop) if i >= 0]
            if hits:
                self.text = self.text[:min(hits)]  # OpenAI leaves the stop string out
                self.stopped = True
        return self.stopped

    def pending(self, final: bool) -> str:
        """Text not yet handed out that can no longer change (all of it when ``final``)."""
        end = len(self.text)
        if not final and not self.stopped:
            end = len(self.text.rstrip(REPLACEMENT))
            end = min(end, len(self.text) - self._holdback)
        if end <= self.sent:
            return ""
        piece = self.text[self.sent:end]
        self.sent = end
        return piece
