"""The `specserve` command line."""

from __future__ import annotations

import argparse
import contextlib
import errno
import importlib
import json
import logging
import math
import os
import re
import shlex
import sys
import time

from specserve.config import APP_IMPORT_PATH, DEFAULT_MODEL_DIR, SpecServeConfig, env_api_key, valid_device
from specserve.core.proposer import MAX_K


class CLIError(Exception):
    """A user error: printed as one line, exit code 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2, no usage dump
        raise CLIError(message)


def _positive_int(name):
    def parse(s):
        try:
            v = int(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be an integer, got {s!r}") from None
        if v < 1:
            raise argparse.ArgumentTypeError(f"{name} must be >= 1, got {v}")
        return v
    return parse


def _seconds(s):
    """--shutdown-timeout: seconds, finite and >= 0."""
    try:
        v = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number of seconds, got {s!r}") from None
    if not math.isfinite(v) or v < 0:
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds >= 0, got {s!r}")
    return v


def resolve_pair(target: str | None, drafter: str | None, no_speculation: bool) -> tuple[str, str | None]:
    """Explicit paths win; with no --target, the embedded demo pair is the default."""
    if target is None:
        if drafter is not None:
            raise CLIError("--drafter given without --target")
        target, drafter = str(DEFAULT_MODEL_DIR / "target"), str(DEFAULT_MODEL_DIR / "drafter")
        if not os.path.isdir(target):
            raise CLIError(f"no --target given and the demo pair is not at {DEFAULT_MODEL_DIR} "
                           "(set SPECSERVE_MODEL_DIR to a folder with target/ and drafter/, pass --target/--drafter, "
                           "or run `specserve train-demo` in a checkout)")
    if no_speculation:
        drafter = None
    elif drafter is None:
        raise CLIError("--drafter is required with --target (or pass --no-speculation)")
    return target, drafter


def _draft_vocab(value: str):
    from specserve.core.draft_vocab import DraftVocabError, check_setting
    setting = int(value) if value.lstrip("-").isdigit() else value
    try:
        check_setting(setting)
    except DraftVocabError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return setting


def device_arg(value: str) -> str:
    """--device: auto, cpu, cuda or cuda:N, as the config's `device` (cuda:N refused until stop 53)."""
    if valid_device(value):
        return value
    raise argparse.ArgumentTypeError(f"must be auto, cpu, cuda or cuda:N, got {value!r}")


def add_device_args(p: argparse.ArgumentParser, default) -> None:
    p.add_argument("--device", type=device_arg, default=default,
                   help="where the models run: auto (the GPU this process, or its Ray actor, holds; else the CPU), "
                        "cpu, cuda or cuda:N")
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"], default=default,
                   help="model weights and activations (auto: bfloat16 on a GPU; on a CPU, bfloat16 for each model the lean forward packs, where the CPU multiplies bf16 in hardware (AMX or AVX512-BF16), the drafter there float32 with a bfloat16 head; float32 otherwise)")
    c = p.add_mutually_exclusive_group()
    c.add_argument("--compile", dest="compile", action="store_const", const=True, default=default,
                   help="torch.compile the forward (default: auto, i.e. on a GPU only; why: README, \"Compiling the forward\")")
    c.add_argument("--no-compile", dest="compile", action="store_const", const=False,
                   help="run the forward eagerly")
    p.add_argument("--draft-vocab", dest="draft_vocab", type=_draft_vocab, default=default,
                   help="the drafter's greedy drafts from its N most frequent tokens: auto (its folder's "
                        "draft_vocab.json, if any; the default), off, or N")


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0, help="0 = off")
    p.add_argument("--seed", type=int, default=None,
                   help="any 64-bit integer, taken modulo 2**63 as the HTTP API's seed (the same seed, the same text)")


def sampling_from_args(args, stop_token_ids=()):
    from specserve.core.sampling import SEED_HIGH, SEED_LOW, SamplingParams, user_seed
    seed = args.seed
    if seed is not None:  # (until stop 61 taken as given, in [0, 2**64): a seed of 2**63 + 1 or -1 gave other
        # text than the HTTP API's, which takes it modulo 2**63)
        if not SEED_LOW <= seed < SEED_HIGH:
            raise CLIError(f"--seed must be a 64-bit integer, in [-2**63, 2**64), got {seed}")
        seed = user_seed(seed)
    try:
        return SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=seed,
                              stop_token_ids=tuple(stop_token_ids))
    except ValueError as e:
        raise CLIError(str(e)) from None


