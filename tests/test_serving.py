"""The HTTP endpoint, live on Ray Serve, driven by the official `openai` client."""

import asyncio
import json
import os
import re
import time

import httpx
import openai
import pytest
from conftest import free_port
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

MODEL = "specserve-test"


@pytest.fixture(scope="module")
def server(ray_session, tiny_pair_dir):
    from ray import serve

    from specserve.cluster.serve_app import build_app
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    args = {"model": MODEL, "target": tiny_pair_dir["target"], "drafter": tiny_pair_dir["drafter"], "k": 3,
            "max_num_seqs": 4, "max_waiting": 32, "cpus_per_actor": 1}
    serve.run(build_app(args), name="specserve", route_prefix="/")
    yield f"http://127.0.0.1:{port}"
    serve.delete("specserve")


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0, timeout=60)


def metric(server, name, labels=""):
    text = httpx.get(server + "/metrics", timeout=30).text
    m = re.search(rf"^{re.escape(name)}{re.escape(labels)} (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def test_completion_and_stream_agree(client):
    prompt = "def fibonacci(n):"
    full = client.completions.create(model=MODEL, prompt=prompt, max_tokens=40, temperature=0)
    assert full.choices[0].finish_reason in ("length", "stop") and full.usage.completion_tokens <= 40
    assert full.usage.prompt_tokens > 0
    spec = full.model_extra["speculative"]
    assert spec["enabled"] and spec["num_draft_tokens"] > 0
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=40, temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == full.choices[0].text
    assert chunks[-1].choices[0].finish_reason == full.choices[0].finish_reason
    plain = client.completions.create(model=MODEL, prompt=prompt, max_tokens=40, temperature=0,
                                      extra_body={"speculative": {"enabled": False}})
    assert plain.choices[0].text == full.choices[0].text
    assert plain.model_extra["speculative"]["num_draft_tokens"] == 0


def test_a_colocated_app_serves_the_same_text(server, client, tiny_pair_dir):
    """`colocate: true`: each replica loads the drafter itself (no drafter actor): the same
    greedy text as the pair of the main app, with drafts made, through the openai client. Fixed k:
    in process nothing hides the drafting, and on CI's 2-core machine (stop 31) the adaptive policy
    drafted no token for the tiny pair there; this test is about the colocated drafts, not the policy."""
    from ray import serve

    from specserve.cluster.serve_app import build_app
    args = {"model": MODEL, "target": tiny_pair_dir["target"], "drafter": tiny_pair_dir["drafter"], "k": 3,
            "speculation": "fixed", "max_num_seqs": 2, "cpus_per_actor": 1, "colocate": True}
    serve.run(build_app(args), name="colocated", route_prefix="/colocated")
    try:
        colocated = openai.OpenAI(base_url=server + "/colocated/v1", api_key="unused", max_retries=0, timeout=60)
        for prompt in ("def fibonacci(n):", "import os\n"):
            got = colocated.completions.create(model=MODEL, prompt=prompt, max_tokens=32, temperature=0)
            want = client.completions.create(model=MODEL, prompt=prompt, max_tokens=32, temperature=0)
            assert got.choices[0].text == want.choices[0].text
            assert got.model_extra["speculative"]["num_draft_tokens"] > 0
        info = httpx.get(server + "/colocated/health", timeout=30)
        assert info.status_code == 200
    finally:
        serve.delete("colocated")


def test_token_id_prompt_and_seeded_sampling(client):
    a = client.completions.create(model=MODEL, prompt=[5, 6, 7], max_tokens=12, temperature=0.8, seed=3)
    b = client.completions.create(model=MODEL, prompt=[5, 6, 7], max_tokens=12, temperature=0.8, seed=3)
    assert a.choices[0].text == b.choices[0].text


def test_stop_strings_in_both_modes(server, client):
    """The pair ends a request at its stop string (PairReplica.generate watches for it), so the
    response and /metrics still get the request's speculation figures (until stop 48 the ingress
    cut such a request off and they were lost)."""
    base = client.completions.create(model=MODEL, prompt="x = ", max_tokens=30, temperature=0).choices[0].text
    at = next(i for i in range(4, len(base) - 1) if base[i:i + 2].isascii())  # (the tiny model writes bytes that
    stop = base[at:at + 2]  # are no text: a stop string across them may have no first token to end at)
    rounds = metric(server, "specserve_spec_decode_chosen_k_count")
    full = client.completions.create(model=MODEL, prompt="x = ", max_tokens=30, temperature=0, stop=[stop])
    assert full.choices[0].text == base[:base.index(stop)] and full.choices[0].finish_reason == "stop"
    spec = full.model_extra["speculative"]  # (the policy may not draft this early: its rounds by k are there)
    assert spec["enabled"] and sum(spec["rounds_by_k"]) > 0 and 0 < full.usage.completion_tokens < 30
    assert metric(server, "specserve_spec_decode_chosen_k_count") - rounds == sum(spec["rounds_by_k"])
    chunks = list(client.completions.create(model=MODEL, prompt="x = ", max_tokens=30, temperature=0, stop=stop,
                                            stream=True, stream_options={"include_usage": True}))
    *chunks, usage = chunks
    assert "".join(c.choices[0].text for c in chunks) == full.choices[0].text
    last = chunks[-1].model_extra
    assert chunks[-1].choices[0].finish_reason == "stop" and sum(last["speculative"]["rounds_by_k"]) > 0
    assert usage.choices == [] and usage.usage.completion_tokens == full.usage.completion_tokens
    # the round that completes the stop string is the request's last: plain, a token a round, the
    # rounds are the tokens through the stop string, streamed or not
    for stream in (False, True):
        r = client.completions.create(model=MODEL, prompt="x = ", max_tokens=30, temperature=0, stop=stop,
                                      stream=stream, extra_body={"speculative": {"enabled": False}},
                                      **({"stream_options": {"include_usage": True}} if stream else {}))
        if stream:
            *_, r, last = r
            usage = last.usage
        else:
            usage = r.usage
        assert sum(r.model_extra["speculative"]["rounds_by_k"]) == usage.completion_tokens == \
            full.usage.completion_tokens, stream


def test_stop_token_ids_end_a_request(client, tiny_pair_dir):
    """vLLM's stop_token_ids: the engine had them, and the API dropped them (a 200 that ran on)."""
    from specserve.core.runner import ModelRunner, load_tokenizer
    from specserve.core.sampling import SamplingParams
    from specserve.verifier.engine import SpeculativeEngine
    ids = SpeculativeEngine(ModelRunner.from_pretrained(tiny_pair_dir["target"]), None).generate(
        [5, 6, 7], 30, SamplingParams(), 0).token_ids  # what the server writes, greedy
    at = next(i for i in range(3, 30) if ids[i] not in ids[:i])
    for stream in (False, True):
        r = client.completions.create(model=MODEL, prompt=[5, 6, 7], max_tokens=30, temperature=0, stream=stream,
                                      extra_body={"ignore_eos": True, "stop_token_ids": [ids[at]]},
                                      **({"stream_options": {"include_usage": True}} if stream else {}))
        if stream:
            *chunks, last = r
            text, usage, finish = "".join(c.choices[0].text for c in chunks), last.usage, chunks[-1].choices[0].finish_reason
        else:
            text, usage, finish = r.choices[0].text, r.usage, r.choices[0].finish_reason
        assert finish == "stop" and usage.completion_tokens == at + 1, stream  # (the stop token counts, and
        assert text == load_tokenizer(tiny_pair_dir["target"]).decode(ids[:at], skip_special_tokens=True)  # is no text, as vLLM's)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="x", max_tokens=3, extra_body={"stop_token_ids": [10 ** 9]})
    assert e.value.body["param"] == "stop_token_ids"


def test_continuous_usage_stats_put_the_usage_so_far_in_every_chunk(server, client):
    """vLLM's stream_options.continuous_usage_stats (with include_usage): every chunk carries the
    usage so far, growing to the final count (until stop 49 it was accepted and ignored)."""
    for chat in (False, True):
        kwargs = dict(model=MODEL, max_tokens=20, temperature=0, stream=True, extra_body={"ignore_eos": True},
                      stream_options={"include_usage": True, "continuous_usage_stats": True})
        chunks = list(client.chat.completions.create(messages=[{"role": "user", "content": "hi"}], **kwargs)
                      if chat else client.completions.create(prompt="x = ", **kwargs))
        *chunks, last = chunks
        counts = [c.usage.completion_tokens for c in chunks]
        assert all(c.usage is not None and c.usage.prompt_tokens == last.usage.prompt_tokens for c in chunks)
        assert counts == sorted(counts) and counts[-1] == last.usage.completion_tokens == 20, (chat, counts)
        assert all(c.usage.total_tokens == c.usage.prompt_tokens + c.usage.completion_tokens for c in chunks)
    plain = list(client.completions.create(model=MODEL, prompt="x = ", max_tokens=5, temperature=0, stream=True,
                                           stream_options={"include_usage": True}))
    assert all(c.usage is None for c in plain[:-1])  # without it, only the last chunk


def test_a_non_streamed_request_times_its_rounds(server, client):
    """A non-streamed request comes in one message, with the times of its rounds: its time to
    first token is its first round's, not the whole request's, and its later rounds are ITL."""
    names = ("specserve_time_to_first_token_seconds_sum", "specserve_e2e_request_latency_seconds_sum",
             "specserve_inter_token_latency_seconds_count")
    before = {n: metric(server, n) for n in names}
    r = client.completions.create(model=MODEL, prompt="def g(x):", max_tokens=30, temperature=0,
                                  extra_body={"ignore_eos": True, "speculative": {"enabled": False}})
    after = {n: metric(server, n) for n in names}
    ttft, e2e = (after[n] - before[n] for n in names[:2])
    assert r.usage.completion_tokens == 30
    assert after[names[2]] - before[names[2]] == 29  # plain: a round per token, the first one is TTFT
    assert 0 < ttft < e2e


@pytest.mark.parametrize("kwargs,param", [
    (dict(max_tokens=0), "max_tokens"), (dict(max_tokens=-3), "max_tokens"), (dict(temperature=-1), "temperature"),
    (dict(top_p=1.5), "top_p"), (dict(top_p=0), "top_p"), (dict(n=2), "n"), (dict(prompt=""), "prompt"),
    (dict(prompt="word " * 2000), "prompt"), (dict(extra_body={"speculative": {"k": 99}}), "speculative.k"),
])
def test_bad_input_is_a_400_with_our_message(client, kwargs, param):
    args = dict(model=MODEL, prompt="hello", max_tokens=5)
    args.update(kwargs)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(**args)
    body = e.value.body
    assert body["type"] == "invalid_request_error" and body["message"]
    if param != "prompt":
        assert body["param"] == param


def test_unknown_model(client):
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.completions.create(model="nope", prompt="hi", max_tokens=3)
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("nope")


def test_chat_as_openai_s(client):
    """The tiny pair's chat template: without max_tokens a reply runs to the end of the context
    (not 16 tokens); a stream starts with the assistant's role and equals the reply; content as
    text parts is the same prompt; usage comes in a last chunk only when asked for."""
    messages = [{"role": "user", "content": "def f(x):"}]
    full = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, extra_body={"ignore_eos": True})
    assert full.id.startswith("chatcmpl-") and full.choices[0].message.role == "assistant"
    assert full.usage.prompt_tokens + full.usage.completion_tokens == 512  # the tiny target's context
    assert full.choices[0].finish_reason == "length"
    short = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=20)
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=20,
                                                 stream=True))
    assert chunks[0].choices[0].delta.role == "assistant" and all(c.usage is None for c in chunks)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == short.choices[0].message.content
    parts = [{"role": "user", "content": [{"type": "text", "text": "def f(x):"}]}]
    with_usage = list(client.chat.completions.create(model=MODEL, messages=parts, temperature=0, max_tokens=20,
                                                     stream=True, stream_options={"include_usage": True}))
    assert with_usage[-1].choices == [] and with_usage[-1].usage.completion_tokens == short.usage.completion_tokens
    assert "".join(c.choices[0].delta.content or "" for c in with_usage[:-1]) == short.choices[0].message.content
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=messages, max_tokens=5,
                                       tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}])
    assert e.value.body["code"] == "unsupported_value"


