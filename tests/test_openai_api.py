"""The HTTP protocol's pure parts: strict JSON, request validation, incremental detokenization."""

import random

import pytest

from specserve.cluster.openai_api import APIError, Detokenizer, parse_completion, parse_json
from specserve.config import DEFAULT_MODEL_DIR
from specserve.core.runner import load_tokenizer


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(str(DEFAULT_MODEL_DIR / "target"))


class CountingTokenizer:
    """Counts the token ids each decode call sees."""

    def __init__(self, inner):
        self.inner, self.decoded = inner, 0

    def decode(self, ids, **kw):
        self.decoded += len(ids)
        return self.inner.decode(ids, **kw)


def stream(detok, ids, rng):
    out, i = "", 0
    while i < len(ids):
        n = rng.randint(1, 5)  # speculation writes 1..k+1 tokens per round
        out += detok.add(ids[i:i + n])
        i += n
    return out + (detok.flush() if not detok.stopped else "")


TEXTS = ["def f(x):\n    return x ** 2  # ünïcode ✓ 日本語 🙂\n", "print('a' * 3)\n\tpass\n", "é" * 40 + "🙂" * 10]


@pytest.mark.parametrize("text", TEXTS)
def test_incremental_text_equals_one_shot_decode(tok, text):
    ids = tok(text)["input_ids"]
    for seed in range(5):
        assert stream(Detokenizer(tok, []), ids, random.Random(seed)) == tok.decode(ids, skip_special_tokens=True)


def test_split_multibyte_characters_are_held_not_garbled(tok):
    ids = tok("🙂🙂🙂")["input_ids"]
    detok = Detokenizer(tok, [])
    deltas = [detok.add([t]) for t in ids]
    assert all("\ufffd" not in d for d in deltas) and "".join(deltas) == "🙂🙂🙂"


def test_stop_strings_are_never_emitted(tok):
    text = "alpha = 1\nbeta = 2\nSTOP here\ngamma = 3\n"
    ids = tok(text)["input_ids"]
    for seed in range(5):
        detok = Detokenizer(tok, ["STOP", "zzz"])
        out = stream(detok, ids, random.Random(seed))
        assert out == "alpha = 1\nbeta = 2\n" and detok.stopped
        # usage: the tokens through the one that completes "STOP", however the rounds split them
        used = detok.tokens_used()
        assert "STOP" in tok.decode(ids[:used]) and "STOP" not in tok.decode(ids[:used - 1])


@pytest.mark.parametrize("stop", [["```\n", "\n```"], ["one\n```", "```"], ["x = 1", "= 1\n"]])
def test_overlapping_stop_strings_cut_where_token_by_token_decoding_does(tok, stop):
    """Of stop strings that overlap, the one that ends first cuts the text (as one token at a time
    meets it), whatever the rounds' grouping of the tokens, and usage counts the tokens through
    it. Until stop 52 the first of the list the text held cut it: a speculative round or a paced
    stream message that brought both cut elsewhere than plain decoding, and a stream otherwise
    than the same request answered whole."""
    text = "code = 0\nx = 1\none\n```\nmore\n"
    ids = tok(text)["input_ids"]
    one_at_a_time = Detokenizer(tok, stop)
    want = "".join(one_at_a_time.add([t]) for t in ids)
    assert one_at_a_time.stopped
    for grouping in [len(ids)] + list(range(2, 6)):
        detok = Detokenizer(tok, stop)
        got = "".join(detok.add(ids[i:i + grouping]) for i in range(0, len(ids), grouping))
        assert (got, detok.tokens_used()) == (want, one_at_a_time.tokens_used()), (grouping, got, want)
    for seed in range(5):
        detok = Detokenizer(tok, stop)
        assert stream(detok, ids, random.Random(seed)) == want and detok.tokens_used() == one_at_a_time.tokens_used()


