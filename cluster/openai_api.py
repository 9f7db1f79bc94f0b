"""The OpenAI completions protocol: request validation, incremental detokenization with stop
strings, and response/error shapes. Pure functions and small classes, no Ray or HTTP here."""

from __future__ import annotations

import json
import math
import time
import uuid
from dataclasses import dataclass, field

from specserve.core.proposer import MAX_K
from specserve.core.sampling import MIN_TEMPERATURE, SEED_HIGH, SEED_LOW, user_seed

MAX_STOP_STRINGS = 16
SPECULATIVE_METHODS = ("draft_model", "ngram", "none")  # as specserve.verifier.engine.METHODS
MAX_STOP_CHARS = 256
MAX_STOP_TOKEN_IDS = 64


class APIError(Exception):
    """An error answered as an OpenAI-style JSON body with an HTTP status."""

    def __init__(self, status: int, message: str, param: str | None = None, type_: str | None = None,
                 code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.type = type_ or {401: "authentication_error", 404: "not_found_error", 503: "overloaded_error",
                              504: "timeout_error"}.get(status, "server_error" if status >= 500 else
                                                        "invalid_request_error")
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def _bad(message: str, param: str | None = None, code: str = "invalid_value") -> APIError:
    return APIError(400, message, param=param, code=code)


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    """A finite JSON number (an integer too large for a float is none: math.isfinite raised on it, a 500)."""
    if not isinstance(v, (int, float)) or isinstance(v, bool):
        return False
    try:
        return math.isfinite(v)
    except OverflowError:
        return False


def _shown(value, most: int = 200) -> str:
    """A JSON value for a message, cut to `most` characters."""
    text = json.dumps(value)
    return text if len(text) <= most else text[:most] + "..."


def _same(a, b) -> bool:
    """Equal as JSON values: Python's True == 1 and 0 == False do not count (until stop 62 `echo: 0`,
    `best_of: true` and `presence_penalty: false` passed as the values that ask for nothing)."""
    if isinstance(a, bool) or isinstance(b, bool):
        return isinstance(a, bool) and isinstance(b, bool) and a == b
    if _is_number(a) and _is_number(b):
        return a == b
    return type(a) is type(b) and a == b


def _is_text(v) -> bool:
    """A string that is valid Unicode text (JSON can carry lone surrogates, which no tokenizer takes)."""
    if not isinstance(v, str):
        return False
    try:
        v.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _reject_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def parse_json(raw: bytes):
    """Strict JSON: UTF-8, and no NaN / Infinity (Python's json accepts them by default)."""
    return json.loads(raw.decode("utf-8"), parse_constant=_reject_constant)


@dataclass
class CompletionRequest:
    model: str
    prompt: str | list[int]
    max_tokens: int | None = 16  # None (chat, not given): what the context leaves after the prompt
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)  # vLLM's extension: these tokens end it too
    stream: bool = False
    speculative: bool = True
    k: int | None = None  # None: the deployment's k (the most per round under the adaptive policy)
    method: str | None = None  # the proposer: draft_model, ngram or none (None: the deployment's default)
    ignore_eos: bool = False  # vLLM's extension: generate max_tokens whatever the model says
    include_usage: bool = False  # stream_options.include_usage: a last chunk with the usage, as OpenAI's
    continuous_usage: bool = False  # and continuous_usage_stats (vLLM's): every chunk carries the usage so far