def test_models_health_and_bad_json(server):
    assert httpx.get(server + "/health").json() == {"status": "ok"}
    assert httpx.get(server + "/v1/models").json()["data"][0]["id"] == MODEL
    r = httpx.post(server + "/v1/completions", content=b"{not json")
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    # nested past Python's recursion limit: RecursionError, not ValueError (a 500 until stop 47)
    r = httpx.post(server + "/v1/completions", content=b'{"stop": ' + b"[" * 100_000 + b"}")
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    # a body past 16 MiB is refused, with or without its length up front (stop 51: read whole, parsed on
    # the one event loop every stream of the ingress shares)
    big = b'{"model": "m", "prompt": "' + b"x" * (17 << 20) + b'"}'
    for content in (big, iter([big[i:i + (1 << 20)] for i in range(0, len(big), 1 << 20)])):
        r = httpx.post(server + "/v1/completions", content=content, timeout=60)
        assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"
        assert r.json()["error"]["type"] == "invalid_request_error"  # (the client's to mend: server_error until stop 60)
    # a long prompt (1 MB, tokenized off the loop) is the context's 400, as a short one
    r = httpx.post(server + "/v1/completions", json={"model": MODEL, "prompt": "word " * 200_000, "max_tokens": 2},
                   timeout=60)
    assert r.status_code == 400 and "exceeds the context" in r.json()["error"]["message"]
    # the pair's refusal names the field at fault as the request named it (until stop 52 every 400 from
    # the pair said "prompt", and no code): a chat request's prompt is its messages
    assert {k: r.json()["error"][k] for k in ("param", "code")} == {"param": "prompt", "code": "context_length_exceeded"}
    r = httpx.post(server + "/v1/chat/completions", json={"model": MODEL, "max_tokens": 600,
                                                          "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 400 and (r.json()["error"]["param"], r.json()["error"]["code"]) == \
        ("messages", "context_length_exceeded")
    # token ids past the vocabulary: the field and a code (no code until stop 61)
    for body, param in (({"prompt": [1, 10 ** 6]}, "prompt"), ({"prompt": "x", "stop_token_ids": [10 ** 6]}, "stop_token_ids")):
        r = httpx.post(server + "/v1/completions", json={"model": MODEL, "max_tokens": 2, **body})
        assert r.status_code == 400 and "must be below" in r.json()["error"]["message"]
        assert (r.json()["error"]["param"], r.json()["error"]["code"]) == (param, "invalid_value")


def test_16_concurrent_streams_equal_solo(server, client):
    """16 speculative streams at once (4 slots: batches and a queue) write plain decoding's text, one
    request at a time (until stop 51 the reference was speculative too)."""
    prompts = [f"def f{i}(x):" for i in range(16)]
    solo = [client.completions.create(model=MODEL, prompt=p, max_tokens=24, temperature=0,
                                      extra_body={"speculative": {"enabled": False}}).choices[0].text
            for p in prompts]

    async def one(ac, p):
        text = ""
        async with ac.stream("POST", server + "/v1/completions", json={
                "model": MODEL, "prompt": p, "max_tokens": 24, "temperature": 0, "stream": True}) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    text += json.loads(line[6:])["choices"][0]["text"]
        return text

    async def all_():
        async with httpx.AsyncClient(timeout=120) as ac:
            return await asyncio.gather(*(one(ac, p) for p in prompts))

    assert asyncio.run(all_()) == solo


def test_a_burst_of_what_the_app_admits_gets_in_and_health_beside_it(server):
    """36 requests at once, all the app admits (max_num_seqs 4 + max_waiting 32), and a /health
    call with them: every one answered 200. Until stop 57 each caller's Serve queue (the proxy's,
    the ingress's handle) held 16 requests waiting for their replica to be picked, and a burst had
    some dropped by the proxy with a plain-text 503 ("Request dropped due to backpressure"): 6-12 of
    41 at the default config, /health among them in a soak run."""
    async def burst():
        body = {"model": MODEL, "prompt": "a", "max_tokens": 2, "temperature": 0}
        async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=64)) as ac:
            return await asyncio.gather(*[ac.post(server + "/v1/completions", json=body) for _ in range(36)],
                                        ac.get(server + "/health"))

    answers = asyncio.run(burst())
    assert [r.status_code for r in answers] == [200] * 37, {r.text[:120] for r in answers if r.status_code != 200}
    assert answers[-1].json()["status"] in ("ok", "degraded")


