"""The Ray Serve application: an OpenAI-compatible HTTP ingress and speculative-pair replicas.

`build_app(args)` takes a plain config (the fields of `specserve.config.SpecServeConfig`, Ray
Serve LLM style) and returns the application, so the same config runs under `serve run`,
`specserve serve` and a KubeRay RayService:

    applications:
      - name: specserve
        route_prefix: /
        import_path: specserve.cluster.serve_app:build_app
        args: {target: /models/target, drafter: /models/drafter, k: 4, num_pairs: 1}

Deployments:
- `OpenAIIngress` (CPU only): HTTP, tokenization, the OpenAI schema, streaming, metrics.
- `PairReplica`: each replica is a verifier. It reserves two placement-group bundles (one GPU
  each on GPU clusters): the replica (target model, engine loop) sits in the first, and starts its
  drafter actor (gRPC server) in the second. `num_pairs` replicas = that many pairs.
"""


import asyncio
import contextlib
import hmac
import json
import logging
import os
import time
import uuid
import weakref

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from ray import serve
from starlette.exceptions import HTTPException as StarletteHTTPException

from specserve.cluster.openai_api import (APIError, Detokenizer, chat_prompt, completion_chunk, completion_id,
                                          completion_response, parse_completion, parse_json, prompt_token_ids,
                                          role_chunk, speculative_block, usage, usage_chunk)
from specserve.config import DRAFTER_BUNDLE, SpecServeConfig

log = logging.getLogger("specserve.serve")


async def paced(queue: asyncio.Queue, interval_s: float):
    """A request's ("tokens", [...]) items from its rounds, merged into messages at most one per
    interval_s (the first at once; rounds that finish sooner after a message wait for the next,
    which leaves when the interval is over or with the finish), then its ("done", request) item."""
    loop = asyncio.get_running_loop()
    pending = None
    last_sent = float("-inf")
    while True:
        kind, item = pending or await queue.get()
        pending = None
        if kind != "tokens":
            yield kind, item
            return
        deadline = last_sent + interval_s
        while pending is None:
            while not queue.empty():  # rounds that are ready (up to the finish): one message
                nxt = queue.get_nowait()
                if nxt[0] != "tokens":
                    pending = nxt
                    break
                item = item + nxt[1]
            hold = deadline - loop.time()
            if pending is not None or hold <= 0:
                break
            try:  # too soon after the last message: the rounds until it is time go with it
                nxt = await asyncio.wait_for(queue.get(), hold)
            except asyncio.TimeoutError:
                break
            if nxt[0] != "tokens":
                pending = nxt
            else:
                item = item + nxt[1]
        yield kind, item
        last_sent = loop.time()


