"""The serving layer's pieces without a server: the byte-level tokenizer, the sampler, and the
request checks for what this server does not implement (text streaming: test_detokenize.py)."""

from __future__ import annotations

import json

import pytest
import tokenizers
import torch
from transformers import AutoTokenizer

from engine.core.request import Request
from engine.core.sampling import SamplingParams
from engine.model import sampler
from engine.model.sampler import filtered_probs, sample
from engine.model.tokenizer import byte_tokenizer
from engine.serving.app import _tokenize
from engine.serving import protocol
from engine.serving.protocol import MAX_NESTING, ApiError, parse_chat, parse_completion, parse_json

TOK = byte_tokenizer(512, eos_token_id=1)


def test_byte_tokenizer_round_trips_saves_and_loads_as_tokenizer_json(tmp_path):
    qwen = byte_tokenizer(151936, eos_token_id=151643)
    assert qwen.encode("A") == [65] and qwen.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"]) == [151644, 151645]
    text = "naïve 中 \x00\n"
    assert TOK.decode(TOK.encode(text)) == text
    assert TOK.eos_token_id == 1 and all(0 <= i < 512 for i in TOK.encode(text))
    TOK.save_pretrained(tmp_path)
    assert tokenizers.Tokenizer.from_file(str(tmp_path / "tokenizer.json")).encode(text).ids == TOK.encode(text)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    chat = [{"role": "user", "content": "hi"}]
    assert loaded.apply_chat_template(chat, add_generation_prompt=True, tokenize=False) == \
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def _requests(params: SamplingParams | None, n: int = 3) -> list[Request]:
    return [Request(f"s{i}", [1, 2], 8, sampling=params) for i in range(n)]


def test_sampling_with_a_seed_repeats_and_greedy_is_argmax():
    logits = torch.randn(3, 512, generator=torch.Generator().manual_seed(0))
    greedy = lambda x: x.argmax(-1)  # noqa: E731
    assert sample(logits, _requests(None), greedy) == logits.argmax(-1).tolist()
    seeded = SamplingParams(temperature=1.0, seed=7)
    first = sample(logits, _requests(seeded), greedy)
    assert sample(logits, _requests(seeded), greedy) == first
    same_rows = logits[:1].expand(3, -1)
    draws = sample(same_rows, _requests(seeded), greedy)
    assert draws[0] == draws[1] == draws[2]  # same seed, same output index, same logits: same draw
    draws = {tuple(sample(logits, _requests(SamplingParams(temperature=1.0, seed=s)), greedy)) for s in range(20)}
    assert len(draws) > 1  # it really samples
    assert sample(logits, _requests(SamplingParams(temperature=1.0, top_k=1, seed=1)), greedy) == \
        logits.argmax(-1).tolist()


def test_top_p_keeps_the_smallest_set_reaching_p():
    probs = filtered_probs(torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05])), SamplingParams(temperature=1.0, top_p=0.7))
    assert probs.tolist()[2:] == [0.0, 0.0] and probs[0] > 0 and probs[1] > 0


