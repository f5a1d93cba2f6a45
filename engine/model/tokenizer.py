"""A deterministic byte-level tokenizer for the bundled random-weight models.

The bundled configs have no checkpoint and so no tokenizer; without one, text prompts, chat and
third-party benchmark clients cannot talk to the server. This one maps every UTF-8 byte to one
id, so any text round-trips exactly, and it is built with the ``tokenizers`` library so it saves
as a standard ``tokenizer.json`` a client can load (``save_pretrained``).

Layout, a function of the model config only: ``<|endoftext|>`` at the config's ``eos_token_id``,
``<|im_start|>`` and ``<|im_end|>`` right after it (or at the top of the vocabulary when that
is full), and the 256 bytes at the lowest ids left. For the Qwen2.5 shape that is bytes 0-255 and
the specials at 151643-151645, as in Qwen's own vocabulary. Ids outside those 259 (a
random-weight model samples them often) decode to nothing.
"""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from tokenizers.pre_tokenizers import ByteLevel
from transformers import PreTrainedTokenizerFast

SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")

# ChatML, as Qwen's checkpoints use; string content or OpenAI's list of text parts.
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}{{ part['text'] }}{% endfor %}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def special_ids(vocab_size: int, eos_token_id: int | None) -> dict[str, int]:
    eos = eos_token_id if eos_token_id is not None and 0 <= eos_token_id < vocab_size else vocab_size - 3
    if eos + 2 < vocab_size:
        ids = (eos, eos + 1, eos + 2)
    else:
        ids = (eos, *[i for i in range(vocab_size - 1, vocab_size - 4, -1) if i != eos][:2])
    return dict(zip(SPECIALS, ids))


def byte_tokenizer(vocab_size: int, eos_token_id: int | None) -> PreTrainedTokenizerFast:
    """UTF-8 bytes to ids (one each) plus three ChatML specials, inside ``vocab_size``."""
    if vocab_size < 256 + len(SPECIALS):
        raise ValueError(f"a byte-level tokenizer needs a vocabulary of at least 259, got {vocab_size}")
    specials = special_ids(vocab_size, eos_token_id)
    taken = set(specials.values())
    free = (i for i in range(vocab_size) if i not in taken)
    byte_chars = ByteLevel.alphabet()  # the 256 printable stand-ins GPT-2's byte-level BPE uses
    byte_chars.sort(key=lambda c: _BYTE_OF_CHAR[c])
    vocab = {char: next(free) for char in byte_chars}
    vocab.update(specials)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>",
                                   additional_special_tokens=["<|im_start|>", "<|im_end|>"])
    fast.chat_template = CHAT_TEMPLATE
    return fast


def _byte_of_char() -> dict[str, int]:
    """GPT-2's bytes_to_unicode, inverted: which byte each stand-in character means."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    chars, n = {}, 0
    for b in range(256):
        if b in keep:
            chars[chr(b)] = b
        else:
            chars[chr(256 + n)] = b
            n += 1
    return chars


_BYTE_OF_CHAR = _byte_of_char()
