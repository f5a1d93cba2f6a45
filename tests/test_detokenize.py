"""Streamed text: the pieces add up to the whole decode byte for byte, stops cut it where they
fall, and a byte-level tokenizer's stream decodes each token once, not the whole output again."""

from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from engine.model.tokenizer import byte_tokenizer
from engine.serving.detokenize import TextStream, decodes_bytewise, text_decoder

TOK = byte_tokenizer(512, eos_token_id=1)  # ids 259-511 have no text
CORPUS = ["中文 naïve café 🙂 ok, bye.", "hello world, hello 中文 world",
          "日本語のテキスト and émoji 🙂🙂"] * 20


def trained_tokenizer(decoder: str) -> PreTrainedTokenizerFast:
    """A small BPE with merges: byte-level (Qwen's kind), or SentencePiece's Metaspace."""
    tok = Tokenizer(models.BPE(unk_token=None if decoder == "bytelevel" else "<unk>"))
    if decoder == "bytelevel":
        tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
        alphabet = pre_tokenizers.ByteLevel.alphabet()
    else:
        tok.pre_tokenizer, tok.decoder = pre_tokenizers.Metaspace(), decoders.Metaspace()
        alphabet = []
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=400, initial_alphabet=alphabet,
                                                         special_tokens=["<unk>", "<|endoftext|>"]))
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")


def stream(tokenizer, ids: list[int], bytewise: bool | None = None, **stops) -> tuple[str, TextStream]:
    """What a streaming client receives: the pieces after every token, then the final one."""
    bytewise = decodes_bytewise(tokenizer) if bytewise is None else bytewise
    ts = TextStream(text_decoder(tokenizer), bytewise=bytewise, **stops)
    out = ""
    for token in ids:
        stopped = ts.add(token)
        out += ts.pending(final=False)
        if stopped:
            break
    return out + ts.pending(final=True), ts


def test_byte_level_tokenizers_are_recognised_and_sentencepiece_is_not():
    assert decodes_bytewise(TOK) and decodes_bytewise(trained_tokenizer("bytelevel"))
    assert not decodes_bytewise(trained_tokenizer("metaspace")) and not decodes_bytewise(None)


def test_a_byte_level_tokenizer_that_cleans_up_spaces_is_not_bytewise(monkeypatch):
    """' .' becoming '.' rewrites text already streamed: such a decode needs the whole output."""
    tok = trained_tokenizer("bytelevel")
    plain = tok.decode
    monkeypatch.setattr(tok, "decode", lambda ids, **kw: plain(ids, **kw).replace(" .", ".").replace(" ,", ","))
    assert not decodes_bytewise(tok)


@pytest.mark.parametrize("bytewise", [True, False])
def test_streamed_pieces_add_up_to_the_whole_decode_byte_for_byte(bytewise):
    ids = TOK.encode("中文 é ok 🙂")
    ts = TextStream(text_decoder(TOK), bytewise=bytewise)
    pieces = []
    for token in ids:
        ts.add(token)
        pieces.append(ts.pending(final=False))
    pieces.append(ts.pending(final=True))
    assert "".join(pieces) == ts.text == "中文 é ok 🙂"
    assert "\ufffd" not in "".join(pieces[:-1])  # never a half character on the wire
    assert TOK.decode(ids[:1]) == "\ufffd"  # what decoding one chunk's bytes alone gave


@pytest.mark.parametrize("bytewise", [True, False])
def test_random_byte_sequences_stream_exactly_as_they_decode(bytewise):
    """Invalid bytes, split characters, and ids with no text (a random-weight model samples them)."""
    rng = random.Random(0)
    for _ in range(300):
        ids = [rng.choice([rng.randrange(4, 259), rng.randrange(259, 512), *TOK.encode("中é🙂")])
               for _ in range(rng.randrange(1, 30))]
        out, ts = stream(TOK, ids, bytewise=bytewise)
        assert out == ts.text == TOK.decode(ids)


def test_merged_byte_level_tokens_split_inside_characters_stream_as_they_decode():
    tok = trained_tokenizer("bytelevel")
    vocab = list(range(tok.vocab_size))
    rng = random.Random(1)
    for _ in range(300):
        ids = [rng.choice(vocab) for _ in range(rng.randrange(1, 30))]
        out, _ = stream(tok, ids)
        assert out == tok.decode(ids, skip_special_tokens=True)
    text = " ".join(CORPUS[:3])
    assert stream(tok, tok.encode(text))[0] == text