def cmd_generate(args) -> int:
    try:  # (bytes the shell passed that are not UTF-8 arrive as lone surrogates: a tokenizer traceback until stop 60)
        args.prompt.encode("utf-8")
    except UnicodeEncodeError as e:
        c = ord(args.prompt[e.start])
        what = f"byte 0x{c - 0xDC00:02x}" if 0xDC80 <= c <= 0xDCFF else f"a lone surrogate U+{c:04X}"
        raise CLIError(f"--prompt is not UTF-8 text: {what}, character {e.start + 1} (a file in another "
                       "encoding? convert it with iconv)") from None
    if not 0 <= args.k <= MAX_K:
        raise CLIError(f"-k must be in [0, {MAX_K}], got {args.k}")
    if args.method in ("draft_model", "ngram") and (args.no_speculation or args.k == 0):
        plain = "--no-speculation" if args.no_speculation else "-k 0"  # (both accepted silently until stop 61)
        raise CLIError(f"--method {args.method} drafts tokens, and {plain} decodes without drafts: drop one")
    no_drafter = args.no_speculation or args.k == 0 or args.method in ("ngram", "none")
    target, drafter = resolve_pair(args.target, args.drafter, no_drafter)
    method = "none" if args.no_speculation or args.k == 0 else args.method
    if args.distributed and method == "none":
        raise CLIError("--distributed runs a drafter actor, and plain decoding (--no-speculation, -k 0 or "
                       "--method none) has none: drop --distributed")
    if args.distributed and method not in (None, "draft_model"):
        raise CLIError("--method ngram runs in process: drop --distributed")
    most = 4 * (os.cpu_count() or 1)
    if not 0 <= args.threads <= most:
        raise CLIError(f"--threads must be in [0, {most}] (0: torch's default; this machine has "
                       f"{os.cpu_count()} CPUs), got {args.threads}")
    if args.distributed and args.threads:  # (it set the driver's threads, which run no model: ignored until stop 51)
        raise CLIError("--threads is for in-process generation: --distributed actors run one torch thread each")
    if args.no_pipeline and not args.distributed:
        raise CLIError("--no-pipeline applies to --distributed only (in process, drafting is never pipelined)")
    # the arguments checked, torch and transformers next (seconds of imports: a mistyped flag is told at
    # once; the sampling flags are checked by SamplingParams, after importing torch)
    sampling = sampling_from_args(args)
    if args.method in ("ngram", "none") and args.drafter is not None and not args.no_speculation and args.k:
        print(f"warning: --method {args.method} drafts without the drafter model: --drafter is not used",
              file=sys.stderr)  # (until stop 53 dropped silently; --no-speculation and -k 0 say so themselves)
    quiet_transformers()
    import torch

    from specserve.builder import build_engine, check_pair
    from specserve.core.runner import ModelLoadError

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.distributed:
        from specserve.cluster.pair import generate_distributed
        try:  # generate_distributed checks paths and the shared vocabulary before any actor starts
            result, tokenizer = generate_distributed(target, drafter, args.prompt, args.max_tokens, sampling,
                                                     args.k, pipeline=not args.no_pipeline, device=args.device,
                                                     dtype=args.dtype, compile=args.compile,
                                                     speculation=args.speculation, draft_vocab=args.draft_vocab)
        except (ModelLoadError, ValueError) as e:
            raise CLIError(str(e)) from None
        except Exception as e:  # an actor that died loading (a device it lacks, ...) or was never placed
            from ray.exceptions import RayError
            if not isinstance(e, RayError):
                raise
            raise CLIError(f"the pair did not start: {type(e).__name__}: {last_line(e, '')} "
                           "(the actors' logs under /tmp/ray/session_latest/logs have the rest)") from None
    else:
        try:
            cfg = SpecServeConfig(target=target, drafter=drafter, k=args.k, max_num_seqs=1, device=args.device,
                                  dtype=args.dtype, compile=args.compile, speculation=args.speculation,
                                  draft_vocab=args.draft_vocab)
            tokenizer = check_pair(cfg)
            engine = build_engine(cfg, checked=True)
        except (ModelLoadError, ValueError) as e:
            raise CLIError(str(e)) from None
        prompt_ids = tokenizer(args.prompt)["input_ids"]
        t0 = time.perf_counter()
        try:
            result = engine.generate(prompt_ids, args.max_tokens, sampling, args.k, method=method)
        except ValueError as e:
            raise CLIError(str(e)) from None
        elapsed = time.perf_counter() - t0
    text = tokenizer.decode(result.token_ids, skip_special_tokens=True)
    stats = result.stats.to_dict()
    stats["finish_reason"] = result.finish_reason
    if not args.distributed:
        stats["seconds"] = elapsed
        stats["tokens_per_s"] = len(result.token_ids) / elapsed if elapsed > 0 else None
    if args.json:
        print(json.dumps({"text": text, "token_ids": result.token_ids, "stats": stats}))
    else:
        print(args.prompt + text)
        print(f"\n-- {len(result.token_ids)} tokens, {stats['num_target_passes']} target passes, "
              f"acceptance rate {stats['acceptance_rate']:.2f}, mean acceptance length "
              f"{stats['mean_acceptance_length']:.2f}, finish_reason {result.finish_reason}", file=sys.stderr)
    return 0