@serve.deployment
class PairReplica:
    """One pair: this replica is the verifier (target + engine loop); its drafter actor sits in the
    replica's second placement-group bundle, or with `colocate` the drafter runs in this process.
    Both are built by `specserve.builder`."""

    def __init__(self, config: dict):
        import torch
        from ray.util import get_current_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
        from transformers.utils import logging as hf_logging

        from specserve.builder import build_engine, check_pair, start_drafter

        cfg = SpecServeConfig.from_dict(config)
        torch.set_num_threads(cfg.threads)
        hf_logging.disable_progress_bar()
        self.tokenizer = check_pair(cfg)  # once, before any actor starts; for stop strings too (generate)
        self.drafter = None  # a DrafterHandle: restarted by Ray, or recreated, and found again
        self.silent_probes = 0  # /health's probes of the drafter actor left unanswered in a row
        self.probe: asyncio.Future | None = None  # the one under way
        if cfg.drafter_actor:  # (colocated: build_engine loads the drafter in this process)
            pg = get_current_placement_group()
            strategy = PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=DRAFTER_BUNDLE) if pg else None
            self.drafter = start_drafter(cfg, strategy, checked=True, wait=False)  # loads while the target does
        try:
            self.engine = build_engine(cfg, self.drafter, checked=True)  # (a drafter's failed start raises here)
        except BaseException:
            if self.drafter is not None:
                self.drafter.kill()
            raise
        self.engine.start()
        self.k = cfg.k if self.engine.proposers else 0
        self.stream_interval_s = cfg.stream_interval_ms / 1000.0

    async def generate(self, request: dict):
        """Streams {"token_ids": [...]} per round, then {"finish_reason", "stats"} (or {"error"}).
        Messages go at most one per `stream_interval_ms`: rounds that finish sooner after the last
        message (or while it was on its way) go in the next one, which leaves as soon as the
        interval is over (the first at once, the last with the finish). Each message costs the
        replica, the ingress and the client CPU time: at one token per round (plain decoding),
        one message per round ran the HTTP path at 0.67x the pair's own speed on the reference
        machine (docs/benchmarks/overhead_f09d900.md; paced at 20 ms, 0.83x: overhead.md).
        With request["coalesce"] (a non-streamed request: nobody reads the rounds) the tokens come
        in the final message, with each round's time ("rounds": [seconds before the final message,
        tokens]) for the ingress's latency metrics: one message per request, not per round.

        A request with stop strings (request["stop"]) is watched here too, with the ingress's own
        `Detokenizer` over the same tokenizer, on the engine's thread (`on_tokens`): the round
        that completes a stop string is the request's last (finish_reason "stop"), so its final
        message still brings its stats, and they count no round past the stop. The ingress cuts
        the text at the same place."""
        from specserve.cluster.openai_api import Detokenizer
        from specserve.core.sampling import SamplingParams
        from specserve.verifier.engine import InvalidRequest, Overloaded, RequestFailed, RequestTimeout

        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        coalesce = request.get("coalesce", False)
        watch = Detokenizer(self.tokenizer, request["stop"], request["prompt_ids"],
                            request["sampling"]["stop_token_ids"]) if request.get("stop") else None

        def on_tokens(tokens: list[int]) -> bool:  # (the engine's thread: False ends the request in this round)
            if watch is not None:
                watch.add(tokens)
            if not coalesce:
                loop.call_soon_threadsafe(queue.put_nowait, ("tokens", list(tokens)))
            return watch is None or not watch.stopped

        k = self.k if request["speculative"] else 0
        if request.get("k") is not None:  # at most the config's k (until stop 51 a request's k replaced it)
            k = min(k, request["k"])
        max_tokens = request["max_tokens"]
        try:
            if max_tokens is None:  # (chat without max_tokens: as OpenAI's, up to the end of the context)
                max_tokens = self.engine.max_length - len(request["prompt_ids"])
                if max_tokens < 1:
                    raise InvalidRequest(f"the prompt ({len(request['prompt_ids'])} tokens) fills the context of "
                                         f"{self.engine.max_length} tokens", "prompt", "context_length_exceeded")
            self.engine.submit(
                request["prompt_ids"], max_tokens, SamplingParams(**request["sampling"]), k,
                request_id=request["id"], ignore_eos=request.get("ignore_eos", False), method=request.get("method"),
                on_tokens=None if coalesce and watch is None else on_tokens,
                on_finish=lambda r: loop.call_soon_threadsafe(queue.put_nowait, ("done", r)))
        except ValueError as e:  # (InvalidRequest: with the field at fault)
            yield {"error": {"status": 400, "message": str(e), "param": getattr(e, "param", None),
                             "code": getattr(e, "code", None)}}
            return
        except (Overloaded, RequestFailed) as e:  # (RequestFailed: the engine stopped, or its loop died)
            yield {"error": {"status": 503, "message": str(e)}}
            return
        finished = False
        try:
            async for kind, item in paced(queue, self.stream_interval_s):
                if kind == "tokens":
                    yield {"token_ids": item}
                    continue
                finished = True
                # (the watch takes no tokens after it stopped: the request ended in that round)
                kept = watch.tokens_used() if watch is not None and watch.stopped else None
                if kept is None and isinstance(item.error, RequestTimeout):
                    yield {"error": {"status": 504, "message": str(item.error)}}
                elif kept is None and item.error is not None:
                    yield {"error": {"status": 500, "message": f"generation failed: {item.error}"}}
                elif kept is None and item.finish_reason == "cancelled":  # streaming failed here: an error, not a short answer
                    yield {"error": {"status": 500, "message": "generation stopped: streaming its tokens failed"}}
                else:
                    final = {"finish_reason": "stop" if kept is not None else item.finish_reason,
                             "stats": item.stats.to_dict(), "k": k, "method": item.method}
                    if coalesce:  # the tokens (through the stop string), and when each round wrote its own
                        now, written = time.monotonic(), 0
                        final["rounds"] = []
                        for t, n in item.chunks:
                            n = n if kept is None else min(n, kept - written)
                            if n > 0:
                                final["rounds"].append([now - t, n])
                                written += n
                        final["token_ids"] = item.out[:written]
                    yield final
                return
        finally:
            if not finished:  # the client went away: free the slots on both sides
                self.engine.cancel(request["id"])

    def load(self) -> dict:
        return {"running": self.engine.num_running, "waiting": self.engine.num_waiting, **self.engine.policy.gauges(),
                "degraded": int(self.engine.degraded is not None), "drafter_failures": self.engine.degradations,
                "drafter_recoveries": self.engine.recoveries}

    async def health(self) -> dict:
        """The engine's state, and, while it drafts through its drafter actor without trouble, a
        probe of that actor: the engine learns of a failed drafter only from its next drafting
        call, so an idle pair whose drafter died or restarted said "ok" until a request came."""
        state = self.engine.health()
        if state["status"] != "ok" or self.drafter is None:
            return state
        if self.probe is None or self.probe.done():  # one probe at a time: callers at once share it (until
            self.probe = asyncio.ensure_future(self._probe_drafter())  # stop 51 three /health calls in one stall
        return await asyncio.shield(self.probe) or state              # of 2 s had a busy drafter restarted)

    DRAFTER_PROBE_S = 2.0
    DRAFTER_SILENT_PROBES = 3  # probes in a row the drafter actor leaves unanswered: the engine is told

    async def _probe_drafter(self) -> dict | None:
        """None if the drafter actor answers at the address the engine drafts through; else the
        pair is degraded. A drafter found elsewhere (restarted) or dead for good is reported to the
        engine, which reconnects (`SpeculativeEngine.drafter_moved`); so is one that leaves
        DRAFTER_SILENT_PROBES probes in a row unanswered (hung, or restarting): the engine then
        reconnects in the background, and restarts a hung drafter (`drafter_hang_s`), with no
        request needed."""
        import ray

        using = self.engine.proposer.client.address
        try:
            address = await asyncio.wait_for(self.drafter.actor.get_address.remote(), self.DRAFTER_PROBE_S)
        except asyncio.TimeoutError:
            self.silent_probes += 1
            if self.silent_probes >= self.DRAFTER_SILENT_PROBES:  # (until stop 50 an idle pair's engine learnt of
                self.silent_probes = 0                            # a hung drafter only from its next request)
                self.engine.drafter_moved(using, f"the drafter actor did not answer {self.DRAFTER_SILENT_PROBES} "
                                          f"health probes of {self.DRAFTER_PROBE_S:g} s")
            return {"status": "degraded", "reason": f"the drafter actor did not answer in {self.DRAFTER_PROBE_S:g} s "
                    "(restarting?)"}
        except ray.exceptions.ActorDiedError:  # for good: the engine's reconnect starts another
            address = "none (the actor died)"
        except ray.exceptions.RayError as e:  # unreachable for now (a node, the network): maybe fine
            return {"status": "degraded", "reason": f"the drafter actor did not answer ({type(e).__name__})"}
        self.silent_probes = 0
        if address == using:
            return None
        self.engine.drafter_moved(using)
        return {"status": "degraded", "reason": f"the drafter moved from {using} to {address}; reconnecting"}

    def drafter_info(self) -> dict:
        """This replica's and its drafter's processes and connection, for operators (and the soak)."""
        import os
        if self.drafter is None:
            return {"replica_pid": os.getpid()}
        import ray
        info = {"replica_pid": os.getpid(), "address": self.engine.proposer.client.address,
                "reconnects": self.engine.proposer.reconnects}
        try:
            info["pid"] = ray.get(self.drafter.actor.pid.remote(), timeout=30)
            info["draft_vocab"] = ray.get(self.drafter.actor.draft_vocab_size.remote(), timeout=30)
        except ray.exceptions.RayError:  # restarting: no process to name now
            pass
        return info

    def check_health(self) -> None:
        """Serve's replica health check: a replica whose engine loop died, or hangs in one step
        (`engine_hang_s`), is restarted."""
        state = self.engine.health()
        if state["status"] == "dead":
            raise RuntimeError(state["reason"])

    def __del__(self):
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.stop()