# OpenAI request fields this server does not implement, with the values that ask for nothing
UNSUPPORTED = (("top_logprobs", (None, 0), "no log probabilities are returned"),
               ("echo", (None, False), "the prompt is not echoed"),
               ("best_of", (None, 1), "only one completion is made"),
               ("suffix", (None, ""), "no insertion"),
               ("presence_penalty", (None, 0), "no penalties: they would change the target's distribution"),
               ("frequency_penalty", (None, 0), "no penalties: they would change the target's distribution"),
               ("logit_bias", (None, {}), "no logit bias"),
               ("response_format", (None, {"type": "text"}), "text only: no JSON mode or schema"),
               # vLLM's extensions that would change the output (ignoring them would answer something else)
               ("min_tokens", (None, 0), "no minimum length"),
               ("repetition_penalty", (None, 1), "no penalties: they would change the target's distribution"),
               ("length_penalty", (None, 1), "no beam search"),
               ("use_beam_search", (None, False), "no beam search"),
               ("min_p", (None, 0), "no min-p sampling"),
               ("bad_words", (None, []), "no banned words"),
               ("allowed_token_ids", (None, []), "no token restriction"),
               ("include_stop_str_in_output", (None, False), "a stop string is left out of the text"),
               ("skip_special_tokens", (None, True), "special tokens are left out of the text"),
               ("prompt_logprobs", (None, 0), "no log probabilities are returned"),
               ("truncate_prompt_tokens", (None,), "the prompt is not truncated"),
               ("guided_json", (None,), "no guided decoding"),
               ("guided_regex", (None,), "no guided decoding"),
               ("guided_choice", (None,), "no guided decoding"),
               ("guided_grammar", (None,), "no guided decoding"),
               ("structured_outputs", (None,), "no guided decoding"))
# a completion's logprobs is a count, and 0 asks for the chosen tokens' own (see parse_completion); chat's is a
# flag, which 0 leaves off
COMPLETION_UNSUPPORTED = (("logprobs", (None, False), "no log probabilities are returned"),)
# and chat fields: tools and structured output (what does not ask for them is accepted)
CHAT_UNSUPPORTED = (("logprobs", (None, False, 0), "no log probabilities are returned"),
                    ("tools", (None, []), "no tool calls"),
                    ("functions", (None, []), "no function calls"),
                    ("tool_choice", (None, "none", "auto"), "no tool calls"),
                    ("function_call", (None, "none", "auto"), "no function calls"),
                    # vLLM's chat template controls (they would change the prompt)
                    ("chat_template_kwargs", (None, {}), "the chat template takes no arguments"),
                    ("add_generation_prompt", (None, True), "the template always adds the generation prompt"),
                    ("continue_final_message", (None, False), "no continuation of the final message"),
                    ("add_special_tokens", (None, False), "the template's text gets no special tokens added"),
                    ("chat_template", (None,), "the model's own chat template only"))