class _Without(logging.Filter):
    """Drops the log records whose message contains `text`."""

    def __init__(self, text: str):
        super().__init__()
        self.text = text

    def filter(self, record: logging.LogRecord) -> bool:
        return self.text not in record.getMessage()


def last_line(error: Exception, default: str) -> str:
    """The last non-blank line of an error's message (Ray's end with the cause), else `default`."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return lines[-1] if lines else default


# an exception's own line in a traceback: "pkg.ModelLoadError: message", or a class name alone ("AssertionError")
_RAISED = re.compile(r"^((?:\w+\.)*[A-Z]\w*)(\([\w.]+\))?(?:: (.*))?$")


def deploy_failure(app: str) -> str | None:
    """Why Serve gave up on the app's deployments: each failed one's name and the exception its
    replicas died of (`serve.run` itself raises only "Failed to update the
    deployments [...]", the cause in the controller's log: until stop 59 that was all a user saw).
    None when Serve's status says nothing more."""
    from ray import serve
    try:
        deployments = serve.status().applications[app].deployments
    except Exception:  # (the controller gone as well: the caller says what serve.run raised)
        return None
    said = [f"{name}: {_cause(d.message or '')}" for name, d in deployments.items()
            if str(d.status).endswith(("DEPLOY_FAILED", "UNHEALTHY")) and (d.message or "").strip()]
    return "; ".join(said) or None


def _cause(message: str) -> str:
    """The last exception raised in a replica's error message, as "ModelLoadError: ...": not the
    lines after a message of several (a CUDA error ends "Compile with `TORCH_USE_CUDA_DSA` ..."),
    nor the "RuntimeError: Traceback (most recent call last):" Serve wraps the constructor's error
    in; the last line where none is found."""
    lines = [line for line in (re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", x).strip() for x in message.splitlines()) if line]
    raised = [m for m in map(_RAISED.match, lines)
              if m and not (m.group(3) or "").startswith("Traceback (most recent call last)")]
    if not raised:
        return lines[-1]
    name, text = raised[-1].group(1).rsplit(".", 1)[-1], raised[-1].group(3)
    return f"{name}: {text}" if text else name


def load_serve_config(path: str | None) -> tuple[dict, dict, list[str]]:
    """(app args, http options, the fields `specserve serve` does not apply) from a Serve config
    file (its one application's args, and its http_options) or from a plain YAML mapping of app
    args (no http options)."""
    if path is None:
        return {}, {}, []
    import yaml
    try:
        with open(path, encoding="utf-8") as f:
            doc = yaml.safe_load(f) or {}
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
        raise CLIError(f"cannot read config {path!r}: {e}") from None
    http: dict = {}
    unused: list[str] = []
    if isinstance(doc, dict) and "applications" in doc:
        apps = doc["applications"]
        if not apps:  # (until stop 61 served the demo pair, silently: a config that names no app is a mistake)
            raise CLIError(f"config {path!r}: applications is empty; give the one application specserve serves "
                           "(with its args), or leave --config out for the demo pair")
        if not isinstance(apps, list) or not all(isinstance(app, dict) for app in apps):
            raise CLIError(f"config {path!r}: applications must be a list of mappings (Serve's config format)")
        if len(apps) > 1:
            raise CLIError(f"config {path!r} has {len(apps)} applications; specserve serve runs one "
                           "(`serve run` deploys several)")
        http = doc.get("http_options") or {}
        if not isinstance(http, dict):
            raise CLIError(f"config {path!r}: http_options must be a mapping")
        unused = unused_serve_fields(doc)
        doc = apps[0].get("args") or {}
    if not isinstance(doc, dict):
        raise CLIError(f"config {path!r} must be a mapping of app args or a Serve config")
    return doc, http, unused


def unused_serve_fields(doc: dict) -> list[str]:
    """The fields of a Serve config of one application (checked by `load_serve_config`) that
    `specserve serve` would not apply: it runs the app's args at route / under its own name, with
    http_options' host and port (a name, proxy_location, and this app's own import path and route
    / change nothing there)."""
    app = (doc.get("applications") or [{}])[0]
    unused = [str(key) for key in doc if key not in ("applications", "http_options", "proxy_location")]
    unused += [f"http_options.{key}" for key in (doc.get("http_options") or {}) if key not in ("host", "port")]
    unused += [str(key) for key in app if key not in ("name", "args", "route_prefix", "import_path")]
    unused += [f"{key} ({app[key]})" for key, ours in (("route_prefix", "/"), ("import_path", APP_IMPORT_PATH))
               if app.get(key, ours) != ours]
    return unused


def load_app_args(path: str | None) -> dict:
    """App args from a Serve config file or a plain YAML mapping of args (`load_serve_config`)."""
    return load_serve_config(path)[0]


def serve_settings(args) -> tuple[dict, str, int]:
    """`serve`'s app args, host and port: each from its flag, else the config file, else the
    default; the API key from --api-key, else the config, else $SPECSERVE_API_KEY, read here (the
    ingress replica's process, perhaps on another node, may not have the variable)."""
    app_args, http, unused = load_serve_config(args.config)
    if unused:  # (until stop 52 dropped silently)
        print(f"warning: config {args.config!r}: `specserve serve` takes its app's args and http_options' host "
              f"and port only; it ignores {', '.join(unused)} (`serve run {args.config}` applies them)",
              file=sys.stderr, flush=True)
    host = args.host if args.host is not None else http.get("host", DEFAULT_HOST)
    port = args.port if args.port is not None else http.get("port", DEFAULT_PORT)
    if (args.target is not None and args.drafter is None and "drafter" not in app_args and not args.no_speculation
            and args.k != 0):
        raise CLIError("--drafter is required with --target (or pass --no-speculation)")  # as `generate`
    if args.drafter is not None and args.target is None and "target" not in app_args:  # (it paired the demo
        raise CLIError("--drafter given without --target")                            # target, silently)
    if not _is_port(port):
        raise CLIError(f"the port must be an integer in [1, 65535], got {port!r}")
    if not isinstance(host, str) or not host:
        raise CLIError(f"the host must be a non-empty string, got {host!r}")
    for key in ("target", "drafter", "k", "num_pairs", "max_num_seqs", "device", "dtype", "compile", "speculation",
                "colocate", "draft_vocab", "model"):
        if getattr(args, key) is not None:
            app_args[key] = getattr(args, key)
    if args.no_speculation:
        app_args["drafter"], app_args["k"] = None, 0
    # (`--api-key "$KEY"` with $KEY unset served with no key, silently, until stop 60)
    if args.api_key is not None and not args.api_key.strip():
        raise CLIError("--api-key is empty: give the key the server should require, or leave the flag out")
    api_key = args.api_key if args.api_key is not None else app_args["api_key"] if app_args.get("api_key") is not None \
        else env_api_key()  # (a config's empty api_key is refused with the config, not replaced by the variable)
    if api_key:
        app_args["api_key"] = api_key
    elif os.environ.get("SPECSERVE_API_KEY") is not None:
        print("warning: SPECSERVE_API_KEY is set but blank: /v1/* will require no key", file=sys.stderr)
        # said once: the Ray workers this process starts inherit its environment, and the ingress
        # (which says it under `serve run` and KubeRay) said it again until stop 61
        del os.environ["SPECSERVE_API_KEY"]
    return app_args, host, port


def _is_port(port) -> bool:
    return isinstance(port, int) and not isinstance(port, bool) and 1 <= port <= 65535


def _port_taken(host: str, port: int) -> str | None:
    """Why this machine cannot listen at (host, port), or None: Serve's proxy binds it in an actor
    of its own, and a port in use left `serve` saying it served while nothing of ours listened.
    A port in use says so, with a hint."""
    import socket
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # (as the proxy: a port in TIME_WAIT is free)
        try:
            s.bind((host, port))
        except OSError as e:
            why = e.strerror or str(e)
            return f"{why} (another server? pass --port)" if e.errno == errno.EADDRINUSE else why
        except ValueError as e:  # (a host name socket cannot take at all, UnicodeError among them)
            return str(e)
    return None


class Terminated(KeyboardInterrupt):
    """SIGTERM before `serve` is up: the command ends as at Ctrl-C, with 143 (until stop 63 Ray's own
    handlers ended it with a stack dump and 134, or with 15, by when it came)."""


def _terminated(signum, frame):
    raise Terminated()


def _default_signals() -> None:
    """On the way out after Ctrl-C or a SIGTERM: another signal takes its default action, not a
    handler raising inside Ray's own shutdown at exit."""
    import signal
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_DFL)


def cmd_serve(args) -> int:
    import signal

    signal.signal(signal.SIGTERM, _terminated)  # (again once Ray has started: it sets its own; until the banner)
    app_args, host, port = serve_settings(args)
    try:
        cfg = SpecServeConfig.from_dict(app_args)
    except (TypeError, ValueError) as e:
        raise CLIError(str(e)) from None
    quiet_transformers()
    from specserve.builder import check_pair
    from specserve.core.runner import ModelLoadError
    try:
        check_pair(cfg)  # fail fast, here, on a wrong path or a mismatched pair
    except (ValueError, ModelLoadError) as e:
        raise CLIError(str(e)) from None
    import ray
    from ray import serve

    from specserve.cluster.pair import ensure_ray, starts_ray
    from specserve.cluster.serve_app import build_app
    taken = _port_taken(host, port) if starts_ray() else None  # (a cluster joined may run Serve's proxy there)
    if taken:
        raise CLIError(f"cannot listen at {host}:{port}: {taken}")
    try:
        fresh = ensure_ray()
    except SystemExit as e:  # SIGTERM while Ray starts: its handler's sys.exit(15)
        if e.code == signal.SIGTERM:
            raise Terminated() from None
        raise
    signal.signal(signal.SIGTERM, _terminated)
    have = ray.cluster_resources()
    if str(cfg.device).startswith("cuda") and cfg.use_gpu is None and not have.get("GPU"):  # the actors would
        # die loading, Serve retrying each: until stop 59 told as "Failed to update the deployments" (use_gpu: false
        # is left alone: a process may see a GPU that Ray does not count, and Ray 2.60 hides none from an actor)
        raise CLIError(f"device {cfg.device!r} runs the models on GPUs, but the Ray cluster has none "
                       "(joining a cluster, use_gpu: true in a config waits for GPU nodes to join it)")
    short = {name: (amount, have.get(name, 0.0)) for name, amount in cfg.resources().items()
             if have.get(name, 0.0) < amount}
    if short:  # Serve would wait for them for good, silently
        what = ", ".join(f"{need:g} {name} (it has {got:g})" for name, (need, got) in short.items())
        msg = (f"the app reserves {what}: {cfg.num_pairs} pair(s) of {len(cfg.bundles())} actor(s), "
               f"cpus_per_actor {cfg.cpus_per_actor:g}" + (f", gpus_per_actor {cfg.gpus_per_actor:g}" if cfg.gpu() else ""))
        if fresh:  # the local Ray this command started: nothing will join it
            # (the hint named cpus_per_actor for a GPU shortfall too until stop 61)
            no_gpu = "GPU" in short and not have.get("GPU")
            fixes = " or ".join(["fewer pairs"] + (["a smaller cpus_per_actor"] if "CPU" in short else [])
                                + (["a smaller gpus_per_actor"] if "GPU" in short and not no_gpu else []))
            if no_gpu:  # (nothing GPU-sized fits a cluster without GPUs)
                fixes = "use_gpu: false with device cpu, the models on the CPU" + (f"; then {fixes}" if "CPU" in short else "")
            raise CLIError(f"{msg}; this machine's Ray cannot place it ({fixes} would fit)")
        print(f"warning: {msg}; the Ray cluster joined has less now, so the app starts once it grows",
              file=sys.stderr, flush=True)
    try:
        serve.start(http_options={"host": host, "port": port})
    except Exception as e:  # HAProxy that could not start (a port another process took since): its own alerts
        alerts = [m.group(1).strip() for m in re.finditer(r"\[ALERT\][^:]*:(.*)", str(e))]
        why = "; ".join(alerts) or last_line(e, type(e).__name__)
        hint = " (RAY_SERVE_ENABLE_HA_PROXY=0 in the environment runs Serve's proxy instead of HAProxy)" \
            if alerts and fresh else ""
        raise CLIError(f"Serve's HTTP entry did not start: {why}{hint}") from None
    # (the HAProxy of the Ray started here, to stop on the ways out that skip Serve's shutdown)
    haproxy = f"/{ray.get_runtime_context().get_node_id()}/" \
        if fresh and os.environ.get("RAY_SERVE_ENABLE_HA_PROXY") == "1" else None

    def leave(code: int):
        _stop_haproxy(haproxy)
        os._exit(code)
    # serve.run connects to the Serve that serve.start just started with our host and port, and logs that
    # "New http_options/controller_options will not be applied" (at every start until stop 62): not so here
    # (a Serve this command found already running was told of by serve.start, which checked the options)
    said_by_run = logging.getLogger("ray.serve")
    quiet = _Without("New http_options/controller_options will not be applied")
    said_by_run.addFilter(quiet)
    try:
        serve.run(build_app(app_args), name="specserve", route_prefix="/", blocking=False)
    except Exception as e:  # a replica that could not start: a device it lacks, weights that do not load, ...
        error = CLIError(f"the app did not start: {deploy_failure('specserve') or last_line(e, type(e).__name__)} "
                         "(the replica's log under /tmp/ray/session_latest/logs/serve has the rest)")
        _without_serve(haproxy)
        raise error from None
    except BaseException:  # a Ctrl-C or SIGTERM (Terminated) while it starts
        _without_serve(haproxy)
        raise
    finally:
        said_by_run.removeFilter(quiet)
    shown = "localhost" if host in ("0.0.0.0", "127.0.0.1", "::", "::1") else f"[{host}]" if ":" in host else host
    url = f"http://{shown}:{port}"
    auth = "" if not cfg.api_key else ' -H "Authorization: Bearer $SPECSERVE_API_KEY"' \
        if os.environ.get("SPECSERVE_API_KEY") == cfg.api_key else " -H 'Authorization: Bearer <your API key>'"
    # (the variable as the shell has it: one with a newline at its end would break the header)
    # (the key itself is kept out of the banner, and so out of logs; the body quoted for the shell, whatever the name)
    body = json.dumps({"model": cfg.model, "prompt": "def fibonacci(n):", "max_tokens": 64, "temperature": 0})
    stop: list[int] = []  # a plain flag: a handler that set a threading.Event could run while the main
    # thread held that Event's lock (inside its wait) and deadlock on it, as a Ctrl-C once did here

    def stopping(signum, _):
        if stop:  # a second signal before the loop woke: at once, as after it
            leave(128 + signum)
        stop.append(signum)

    for sig in (signal.SIGINT, signal.SIGTERM):  # ours, whatever Ray installed or the parent left ignored
        signal.signal(sig, stopping)
    print(f"specserve is serving {cfg.model!r} at {url}  (Ctrl-C stops it)\n\n"
          f"  curl {url}/v1/completions -H 'Content-Type: application/json'{auth} \\\n"
          f"    -d {shlex.quote(body)}\n", flush=True)
    exited = _ray_exited()  # (a Ray process that exited before the signal, its dashboard say, is not the signal's)
    while not stop:  # wakes twice a second, so the handlers run (they run between bytecodes)
        time.sleep(0.5)
        exited = _ray_exited() if not stop else exited
    signal.signal(signal.SIGINT, lambda *_: leave(130))  # a second Ctrl-C, or SIGTERM, exits at once
    signal.signal(signal.SIGTERM, lambda *_: leave(143))
    gone = _ray_stopped_too(exited) if fresh else []
    if gone:  # nothing left to drain, or to shut down: the drain would wait on Ray's GCS for 60 s, then fail
        _say(f"Ray's own processes ({', '.join(gone)}) were stopped by the same signal (sent to the whole process "
             "group, or by systemd's control-group kill): the requests in flight are lost; exiting. Signal this "
             "process alone (under systemd: KillMode=mixed) for a drain", file=sys.stderr)
        leave(1)
    limit = args.shutdown_timeout + CUT_OFF_WAIT_S + 3 * DRAIN_CALL_S
    if not _bounded(lambda: drain(args.shutdown_timeout), limit):  # (Serve's controller not answering, say)
        _say(f"the drain did not end within {limit:.0f} s; shutting down", file=sys.stderr)
    for what, step in (("Ray Serve", serve.shutdown), ("Ray", ray.shutdown)):
        t0 = time.monotonic()
        if not _bounded(step, SHUTDOWN_STEP_S):
            _say(f"{what} did not shut down within {SHUTDOWN_STEP_S:.0f} s; its threads, for a bug report:",
                 file=sys.stderr)
            import faulthandler
            with contextlib.suppress(OSError, ValueError):
                faulthandler.dump_traceback(file=sys.stderr)
        else:
            _say(f"{what} stopped in {time.monotonic() - t0:.1f} s")
    _say("stopped")
    with contextlib.suppress(OSError, ValueError):
        sys.stderr.flush()
    leave(0)  # (os._exit: threads that Ray or Serve left behind must not hold the process at exit)


SHUTDOWN_STEP_S = 60.0
RAY_STOPPED_WAIT_S = 1.0  # for Ray's processes to exit, if the signal reached them too
DRAIN_POLL_S = 0.25
DRAIN_SETTLE_S = 0.5  # after the last completion's end is handed to Serve, for Serve to send it
CUT_OFF_WAIT_S = 5.0  # for the ends of the completions cut off (their error events) to be sent
DRAIN_CALL_S = 10.0  # a broadcast to the ingress replicas answers within this, or counts as not known


def _say(*args, **kwargs) -> None:
    """print, for the shutdown: a stdout or stderr closed meanwhile (a pipe's reader gone) must not
    stop it (an exception there went to Ray's excepthook, which hung on Ray's GCS)."""
    try:
        print(*args, **kwargs, flush=True)
    except (OSError, ValueError):
        pass


def _without_serve(haproxy: str | None) -> None:
    """The way out before the banner, the app not started: Ray's own shutdown (as at exit), then
    its HAProxy (`_stop_haproxy`), which Ray's shutdown alone left holding the port."""
    if haproxy:
        import ray
        with contextlib.suppress(Exception):
            ray.shutdown()
        _stop_haproxy(haproxy)


def _stop_haproxy(node_dir: str | None) -> None:
    """Kills the HAProxy processes of the local Ray this command started (their config under
    /tmp/haproxy-serve/<node id>/, `node_dir` that id between slashes; None: none of ours). Serve's
    shutdown stops them; a SIGTERM to the whole process group stops Ray's processes without it,
    and their HAProxy, in a session of its own, went on holding the port (stop 64)."""
    if not node_dir:
        return
    killed: list[str] = []
    for pid in os.listdir("/proc"):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:  # (not a process, or gone)
            continue
        if any(node_dir.encode() + b"haproxy.cfg" in arg for arg in argv):
            with contextlib.suppress(OSError):
                os.kill(int(pid), 9)  # (SIGKILL)
                killed.append(pid)
    deadline = time.monotonic() + 1.0  # (gone, its port with it, before the command exits)
    while any(os.path.exists(f"/proc/{pid}") for pid in killed) and time.monotonic() < deadline:
        time.sleep(0.05)


def _ray_exited() -> set[str]:
    """The kinds of the local Ray's processes (this command started them) that have exited. (Ray
    2.60's private `Node`: without it, none known.)"""
    try:
        from ray._private.worker import _global_node as node
        return {kind for kind, _ in node.dead_processes()}
    except Exception:
        return set()


def _ray_stopped_too(before: set[str]) -> list[str]:
    """The kinds of the local Ray's processes that exited since `before`, within RAY_STOPPED_WAIT_S:
    a signal sent to the process group (a shell's `kill %1`) or to a cgroup stops them with this one."""
    deadline = time.monotonic() + RAY_STOPPED_WAIT_S
    while True:
        gone = sorted(_ray_exited() - before)
        if gone or time.monotonic() > deadline:
            return gone
        time.sleep(0.1)


def drain(timeout_s: float) -> None:
    """`serve`'s shutdown, before Serve's: every ingress replica stops taking completions (503
    `server_shutting_down`; /health 503 "draining"), and the ones in flight have up to timeout_s
    to finish; those still running then end with an error (`OpenAIIngress.drain`, `cut_off`).
    An ingress that does not answer counts as one with completions in flight, until the time is up."""
    from ray import serve

    try:
        ingress = serve.get_app_handle("specserve")
    except Exception as e:  # (the app gone already: nothing to drain)
        _say(f"shutting down (the app did not answer: {last_line(e, type(e).__name__)})")
        return
    trouble: list[str] = []

    def in_flight(method: str) -> int | None:
        """The completions in flight over the ingress replicas, or None if one did not answer."""
        try:
            answers = ingress.broadcast(method).results(timeout_s=DRAIN_CALL_S, return_exceptions=True)
        except Exception as e:
            answers = [e]
        failed = [a for a in answers if not isinstance(a, int)]
        if failed:
            trouble.append(last_line(failed[0], type(failed[0]).__name__) if isinstance(failed[0], BaseException)
                           else repr(failed[0]))
            return None
        return sum(answers)

    t0 = time.monotonic()
    n = first = in_flight("drain")
    if n == 0 or timeout_s == 0:
        _say("shutting down (Ctrl-C again to exit at once)")
    else:
        what = f"{n} request(s) in flight" if n else f"the ingress did not answer ({trouble[-1]})"
        _say(f"shutting down: {what}; new ones get a 503; waiting up to {timeout_s:g} s for them to finish "
             "(--shutdown-timeout; Ctrl-C again to exit at once)")
    while n != 0 and time.monotonic() - t0 < timeout_s:
        time.sleep(DRAIN_POLL_S)
        n = in_flight("drain")
    if n != 0:
        n = in_flight("cut_off")
        _say(f"{'the' if n is None else n} request(s) still in flight after {timeout_s:g} s end with an error "
             "(server_shutting_down)")
        t1 = time.monotonic()
        while n != 0 and time.monotonic() - t1 < CUT_OFF_WAIT_S:
            time.sleep(DRAIN_POLL_S)
            n = in_flight("drain")
    elif first:
        _say(f"the requests in flight finished in {time.monotonic() - t0:.1f} s")
    if trouble:
        _say(f"an ingress replica did not answer the drain: {trouble[-1]}", file=sys.stderr)
    time.sleep(DRAIN_SETTLE_S)


DEFAULT_HOST, DEFAULT_PORT = "0.0.0.0", 8000


def _bounded(fn, seconds: float) -> bool:
    """Runs fn on a daemon thread; whether it returned within `seconds` (it is left behind if not)."""
    import threading
    t = threading.Thread(target=fn, name=f"shutdown-{getattr(fn, '__name__', 'step')}", daemon=True)
    t.start()
    t.join(seconds)
    return not t.is_alive()


def cmd_make_tiny_pair(args) -> int:
    quiet_transformers()
    make_tiny_pair = _import("specserve.training.tiny").make_tiny_pair
    try:
        target, drafter = make_tiny_pair(args.out, seed=args.seed)
    except OSError as e:
        raise CLIError(f"cannot write the pair to {args.out!r}: {e}") from None
    print(f"wrote {target} and {drafter}")
    return 0


# Subcommands with their own argument parsers: `specserve NAME ARGS...` runs MODULE.main(ARGS).
PASSTHROUGH = {
    "train-demo": ("specserve.training.demo_pair", "train the embedded demo pair from the stdlib"),
    "distill": ("specserve.training.distill", "distill a drafter for a target"),
    "draft-vocab": ("specserve.training.draft_vocab", "rank a drafter's tokens by frequency (its draft vocabulary)"),
    "eval-demo": ("specserve.training.eval_demo", "measure the demo pair on held-out code"),
    "bench": ("specserve.benchmarks.bench", "run a benchmark and write its results"),
}


def _import(module: str):
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name and module.startswith(e.name):  # e.g. a serving image, which ships no training code
            raise CLIError(f"{module} is not installed here (serving images hold no training or benchmark "
                           "code): run this from a checkout of the repository") from None
        raise


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="specserve", description="Speculative decoding that never changes an output token.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    g = sub.add_parser("generate", help="generate text speculatively")
    g.add_argument("--target", help="local HF model folder of the target (default: the demo pair)")
    g.add_argument("--drafter", help="local HF model folder of the drafter")
    g.add_argument("--prompt", required=True)
    g.add_argument("--max-tokens", type=_positive_int("--max-tokens"), default=64)
    add_sampling_args(g)
    g.add_argument("-k", type=int, default=4, help="draft tokens per round (0 = plain decoding)")
    g.add_argument("--no-speculation", action="store_true", help="plain target decoding through the same runner")
    g.add_argument("--method", choices=["draft_model", "ngram", "none"], default=None,
                   help="the proposer (default: the drafter; ngram: prompt lookup, no drafter model)")
    g.add_argument("--speculation", choices=["adaptive", "fixed"], default="adaptive",
                   help="adaptive: the policy picks k <= -k each round (0 when it does not pay); fixed: always k")
    g.add_argument("--distributed", action="store_true", help="drafter and verifier as Ray actors over gRPC")
    g.add_argument("--no-pipeline", action="store_true", help="with --distributed: draft only when asked")
    g.add_argument("--threads", type=int, default=0,
                   help="torch threads in process (0 = torch default); --distributed actors run one each")
    g.add_argument("--json", action="store_true", help="print one JSON object: text, token_ids, stats")
    add_device_args(g, default="auto")
    g.set_defaults(func=cmd_generate)

    s = sub.add_parser("serve", help="serve the OpenAI-compatible HTTP API on Ray Serve")
    s.add_argument("--config", help="a Serve config file of one application, or a YAML of app args")
    s.add_argument("--port", type=int, default=None, help=f"default: the config's http_options, else {DEFAULT_PORT}")
    s.add_argument("--host", default=None, help=f"default: the config's http_options, else {DEFAULT_HOST}")
    s.add_argument("--target", default=None)
    s.add_argument("--drafter", default=None)
    s.add_argument("-k", type=int, default=None)
    s.add_argument("--num-pairs", dest="num_pairs", type=int, default=None)
    s.add_argument("--max-num-seqs", dest="max_num_seqs", type=int, default=None)
    s.add_argument("--no-speculation", action="store_true", help="plain decoding: no drafter and k = 0")
    s.add_argument("--colocate", action="store_const", const=True, default=None,
                   help="the drafter in each verifier's process and device (no drafter actor, no gRPC)")
    s.add_argument("--speculation", choices=["adaptive", "fixed"], default=None,
                   help="the speculation policy (default: adaptive)")
    add_device_args(s, default=None)
    s.add_argument("--served-model-name", dest="model", default=None,
                   help="the model id clients ask for, as vLLM's flag (default: the config's model, else specserve-demo)")
    s.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on /v1/* (default: the config's api_key, else "
                        "$SPECSERVE_API_KEY)")
    s.add_argument("--shutdown-timeout", dest="shutdown_timeout", type=_seconds, default=30.0, metavar="S",
                   help="at Ctrl-C or SIGTERM, new requests get a 503 and the ones in flight have up to S seconds "
                        "to finish; then those still running end with an error (default: 30; 0: at once)")
    s.set_defaults(func=cmd_serve)

    t = sub.add_parser("make-tiny-pair", help="write a tiny random target/drafter pair (for trying things out)")
    t.add_argument("out")
    t.add_argument("--seed", type=int, default=0)
    t.set_defaults(func=cmd_make_tiny_pair)

    for name, (module, help_) in PASSTHROUGH.items():  # listed here; run by main() with their own parsers
        sub.add_parser(name, help=help_, add_help=False)
    return parser


def quiet_transformers() -> None:
    """No progress bars or advisory warnings on a user's terminal."""
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()


def main(argv=None) -> int:
    try:  # (transformers is quieted by each command that loads it, after its arguments are checked)
        argv = sys.argv[1:] if argv is None else list(argv)
        if argv and argv[0] in PASSTHROUGH:
            quiet_transformers()
            from specserve.core.runner import ModelLoadError
            try:
                return _import(PASSTHROUGH[argv[0]][0]).main(argv[1:]) or 0
            except ModelLoadError as e:  # a model folder that does not load (until stop 53 a traceback)
                raise CLIError(f"{argv[0]}: {e}") from None
        args = build_parser().parse_args(argv)
        return args.func(args)
    except CLIError as e:
        print(f"specserve: error: {e}", file=sys.stderr)
        return 2
    except Terminated:
        _default_signals()
        return 143
    except KeyboardInterrupt:
        _default_signals()
        return 130


if __name__ == "__main__":
    sys.exit(main())