def test_a_stop_string_with_a_replacement_character_matches_only_completed_text(tok):
    """Text holds '\ufffd' where the tokens' bytes are not UTF-8 (a byte-level model can write
    any byte), and, until its next token, where a character is incomplete. A stop string holding
    it matches the first only: the request answered whole (the pair watching the rounds cuts its
    tokens at tokens_used, the ingress decodes those) and streamed agree, in text and usage. Until
    stop 60 tokens_used took a transient '\ufffd' (the first byte of "˷") for the stop string:
    the answer was "nEv", 4 tokens, the stream "nEv˷" with usage 4 (found by a user trial)."""
    invalid = tok.convert_tokens_to_ids("ÿ")  # the byte 0xff: never UTF-8
    ids = tok("nEv˷")["input_ids"] + [invalid, invalid] + tok("z")["input_ids"]
    assert tok.decode(ids) == "nEv˷\ufffd\ufffdz" and tok.decode(ids[:4]) == "nEv\ufffd"  # (the transient one)
    for grouping in range(1, len(ids) + 1):
        watch = Detokenizer(tok, ["\ufffd"])  # the pair's, over the rounds
        streamed = "".join(watch.add(ids[i:i + grouping]) for i in range(0, len(ids), grouping))
        # (usage: through the "z", after which a '\ufffd' is no longer the text's last character)
        assert watch.stopped and (streamed, watch.tokens_used()) == ("nEv˷", len(ids)), grouping
        whole = Detokenizer(tok, ["\ufffd"])  # the ingress's, of the tokens the pair kept
        whole.add(ids[:watch.tokens_used()])
        text = whole.text if whole.stopped else whole.text + whole.flush()
        assert (text, whole.tokens_used()) == ("nEv˷", len(ids)), grouping
    cut = Detokenizer(tok, ["\ufffd"])  # max_tokens ending inside the character: the text's last '\ufffd' is final
    assert cut.add(ids[:4]) + cut.flush() == "nEv" and cut.stopped and cut.tokens_used() == 4


def sentencepiece_like():
    """A tokenizer decoding as Llama 2's and Mistral's do: "▁" is a space, and a decode's first
    space is stripped. Built in place (no model hub here)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    words = ["<unk>", "▁The", "▁capital", "▁of", "▁France", "▁is", "▁Paris", "▁and", "▁Rome"]
    inner = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    inner.pre_tokenizer, inner.decoder = pre_tokenizers.Metaspace(), decoders.Metaspace()
    return PreTrainedTokenizerFast(tokenizer_object=inner)


def test_the_first_word_keeps_its_space_after_the_prompt():
    """Decoded alone, a SentencePiece token loses its leading space: the prompt's last tokens are
    the first window's context, so the text goes on as one decode of prompt + output would."""
    tok = sentencepiece_like()
    prompt, out = tok("The capital of France is")["input_ids"], tok("Paris and Rome")["input_ids"]
    assert tok.decode(out) == "Paris and Rome"  # (the strip this is about)
    whole = tok.decode(prompt + out)
    for seed in range(3):
        detok = Detokenizer(tok, [], prompt)
        assert stream(detok, out, random.Random(seed)) == whole[len(tok.decode(prompt)):] == " Paris and Rome"
        assert detok.tokens_used() == len(out)
    detok = Detokenizer(tok, [" Rome"], prompt)  # stop strings and usage see the same text
    assert stream(detok, out, random.Random(0)) == " Paris and" and detok.tokens_used() == 3
    detok = Detokenizer(tok, [], prompt, stop_ids=[out[1]])  # a stop token ends the text, its own text left out
    assert stream(detok, out, random.Random(0)) == " Paris" and detok.tokens_used() == 2  # (it counts: vLLM's usage)
    detok = Detokenizer(tok, ["France"], prompt)  # the prompt's own text is not searched
    assert stream(detok, out, random.Random(0)) == " Paris and Rome" and not detok.stopped