HEALTH_TIMEOUT_S = 5.0
MAX_BODY_BYTES = 16 << 20  # a request body past this is refused (413): a whole 128k-token context as JSON takes ~1 MiB


def health_answer(states: list, pairs: int | None = None) -> tuple[int, dict]:
    """/health's answer from each pair's `health()` (or the exception its call raised): 503 only
    when no pair serves. Until stop 51 one pair down made it 503 for the whole service, though the
    others served (Serve routes around a replica whose health check fails, and restarts it).
    pairs: the pairs the app runs (`num_pairs`): a replica Serve has dropped (its process died, its
    successor not yet up) answers nothing, and counts as down (until stop 62 /health said "ok"
    while one of two pairs was down, for as long as its restart took)."""
    down = [s["reason"] if isinstance(s, dict) else f"a pair did not answer: {type(s).__name__}"
            for s in states if not isinstance(s, dict) or s["status"] == "dead"]
    total = max(len(states), pairs or 0)
    missing = total - len(states)
    down_n = len(down) + missing
    if missing:
        down.append(f"{missing} without a running replica: starting, restarting or waiting for resources")
    if down_n == total:
        return 503, {"status": "unavailable", "reason": "; ".join(down) or "no pair is running"}
    reasons = sorted({s["reason"] for s in states if isinstance(s, dict) and s["status"] == "degraded"})
    if down_n:
        reasons.insert(0, f"{down_n} of {total} pairs down ({'; '.join(down)})")
    return 200, {"status": "degraded", "reason": "; ".join(reasons)} if reasons else {"status": "ok"}


