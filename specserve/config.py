"""The one configuration object of a speculative pair and its deployment, with one set of
defaults and one set of checks. The CLI, `cluster.pair.SpeculativePair`, the Serve app and the
KubeRay serveConfigV2 (its `args`) all build a `SpecServeConfig`; `specserve.builder` turns it
into running parts.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from specserve.core.draft_vocab import DraftVocabError, check_setting
from specserve.core.proposer import MAX_K

REPO_ROOT = Path(__file__).resolve().parent.parent
APP_IMPORT_PATH = "specserve.cluster.serve_app:build_app"  # the app's builder, as Serve configs name it
DEFAULT_MODEL_DIR = Path(os.environ.get("SPECSERVE_MODEL_DIR", REPO_ROOT / "models" / "demo"))
PIPELINE_POLICIES = ("all-accepted", "most-likely")  # the first is the default: docs/benchmarks/distributed.md
PLACEMENT_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")
SPECULATION_POLICIES = ("adaptive", "fixed")  # specserve.verifier.policy
STREAM_INTERVAL_MS = 20.0  # the default: see README, "Configuration" (stream_interval_ms)


def valid_device(value) -> bool:
    """auto, cpu, cuda or cuda:N (the config's `device` and the CLI's --device)."""
    return value in ("auto", "cpu", "cuda") or (isinstance(value, str) and value.startswith("cuda:")
                                                and value[5:].isdigit())


@dataclass
class SpecServeConfig:
    model: str = "specserve-demo"  # the served model name
    target: str = str(DEFAULT_MODEL_DIR / "target")  # local HF folder of the target
    drafter: str | None = str(DEFAULT_MODEL_DIR / "drafter")  # local HF folder of the drafter; None: n-gram drafting
    k: int = 4  # the most draft tokens per round (0: no speculation)
    speculation: str = "adaptive"  # adaptive: the policy picks k <= this per round (0 when it does not pay); fixed: k
    pipeline: bool | str = True  # False, True (the default policy) or a name from PIPELINE_POLICIES
    fanout: int = 1  # with pipeline: outcomes the drafter prepares per round and sequence (1: the main one; docs/benchmarks/distributed.md)
    colocate: bool = False  # the drafter in the verifier's process and device (no drafter actor, no gRPC, no pipelining): one GPU per pair
    max_num_seqs: int = 8  # sequences batched together in each round, per pair
    max_waiting: int = 64  # queued requests per pair beyond which new ones are refused (HTTP 503)
    max_model_len: int | None = None  # prompt + generated tokens (default: the models' context)
    num_pairs: int = 1  # Serve replicas, each one pair (drafter + verifier)
    use_gpu: bool | None = None  # None: on GPUs when the Ray cluster has gpus_per_actor for each of the pair's actors
    cpus_per_actor: float = 1.0  # CPUs reserved per actor; also its torch thread count (at least 1)
    gpus_per_actor: float = 1.0  # when on GPUs: 0.5 puts both actors of a pair on one GPU
    placement_strategy: str = "PACK"  # of the pair's two placement-group bundles
    request_timeout_s: float | None = None  # a request running longer fails with HTTP 504 (None: no limit)
    pair_wait_s: float | None = 60.0  # served: a request no pair replica takes this long (pairs restarting, down) fails with HTTP 503 (None: no limit)
    drafter_seq_ttl_s: float = 600.0  # the drafter reclaims a sequence with no call for this long
    drafter_hang_s: float = 60.0  # a drafter actor that runs but cannot be reached for this long after a failed call is restarted
    engine_hang_s: float | None = 300.0  # a pair whose engine loop has been in one step this long is restarted (None: never)
    api_key: str | None = None  # /v1/* require "Authorization: Bearer <key>" (also: env SPECSERVE_API_KEY)
    device: str = "auto"  # auto (the actor's GPU if it holds one, else CPU), cpu, cuda, cuda:N
    dtype: str = "auto"  # auto (bfloat16 on a GPU; on a CPU bfloat16 for each model the lean forward packs, where the CPU multiplies bf16 in hardware (AMX, AVX512-BF16), the drafter there float32 with a bfloat16 head; else float32), float32, bfloat16, float16
    q_dtype: str = "float32"  # q on the wire: float32, or bfloat16 / float16 for large vocabularies and batches
    compile: bool | str = "auto"  # torch.compile the forward: auto (on a GPU, where it pays), true, false
    draft_vocab: str | int = "auto"  # the drafter's greedy drafts from its N most frequent tokens (specserve.core.draft_vocab): auto (its folder's draft_vocab.json, if any), off, or N
    stream_interval_ms: float = STREAM_INTERVAL_MS  # a streamed request's messages from its pair: at most one per this long

    def __post_init__(self):
        def need(ok: bool, what: str):
            if not ok:
                raise ValueError(what)

        need(isinstance(self.model, str) and bool(self.model), "model must be a non-empty string")
        need(isinstance(self.target, str) and bool(self.target), "target must be a model folder path")
        need(self.drafter is None or isinstance(self.drafter, str), "drafter must be a model folder path or null")
        if self.drafter == "":
            self.drafter = None
        need(_is_int(self.k) and 0 <= self.k <= MAX_K, f"k must be an integer in [0, {MAX_K}], got {self.k!r}")
        if self.k == 0:  # the target alone: no drafter to start, nor a GPU to reserve for it (until stop 51 it ran idle)
            self.drafter = None
        need(self.speculation in SPECULATION_POLICIES,
             f"speculation must be one of {SPECULATION_POLICIES}, got {self.speculation!r}")
        need(isinstance(self.pipeline, bool) or self.pipeline in PIPELINE_POLICIES,
             f"pipeline must be true, false or one of {PIPELINE_POLICIES}, got {self.pipeline!r}")
        need(_is_int(self.fanout) and 1 <= self.fanout <= 16, f"fanout must be an integer in [1, 16], got {self.fanout!r}")
        need(isinstance(self.colocate, bool), f"colocate must be true or false, got {self.colocate!r}")
        need(not (self.colocate and self.fanout > 1),
             "fanout > 1 needs a pipelining drafter actor: a colocated drafter (colocate: true) does not pipeline")
        need(not (self.pipeline is False and self.fanout > 1),
             "fanout > 1 needs pipelining: with pipeline: false nothing is prepared (it was ignored until stop 47)")
        need(_is_int(self.max_num_seqs) and self.max_num_seqs >= 1, "max_num_seqs must be an integer >= 1")
        need(_is_int(self.max_waiting) and self.max_waiting >= 0, "max_waiting must be an integer >= 0")
        need(self.max_model_len is None or (_is_int(self.max_model_len) and self.max_model_len >= 2),
             "max_model_len must be null or an integer >= 2")
        need(_is_int(self.num_pairs) and self.num_pairs >= 1, "num_pairs must be an integer >= 1")
        need(self.use_gpu is None or isinstance(self.use_gpu, bool), "use_gpu must be true, false or null")
        need(_is_number(self.cpus_per_actor) and self.cpus_per_actor > 0, "cpus_per_actor must be a number > 0")
        need(self.placement_strategy in PLACEMENT_STRATEGIES,
             f"placement_strategy must be one of {PLACEMENT_STRATEGIES}")
        need(_is_number(self.gpus_per_actor) and 0 < self.gpus_per_actor <= 8, "gpus_per_actor must be in (0, 8]")
        need(self.request_timeout_s is None or (_is_number(self.request_timeout_s) and self.request_timeout_s > 0),
             "request_timeout_s must be null or a number > 0")
        need(self.pair_wait_s is None or (_is_number(self.pair_wait_s) and self.pair_wait_s > 0),
             "pair_wait_s must be null or a number > 0")
        need(_is_number(self.drafter_seq_ttl_s) and self.drafter_seq_ttl_s > 0, "drafter_seq_ttl_s must be a number > 0")
        need(_is_number(self.drafter_hang_s) and self.drafter_hang_s > 0, "drafter_hang_s must be a number > 0")
        need(self.engine_hang_s is None or (_is_number(self.engine_hang_s) and self.engine_hang_s > 0),
             "engine_hang_s must be null or a number > 0")
        need(_is_number(self.stream_interval_ms) and 0 <= self.stream_interval_ms <= 1000,
             "stream_interval_ms must be a number in [0, 1000]")
        need(valid_device(self.device), f"device must be auto, cpu, cuda or cuda:N, got {self.device!r}")
        need(self.dtype in ("auto", "float32", "bfloat16", "float16"),
             f"dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}")
        need(self.q_dtype in ("float32", "bfloat16", "float16"), "q_dtype must be float32, bfloat16 or float16")
        need(isinstance(self.compile, bool) or self.compile == "auto", "compile must be true, false or auto")
        if self.draft_vocab is False:  # YAML reads an unquoted `off` as false
            self.draft_vocab = "off"
        try:
            check_setting(self.draft_vocab)
        except DraftVocabError as e:
            need(False, str(e))
        need(self.api_key is None or (isinstance(self.api_key, str) and bool(self.api_key)
                                      and self.api_key.strip() == self.api_key),
             "api_key must be null or a non-empty string without surrounding whitespace (the server strips the "
             "client's Bearer token, which then never matched a key with spaces or a newline at its ends)")

    @classmethod
    def from_dict(cls, args: dict | None) -> "SpecServeConfig":
        """From a plain mapping (Serve app args, a YAML file); unknown keys are errors."""
        args = dict(args or {})
        unknown = set(args) - {f.name for f in fields(cls)}
        if unknown:
            raise ValueError(f"unknown specserve config keys: {sorted(unknown)}")
        return cls(**args)

    def to_dict(self) -> dict:
        return asdict(self)

    @property
    def speculative(self) -> bool:
        return self.drafter is not None and self.k > 0

    @property
    def threads(self) -> int:
        """torch threads of each actor."""
        return max(1, int(self.cpus_per_actor))

    @property
    def drafter_actor(self) -> bool:
        """Whether the pair runs its drafter as an actor of its own (over gRPC)."""
        return self.drafter is not None and not self.colocate

    def gpu(self) -> bool:
        """Whether each actor takes a GPU: `use_gpu`, or when unset, whether the Ray cluster this
        process is connected to has a GPU for each actor of a pair (two; one when colocated)."""
        if self.use_gpu is not None:
            return self.use_gpu
        import ray
        actors = 2 if self.drafter_actor else 1
        return ray.is_initialized() and ray.cluster_resources().get("GPU", 0) >= actors * self.gpus_per_actor

    def bundle(self) -> dict:
        """One actor's placement-group bundle."""
        return {"CPU": self.cpus_per_actor, **({"GPU": self.gpus_per_actor} if self.gpu() else {})}

    def bundles(self) -> list[dict]:
        """The pair's bundles: [verifier, drafter] (the verifier alone without a drafter actor)."""
        return [self.bundle(), self.bundle()] if self.drafter_actor else [self.bundle()]

    def resources(self) -> dict[str, float]:
        """What the app reserves in all: every pair's bundles (the ingress takes no CPU)."""
        total: dict[str, float] = {}
        for bundle in self.bundles():
            for name, amount in bundle.items():
                total[name] = total.get(name, 0.0) + amount * self.num_pairs
        return total

    # Serve's limits, from the engine's: every sequence that may run or wait gets in, plus room
    # for /health, /metrics and cancellations; beyond that a prompt 503, never an unbounded queue.
    # Each caller's queue (the proxy's, the ingress's handle) holds as many as its deployment takes:
    # in a burst, requests wait there for a replica to be picked, and until stop 57 (a queue of
    # HEADROOM) a burst of 40 at the default config, 72 admitted, had 6-12 dropped by the proxy with
    # a plain-text 503 ("Request dropped due to backpressure"), /health among them. The ingress's
    # one handle to the pairs queues every pair's sequences but not the headroom, so that requests
    # waiting there for a pair (one restarting) leave the ingress room for /health and /metrics.
    HEADROOM = 16
    # The ingress takes this many requests more, at once, only to answer them its own OpenAI-style
    # 503: the pairs' handle refuses what they cannot queue at once (BackPressureError), and the
    # ingress says so in the API's shape. Until stop 59 the ingress took only what the app admits,
    # and Serve's proxy dropped the rest of a larger burst with its plain-text 503, uncounted in
    # /metrics (a burst of 1001 at the default config: 667-682 of them, benchmarks/diagnostics/burst.py).
    # The cost: each is read, parsed and tokenized before the refusal (see README, "Overload").
    BURST = 1024

    def pair_max_ongoing_requests(self) -> int:
        return self.max_num_seqs + self.max_waiting + self.HEADROOM

    def pair_max_queued_requests(self) -> int:
        return self.num_pairs * (self.max_num_seqs + self.max_waiting)

    def ingress_max_ongoing_requests(self) -> int:
        return self.pair_max_queued_requests() + self.HEADROOM + self.BURST

    def resolved_api_key(self) -> str | None:
        return self.api_key or env_api_key()


def env_api_key() -> str | None:
    """$SPECSERVE_API_KEY, stripped (a key mounted from a file or Secret often ends in a newline,
    and the server strips the client's token); None where it is unset or blank."""
    return os.environ.get("SPECSERVE_API_KEY", "").strip() or None


TARGET_BUNDLE, DRAFTER_BUNDLE = 0, 1


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v == v and abs(v) != float("inf")