def test_detokenization_costs_o_new_tokens(tok):
    """Decoded token count grows linearly with the output, not quadratically."""
    ids = (tok("x = [i * 2 for i in range(10)]\n" * 200)["input_ids"])
    counting = CountingTokenizer(tok)
    detok = Detokenizer(counting, ["never"])
    for i in range(0, len(ids), 3):
        detok.add(ids[i:i + 3])
    assert detok.text == tok.decode(ids, skip_special_tokens=True)
    assert counting.decoded < 6 * len(ids), (counting.decoded, len(ids))  # a full re-decode would be ~len^2/6


@pytest.mark.parametrize("raw", [b'{"temperature": NaN}', b'{"temperature": Infinity}', b'{"x": -Infinity}',
                                 b'\xff\xfe{"model": 1}', b'{"model": "a"'])
def test_strict_json_refuses_non_numbers_and_bad_bytes(raw):
    with pytest.raises((ValueError, UnicodeDecodeError)):
        parse_json(raw)


@pytest.mark.parametrize("body,param", [
    ({"temperature": 1e-300}, "temperature"), ({"temperature": 1e400}, "temperature"),
    ({"temperature": 0.0009}, "temperature"), ({"top_p": float("nan")}, "top_p"),
    ({"stop": ["x"] * 17}, "stop"), ({"stop_token_ids": [1] * 65}, "stop_token_ids"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"), ({"stop_token_ids": 5}, "stop_token_ids"), ({"prompt": "\ud800"}, "prompt"), ({"stop": "a\udfff"}, "stop"), ({"stop": ["y" * 257]}, "stop"), ({"stop": [1]}, "stop"),
    # integers too large for a float (JSON takes 4300 digits): a 500 until stop 62 (an OverflowError)
    ({"temperature": 10 ** 400}, "temperature"), ({"echo": 10 ** 400}, "echo"), ({"top_p": -10 ** 400}, "top_p"),
    # speculation asked for and turned off in one body: accepted, and run plain, until stop 64
    ({"speculative": {"enabled": True, "method": "none"}}, "speculative.method"),
    # a prompt of another type was missing_required_parameter until stop 65; a user not a string, a 200
    ({"prompt": 5}, "prompt"), ({"prompt": {"a": 1}}, "prompt"), ({"user": 5}, "user"), ({"user": ["x"]}, "user"),
])
def test_absurd_values_are_400s(body, param):
    with pytest.raises(APIError) as e:
        parse_completion({"model": "m", "prompt": "p", **body}, "m")
    assert e.value.status == 400 and e.value.param == param
    if param in ("prompt", "user"):  # (present, of a wrong type: not a missing parameter)
        assert e.value.code == "invalid_value"


def test_a_prompt_missing_or_null_is_a_missing_parameter_and_a_user_string_is_accepted():
    for body in ({"model": "m"}, {"model": "m", "prompt": None}):
        with pytest.raises(APIError) as e:
            parse_completion(body, "m")
        assert (e.value.param, e.value.code) == ("prompt", "missing_required_parameter")
    assert parse_completion({"model": "m", "prompt": "p", "user": "u-1"}, "m").prompt == "p"
    assert parse_completion({"model": "m", "prompt": "p", "user": None}, "m").prompt == "p"


@pytest.mark.parametrize("field,value", [("logprobs", 5), ("logprobs", 0), ("logprobs", 0.0), ("logprobs", True),
                                         ("top_logprobs", 2), ("echo", True), ("best_of", 3), ("suffix", "x"), ("presence_penalty", 0.5),
                                         ("frequency_penalty", -1), ("logit_bias", {"5": 10}),
                                         ("response_format", {"type": "json_object"}), ("min_tokens", 5),
                                         ("repetition_penalty", 1.2), ("min_p", 0.1), ("use_beam_search", True),
                                         ("include_stop_str_in_output", True), ("skip_special_tokens", False),
                                         ("guided_json", {"type": "object"}), ("guided_choice", ["a", "b"]),
                                         ("structured_outputs", {"regex": "a+"}), ("bad_words", ["x"]),
                                         ("truncate_prompt_tokens", 10)])
def test_fields_asked_for_and_not_implemented_are_400s(field, value):
    """Until stop 47 these were accepted and ignored (a 200 whose logprobs were null, say); vLLM's
    extensions that would change the output, and response_format on completions, until stop 50."""
    with pytest.raises(APIError) as e:
        parse_completion({"model": "m", "prompt": "p", field: value}, "m")
    assert e.value.status == 400 and e.value.param == field and e.value.code == "unsupported_value"
    inert = {"logprobs": None, "top_logprobs": 0, "echo": False, "best_of": 1, "suffix": "", "presence_penalty": 0,
             "frequency_penalty": 0.0, "logit_bias": {}, "response_format": {"type": "text"}, "min_tokens": 0,
             "repetition_penalty": 1.0, "min_p": 0.0, "use_beam_search": False, "include_stop_str_in_output": False,
             "skip_special_tokens": True, "guided_json": None, "guided_choice": None, "structured_outputs": None,
             "bad_words": [], "truncate_prompt_tokens": None}[field]
    assert parse_completion({"model": "m", "prompt": "p", field: inert}, "m").prompt == "p"  # asks for nothing
    if (field, value) == ("logprobs", 0):  # chat's logprobs is a flag: 0 asks for nothing there
        assert parse_completion({"model": "m", "prompt": "p", "logprobs": 0}, "m", chat=True).prompt == "p"


def test_an_error_s_type_follows_its_status():
    """Any 4xx is the client's to mend (a 413 was a server_error until stop 60), unless typed apart."""
    assert [APIError(s, "m").type for s in (400, 401, 404, 413, 415, 422, 500, 503, 504)] == \
        ["invalid_request_error", "authentication_error", "not_found_error", "invalid_request_error",
         "invalid_request_error", "invalid_request_error", "server_error", "overloaded_error", "timeout_error"]


def test_max_completion_tokens_supersedes_max_tokens_and_each_is_checked():
    """As vLLM and SGLang: a client sending both means the newer name. Until stop 62 max_tokens won,
    and a max_completion_tokens beside it ("abc", 0, -3) was never read: a 200."""
    assert parse_completion({"model": "m", "prompt": "p", "max_completion_tokens": 40}, "m").max_tokens == 40
    assert parse_completion({"model": "m", "prompt": "p", "max_tokens": 7, "max_completion_tokens": 40},
                            "m").max_tokens == 40
    assert parse_completion({"model": "m", "prompt": "p", "max_tokens": 7, "max_completion_tokens": None},
                            "m").max_tokens == 7
    for body in ({"max_completion_tokens": 0}, {"max_tokens": 5, "max_completion_tokens": "abc"},
                 {"max_tokens": 5, "max_completion_tokens": -3}, {"max_tokens": 0, "max_completion_tokens": 5}):
        with pytest.raises(APIError) as e:
            parse_completion({"model": "m", "prompt": "p", **body}, "m", chat=True)
        assert e.value.status == 400 and e.value.param == next(k for k, v in body.items() if v in (0, -3, "abc"))


@pytest.mark.parametrize("field,value", [("echo", 0), ("best_of", True), ("presence_penalty", False),
                                         ("skip_special_tokens", 1), ("top_logprobs", False), ("min_p", False),
                                         ("frequency_penalty", "0")])
def test_a_field_not_implemented_asks_for_nothing_only_with_its_own_type(field, value):
    """Python's 0 == False and 1 == True let these pass as the values that ask for nothing until stop 62."""
    with pytest.raises(APIError) as e:
        parse_completion({"model": "m", "prompt": "p", field: value}, "m")
    assert e.value.code == "unsupported_value" and e.value.param == field and "got " in e.value.message


def test_a_completion_s_logprobs_message_names_only_what_it_accepts():
    with pytest.raises(APIError) as e:
        parse_completion({"model": "m", "prompt": "p", "logprobs": True}, "m")
    assert e.value.message.endswith("it may be absent or false, got true")  # (0 too, until review: refused there)
    with pytest.raises(APIError) as e:
        parse_completion({"model": "m", "prompt": "p", "logprobs": 0}, "m")
    assert "0 asks for those of the chosen tokens" in e.value.message


def test_a_batch_of_prompts_is_refused_as_a_feature_not_implemented():
    for prompt in (["def f(x):", "class A:"], [[1, 2], [3, 4]]):
        with pytest.raises(APIError) as e:
            parse_completion({"model": "m", "prompt": prompt}, "m")
        assert e.value.code == "unsupported_value" and e.value.param == "prompt" and "batch of 2" in e.value.message
    assert parse_completion({"model": "m", "prompt": ["def f(x):"]}, "m").prompt == "def f(x):"  # a batch of one
    with pytest.raises(APIError) as e:
        parse_completion({"model": "m", "prompt": [1, "a"]}, "m")
    assert e.value.code == "invalid_value"


def test_a_chat_template_that_refuses_the_messages_is_a_400(tok):
    from specserve.cluster.openai_api import chat_prompt

    class Strict:
        chat_template = "{{ raise_exception('roles must alternate') }}"

        def apply_chat_template(self, messages, **kw):
            return tok.apply_chat_template(messages, chat_template=self.chat_template, **kw)

    with pytest.raises(APIError) as e:
        chat_prompt({"messages": [{"role": "user", "content": "hi"}]}, Strict())
    assert e.value.status == 400 and "roles must alternate" in e.value.message


def test_a_conversation_with_tool_calls_is_refused_as_not_implemented():
    """An assistant message of tool calls (content null) was told only "'messages' must be a
    non-empty list of {role, content} objects" until stop 62."""
    from specserve.cluster.openai_api import chat_prompt
    from specserve.training.tiny import tiny_tokenizer
    tok = tiny_tokenizer()
    tok.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    for message in ({"role": "assistant", "content": None, "tool_calls": [call]},
                    {"role": "assistant", "content": "ok", "function_call": {"name": "f", "arguments": "{}"}}):
        with pytest.raises(APIError) as e:
            chat_prompt({"messages": [{"role": "user", "content": "hi"}, message]}, tok)
        assert e.value.code == "unsupported_value" and "messages[1]" in e.value.message
    for role in ("tool", "function"):  # a tool's answer (until stop 63 it reached the template)
        with pytest.raises(APIError) as e:
            chat_prompt({"messages": [{"role": "user", "content": "hi"}, {"role": role, "content": "42"}]}, tok)
        assert e.value.code == "unsupported_value" and "messages[1]" in e.value.message
    for role in ("bot", "User", "ipython"):  # not a role of the API (until stop 63 printed into the prompt as it was)
        with pytest.raises(APIError) as e:
            chat_prompt({"messages": [{"role": role, "content": "hi"}]}, tok)
        assert e.value.code == "invalid_value" and e.value.param == "messages" and "messages[0].role" in e.value.message
    for role in ("system", "developer", "user", "assistant"):
        assert f"{role}: hi" in chat_prompt({"messages": [{"role": role, "content": "hi"}]}, tok)
    for empty in ([], None):  # (the openai client echoes an assistant message back with its empty tool_calls)
        said = {"role": "assistant", "content": "ok", "tool_calls": empty}
        assert "ok" in chat_prompt({"messages": [{"role": "user", "content": "hi"}, said]}, tok)


def test_chat_fields_asked_for_and_not_done_are_400s_and_the_rest_is_accepted():
    for field, value in (("tools", [{"type": "function", "function": {"name": "f"}}]), ("tool_choice", "required"),
                         ("functions", [{"name": "f"}]), ("function_call", {"name": "f"}),
                         ("response_format", {"type": "json_object"}),
                         ("chat_template_kwargs", {"enable_thinking": False}), ("add_generation_prompt", False),
                         ("continue_final_message", True), ("add_special_tokens", True), ("chat_template", "{{ x }}")):
        with pytest.raises(APIError) as e:
            parse_completion({"model": "m", "prompt": "p", field: value}, "m", chat=True)
        assert e.value.param == field and e.value.code == "unsupported_value"
    req = parse_completion({"model": "m", "prompt": "p", "tools": [], "tool_choice": "auto",
                            "response_format": {"type": "text"}, "add_generation_prompt": True,
                            "chat_template_kwargs": {}}, "m", chat=True)
    assert req.max_tokens is None  # chat: up to the end of the context, as OpenAI's (completions: 16)
    assert parse_completion({"model": "m", "prompt": "p"}, "m").max_tokens == 16


def test_seeds_are_any_64_bit_integer_and_stream_options_need_a_stream():
    assert parse_completion({"model": "m", "prompt": "p", "seed": -1}, "m").seed == 2 ** 63 - 1
    assert parse_completion({"model": "m", "prompt": "p", "seed": 5}, "m").seed == 5
    with pytest.raises(APIError):
        parse_completion({"model": "m", "prompt": "p", "seed": 2 ** 64}, "m")
    body = {"model": "m", "prompt": "p", "stream_options": {"include_usage": True}}
    assert parse_completion({**body, "stream": True}, "m").include_usage
    both = {"include_usage": True, "continuous_usage_stats": True}
    assert parse_completion({**body, "stream": True, "stream_options": both}, "m").continuous_usage
    assert not parse_completion({**body, "stream": True, "stream_options": {"continuous_usage_stats": True}},
                                "m").continuous_usage  # as vLLM's: only with include_usage
    for bad in (body, {**body, "stream": True, "stream_options": {"include_usage": "yes"}},
                {**body, "stream": True, "stream_options": {"other": True}}):
        with pytest.raises(APIError) as e:
            parse_completion(bad, "m")
        assert e.value.param == "stream_options"


def test_chat_content_parts_and_one_bos():
    """Text parts are the text; other parts are a 400. The template's text has the BOS the
    template writes, and the tokenizer adds none of its own (it would for a completion)."""
    from tokenizers.processors import TemplateProcessing

    from specserve.cluster.openai_api import chat_prompt, prompt_token_ids
    from specserve.training.tiny import EOS, tiny_tokenizer
    tok = tiny_tokenizer()
    bos = tok.convert_tokens_to_ids(EOS)  # (the tiny tokenizer's one special token, as its BOS)
    tok._tokenizer.post_processor = TemplateProcessing(single=f"{EOS} $A", special_tokens=[(EOS, bos)])
    tok.bos_token = EOS
    tok.chat_template = "{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    parts = chat_prompt({"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"},
                                                                   {"type": "text", "text": "there"}]}]}, tok)
    assert parts == chat_prompt({"messages": [{"role": "user", "content": "hi\nthere"}]}, tok)  # (as vLLM joins them)
    assert prompt_token_ids(tok, parts, chat=True).count(bos) == 1
    assert prompt_token_ids(tok, "hi", chat=False)[0] == bos
    with pytest.raises(APIError) as e:
        chat_prompt({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
                    tok)
    assert e.value.code == "unsupported_value"


def test_a_model_without_a_chat_template_refuses_chat(tok):
    from specserve.cluster.openai_api import chat_prompt
    with pytest.raises(APIError, match="no chat template") as e:  # (the demo pair has none)
        chat_prompt({"messages": [{"role": "user", "content": "hi"}]}, tok)
    assert e.value.status == 400


def test_small_but_sane_temperature_is_accepted():
    assert parse_completion({"model": "m", "prompt": "p", "temperature": 0.001}, "m").temperature == 0.001


def test_top_p_that_rounds_to_zero_keeps_the_most_likely_token():
    import torch

    from specserve.core.sampling import SamplingParams, warp
    logits = torch.randn(3, 50) * 3
    p = warp(logits, SamplingParams(temperature=1.0, top_p=1e-300))
    assert torch.equal(p, torch.nn.functional.one_hot(logits.argmax(-1), 50).float())


def test_a_pair_that_fails_under_a_request_is_a_503_in_the_openai_shape():
    """Whatever the pair's stream raises that is not our own error (Ray's ActorDiedError when its
    replica died, say) becomes a 503 the client may retry (until stop 47: the framework's
    plain-text 500, and a streamed response cut off without its error event and [DONE])."""
    import asyncio

    from specserve.cluster.serve_app import Flight, OpenAIIngress

    ingress = object.__new__(OpenAIIngress.func_or_class)  # (its state only: no tokenizer, no pairs)
    ingress.cut, ingress.draining, ingress.live = False, False, set()

    async def dying():
        yield {"token_ids": [1]}
        raise RuntimeError("the replica died")

    async def read(stream, cut_after_s=None):
        flight = Flight()
        ingress.live.add(flight)
        if cut_after_s is not None:  # a shutdown's cut_off while the request waits on its pair
            async def cut():
                await asyncio.sleep(cut_after_s)
                await ingress.cut_off()
            asyncio.ensure_future(cut())
        got = []
        with pytest.raises(APIError) as e:
            async for item in ingress._items({"token_ids": [0]}, stream, flight):
                got.append(item)
        return got, e.value

    got, error = asyncio.run(read(dying()))
    assert got == [{"token_ids": [0]}, {"token_ids": [1]}]
    assert error.status == 503 and error.code == "pair_unavailable" and error.headers == {"Retry-After": "1"}
    assert set(error.body()["error"]) == {"message", "type", "param", "code"}

    async def silent():  # a pair that stops answering (its process stopped): its stream's cancel never ends it
        yield {"token_ids": [1]}
        await asyncio.sleep(3600)
        yield {"token_ids": [2]}

    got, error = asyncio.run(asyncio.wait_for(read(silent(), cut_after_s=0.1), 30))
    assert got == [{"token_ids": [0]}, {"token_ids": [1]}]
    assert error.status == 503 and error.code == "server_shutting_down" and not error.headers


def test_a_method_with_speculation_off_asks_for_no_proposer():
    """{"enabled": false, "method": "draft_model"} on a deployment without a drafter was a 400
    (the method was checked though no proposer would run)."""
    off = parse_completion({"model": "m", "prompt": "p", "speculative": {"enabled": False, "method": "draft_model"}},
                           "m")
    assert not off.speculative and off.method is None
    on = parse_completion({"model": "m", "prompt": "p", "speculative": {"method": "ngram"}}, "m")
    assert on.speculative and on.method == "ngram"


def test_health_is_503_only_when_no_pair_serves():
    """One pair down among several is "degraded", not a 503 for the whole service (until stop 51:
    the other pairs served, and Serve routes around the failing replica while it restarts it)."""
    from specserve.cluster.serve_app import health_answer
    ok, dead = {"status": "ok"}, {"status": "dead", "reason": "the engine loop has stopped"}
    slow = {"status": "degraded", "reason": "the drafter is unavailable"}
    assert health_answer([ok, ok]) == (200, {"status": "ok"})
    assert health_answer([ok, slow]) == (200, {"status": "degraded", "reason": "the drafter is unavailable"})
    status, body = health_answer([ok, dead, TimeoutError()])
    assert status == 200 and body["status"] == "degraded" and body["reason"].startswith("2 of 3 pairs down")
    assert "the engine loop has stopped" in body["reason"] and "TimeoutError" in body["reason"]
    assert health_answer([dead, RuntimeError()])[0] == 503
    assert health_answer([]) == (503, {"status": "unavailable", "reason": "no pair is running"})
    # a pair whose replica Serve has dropped answers nothing: with num_pairs it counts as down (until stop 62
    # /health said "ok" while one of two pairs was down, a user trial)
    status, body = health_answer([ok], pairs=2)
    assert status == 200 and body["status"] == "degraded" and body["reason"].startswith("1 of 2 pairs down")
    assert "1 without a running replica: starting, restarting" in body["reason"]
    assert health_answer([], pairs=2)[0] == 503 and health_answer([dead], pairs=2)[0] == 503
    assert health_answer([ok, ok], pairs=2) == (200, {"status": "ok"})