def test_a_burst_past_what_the_app_admits_is_answered_in_the_api_s_shape(server):
    """240 requests at once, against 36 the app admits: each is answered 200 or the engine's
    OpenAI-style 503 with Retry-After, and each 503 is counted in /metrics. Until stop 59 the
    ingress took only what the app admits (plus headroom) and Serve's proxy dropped the rest of a
    larger burst with a plain-text 503, "Request dropped due to backpressure", that no counter saw
    (40 of a burst of 300 at the default config in a user trial)."""
    failed = metric(server, "specserve_request_failures_total", '{status="503"}')

    async def burst():
        body = {"model": MODEL, "prompt": "a", "max_tokens": 2, "temperature": 0}
        async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=None)) as ac:
            return await asyncio.gather(*[ac.post(server + "/v1/completions", json=body) for _ in range(240)])

    answers = asyncio.run(burst())
    plain = {r.text[:120] for r in answers if not r.headers.get("content-type", "").startswith("application/json")}
    assert not plain, plain
    refused = [r for r in answers if r.status_code != 200]
    assert {r.status_code for r in refused} <= {503} and all(r.headers.get("retry-after") for r in refused)
    assert all(r.json()["error"]["message"] for r in refused) and len(refused) < 240
    assert metric(server, "specserve_request_failures_total", '{status="503"}') == failed + len(refused)