def test_sentencepiece_decoding_keeps_its_leading_space_rule():
    tok = trained_tokenizer("metaspace")
    for text in CORPUS[:3]:
        ids = tok.encode(text)
        out, _ = stream(tok, ids)
        assert out == tok.decode(ids, skip_special_tokens=True) and out.endswith(text[-6:])


@pytest.mark.parametrize("kind", ["text", "invalid bytes"])
def test_a_byte_level_stream_decodes_each_token_a_few_times_not_the_whole_output(kind):
    """Invalid bytes never make a character (a random-weight model samples them): they must not
    keep the unsettled tail growing either."""
    decoded = []

    def counting_decode(ids):
        decoded.append(len(ids))
        return TOK.decode(ids, skip_special_tokens=True)

    continuation = TOK.convert_tokens_to_ids(chr(0x100 + 34))  # byte 0x80 (GPT-2's stand-in): never starts a character
    assert TOK.decode([continuation]) == "\ufffd"
    ids = TOK.encode("plain text 中文 🙂 " * 200) if kind == "text" else [continuation] * 2000
    ids += list(range(300, 340))  # ids with no text
    ts = TextStream(counting_decode, stop=("never",), bytewise=True)
    out = ""
    for token in ids:
        ts.add(token)
        out += ts.pending(final=False)
    assert out + ts.pending(final=True) == TOK.decode(ids)
    assert sum(decoded) < 10 * len(ids)  # the whole output again each time would be len(ids)²/2


@pytest.mark.parametrize("bytewise", [True, False])
def test_stop_string_trims_the_text_even_split_across_tokens(bytewise):
    ids = TOK.encode("hello world, bye")
    out, ts = stream(TOK, ids, bytewise=bytewise, stop=("ld, b", "zzz"))
    assert out == ts.text == "hello wor"
    assert ts.stopped and TOK.decode(ts.token_ids) == "hello world, b"  # tokens up to the one that completed it


@pytest.mark.parametrize("bytewise", [True, False])
def test_a_stop_string_completed_by_a_split_character_is_never_sent(bytewise):
    """'b' is held back while the next bytes may still make the stop string 'b中'."""
    ids = TOK.encode("ab中c")
    out, ts = stream(TOK, ids, bytewise=bytewise, stop=("b中",))
    assert out == ts.text == "a" and ts.stopped


@pytest.mark.parametrize("bytewise", [True, False])
def test_random_stop_strings_cut_at_their_first_occurrence_in_the_whole_decode(bytewise):
    rng = random.Random(2)
    checked = 0
    while checked < 200:
        ids = [rng.choice([rng.randrange(4, 259), rng.randrange(259, 512), *TOK.encode("中é🙂 ab")])
               for _ in range(rng.randrange(2, 40))]
        whole = TOK.decode(ids)
        start = rng.randrange(len(whole) or 1)
        stop = whole[start:start + rng.randrange(1, 5)]
        if not stop or "\ufffd" in stop:
            continue  # a stop string of replacement characters could match a character not yet complete
        out, ts = stream(TOK, ids, bytewise=bytewise, stop=(stop, "never here"))
        assert out == ts.text == whole[:whole.find(stop)] and ts.stopped
        checked += 1


@pytest.mark.parametrize("bytewise", [True, False])
def test_stop_token_id_ends_the_output_without_its_text(bytewise):
    ids = TOK.encode("abc")
    out, ts = stream(TOK, ids + ids, bytewise=bytewise, stop_token_ids=frozenset({ids[1]}))
    assert (out, ts.token_ids) == ("a", ids[:2])


@pytest.mark.parametrize("bytewise", [True, False])
def test_a_stop_string_with_a_replacement_character_waits_for_the_character(bytewise):
    """The first byte of 中 decodes to U+FFFD until the rest arrives: not a match for the stop."""
    invalid = TOK.convert_tokens_to_ids("ÿ")  # the stand-in for byte 0xff, never valid UTF-8
    out, ts = stream(TOK, TOK.encode("中x") + [invalid] + TOK.encode("!"), bytewise=bytewise, stop=("\ufffd",))
    assert out == ts.text == "中x" and ts.stopped  # the invalid byte is one, once the next character settles it


def test_pieces_asked_for_only_at_the_end_are_the_whole_text():
    """A non-streamed response asks once, at the end."""
    ids = TOK.encode("no streaming 中文, stop here and not after")
    ts = TextStream(text_decoder(TOK), stop=("stop",), bytewise=True)
    for token in ids:
        if ts.add(token):
            break
    assert ts.pending(final=True) == ts.text == "no streaming 中文, "