async def each_pair(handle, method: str, timeout_s: float) -> list:
    """Every pair replica's answer to `method`: its result, or the exception it raised, or a
    TimeoutError where it did not answer within timeout_s. One replica's stall costs only its own
    answer: the broadcast's own timeout is for the whole set, and until stop 52 one stalled pair
    took /health to 503 and zeroed every pair's gauges in /metrics. (The per-replica results are
    Ray Serve 2.60's private API; without it, the whole set's timeout as before.)"""
    response = handle.broadcast(method)
    deadline = time.monotonic() + timeout_s
    replicas = getattr(response, "_fetch_replica_results_async", None)
    if replicas is None:
        return await response.results_async(timeout_s=timeout_s, return_exceptions=True)
    replicas = await asyncio.wait_for(replicas(), timeout_s)

    async def answer(replica):
        return await asyncio.wait_for(replica.get_async(), max(deadline - time.monotonic(), 0.0))

    return list(await asyncio.gather(*map(answer, replicas), return_exceptions=True))


class Flight:
    """A completion in the ingress, from its arrival until its answer, or its stream's last event,
    is handed to Serve: `OpenAIIngress.live`; its pair stream once it has one."""
    __slots__ = ("stream", "streaming", "cut", "__weakref__")

    def __init__(self):
        self.stream = None
        self.streaming = False  # its StreamingResponse took it (and `_stream` ends it)
        self.cut = asyncio.get_running_loop().create_future()  # done at `cut_off`: ends its waits on the pair


def _read(task: asyncio.Task) -> None:
    """A task's outcome, read (a stream cancelled as its next message was awaited ends in Ray's
    RequestCancelledError, which asyncio would log as never retrieved)."""
    if not task.cancelled():
        task.exception()


def sse_event(obj: dict) -> str:
    return f"data: {json.dumps(obj)}\n\n"


# FastAPI's /docs, /redoc and /openapi.json off: the routes are README's, every other path the API's 404
# (until stop 65 those three answered, /docs a page that loads its script from a CDN)
app = FastAPI(title="specserve", description="OpenAI-compatible speculative decoding", docs_url=None,
              redoc_url=None, openapi_url=None)


@app.exception_handler(APIError)
async def _api_error(_, exc: APIError):
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


@app.exception_handler(StarletteHTTPException)
async def _http_error(_, exc: StarletteHTTPException):
    """Unknown paths, wrong methods: the same OpenAI-style body as every other error."""
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)  # (405's was null until stop 63)
    return await _api_error(_, APIError(exc.status_code, str(exc.detail), code=code,
                                        headers=getattr(exc, "headers", None)))


def _pair_failed(error: Exception) -> APIError:
    """A request whose pair replica failed under it (died, restarted, unreachable): a 503 the
    client may retry, in the OpenAI shape, not the framework's plain-text 500. A pair whose Serve
    queue was full is an overload, as the engine's own (it was "the pair failed", with a warning)."""
    from ray.serve.exceptions import BackPressureError
    if isinstance(error, BackPressureError):
        return APIError(503, f"the server is overloaded ({error}); retry", headers={"Retry-After": "1"})
    log.warning("a pair failed a request: %r", error)
    return APIError(503, f"the pair serving this request failed ({type(error).__name__}); retry",
                    code="pair_unavailable", headers={"Retry-After": "1"})


