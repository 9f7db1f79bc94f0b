"""Shared by the endpoint benchmarks (`bench soak`, `bench fuzz`): target a live endpoint with
--url, or start one here (a local Ray + Serve with the usual config) and stop it afterwards."""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
from dataclasses import dataclass
from typing import Callable


@dataclass
class Endpoint:
    url: str
    app: str  # the Serve application name (for its PairReplica handle), when reachable through Ray
    model: str
    api_key: str | None
    stop: Callable[[], None]
    started_here: bool


def add_endpoint_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", help="a live endpoint (default: start one here)")
    p.add_argument("--app", default="specserve", help="its Serve application name (for drafter kills and RSS)")
    p.add_argument("--model", default=None, help="model name to request (default: the config's)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--config", help="when starting one: a Serve config or YAML of app args")
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument("--max-waiting", type=int, default=None)
    p.add_argument("--num-pairs", type=int, default=None)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def open_endpoint(args) -> Endpoint:
    from specserve.cli import load_app_args
    from specserve.config import SpecServeConfig

    app_args = load_app_args(args.config)
    for key in ("max_num_seqs", "max_waiting", "num_pairs"):
        if getattr(args, key) is not None:
            app_args[key] = getattr(args, key)
    cfg = SpecServeConfig.from_dict(app_args)
    model = args.model or cfg.model
    if args.url:
        return Endpoint(args.url.rstrip("/"), args.app, model, args.api_key, lambda: None, False)
    from ray import serve

    from specserve.cluster.pair import ensure_ray
    from specserve.cluster.serve_app import build_app
    ensure_ray()
    port = _free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(build_app(cfg.to_dict()), name=args.app, route_prefix="/")

    def stop():
        import ray
        serve.shutdown()
        ray.shutdown()
    return Endpoint(f"http://127.0.0.1:{port}", args.app, model, cfg.resolved_api_key(), stop, True)


def ray_reachable() -> bool:
    """Whether this process can reach the endpoint's Ray cluster (started here, or RAY_ADDRESS)."""
    import ray
    if ray.is_initialized():
        return True
    try:
        ray.init(address="auto", logging_level="ERROR", log_to_driver=False)
        return True
    except Exception:
        return False


def check_url(p: argparse.ArgumentParser, url: str | None) -> None:
    """--url: a server answers there (any status: one starting says 503), told before the run.
    Until stop 61 `bench fuzz` fired its requests into refused connections and then raised at its
    closing /health, and `bench serve` counted them all failed."""
    if not url:
        return
    import httpx
    try:
        httpx.get(url.rstrip("/") + "/health", timeout=10)
    except (httpx.UnsupportedProtocol, httpx.InvalidURL) as e:
        p.error(f"--url {url}: not an http(s) URL ({e})")
    except httpx.TimeoutException:  # (a server too busy to answer in time is still there)
        print(f"warning: --url {url}: /health did not answer within 10 s", file=sys.stderr)
    except httpx.HTTPError as e:
        p.error(f"--url {url}: no server answers there ({type(e).__name__}: {e})")


def out_prefix(out: str) -> str:
    """argparse type of every bench's --out (a path prefix: OUT.json, OUT.md, OUT.png): makes its
    folder and checks that it takes files, when the flags are parsed. Until stop 61 a bench found out
    only when it wrote, after a run of minutes, whose results were then lost: `bench soak` with a
    new folder (its plot came before the folder), `bench batching` with a bare name."""
    folder = os.path.dirname(os.path.abspath(out))
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as e:
        raise argparse.ArgumentTypeError(f"cannot make the folder {folder!r}: {e.strerror}") from None
    if not os.access(folder, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"cannot write in the folder {folder!r}")
    return out


def write_results(out: str, report: dict, md: str) -> None:
    """OUT.json and OUT.md (a PNG, if any, is written by the bench itself), and the Markdown on stdout.
    OUT's folder was made when the flags were read (`out_prefix`)."""
    with open(out + ".json", "w") as f:
        f.write(json.dumps(report, indent=1) + "\n")
    with open(out + ".md", "w") as f:
        f.write(md)
    print(md)