def test_disconnect_frees_the_sequence(server):
    cancelled = metric(server, "specserve_request_failures_total", '{status="cancelled"}')
    with httpx.Client(timeout=60) as c:
        with c.stream("POST", server + "/v1/completions", json={
                "model": MODEL, "prompt": "a", "max_tokens": 480, "temperature": 0.9, "stream": True,
                "ignore_eos": True}) as r:
            lines = r.iter_lines()  # kept referenced until the `with` closes the connection
            while not next(lines).startswith("data: "):
                pass
            assert metric(server, "specserve_num_requests_running") >= 1
    deadline = time.monotonic() + 5
    while metric(server, "specserve_num_requests_running") != 0:
        assert time.monotonic() < deadline, "the dropped stream's sequence is still running"
        time.sleep(0.2)
    # and it is counted: a failure, "cancelled" (until stop 49 no counter saw a request that did not finish)
    assert metric(server, "specserve_request_failures_total", '{status="cancelled"}') == cancelled + 1
    assert metric(server, "specserve_pairs_reporting") >= 1


def test_a_client_that_leaves_a_completion_cancels_it(server):
    """A non-streamed completion whose client closes the connection is cancelled, its sequence
    freed and counted as "cancelled", as a dropped stream's is. The request is sent as HTTP
    clients send it, the body in a TCP segment after the headers': through Ray Serve's HAProxy
    with its `option splice-request`, HAProxy never passed such a client's close on, the
    completion ran to its end and HAProxy spun on the closed socket (stop 65, found with the
    `openai` client's timeout; `cluster.pair.haproxy_without_splice` runs it without splicing)."""
    import socket
    from urllib.parse import urlsplit
    cancelled = metric(server, "specserve_request_failures_total", '{status="cancelled"}')
    finished = metric(server, "specserve_requests_total", '{finish_reason="length"}')
    body = json.dumps({"model": MODEL, "prompt": "a", "max_tokens": 480, "temperature": 0.9, "ignore_eos": True,
                       "speculative": {"method": "none"}}).encode()
    url = urlsplit(server)
    with socket.create_connection((url.hostname, url.port), timeout=30) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n" % len(body))
        time.sleep(0.05)
        s.sendall(body)
        deadline = time.monotonic() + 10
        while metric(server, "specserve_num_requests_running") < 1:
            assert time.monotonic() < deadline, "the request never ran"
            time.sleep(0.02)
    deadline = time.monotonic() + 10
    while metric(server, "specserve_num_requests_running") != 0:
        assert time.monotonic() < deadline, "the abandoned completion is still running"
        time.sleep(0.2)
    assert metric(server, "specserve_request_failures_total", '{status="cancelled"}') == cancelled + 1
    assert metric(server, "specserve_requests_total", '{finish_reason="length"}') == finished
    if os.environ.get("RAY_SERVE_ENABLE_HA_PROXY") == "1":  # (this ran through HAProxy, and it runs without splicing)
        import psutil
        port = urlsplit(server).port
        entry = [psutil.Process(c.pid) for c in psutil.net_connections("tcp")
                 if c.status == psutil.CONN_LISTEN and c.laddr.port == port and c.pid]
        assert entry and entry[0].name() == "haproxy" and "-dS" in entry[0].cmdline(), entry