@serve.deployment(ray_actor_options={"num_cpus": 0})
@serve.ingress(app)
class OpenAIIngress:
    def __init__(self, pair, config: dict):
        from transformers.utils import logging as hf_logging

        from specserve.cluster.metrics import Metrics
        from specserve.core.runner import load_tokenizer

        hf_logging.disable_progress_bar()
        self.pair = pair
        self.cfg = SpecServeConfig.from_dict(config)
        self.tokenizer = load_tokenizer(self.cfg.target)
        self.metrics = Metrics()
        self.api_key = self.cfg.resolved_api_key()
        if self.api_key is None and os.environ.get("SPECSERVE_API_KEY") is not None:  # (under `serve run`, KubeRay)
            log.warning("SPECSERVE_API_KEY is set but blank: /v1/* requires no key")
        self.live: set[Flight] = set()  # the completions in flight here, from their arrival (see `drain`)
        self.draining = False  # set by `drain`: completions are refused, /health says so
        self.cut = False  # set by `cut_off`: the completions still in flight end with an error

    # ------------------------------------------------------------------ shutdown (`specserve serve`)
    async def drain(self) -> int:
        """Stops taking completions (a 503 `server_shutting_down`; /health answers 503 "draining",
        so a load balancer routes elsewhere) and returns how many are still in flight here, their
        answers or streams not yet wholly handed to Serve. `specserve serve` calls it on every
        ingress replica at Ctrl-C or SIGTERM, until none is in flight or its --shutdown-timeout
        passes: until stop 63 Serve's shutdown cut the streams off mid-token, with no error event.
        (async: it runs on the replica's event loop, as the routes do, so a completion's check of
        `draining` and its entry in `live` come with nothing of this between them; Serve runs a
        plain method on a thread of its own.)"""
        self.draining = True
        return len(self.live)

    async def cut_off(self) -> int:
        """Ends the completions still in flight: each stream with an error event, each answer not
        yet sent as a 503, both `server_shutting_down` (their pairs free the slots). Returns how
        many it ended."""
        self.draining = self.cut = True
        live = list(self.live)
        for flight in live:
            if not flight.cut.done():  # ends its wait on the pair: a stopped replica's stream is not ended by its cancel
                flight.cut.set_result(None)
            if flight.stream is not None:
                flight.stream.cancel()
        return len(live)

    async def _next(self, stream, flight: "Flight"):
        """The pair stream's next message (StopAsyncIteration at its end), unless `cut_off` comes
        first: then the cut's 503."""
        if self.cut:
            raise self._cut_error(None)
        nxt = asyncio.ensure_future(stream.__anext__())
        nxt.add_done_callback(_read)
        try:
            await asyncio.wait({nxt, flight.cut}, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:  # (the client went away)
            nxt.cancel()
            raise
        if not nxt.done():
            nxt.cancel()
            raise self._cut_error(None)
        return nxt.result()

    # ------------------------------------------------------------------ routes
    @app.get("/health")
    async def health(self):
        """200 ok; 200 degraded (with the reasons) while a pair serves target-only, or some pairs
        are down and others serve; 503 when none serves, or the pairs do not answer in time. Open
        to probes (no API key); 503 "draining" once a shutdown has begun (`drain`)."""
        if self.draining:
            return JSONResponse({"status": "draining", "reason": "the server is shutting down"}, status_code=503)
        try:
            states = await each_pair(self.pair, "health", HEALTH_TIMEOUT_S)
        except Exception as e:
            return JSONResponse({"status": "unavailable", "reason": f"a pair did not answer: {type(e).__name__}"},
                                status_code=503)
        status, body = health_answer(states, self.cfg.num_pairs)
        return JSONResponse(body, status_code=status)

    @app.get("/v1/models")
    async def models(self, request: Request):
        self._authorize(request)
        return {"object": "list", "data": [self._model_card()]}

    @app.get("/v1/models/{model:path}")
    async def model(self, model: str, request: Request):
        self._authorize(request)
        if model != self.cfg.model:
            raise APIError(404, f"model {model!r} does not exist; this server serves {self.cfg.model!r}",
                           param="model", code="model_not_found")
        return self._model_card()

    @app.get("/metrics")
    async def metrics(self):
        try:  # a pair that failed or was slow is left out of the sums (specserve_pairs_reporting says how many are in)
            loads = await each_pair(self.pair, "load", HEALTH_TIMEOUT_S)
        except Exception:  # no pair up (starting, restarting): the ingress's own series still answer
            loads = []
        loads = [x for x in loads if isinstance(x, dict)]
        return PlainTextResponse(self.metrics.render(loads), media_type="text/plain; version=0.0.4")

    @app.post("/v1/completions")
    async def completions(self, request: Request):
        return await self._completion(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request):
        return await self._completion(request, chat=True)

    async def _completion(self, request: Request, chat: bool):
        """A completion is in flight (`live`, for a shutdown's drain) from its arrival: one whose
        body was still being read or tokenized as the drain began was refused until stop 63."""
        with self._counting_failures():
            self._authorize(request)
            if self.draining:
                raise APIError(503, "the server is shutting down; send the request to another server",
                               code="server_shutting_down")
            flight = Flight()
            self.live.add(flight)
            try:
                body = await self._json(request)
                self._check_model(body)
                if chat:
                    prompt = chat_prompt(body, self.tokenizer)
                    req = parse_completion({**body, "prompt": prompt}, self.cfg.model, chat=True)
                else:
                    req = parse_completion(body, self.cfg.model)
                    prompt = req.prompt
                return await self._serve(req, prompt, chat, flight)
            finally:
                if not flight.streaming:  # (a stream leaves `live` as it ends: `_stream`)
                    self.live.discard(flight)

    @contextlib.contextmanager
    def _counting_failures(self):
        """specserve_request_failures by status: what a completion route raised (a stream's own
        failures, once it has begun, are counted in `_stream`)."""
        try:
            yield
        except BaseException as e:
            self._count_failure(e)
            raise

    def _count_failure(self, error: BaseException) -> None:
        """An APIError by its status; the client gone away (before the answer or mid-stream) as
        "cancelled"; anything else, answered 500 or breaking a stream off, as "500"."""
        status = (str(error.status) if isinstance(error, APIError) else
                  "cancelled" if isinstance(error, (asyncio.CancelledError, GeneratorExit)) else "500")
        self.metrics.failures.labels(status).inc()

    # ------------------------------------------------------------------ helpers
    def _model_card(self) -> dict:
        return {"id": self.cfg.model, "object": "model", "created": 0, "owned_by": "specserve"}

    def _authorize(self, request: Request) -> None:
        """With an API key configured, /v1/* need `Authorization: Bearer <key>` (as vLLM's server)."""
        if self.api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self.api_key.encode()):
            raise APIError(401, "invalid or missing API key: send 'Authorization: Bearer <key>'",
                           code="invalid_api_key")

    @staticmethod
    async def _json(request: Request):
        """The body's JSON, read up to MAX_BODY_BYTES (413 past it) and parsed off the event loop: this
        one loop serves every stream of the ingress, and a body of megabytes held them all up."""
        too_big = APIError(413, f"the request body is larger than {MAX_BODY_BYTES >> 20} MiB", code="body_too_large")
        length = request.headers.get("content-length", "")
        if length.isdigit() and int(length) > MAX_BODY_BYTES:
            raise too_big
        raw = bytearray()
        async for chunk in request.stream():
            raw += chunk
            if len(raw) > MAX_BODY_BYTES:
                raise too_big
        try:
            return await asyncio.to_thread(parse_json, bytes(raw)) if len(raw) > 1 << 16 else parse_json(bytes(raw))
        except (ValueError, UnicodeDecodeError, RecursionError) as e:  # (RecursionError: nested too deep)
            raise APIError(400, f"the request body is not valid JSON: {e}", code="invalid_json") from None

    def _check_model(self, body) -> None:
        """404 for a body naming a model this server does not serve, before anything else in it is
        judged (a model that is missing or no string: the 400 of the body's checks). Until stop 59
        the model was checked last, and a chat request for an unknown model got the 400 of its
        messages, or of a model without a chat template."""
        model = body.get("model") if isinstance(body, dict) else None
        if isinstance(model, str) and model and model != self.cfg.model:
            raise APIError(404, f"model {model!r} does not exist; this server serves {self.cfg.model!r}",
                           param="model", code="model_not_found")

    async def _serve(self, req, prompt, chat: bool, flight: "Flight"):
        try:  # (a long prompt off the event loop, as its body)
            prompt_ids = prompt_token_ids(self.tokenizer, prompt, chat) if len(prompt) < 1 << 14 else \
                await asyncio.to_thread(prompt_token_ids, self.tokenizer, prompt, chat)
        except Exception as e:  # whatever the tokenizer refuses is the request's fault, not the server's
            # (these four 400s had no code until stop 61: the others from the ingress have one)
            raise APIError(400, f"the prompt cannot be tokenized: {e}", param="prompt", code="invalid_value") from None
        if not prompt_ids:
            raise APIError(400, "the prompt encodes to no tokens", param="prompt", code="invalid_value")
        if max(prompt_ids) >= len(self.tokenizer):
            raise APIError(400, f"prompt token ids must be below {len(self.tokenizer)}", param="prompt", code="invalid_value")
        if req.stop_token_ids and max(req.stop_token_ids) >= len(self.tokenizer):
            raise APIError(400, f"stop token ids must be below {len(self.tokenizer)}", param="stop_token_ids", code="invalid_value")
        from specserve.core.sampling import SamplingParams
        sampling = SamplingParams(temperature=req.temperature, top_k=req.top_k, top_p=req.top_p, seed=req.seed,
                                  stop_token_ids=tuple(req.stop_token_ids)).to_dict()
        upstream = {"id": uuid.uuid4().hex, "prompt_ids": prompt_ids, "max_tokens": req.max_tokens,
                    "sampling": sampling, "speculative": req.speculative, "k": req.k, "ignore_eos": req.ignore_eos,
                    "method": req.method, "coalesce": not req.stream, "stop": req.stop}
        if self.cut:  # (a shutdown's cut came while its body was read or tokenized)
            raise self._cut_error(None)
        stream = flight.stream = self.pair.options(stream=True).generate.remote(upstream)
        cid, timer = completion_id(chat), self.metrics.timer()
        detok = Detokenizer(self.tokenizer, req.stop, prompt_ids, req.stop_token_ids)
        try:
            await self._taken(stream)
            first = await self._next(stream, flight)  # surfaces validation/overload errors before any byte is sent
        except APIError:
            stream.cancel()
            raise
        except Exception as e:
            raise self._pair_failed(e) from None
        except BaseException as e:  # the client went away before the first message (for a request that is
            stream.cancel()         # not streamed, the whole generation): its slots are freed, not kept to its end
            cut = self._cut_error(e)
            if cut:
                raise cut from None
            raise
        if "error" in first:
            self._raise_upstream(first["error"], chat)
        if req.stream:
            events = self._stream(stream, first, detok, cid, req, prompt_ids, chat, timer, flight)
            weakref.finalize(events, self.live.discard, flight)  # (a stream Starlette never began: no finally)
            flight.streaming = True
            return StreamingResponse(events, media_type="text/event-stream")
        final = None
        try:
            async for item in self._items(first, stream, flight):
                if "finish_reason" in item:  # the last message, with the tokens and their rounds' times
                    final = item
                    timer.rounds(item.get("rounds", []))
                if "token_ids" in item and not detok.stopped:  # (the pair ends the request at its stop string)
                    detok.add(item["token_ids"])
        finally:
            stream.cancel()  # an error ends the sequence early: free its slots
        if not detok.stopped:
            detok.flush()
        return self._finish(cid, req, prompt_ids, detok, final, chat, timer)

    async def _taken(self, stream) -> None:
        """Waits until Serve has given the request to a pair replica, at most `pair_wait_s`; then a
        503 the client may retry. Serve holds a request while no replica of the pairs is up, and
        until stop 58 a request whose pair could not come back (its replica's restart failing)
        waited for good, though /health said 503. (`_fetch_future_result_async`: Ray Serve 2.60's
        private API, as `each_pair`'s; without it, no bound, as before.)"""
        taken = getattr(stream, "_fetch_future_result_async", None)
        if self.cfg.pair_wait_s is None or taken is None:
            return
        task = asyncio.ensure_future(taken())  # (asyncio.wait, not wait_for: Python 3.11's wait_for returns the
        try:                                   # result when it is cancelled as the wait ends, and the client's
            done, _ = await asyncio.wait({task}, timeout=self.cfg.pair_wait_s)  # disconnect would be lost)
        except BaseException:
            task.cancel()
            if task.done() and not task.cancelled():
                task.exception()  # (read: it failed as the client left; not logged as never retrieved)
            raise
        if not done:
            task.cancel()
            stream.cancel()
            raise APIError(503, f"no pair took the request within {self.cfg.pair_wait_s:g} s (pairs restarting or "
                           "down: see /health); retry", code="pair_unavailable", headers={"Retry-After": "5"})
        task.result()  # (Serve's own errors: handled as the first message's)

    async def _items(self, first, stream, flight):
        yield first
        try:
            while True:
                try:
                    item = await self._next(stream, flight)
                except StopAsyncIteration:
                    return
                if "error" in item:
                    raise APIError(item["error"]["status"], item["error"]["message"])
                yield item
        except APIError:
            raise
        except Exception as e:  # the pair's replica died or went away mid-request (Ray's errors)
            raise self._pair_failed(e) from None
        except asyncio.CancelledError as e:
            cut = self._cut_error(e)
            if cut:
                raise cut from None
            raise

    def _pair_failed(self, error: Exception) -> APIError:
        return self._cut_error(error) or _pair_failed(error)

    def _cut_error(self, error: BaseException | None) -> APIError | None:
        """The 503 of a completion that `cut_off` ended (error None: `_next` saw the cut; else its
        pair stream cancelled: Ray's TaskCancelledError, asyncio's CancelledError where no pair had
        taken it yet); None for any other failure, or the client's own going away (this task
        cancelled)."""
        cancelling = getattr(asyncio.current_task(), "cancelling", None)  # (3.11; on 3.10 a cancel is the client's)
        if not self.cut or (isinstance(error, asyncio.CancelledError) and (cancelling is None or cancelling())):
            return None
        return APIError(503, "the server shut down before this request finished; retry it on another server",
                        code="server_shutting_down")

    @staticmethod
    def _raise_upstream(error: dict, chat: bool):
        """The pair's refusal as the API's error: its field at fault named as the request named it
        (a chat request's prompt is its messages)."""
        headers = {"Retry-After": "1"} if error["status"] == 503 else None
        param = error.get("param")
        raise APIError(error["status"], error["message"], param="messages" if chat and param == "prompt" else param,
                       code=error.get("code"), headers=headers)

    def _finish(self, cid, req, prompt_ids, detok, final, chat, timer):
        """The response (or the stream's last chunk) from the request's text, and its metrics. Its
        usage counts the tokens the text took: through the stop string, if one stopped it
        (Detokenizer.tokens_used)."""
        stats = final["stats"] if final else {}
        finish_reason = "stop" if detok.stopped or (final and final["finish_reason"] == "stop") else "length"
        used = usage(len(prompt_ids), detok.tokens_used())
        spec = speculative_block(req.speculative and bool(final and final.get("k")),
                                 final.get("k", 0) if final else 0, stats, final.get("method") if final else None)
        self.metrics.finished(finish_reason, timer.elapsed(), used, stats)
        return completion_response(cid, req.model, detok.text, finish_reason, used, spec, chat=chat)

    async def _stream(self, stream, first, detok, cid, req, prompt_ids, chat, timer, flight):
        """The SSE stream: (chat: the role first, as OpenAI's) text chunks, the finish chunk with
        the `speculative` block, and with stream_options.include_usage a usage chunk (with
        continuous_usage_stats too, as vLLM's: every chunk carries the usage so far); then [DONE]."""
        final, answered = None, False

        def chunk(text: str, finish_reason: str | None = None) -> dict:
            c = completion_chunk(cid, req.model, text, finish_reason, chat)
            if req.continuous_usage:
                c["usage"] = usage(len(prompt_ids), detok.tokens_used())
            return c

        try:  # (out of `live` however it ends: a client gone at an error event's yield too)
            try:
                if chat:
                    role = role_chunk(cid, req.model)
                    if req.continuous_usage:
                        role["usage"] = usage(len(prompt_ids), 0)
                    yield sse_event(role)
                async for item in self._items(first, stream, flight):
                    if "token_ids" in item:
                        if detok.stopped:  # (the pair ends the request at its stop string: its last message follows)
                            continue
                        timer.tokens(len(item["token_ids"]))
                        delta = detok.add(item["token_ids"])
                        if delta:
                            yield sse_event(chunk(delta))
                    else:
                        final = item
                if not detok.stopped:
                    tail = detok.flush()
                    if tail:
                        yield sse_event(chunk(tail))
                done = self._finish(cid, req, prompt_ids, detok, final, chat, timer)
                answered = True
                last = chunk("", done["choices"][0]["finish_reason"])
                last["speculative"] = done["speculative"]
                yield sse_event(last)
                if req.include_usage:
                    yield sse_event(usage_chunk(cid, req.model, done["usage"], chat))
            except APIError as e:
                self._count_failure(e)
                yield sse_event(e.body())
            except Exception as e:  # a bug: an error event, as any other failure (it broke the stream off)
                log.exception("a stream failed")
                error = APIError(500, f"the stream failed: {type(e).__name__}: {e}")
                if not answered:  # (once answered, it is counted as finished only)
                    self._count_failure(error)
                yield sse_event(error.body())
            except BaseException as e:  # the client disconnected mid-stream
                if not answered:
                    self._count_failure(e)
                raise
            finally:
                stream.cancel()
            yield "data: [DONE]\n\n"
        finally:
            self.live.discard(flight)