def parse_completion(body, default_model: str, chat: bool = False) -> CompletionRequest:
    """Validates a /v1/completions body (or, chat, a chat body with its prompt put in); raises
    APIError(400) with the offending param. max_tokens defaults to 16 for completions (OpenAI's
    legacy default) and, for chat, to None: as much as the context leaves."""
    if not isinstance(body, dict):
        raise _bad("the request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise _bad("'model' is required and must be a string", "model", "missing_required_parameter")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        if not prompt:
            raise _bad("'prompt' is empty", "prompt")
        if not _is_text(prompt):
            raise _bad("'prompt' is not valid Unicode text (a lone surrogate?)", "prompt")
    elif isinstance(prompt, list):
        if not prompt:
            raise _bad("'prompt' is empty", "prompt")
        # OpenAI's batch of prompts: a feature not implemented, coded as the others (invalid_value until stop 62)
        if len(prompt) > 1 and all(isinstance(p, (str, list)) for p in prompt):
            raise _bad(f"a batch of {len(prompt)} prompts is not supported: send one request per prompt",
                       "prompt", "unsupported_value")
        if not all(_is_int(t) and t >= 0 for t in prompt):
            raise _bad("'prompt' must be a string or a list of non-negative token ids (one prompt per request)",
                       "prompt")
    elif prompt is None:
        raise _bad("'prompt' is required: a string or a list of token ids", "prompt", "missing_required_parameter")
    else:  # (present but of another type: missing_required_parameter until stop 65)
        raise _bad(f"'prompt' must be a string or a list of token ids, got {_shown(prompt)}", "prompt")
    # a completion's logprobs is a count, and 0 asks for the chosen tokens' own (vLLM gives them; accepted
    # here until stop 60, answered with null); chat's is a flag, which 0 leaves off
    if not chat and _is_number(body.get("logprobs")):  # (0.0 too, as vLLM takes it)
        raise _bad("'logprobs' is not supported (no log probabilities are returned; 0 asks for those of the "
                   "chosen tokens)", "logprobs", "unsupported_value")
    for name, inert, what in (CHAT_UNSUPPORTED if chat else COMPLETION_UNSUPPORTED) + UNSUPPORTED:  # asked for,
        value = body.get(name)  # not done: a clear 400, not a 200 that ignores it (numbers equal as numbers: 1, 1.0)
        if not any(_same(value, x) for x in inert):
            accepted = " or ".join(json.dumps(x) for x in inert if x is not None)
            raise _bad(f"'{name}' is not supported ({what}): it may be absent{' or ' + accepted if accepted else ''}, "
                       f"got {_shown(value)}", name, "unsupported_value")
    if body.get("user") is not None and not isinstance(body["user"], str):  # (ignored, but OpenAI's is a string)
        raise _bad(f"'user' must be a string, got {_shown(body['user'])}", "user")
    req = CompletionRequest(model=model, prompt=prompt)
    default = None if chat else 16
    # max_completion_tokens: OpenAI's newer name, which supersedes max_tokens (as in vLLM and SGLang: a client
    # sending both means the new one); each is checked (until stop 62 one sent beside max_tokens was not read)
    req.max_tokens = _get(body, "max_tokens", default, _is_int, lambda v: v >= 1, "an integer >= 1")
    req.max_tokens = _get(body, "max_completion_tokens", req.max_tokens, _is_int, lambda v: v >= 1, "an integer >= 1")
    req.temperature = float(_get(body, "temperature", 1.0, _is_number, lambda v: v == 0 or v >= MIN_TEMPERATURE,
                                 f"0 (greedy) or a number >= {MIN_TEMPERATURE}"))
    req.top_p = float(_get(body, "top_p", 1.0, _is_number, lambda v: 0 < v <= 1, "a number in (0, 1]"))
    top_k = _get(body, "top_k", 0, _is_int, lambda v: v >= -1, "an integer >= -1 (0 or -1: off)")
    req.top_k = max(top_k, 0)
    seed = _get(body, "seed", None, _is_int, lambda v: SEED_LOW <= v < SEED_HIGH, "a 64-bit integer")
    req.seed = None if seed is None else user_seed(seed)
    req.stream = _get(body, "stream", False, lambda v: isinstance(v, bool), lambda v: True, "a boolean")
    options = body.get("stream_options")
    if options is not None:
        if not req.stream:
            raise _bad("'stream_options' is only allowed with 'stream': true", "stream_options")
        if not isinstance(options, dict) or set(options) - {"include_usage", "continuous_usage_stats"} or \
                not all(isinstance(options.get(key, False), bool) for key in options):
            raise _bad("'stream_options' must be an object with optional booleans 'include_usage' and "
                       "'continuous_usage_stats'", "stream_options")
        req.include_usage = options.get("include_usage", False)
        req.continuous_usage = req.include_usage and options.get("continuous_usage_stats", False)
    req.ignore_eos = _get(body, "ignore_eos", False, lambda v: isinstance(v, bool), lambda v: True, "a boolean")
    n = _get(body, "n", 1, _is_int, lambda v: True, "an integer")
    if n != 1:
        raise _bad("only n = 1 is supported", "n", "unsupported_value")
    stop = body.get("stop")
    if stop is None:
        req.stop = []
    elif _is_text(stop):
        req.stop = [stop] if stop else []
    elif isinstance(stop, list) and all(_is_text(s) for s in stop) and len(stop) <= MAX_STOP_STRINGS:
        req.stop = [s for s in stop if s]
    else:
        raise _bad(f"'stop' must be a string or a list of at most {MAX_STOP_STRINGS} strings", "stop")
    if any(len(s) > MAX_STOP_CHARS for s in req.stop):
        raise _bad(f"each 'stop' string must be at most {MAX_STOP_CHARS} characters", "stop")
    req.stop_token_ids = _get(body, "stop_token_ids", [], lambda v: isinstance(v, list),
                              lambda v: len(v) <= MAX_STOP_TOKEN_IDS and all(_is_int(t) and t >= 0 for t in v),
                              f"a list of at most {MAX_STOP_TOKEN_IDS} token ids")
    spec = body.get("speculative")
    if spec is not None:
        if not isinstance(spec, dict) or set(spec) - {"enabled", "k", "method"}:
            raise _bad("'speculative' must be an object with optional 'enabled' (bool), 'k' (int) and 'method' "
                       f"(one of {SPECULATIVE_METHODS})", "speculative")
        enabled = spec.get("enabled", True)
        if not isinstance(enabled, bool):
            raise _bad("'speculative.enabled' must be a boolean", "speculative.enabled")
        req.speculative = enabled
        k = spec.get("k")
        if k is not None and not (_is_int(k) and 0 <= k <= MAX_K):
            raise _bad(f"'speculative.k' must be an integer in [0, {MAX_K}]", "speculative.k")
        req.k = k
        method = spec.get("method")
        if method is not None and method not in SPECULATIVE_METHODS:
            raise _bad(f"'speculative.method' must be one of {SPECULATIVE_METHODS}", "speculative.method")
        if method == "none" and spec.get("enabled") is True:  # (accepted, and run without speculation, until stop 64)
            raise _bad("'speculative.method' \"none\" turns speculation off, against 'speculative.enabled': true; "
                       "send one of them", "speculative.method")
        if method == "none":
            req.speculative = False
        # no proposer runs without speculation: its method is not checked against the deployment's
        req.method = method if req.speculative else None
    return req


def _get(body: dict, name: str, default, type_ok, value_ok, what: str):
    v = body.get(name)
    if v is None:
        return default
    if not type_ok(v) or not value_ok(v):
        raise _bad(f"'{name}' must be {what}, got {v!r}", name)
    return v


CHAT_ROLES = ("system", "developer", "user", "assistant")  # OpenAI's, but for the tools' own
TOOL_ROLES = ("tool", "function")


def chat_prompt(body, tokenizer) -> str:
    """The prompt text of a /v1/chat/completions body, through the tokenizer's chat template."""
    if not getattr(tokenizer, "chat_template", None):
        raise APIError(400, "this model has no chat template; use /v1/completions", code="chat_template_missing")
    messages = body.get("messages") if isinstance(body, dict) else None
    if isinstance(messages, list):  # a tool-calling conversation (until stop 62 told only the shape expected)
        for i, m in enumerate(messages):
            if isinstance(m, dict) and (m.get("tool_calls") or m.get("function_call") or m.get("role") in TOOL_ROLES):
                raise _bad(f"messages[{i}]: tool and function calls are not supported (no tool calls)",
                           "messages", "unsupported_value")
            if isinstance(m, dict) and _is_text(m.get("role")) and m["role"] not in CHAT_ROLES:
                # (until stop 63 any role reached the template, which printed it as it was)
                raise _bad(f"messages[{i}].role must be one of {', '.join(CHAT_ROLES)}, got {m['role']!r}", "messages")
    if not isinstance(messages, list) or not messages or not all(
            isinstance(m, dict) and _is_text(m.get("role")) and (_is_text(m.get("content"))
                                                                 or isinstance(m.get("content"), list))
            for m in messages):
        raise _bad("'messages' must be a non-empty list of {role, content} objects, content a string or a list of "
                   "text parts", "messages")
    messages = [{**m, "content": _text_of(m["content"])} for m in messages]
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except Exception as e:  # the template's own checks (roles must alternate, ...): the request's fault
        raise _bad(f"the chat template refused these messages: {e}", "messages") from None


class Detokenizer:
    """Turns a growing list of token ids into text deltas, in O(new tokens) per call.

    Each call decodes only a window: the tokens added since the previous call plus the ones
    added in the call before, as context (so BPE merges and multi-byte characters come out as a
    one-shot decode gives them). Text that ends in '\ufffd' is held until a later token's text
    follows it (an incomplete UTF-8 character decodes as '\ufffd' until the token that completes
    it; bytes that are not UTF-8 are '\ufffd' for good, held all the same, as nothing tells them
    apart). A tail that could still become a stop string is held back too, and searching for
    stop strings looks only at unsent text. The concatenated deltas (plus `flush()`) equal the
    final text, and a stop string is never emitted.

    `prompt_ids`: the first window's context is the prompt's last CONTEXT tokens, as vLLM's is. A
    SentencePiece tokenizer (Llama 2, Mistral) strips the leading space of a decode's first
    word, so without it "The capital of France is" went on "Paris" (found by review in stop 50).

    `stop_ids`: a stop token id ends the text, and its own text is left out, as vLLM leaves it
    out (the token is generated, and counted in the usage).
    """

    CONTEXT = 5

    def __init__(self, tokenizer, stop: list[str], prompt_ids: list[int] = (), stop_ids=()):
        self.tokenizer = tokenizer
        self.stop = stop
        self.stop_ids = set(stop_ids)
        self.ended = False  # a stop token id came (nothing after it is text)
        self.context = min(len(prompt_ids), self.CONTEXT)
        self.ids: list[int] = list(prompt_ids[len(prompt_ids) - self.context:])  # context, then the output
        self.prefix_offset = 0  # the decode window starts here
        self.read_offset = self.context  # tokens before this are in self.text (or are the context)
        self.text = ""  # the text so far (cut at a stop string)
        self.sent = 0  # characters of text already emitted
        self.stopped = False
        self.stopped_at = 0  # once stopped: len(ids) when it stopped

    def add(self, token_ids: list[int]) -> str:
        """New delta after token_ids; sets .stopped when a stop string appears."""
        if self.ended:
            token_ids = []
        for i, t in enumerate(token_ids if self.stop_ids else ()):
            if t in self.stop_ids:
                token_ids, self.ended = token_ids[:i], True
                break
        self.ids.extend(token_ids)
        if not self.stopped:
            self._decode(final=False)
        return self._delta(final=False)

    def tokens_used(self) -> int:
        """The tokens the text needed: all of them, or once stopped, the fewest whose text holds
        the stop string (usage counts those, however the rounds split the tokens and whatever
        they wrote after it). A binary search: once in the text, a stop string stays there.

        A prefix's text is searched without its trailing '\ufffd's, as the text is built (`_decode`
        holds them: see the class). Until stop 60 a stop string holding '\ufffd' matched the
        transient '\ufffd' of an incomplete character: the pair cut a request
        at the first byte of a two-byte character, so the answer lost the character its stream
        showed, and the stream's usage left out the tokens its text needed."""
        if not self.stopped:
            return len(self.ids) - self.context + self.ended
        decode = self.tokenizer.decode
        context = len(decode(self.ids[:self.context], skip_special_tokens=True))
        lo, hi = self.context, self.stopped_at  # (the text of ids[:lo] lacks it; that of ids[:hi] holds it)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            text = decode(self.ids[:mid], skip_special_tokens=True)[context:].rstrip("\ufffd")
            lo, hi = (lo, mid) if any(s in text for s in self.stop) else (mid, hi)
        return hi - self.context

    def flush(self) -> str:
        """At the end: whatever was held back (a trailing partial stop string is real text)."""
        if not self.stopped:
            self._decode(final=True)
        return self._delta(final=True)

    def _decode(self, final: bool) -> None:
        decode = self.tokenizer.decode
        prefix = decode(self.ids[self.prefix_offset:self.read_offset], skip_special_tokens=True)
        window = decode(self.ids[self.prefix_offset:], skip_special_tokens=True)
        if len(window) > len(prefix) and (final or not window.endswith("\ufffd")):
            self.text += window[len(prefix):]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)

    def _delta(self, final: bool) -> str:
        text = self.text
        # the stop string that ends first (of those ending together, the one that starts first): the one
        # token-by-token decoding meets first, however the rounds grouped the tokens (until stop 52 the
        # first in the list that the text held, so overlapping stop strings cut a speculative round's text,
        # or a paced stream's, elsewhere than plain decoding's, and usage counted another one's tokens)
        found = [(i + len(s), i) for s in self.stop if (i := text.find(s, max(0, self.sent - len(s)))) != -1]
        if found:
            text = text[:min(found)[1]]
            if not self.stopped:
                self.stopped_at = len(self.ids)
            self.stopped = True
        self.text = text
        end = len(text)
        if not self.stopped and not final:
            for s in self.stop:  # hold back a tail that is a prefix of a stop string
                for n in range(min(len(s) - 1, end - self.sent), 0, -1):
                    if text[end - n:end] == s[:n]:
                        end -= n
                        break
        delta = text[self.sent:max(end, self.sent)]
        self.sent += len(delta)
        return delta