def _nucleus_by_sorting(row: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The definition, over the whole sorted vocabulary (what the sampler did before it probed)."""
    x = (row - row.max()) / params.temperature
    if 0 < params.top_k < x.numel():
        x = x.masked_fill(x < torch.topk(x, params.top_k).values[-1], float("-inf"))
    probs = torch.softmax(x, dim=-1)
    sorted_p, order = torch.sort(probs, descending=True)
    drop = torch.cumsum(sorted_p, dim=-1) - sorted_p >= params.top_p
    return probs.scatter(0, order, sorted_p.masked_fill(drop, 0.0))


@pytest.mark.parametrize("spread", [4.0, 3.0, 1.0, 0.1])  # a nucleus of ~100 tokens, ~800, ~78k, ~133k
@pytest.mark.parametrize("top_k", [0, 3000])
def test_top_p_without_sorting_the_vocabulary_keeps_what_sorting_it_keeps(spread, top_k):
    row = torch.randn(151936, generator=torch.Generator().manual_seed(int(spread))) * spread
    params = SamplingParams(temperature=0.8, top_p=0.9, top_k=top_k)
    got, want = filtered_probs(row, params), _nucleus_by_sorting(row, params)
    kept = int((want > 0).sum())
    if top_k == 0:  # the spreads reach both ways of finding the set: among the probe's tokens, the radix select
        assert (kept <= sampler.NUCLEUS_PROBE) == (spread == 4.0)
    assert torch.equal(got > 0, want > 0)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-9)


@pytest.mark.parametrize("top_p", [0.9999999, 1 - 1e-12])
def test_top_p_above_what_the_probabilities_sum_to_keeps_every_token(top_p):
    """A flat row's float32 probabilities sum to a little under 1: no threshold reaches such a
    top_p, and the select once came back empty and raised, failing the step of every request in it."""
    row = torch.randn(151936, generator=torch.Generator().manual_seed(3)) * 0.1
    params = SamplingParams(temperature=1.0, top_p=top_p, seed=0)
    assert bool((filtered_probs(row, params) > 0).all())
    assert 0 <= sample(row[None], [Request("n", [1], 4, sampling=params)], lambda x: x.argmax(-1))[0] < 151936


def test_draws_follow_the_kept_distribution_and_never_a_dropped_token():
    """Inverse-CDF draws, one seed each: every kept token about as often as its probability says
    (within 5 standard deviations), a token top-p dropped never."""
    row = torch.log(torch.tensor([0.3, 0.0, 0.25, 0.2, 0.1, 0.08, 0.05, 0.02]))
    params = [SamplingParams(temperature=1.0, top_p=0.9, seed=s) for s in range(4000)]
    counts = torch.bincount(torch.tensor(sample(row.expand(len(params), -1), [Request(f"d{i}", [1], 4, sampling=p)
                                                                              for i, p in enumerate(params)],
                                                lambda x: x.argmax(-1))), minlength=8)
    probs = filtered_probs(row, params[0])
    assert probs[1] == 0 and probs[6] == 0 and probs[7] == 0  # impossible, and past the nucleus
    assert counts[1] == counts[6] == counts[7] == 0
    expected = probs / probs.sum() * len(params)
    sd = (expected * (1 - probs / probs.sum())).sqrt()
    assert ((counts - expected).abs() <= 5 * sd + 1e-9).all(), (counts.tolist(), expected.tolist())


def test_draws_from_a_wide_nucleus_take_only_its_tokens():
    """Past the probe the nucleus is a threshold over the whole vocabulary (weights 0 below it): a
    thousand nearly equal tokens at top_p=0.5 keep about half, and 400 seeded draws land only there."""
    row = torch.randn(1000, generator=torch.Generator().manual_seed(5)) * 0.3
    params = [SamplingParams(temperature=1.0, top_p=0.5, seed=s) for s in range(400)]
    probs = filtered_probs(row, params[0])
    assert sampler.NUCLEUS_PROBE < int((probs > 0).sum()) < 1000
    drawn = sample(row.expand(len(params), -1), [Request(f"w{i}", [1], 4, sampling=p) for i, p in enumerate(params)],
                   lambda x: x.argmax(-1))
    assert all(probs[t] > 0 for t in drawn) and len(set(drawn)) > 100


def test_logprobs_are_recorded_per_sampled_token():
    logits = torch.randn(2, 512, generator=torch.Generator().manual_seed(1))
    requests = _requests(SamplingParams(logprobs=3), n=2)
    tokens = sample(logits, requests, lambda x: x.argmax(-1))
    lp, top = requests[0].output_logprobs[0]
    assert len(top) == 3 and top[0][0] == tokens[0] and lp == pytest.approx(top[0][1])
    assert lp == pytest.approx(torch.log_softmax(logits[0], -1)[tokens[0]].item(), abs=1e-5)


@pytest.mark.parametrize("field,value", [
    ("best_of", 2), ("presence_penalty", 0.5), ("frequency_penalty", 1), ("logit_bias", {"1": 5}),
    ("suffix", "x"), ("min_p", 0.1), ("top_p", 7), ("logprobs", -3), ("logprobs", 99), ("stop", 42),
    ("stop", ["a"] * 17), ("top_k", -2), ("seed", "x"), ("temperature", 2.5), ("stop_token_ids", [1.5]),
    ("presence_penalty", False), ("best_of", True), ("use_beam_search", 0),  # JSON's false is not 0, 0 not false
])
def test_unsupported_or_invalid_parameters_get_400_naming_them(field, value):
    with pytest.raises(ApiError) as err:
        parse_completion({"prompt": [1], field: value})
    assert err.value.status == 400 and err.value.param.split(".")[0] == field and field in err.value.message


@pytest.mark.parametrize("parse,body,param", [
    ("tokenize", {"prompt": "hi", "add_special_tokens": "yes"}, "add_special_tokens"),
    ("tokenize", {"prompt": "hi", "add_special_tokens": 1}, "add_special_tokens"),  # JSON's 1 is not true
    ("tokenize", {"prompt": [104, 105]}, "prompt"),  # /tokenize takes text; ids are already tokens
    ("tokenize", {}, "prompt"),
    ("detokenize", {"tokens": "104 105"}, "tokens"),
    ("detokenize", {"tokens": [104, 1.5]}, "tokens"),
    ("detokenize", {"tokens": [104, True]}, "tokens"),  # a bool is an int to Python, not to JSON
    ("detokenize", {"tokens": [104, 512]}, "tokens"),  # the vocabulary is [0, 512)
    ("detokenize", {"tokens": [-1]}, "tokens"),
])
def test_tokenize_and_detokenize_refuse_bad_bodies_with_400_naming_the_field(parse, body, param):
    with pytest.raises(ApiError) as err:
        protocol.parse_tokenize(body) if parse == "tokenize" else protocol.parse_detokenize(body, 512)
    assert err.value.status == 400 and err.value.param == param and err.value.message.startswith(param)


def test_chat_refuses_tools_and_non_text_parts():
    for body, param in [({"tools": [{"type": "function"}]}, "tools"),
                        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages"),
                        ({"top_logprobs": 2}, "top_logprobs")]:
        with pytest.raises(ApiError) as err:
            parse_chat({"messages": [{"role": "user", "content": "hi"}], **body})
        assert err.value.param == param


def test_supported_parameters_become_sampling_and_stops():
    p = parse_completion({"prompt": "x", "temperature": 0.5, "top_p": 0.9, "top_k": 5, "seed": 3, "logprobs": 2,
                          "stop": "\n", "stop_token_ids": [7], "best_of": 1, "suffix": None})
    assert p.sampling == SamplingParams(0.5, 0.9, 5, 3, 2) and p.stop == ("\n",)
    assert p.stop_token_ids == frozenset({7})
    assert parse_completion({"prompt": [1], "temperature": 0}).sampling is None  # greedy: the fast path


def test_deep_nesting_is_a_400_not_a_recursion_error():
    for raw in (b'{"prompt":[1],"x":' + b"[" * 100_000 + b"]" * 100_000 + b"}",
                b'{"prompt":' + b"[" * 960 + b"1" + b"]" * 960 + b"}"):
        with pytest.raises(ApiError) as err:
            parse_completion(parse_json(raw))
        assert err.value.status == 400 and str(MAX_NESTING) in err.value.message
    assert parse_json(json.dumps({"prompt": [[1, 2]], "x": {"a": [{"b": 1}]}}).encode())["prompt"] == [[1, 2]]


def test_brackets_inside_strings_are_text_not_nesting():
    code = "[" * 200 + '{"unclosed \\" ]' + "{" * 50  # a truncated snippet in a text prompt
    raw = json.dumps({"prompt": code, "stop": ["]]"]}).encode()
    assert parse_completion(parse_json(raw)).prompt_text == code
    with pytest.raises(ApiError):  # the same depth outside a string still is nesting
        parse_json(b'{"prompt":"' + b"[" * 40 + b'","x":' + b"[" * 40 + b"]" * 40 + b"}")


def test_null_means_the_default_as_openais_schema_allows():
    p = parse_completion({"prompt": [1], "stream": None, "n": None, "echo": None, "ignore_eos": None,
                          "logprobs": None, "max_tokens": 4})
    assert (p.stream, p.echo, p.ignore_eos, p.sampling, p.max_tokens) == (False, False, False, None, 4)
    chat = parse_chat({"messages": [{"role": "user", "content": "hi"}], "logprobs": None, "stream": None})
    assert chat.sampling is None and chat.stream is False
    with pytest.raises(ApiError) as err:  # null is not a wildcard: a wrong type still is a 400
        parse_completion({"prompt": [1], "stream": "yes"})
    assert err.value.param == "stream"
    with pytest.raises(ApiError) as err:  # as OpenAI and vLLM: usage options on a reply that is not streamed
        parse_completion({"prompt": [1], "stream_options": {"include_usage": True}})
    assert err.value.param == "stream_options"


def test_a_chat_template_refusing_the_messages_is_a_400_naming_them():
    tok = byte_tokenizer(512, eos_token_id=1)
    tok.chat_template = ("{% if messages[0]['role'] != 'user' %}{{ raise_exception('conversation must start "
                         "with a user turn') }}{% endif %}{{ messages[0]['content'] }}")
    assert _tokenize(tok, None, [{"role": "user", "content": "hi"}]) == tok.encode("hi", add_special_tokens=False)
    with pytest.raises(ApiError) as err:
        _tokenize(tok, None, [{"role": "assistant", "content": "hi"}])
    assert err.value.status == 400 and err.value.param == "messages" and "user turn" in err.value.message


def test_errors_quote_only_a_short_prefix_of_bad_input():
    with pytest.raises(ApiError) as err:
        parse_completion({"prompt": [1], "max_tokens": "9" * 5_000_000})
    assert err.value.param == "max_tokens" and len(err.value.message) < 300


def test_unknown_fields_are_ignored_but_named_once_in_the_log(caplog, monkeypatch):
    """vLLM ignores them too; the warning is how a typo such as max_token gets noticed."""
    monkeypatch.setattr(protocol, "_WARNED_UNKNOWN", set())  # as in a fresh server
    with caplog.at_level("WARNING", logger="miniserve.server"):
        params = parse_completion({"prompt": [1], "max_token": 99, "max_tokens_typo_2": 1})
        parse_completion({"prompt": [1], "max_token": 99})
    assert params.max_tokens == 16  # ignored: the default stands
    warnings = [r.getMessage() for r in caplog.records if "ignored request fields" in r.getMessage()]
    assert len(warnings) == 1 and "'max_token'" in warnings[0] and "'max_tokens_typo_2'" in warnings[0]
    caplog.clear()
    with caplog.at_level("WARNING", logger="miniserve.server"):
        parse_chat({"messages": [{"role": "user", "content": "hi"}], "temperature": 0, "logprobs": False})
    assert not caplog.records  # known fields are not named
    parse_completion({"prompt": [1], "x" * 1_000_000: 1})  # kept cut short: a client cannot pin memory with names
    assert max(map(len, protocol._WARNED_UNKNOWN)) <= protocol.QUOTE_CHARS


@pytest.mark.parametrize("temperature", [1e-39, 1e-45, 1e-6])
def test_a_tiny_temperature_draws_the_most_likely_token_and_does_not_raise(temperature):
    """logits / 1e-39 overflowed to inf and the softmax to NaN: the draw raised, and the engine
    loop took every in-flight request down with it."""
    logits = torch.tensor([[0.5, 3.0, -1.0, 2.9], [1.0, -2.0, 7.5, 7.25]])
    params = SamplingParams(temperature=temperature, seed=3)
    assert torch.isfinite(filtered_probs(logits[0], params)).all()
    assert sample(logits, _requests(params, n=2), lambda x: x.argmax(-1)) == [1, 2]


@pytest.mark.parametrize("raw,param", [
    (b'{"prompt": "a\\ud800b"}', "prompt"),
    (b'{"messages": [{"role": "user", "content": "\\udfff"}]}', "messages"),
    (b'{"prompt": [1], "user": {"\\uDBFF": 1}}', "user"),  # a key too
])
def test_a_lone_surrogate_escape_is_a_400_naming_the_field(raw, param):
    """json.loads takes half a UTF-16 pair; the tokenizer then failed on it as a 500."""
    with pytest.raises(ApiError) as err:
        parse_json(raw)
    assert err.value.status == 400 and err.value.param == param and "Unicode" in err.value.message


def test_a_whole_surrogate_pair_is_one_character():
    assert parse_completion(parse_json(b'{"prompt": "\\ud83d\\ude00 ok"}')).prompt_text == "\U0001F600 ok"