def build_app(args: dict | None = None):
    """The Serve application for a plain config mapping (the fields of `SpecServeConfig`).
    Concurrency comes from the config: the pairs take every sequence they can run or queue
    (num_pairs x (max_num_seqs + max_waiting)), so the engines' own bound answers overload with a
    prompt 503; the ingress takes as many plus headroom for /health and /metrics plus a burst's room
    (SpecServeConfig.BURST), to answer a burst the API's 503 too; Serve's queue in front of each
    deployment is bounded, as long as what the deployment takes (a burst waits there for its
    replica to be picked: see SpecServeConfig.HEADROOM)."""
    cfg = SpecServeConfig.from_dict(args)
    cfg.use_gpu = cfg.gpu()  # decided here, once, with the bundles: the replica's drafter asks what its bundle holds
    bundle = cfg.bundle()
    pair = PairReplica.options(
        num_replicas=cfg.num_pairs,
        max_ongoing_requests=cfg.pair_max_ongoing_requests(),
        max_queued_requests=cfg.pair_max_queued_requests(),
        health_check_period_s=5,
        ray_actor_options={"num_cpus": bundle["CPU"], "num_gpus": bundle.get("GPU", 0)},
        placement_group_bundles=cfg.bundles(),
        placement_group_strategy=cfg.placement_strategy,
    ).bind(cfg.to_dict())
    ingress = OpenAIIngress.options(max_ongoing_requests=cfg.ingress_max_ongoing_requests(),
                                    max_queued_requests=cfg.ingress_max_ongoing_requests())
    return ingress.bind(pair, cfg.to_dict())