def _text_of(content) -> str:
    """A message's content: a string, or a list of parts of which only text ones are supported,
    joined by newlines, as vLLM joins them (until stop 50 with nothing between: "Hello", "world"
    was "Helloworld")."""
    if isinstance(content, str):
        return content
    if not all(isinstance(p, dict) and p.get("type") == "text" and _is_text(p.get("text")) for p in content):
        raise _bad("only text content parts ({'type': 'text', 'text': ...}) are supported", "messages",
                   "unsupported_value")
    return "\n".join(p["text"] for p in content)


def prompt_token_ids(tokenizer, prompt: str | list[int], chat: bool) -> list[int]:
    """A prompt's token ids. A chat prompt, the chat template's text, already has whatever
    special tokens the template puts in (a BOS, most often): the tokenizer adds none of its own."""
    if not isinstance(prompt, str):
        return prompt
    return tokenizer(prompt, add_special_tokens=not chat)["input_ids"]


def completion_id(chat: bool = False) -> str:
    return f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"


def role_chunk(cid: str, model: str) -> dict:
    """A streamed chat's first chunk, as OpenAI's: the assistant's role, no content yet."""
    chunk = completion_chunk(cid, model, "", None, chat=True)
    chunk["choices"][0]["delta"] = {"role": "assistant", "content": ""}
    return chunk


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def usage_chunk(cid: str, model: str, usage: dict, chat: bool) -> dict:
    """The last chunk of a stream with stream_options.include_usage: no choices, the usage."""
    chunk = completion_chunk(cid, model, "", None, chat)
    chunk["choices"], chunk["usage"] = [], usage
    return chunk