def test_unknown_paths_and_wrong_methods_have_the_openai_error_shape(server):
    import httpx
    missing = httpx.get(server + "/v1/nothing", timeout=30)
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"
    for path in ("/docs", "/redoc", "/openapi.json"):  # (FastAPI's own: answered until stop 65)
        assert httpx.get(server + path, timeout=30).json()["error"]["code"] == "not_found"
    wrong = httpx.get(server + "/v1/completions", timeout=30)  # (its code was null until stop 63)
    assert wrong.status_code == 405 and wrong.json()["error"]["code"] == "method_not_allowed"
    assert set(wrong.json()["error"]) == {"message", "type", "param", "code"}


def test_failed_requests_are_counted_by_status(server, client):
    import openai
    before = {s: metric(server, "specserve_request_failures_total", f'{{status="{s}"}}') for s in ("400", "404")}
    finished = metric(server, "specserve_requests_total", '{finish_reason="length"}')
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="x", max_tokens=2)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="x", max_tokens=2, temperature=-1)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=0)
    with pytest.raises(openai.NotFoundError):  # the unknown model before the body's other checks (until stop 59
        client.chat.completions.create(model="nope", messages=[])  # the messages' 400, or no chat template's)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="x", max_tokens=0)
    assert metric(server, "specserve_request_failures_total", '{status="404"}') == before["404"] + 3
    assert metric(server, "specserve_request_failures_total", '{status="400"}') == before["400"] + 2
    assert metric(server, "specserve_requests_total", '{finish_reason="length"}') == finished  # and not finished


