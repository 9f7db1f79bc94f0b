"""Diagnostic (prints, writes no result file): what one request costs on the HTTP path, apart from
decoding. Starts `specserve serve -k K --speculation fixed` (K = 0, the default: plain decoding, the
drafter plays no part) and, in this process, the engine of the same config (its drafter in this
process); then, one request at a time, interleaved, the median
milliseconds of:

- `GET /v1/models`: HAProxy (Serve's proxy actor with RAY_SERVE_ENABLE_HA_PROXY=0 in the
  environment: `specserve.cluster.pair.serve_through_haproxy`) and the ingress, nothing else;
- a completion the ingress refuses (`max_tokens: 0`, a 400): the same plus reading the body;
- a completion of 1 token and of 64 (greedy, ignore_eos), streamed and not, against
  `engine.generate` of the same prompt ids in process: the difference is what the HTTP path adds
  (tokenizing, the ingress's call to the pair replica, its messages back, the response).

    .venv/bin/python benchmarks/diagnostics/http_request_cost.py [--port 8476] [--repeats 3] [--requests 20] [-k 0]
"""
import argparse
import contextlib
import signal
import statistics
import subprocess
import sys
import time

import torch

torch.set_num_threads(1)


def median_ms(call, ids_list) -> float:
    times = []
    for ids in ids_list:
        t0 = time.perf_counter()
        call(ids)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1000


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--port", type=int, default=8476)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--requests", type=int, default=20, help="per measurement (their median is printed)")
    p.add_argument("-k", type=int, default=0, help="the server's and the engine's k (0: plain decoding; more: the "
                   "served pair's drafter actor against the drafter in this process; speculation fixed)")
    args = p.parse_args()
    import httpx

    from specserve.builder import build_engine
    from specserve.config import REPO_ROOT, SpecServeConfig
    from specserve.core.runner import load_tokenizer
    from specserve.core.sampling import SamplingParams

    cfg = SpecServeConfig(k=args.k, speculation="fixed")
    tokenizer = load_tokenizer(cfg.target)
    texts = ["def fibonacci(n):", "import os\nimport sys\n\ndef main(argv):", "class Stack:\n    def __init__(self):",
             "for i in range(10):"]
    ids_list = [tokenizer(texts[i % len(texts)])["input_ids"] for i in range(args.requests)]
    server = subprocess.Popen([sys.executable, "-m", "specserve.cli", "serve", "--port", str(args.port), "-k", str(args.k),
                               "--speculation", "fixed"],
                              cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    stack = contextlib.ExitStack()
    try:
        lines = []
        while not any("curl " in line for line in lines):
            lines.append(server.stdout.readline())
            if not lines[-1] and server.poll() is not None:
                print("".join(lines), file=sys.stderr)
                return 1
        engine = build_engine(cfg)
        engine.start()
        stack.callback(engine.stop)
        client = httpx.Client(base_url=f"http://127.0.0.1:{args.port}", timeout=60)

        def complete(n: int, stream: bool = False):
            def call(ids):
                r = client.post("/v1/completions", json={"model": cfg.model, "prompt": ids, "max_tokens": n,
                                                         "temperature": 0, "ignore_eos": True, "stream": stream})
                assert r.status_code == 200, r.text
            return call

        def local(ids, n: int):
            req = engine.submit(ids, n, SamplingParams(), args.k, ignore_eos=True)
            assert req.done.wait(60) and len(req.result().token_ids) == n

        rows = {
            "GET /v1/models": lambda ids: client.get("/v1/models"),
            "a 400 from the ingress (max_tokens 0)": lambda ids: client.post(
                "/v1/completions", json={"model": cfg.model, "prompt": ids, "max_tokens": 0}),
            "1 token: served": complete(1),
            "1 token: served, streamed": complete(1, True),
            "1 token: in process": lambda ids: local(ids, 1),
            "64 tokens: served": complete(64),
            "64 tokens: served, streamed": complete(64, True),
            "64 tokens: in process": lambda ids: local(ids, 64),
        }
        for call in rows.values():  # warm-up
            call(ids_list[0])
        runs = {name: [] for name in rows}
        for _ in range(args.repeats):
            for name, call in rows.items():
                runs[name].append(median_ms(call, ids_list))
        print(f"median ms per request ({args.requests} requests a run, one at a time; median of {args.repeats} runs, "
              "every run's in brackets):")
        for name, ms in runs.items():
            print(f"  {name}: {statistics.median(ms):.1f}  [{', '.join(f'{x:.1f}' for x in ms)}]")
        for n in (1, 64):
            added = statistics.median(runs[f"{n} token{'s' if n > 1 else ''}: served"]) - \
                statistics.median(runs[f"{n} token{'s' if n > 1 else ''}: in process"])
            print(f"  the HTTP path adds {added:.1f} ms to a request of {n} token{'s' if n > 1 else ''}")
        return 0
    finally:
        stack.close()
        server.send_signal(signal.SIGINT)
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            server.kill()


if __name__ == "__main__":
    sys.exit(main())