def completion_chunk(cid: str, model: str, text: str, finish_reason: str | None, chat: bool = False) -> dict:
    if chat:
        delta = {"content": text} if text else {}
        return {"id": cid, "object": "chat.completion.chunk", "created": int(time.time()), "model": model,
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason}]}
    return {"id": cid, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}]}


def completion_response(cid: str, model: str, text: str, finish_reason: str, usage: dict, speculative: dict,
                        chat: bool = False) -> dict:
    if chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish_reason}
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        obj = "text_completion"
    return {"id": cid, "object": obj, "created": int(time.time()), "model": model, "choices": [choice],
            "usage": usage, "speculative": speculative}


def speculative_block(enabled: bool, k: int, stats: dict, method: str | None = None) -> dict:
    """This request's speculation figures, in vLLM's metric names, plus the proposer (method),
    its drafted rounds by proposer (the n-gram one stands in while a drafter is down) and the
    rounds by the k the policy chose."""
    return {"enabled": enabled, "method": method if enabled else "none", "k": k,
            "rounds_by_k": stats.get("rounds_by_k", []), "drafts_by_method": stats.get("drafts_by_method", {}),
            "num_drafts": stats.get("num_drafts", 0),
            "num_draft_tokens": stats.get("num_draft_tokens", 0),
            "num_accepted_tokens": stats.get("num_accepted_tokens", 0),
            "acceptance_rate": stats.get("acceptance_rate", 0.0),
            "mean_acceptance_length": stats.get("mean_acceptance_length", 1.0),
            "num_pipeline_hits": stats.get("num_pipeline_hits", 0)}