def test_metrics_follow_usage(server, client):
    before = {n: metric(server, n) for n in ("specserve_generation_tokens_total", "specserve_prompt_tokens_total",
                                             "specserve_spec_decode_num_draft_tokens_total",
                                             "specserve_spec_decode_num_accepted_tokens_total")}
    gen = prompt = drafted = accepted = 0
    for i in range(3):
        r = client.completions.create(model=MODEL, prompt=f"import os{i}", max_tokens=10, temperature=0)
        gen += r.usage.completion_tokens
        prompt += r.usage.prompt_tokens
        drafted += r.model_extra["speculative"]["num_draft_tokens"]
        accepted += r.model_extra["speculative"]["num_accepted_tokens"]
    assert metric(server, "specserve_generation_tokens_total") - before["specserve_generation_tokens_total"] == gen
    assert metric(server, "specserve_prompt_tokens_total") - before["specserve_prompt_tokens_total"] == prompt
    assert (metric(server, "specserve_spec_decode_num_draft_tokens_total")
            - before["specserve_spec_decode_num_draft_tokens_total"]) == drafted
    assert (metric(server, "specserve_spec_decode_num_accepted_tokens_total")
            - before["specserve_spec_decode_num_accepted_tokens_total"]) == accepted
    assert metric(server, "specserve_e2e_request_latency_seconds_count") >= 3


def test_the_speculation_policy_state_in_metrics(server, client):
    """/metrics shows, summed over the app's pairs (one here), whether a pair's policy drafts
    now, its guard's vetoes so far, whether one holds now and the times it kept speculation on
    (`SpeculationPolicy.gauges`)."""
    client.completions.create(model=MODEL, prompt="import sys", max_tokens=8, temperature=0)
    text = httpx.get(server + "/metrics", timeout=30).text
    for name in ("specserve_spec_decode_policy_speculating", "specserve_spec_decode_guard_vetoes",
                 "specserve_spec_decode_guard_holds", "specserve_spec_decode_guard_keepings",
                 "specserve_spec_decode_unprepared_rounds"):
        assert re.search(rf"^{name} ", text, re.M), name
    assert metric(server, "specserve_spec_decode_policy_speculating") in (0.0, 1.0)
    assert metric(server, "specserve_spec_decode_guard_holds") in (0.0, 1.0)
    for name in ("specserve_spec_decode_guard_vetoes", "specserve_spec_decode_guard_keepings",
                 "specserve_spec_decode_unprepared_rounds"):
        count = metric(server, name)
        assert count >= 0 and count == int(count), name


