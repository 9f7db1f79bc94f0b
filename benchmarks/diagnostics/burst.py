"""Diagnostic (prints, writes no result file): N completions sent at once, with one /health call
beside them, to the app at the default config (demo pair; 8 sequences run and 64 wait, so 72 are
admitted), three bursts: right after it is up, and twice more. Prints each burst's status codes
and the distinct bodies of what was not 200.

Stop 57, before 3a12cfa (each caller's Serve queue held HEADROOM = 16 requests), N = 40: 9, 12
and 6 of the 41 answered with Serve's plain-text 503 "Request dropped due to backpressure
(num_queued_requests=16, max_queued_requests=16)". With the queues holding what the app admits
(stop 57's final code): 41 of 41 answered 200 in each burst; N = 150: 96, 105 and 99 answered 200,
the rest the engine's OpenAI-style 503 "overloaded: 8 running and 64 waiting requests".

Stop 59, N = 1000 (the status codes, "plain text" for answers not in the API's JSON): before
cb64bc9, 667 to 682 of the 1001 answers in each of three bursts were Serve's plain-text 503
"Request dropped due to backpressure (num_queued_requests=88, max_queued_requests=88)"; since (the
ingress takes BURST = 1024 more requests only to answer them the API's 503), none in three bursts,
with as many 200s (237-308 before, 275-315 since).

Stop 64, N = 1000, through HAProxy (`specserve.cluster.pair.serve_through_haproxy`, straight to
the ingress replica): 269, 254 and 274 of the 1001 answered 200, the rest the API's 503 in its JSON
shape (the pairs' Serve queue full, or the engine's queue bound); no plain-text answer.

    .venv/bin/python benchmarks/diagnostics/burst.py 40     # N
"""
import argparse
import asyncio
import collections

import httpx

from specserve.benchmarks.endpoint import add_endpoint_args, open_endpoint


async def burst(url: str, model: str, n: int) -> tuple[dict, set]:
    body = {"model": model, "prompt": "def f(x):", "max_tokens": 4, "temperature": 0}
    async with httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_connections=n + 8)) as ac:
        answers = await asyncio.gather(*[ac.post(url + "/v1/completions", json=body) for _ in range(n)],
                                       ac.get(url + "/health"))
    return (dict(collections.Counter(
        r.status_code if r.headers.get("content-type", "").startswith("application/json") else f"{r.status_code} plain text"
        for r in answers)), {r.text[:160] for r in answers if r.status_code != 200})


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("n", type=int, nargs="?", default=40, help="completions per burst")
    add_endpoint_args(p)  # (by default the app is started here, as the benches do)
    args = p.parse_args()
    ep = open_endpoint(args)
    try:
        for tag in ("fresh", "again", "again"):
            codes, odd = asyncio.run(burst(ep.url, ep.model, args.n))
            print(tag, codes, odd, flush=True)
    finally:
        ep.stop()


if __name__ == "__main__":
    main()
