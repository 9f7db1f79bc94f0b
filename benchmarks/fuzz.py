"""`specserve bench fuzz`: generated bad requests against the HTTP endpoint. The goal: no 5xx,
every error an OpenAI-style body, and the server still answers afterwards.

    specserve bench fuzz --requests 10000

Each request is drawn from a family of malformed input: bytes that are not JSON or not UTF-8,
JSON that is not an object, NaN / Infinity / 1e400 literals, wrong types and out-of-range values
for every field, absurd temperatures, huge or odd prompts and stop lists, chat messages of the
wrong shape, unknown models, wrong methods and paths, a wrong Authorization header. A few
well-formed small requests are mixed in (they must answer 200). Writes OUT.json and OUT.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from collections import Counter

from specserve.benchmarks.endpoint import add_endpoint_args, check_url, open_endpoint, out_prefix, write_results
from specserve.config import REPO_ROOT

RESULTS_DIR = REPO_ROOT / "docs" / "benchmarks"
FIELDS = ["model", "prompt", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stream", "n",
          "speculative", "ignore_eos", "messages", "user"]


def junk(rng: random.Random, depth: int = 0):
    """A random JSON value of any type, often an awkward one."""
    makers = [
        lambda: None, lambda: True, lambda: rng.randint(-2**70, 2**70),
        lambda: rng.choice([-1, 0, 1, 2**31, 2**63, -2**63]), lambda: rng.uniform(-1e6, 1e6),
        lambda: rng.choice([1e-300, 1e308, -0.0, 5e-324]),
        lambda: "".join(chr(rng.randrange(0x20, 0x2FFF)) for _ in range(rng.randint(0, 30))),
        lambda: rng.choice(["", " ", "\x00", "\ud800", "🙂" * 50, "a" * 5000]),
        lambda: [rng.randint(-5, 10**6) for _ in range(rng.randint(0, 8))],
        lambda: [junk(rng, depth + 1) for _ in range(rng.randint(0, 4))],
        lambda: {str(junk(rng, 2))[:10]: junk(rng, depth + 1) for _ in range(rng.randint(0, 4))},
        lambda: {"enabled": junk(rng, 2), "k": junk(rng, 2), "method": junk(rng, 2)},
    ]
    return makers[rng.randrange(len(makers) if depth < 2 else 9)]()


def bad_request(rng: random.Random, model: str) -> tuple[str, str, bytes, dict]:
    """(method, path, body bytes, headers)."""
    base = {"model": model, "prompt": "def f(x):", "max_tokens": 4}
    family = rng.randrange(12)
    headers = {"Content-Type": "application/json"}
    path = rng.choice(["/v1/completions", "/v1/completions", "/v1/chat/completions"])
    if family == 0:  # not JSON at all
        body = bytes(rng.randrange(256) for _ in range(rng.randint(0, 200)))
    elif family == 1:  # truncated or broken JSON
        s = json.dumps(base)
        body = s[:rng.randrange(len(s))].encode()
    elif family == 2:  # non-numbers JSON accepts only as literals
        lit = rng.choice(["NaN", "Infinity", "-Infinity", "1e400", "-1e400"])
        body = (f'{{"model": "{model}", "prompt": "x", "max_tokens": 4, '
                f'"{rng.choice(["temperature", "top_p", "max_tokens", "seed"])}": {lit}}}').encode()
    elif family == 3:  # not an object
        body = json.dumps(junk(rng, 1) if rng.random() < 0.5 else [base]).encode()
    elif family == 4:  # one field with a junk value
        body = json.dumps({**base, rng.choice(FIELDS): junk(rng)}).encode()
    elif family == 5:  # several junk fields, some unknown
        d = dict(base)
        for _ in range(rng.randint(1, 5)):
            d[rng.choice(FIELDS + ["logprobs", "best_of", "x" * 50])] = junk(rng)
        body = json.dumps(d).encode()
    elif family == 6:  # absurd sampling values
        body = json.dumps({**base, rng.choice(["temperature", "top_p", "top_k"]): rng.choice(
            [1e-300, 1e-30, 1e-4, -1e-9, 1e300, -5, 2.5, 0, 10**12])}).encode()
    elif family == 7:  # prompts: huge, empty, bad token ids, nested
        body = json.dumps({**base, "prompt": rng.choice([
            "word " * rng.randint(600, 3000), "", [], [[1, 2], [3]], [-1], [10**9], list(range(5000)),
            [True, False], ["a", "b"], "\x00\x01\x02"])}).encode()
    elif family == 8:  # stop lists
        body = json.dumps({**base, "stop": rng.choice([["x"] * rng.randint(17, 5000), ["y" * 10000], [1, 2],
                                                       [""] * 10, [None], "z" * 300])}).encode()
    elif family == 9:  # chat messages of the wrong shape
        path = "/v1/chat/completions"
        body = json.dumps({"model": model, "messages": rng.choice([
            None, [], "hi", [{"role": "user"}], [{"content": "x"}], [{"role": 1, "content": 2}],
            [{"role": "user", "content": ["a"]}], [[]], junk(rng)])}).encode()
    elif family == 10:  # wrong method / path / headers
        method = rng.choice(["GET", "PUT", "DELETE", "PATCH"])
        return method, rng.choice(["/v1/completions", "/v1/nothing", "/v2/x", "/%00", "/v1/models/../x"]), b"", {}
    else:  # wrong model, bad auth header, or a well-formed request (must be a 200)
        choice = rng.randrange(3)
        if choice == 0:
            body = json.dumps({**base, "model": rng.choice(["", "gpt-4", model + "x", "a" * 1000])}).encode()
        elif choice == 1:
            headers = {**headers, "Authorization": rng.choice(["Bearer", "Basic abc", "Bearer " + "k" * 5000, "Token abc"])}
            body = json.dumps(base).encode()
        else:
            body = json.dumps({**base, "temperature": rng.choice([0, 0.7]), "stream": rng.random() < 0.5}).encode()
            return "POST", "/v1/completions", body, {**headers, "X-Well-Formed": "1"}
    if rng.random() < 0.1:
        headers = {"Content-Type": rng.choice(["text/plain", "application/x-www-form-urlencoded", "\x7f"])}
    return "POST", path, body, headers


async def fire(ac, ep, rng, n, results, bar):
    for _ in range(n):
        method, path, body, headers = bad_request(rng, ep.model)
        if ep.api_key and "Authorization" not in headers:
            headers = {**headers, "Authorization": f"Bearer {ep.api_key}"}
        rec = {"family_path": path, "well_formed": "X-Well-Formed" in headers}
        try:
            r = await ac.request(method, ep.url + path, content=body, headers=headers)
            rec["code"] = r.status_code
            if r.status_code >= 400:
                try:
                    err = r.json()["error"]
                    rec["openai_shape"] = set(err) == {"message", "type", "param", "code"}
                except Exception:
                    rec["openai_shape"] = False
                if not rec["openai_shape"]:
                    rec["odd"] = {"method": method, "path": path, "body": body[:200].decode("utf-8", "replace"),
                                  "response": r.text[:200]}
                if r.status_code >= 500:
                    rec["sample"] = {"method": method, "path": path, "body": body[:300].decode("utf-8", "replace"),
                                     "response": r.text[:300]}
        except Exception as e:
            rec["code"], rec["sample"] = f"exception:{type(e).__name__}", {"path": path, "error": str(e)[:300]}
        results.append(rec)
        bar.update()


def run(args) -> dict:
    ep = open_endpoint(args)
    try:
        results: list[dict] = []

        async def main():
            import httpx
            from tqdm import tqdm
            per = [args.requests // args.concurrency + (i < args.requests % args.concurrency)
                   for i in range(args.concurrency)]
            with tqdm(total=args.requests, desc="fuzz", disable=not sys.stderr.isatty()) as bar:
                async with httpx.AsyncClient(timeout=120) as ac:
                    await asyncio.gather(*(fire(ac, ep, random.Random(args.seed * 1000 + i), n, results, bar)
                                           for i, n in enumerate(per)))
                    try:
                        health = (await ac.get(ep.url + "/health")).status_code
                    except httpx.HTTPError as e:  # (gone during the run: the report says so)
                        health = f"exception:{type(e).__name__}"
            return health

        t0 = time.monotonic()
        health = asyncio.run(main())
        codes = Counter(str(r["code"]) for r in results)
        errors = [r for r in results if isinstance(r["code"], int) and 400 <= r["code"] < 500]
        return {"requests": len(results), "seconds": time.monotonic() - t0, "codes": dict(sorted(codes.items())),
                "server_errors": sum(1 for r in results if not isinstance(r["code"], int) or r["code"] >= 500),
                "errors_with_openai_body": sum(bool(r.get("openai_shape")) for r in errors),
                "client_errors": len(errors),
                "http_level_rejections": sum(1 for r in errors if not r.get("openai_shape")
                                             and r["odd"]["response"].startswith("Invalid HTTP request")),
                "well_formed": sum(r["well_formed"] for r in results),
                "well_formed_ok": sum(r["well_formed"] and r["code"] == 200 for r in results),
                "health_after": health, "samples_4xx_without_openai_body": [r["odd"] for r in results if "odd" in r][:10],
                "samples_5xx": [r["sample"] for r in results if "sample" in r][:10],
                "seed": args.seed, "started_here": ep.started_here}
    finally:
        ep.stop()


def markdown(report: dict, command: str) -> str:
    return "\n".join([
        f"Command: `{command}`", "",
        "| measure | value |", "|---|---|",
        f"| requests | {report['requests']} in {report['seconds']:.0f} s |",
        f"| responses by code | {report['codes']} |",
        f"| 5xx or broken connections | {report['server_errors']} |",
        f"| 4xx with an OpenAI-style error body | {report['errors_with_openai_body']} of {report['client_errors']} "
        f"({report['http_level_rejections']} more are the HTTP server's own 400 for an illegal header, "
        "before the app) |",
        f"| well-formed requests mixed in, answered 200 | {report['well_formed_ok']} of {report['well_formed']} |",
        f"| /health afterwards | {report['health_after']} |", "",
        *(["5xx samples:", ""] + [f"- `{json.dumps(s)[:400]}`" for s in report["samples_5xx"]]
          if report["samples_5xx"] else []), ""])


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="specserve bench fuzz", description=__doc__.split("\n\n")[0])
    add_endpoint_args(p)
    p.add_argument("--requests", type=int, default=10000)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=out_prefix, default=str(RESULTS_DIR / "fuzz"), help="writes OUT.json and OUT.md")
    return p


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = build_parser()
    args = p.parse_args(argv)
    if args.requests < 1 or args.concurrency < 1:  # (until stop 61 --concurrency 0 sent nothing and passed)
        p.error("--requests and --concurrency must be >= 1")
    check_url(p, args.url)
    report = run(args)
    write_results(args.out, report, markdown(report, "specserve bench fuzz " + " ".join(argv)))
    return 0 if report["server_errors"] == 0 and report["health_after"] == 200 else 1


if __name__ == "__main__":
    sys.exit(main())