def test_per_request_proposer_and_the_chosen_k_in_metrics(server, client):
    """`speculative.method` picks the proposer per request: ngram (prompt lookup) and none give
    the same greedy text as the drafter; the k chosen per round reaches the response and /metrics."""
    prompt = "for i in range(10):\n    print(i)\nfor i in range(10):\n    print(i)\nfor i in range(10):\n"
    rounds_before = metric(server, "specserve_spec_decode_chosen_k_count")
    texts = {}
    for method in ("draft_model", "ngram", "none"):
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0,
                                      extra_body={"speculative": {"method": method}})
        spec = r.model_extra["speculative"]
        assert spec["method"] == method and spec["enabled"] == (method != "none")
        if method == "none":
            assert spec["num_drafts"] == 0 and not any(spec["rounds_by_k"][1:])
        assert set(spec["drafts_by_method"]) <= ({method} if method != "none" else set())
        texts[method] = r.choices[0].text
        rounds = sum(spec["rounds_by_k"])
    assert texts["ngram"] == texts["draft_model"] == texts["none"]
    assert metric(server, "specserve_spec_decode_chosen_k_count") - rounds_before >= rounds > 0
    # a request's k is capped at the deployment's (3 here; until stop 51 a request's k replaced it)
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0,
                                  extra_body={"speculative": {"k": 16}})
    spec = r.model_extra["speculative"]
    assert r.choices[0].text == texts["none"] and spec["k"] == 3 and not any(spec["rounds_by_k"][4:])
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="a", max_tokens=2, extra_body={"speculative": {"method": "eagle"}})
    assert e.value.body["param"] == "speculative.method"


json_values = st.recursive(st.none() | st.booleans() | st.integers(-10 ** 6, 10 ** 6) | st.floats(allow_nan=False, allow_infinity=False)
                           | st.text(max_size=20), lambda c: st.lists(c, max_size=4)
                           | st.dictionaries(st.text(max_size=8), c, max_size=4), max_leaves=8)
fields = st.fixed_dictionaries({}, optional={
    "model": st.sampled_from([MODEL, "other", ""]) | json_values,
    "prompt": st.text(max_size=30) | st.lists(st.integers(-5, 400), max_size=6) | json_values,
    "max_tokens": st.integers(-2, 6) | json_values, "temperature": st.floats(-1, 3) | json_values,
    "top_p": st.floats(-0.5, 1.5) | json_values, "top_k": st.integers(-3, 50) | json_values,
    "seed": st.integers(-5, 2 ** 64) | json_values, "stop": st.text(max_size=3) | json_values,
    "stream": st.booleans() | json_values, "n": st.integers(0, 3) | json_values,
    "speculative": st.fixed_dictionaries({}, optional={"enabled": st.booleans(), "k": st.integers(-2, 20),
                                                       "method": st.sampled_from(["ngram", "none", "draft_model", "x"])})
    | json_values})


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=fields | json_values)
def test_fuzzed_bodies_never_5xx(server, body):
    r = httpx.post(server + "/v1/completions", json=body, timeout=60)
    assert r.status_code < 500, (body, r.text)
    if r.status_code >= 400:
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}


def _pace(interval_s: float, rounds: list[tuple[float, list[int]]], finish_after: float):
    """Feeds ("tokens", ...) items at the given times (s from the start) and ("done", None) at
    finish_after into `paced`; returns [(arrival s, kind, item)] of what it yields."""
    from specserve.cluster.serve_app import paced

    async def run():
        queue: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        for at, tokens in rounds:
            loop.call_at(t0 + at, queue.put_nowait, ("tokens", tokens))
        loop.call_at(t0 + finish_after, queue.put_nowait, ("done", None))
        return [(loop.time() - t0, kind, item) async for kind, item in paced(queue, interval_s)]

    return asyncio.run(run())


def test_streamed_rounds_are_paced_into_messages_at_most_one_per_interval():
    # (times five times those of a 10 ms round: a stall of the loaded test machine, the other
    # pytest-xdist worker beside it, should not merge or delay what the pacing keeps apart)
    rounds = [(0.05 * i, [i]) for i in range(20)]  # a round every 50 ms
    out = _pace(0.3, rounds, finish_after=0.975)
    messages = [(t, item) for t, kind, item in out if kind == "tokens"]
    assert out[-1][1] == "done" and [tok for _, item in messages for tok in item] == list(range(20))
    assert messages[0] == (pytest.approx(0.0, abs=0.15), [0])  # the first at once
    assert 3 <= len(messages) <= 5  # 1 s at most one per 300 ms, not 20
    gaps = [b - a for (a, _), (b, _) in zip(messages, messages[1:])]
    assert min(gaps[:-1]) >= 0.275
    # the finish does not wait for the interval: the last tokens leave with it, at once
    assert out[-1][0] - out[-2][0] < 0.25 and out[-1][0] < 2.0


def test_with_no_interval_every_round_is_its_own_message():
    rounds = [(0.1 * i, [i]) for i in range(5)]  # (100 ms apart: see above)
    out = _pace(0.0, rounds, finish_after=0.5)
    assert [item for _, kind, item in out if kind == "tokens"] == [[0], [1], [2], [3], [4]]
