"""`specserve bench soak`: sustained load against the HTTP endpoint, optionally killing the
drafter's process every S seconds, to show that nothing is lost and memory stays flat.

    specserve bench soak --minutes 30 --concurrency 16 --kill-drafter-every 300

C closed-loop clients send completions back to back (held-out code prompts, half streamed, half
greedy and half sampled, 16-128 new tokens). Reported: requests, errors by code (an error event
inside a 200 stream counts as `stream_error`), p50/p99 latency, tokens/s, health states seen,
and each actor's RSS over time (ingress, pair replica = verifier, drafter) with the growth after
warm-up. Drafter kills are SIGKILLs of its process (a crash, as the OOM killer would do): it needs
this process on the same node as the drafter, as when the endpoint is started here.
Writes OUT.json, OUT.md and OUT.png.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import sys
import time
from collections import Counter
from pathlib import Path

from specserve.benchmarks.endpoint import (add_endpoint_args, check_url, open_endpoint, out_prefix, ray_reachable,
                                           write_results)
from specserve.config import DEFAULT_MODEL_DIR, REPO_ROOT

RESULTS_DIR = REPO_ROOT / "docs" / "benchmarks"
ROLES = {"OpenAIIngress": "ingress", "PairReplica": "verifier (pair replica)", "DrafterActor": "drafter"}


def text_prompts(n: int, seed: int = 0, max_chars: int = 1500) -> list[str]:
    """Snippets of held-out stdlib code (the demo pair's split), or plain code lines without it."""
    from specserve.training.demo_pair import heldout_files
    rng = random.Random(seed)
    split = DEFAULT_MODEL_DIR / "split.json"
    files = sorted(heldout_files(str(split))) if split.exists() else []
    prompts = []
    while files and len(prompts) < n:
        with open(rng.choice(files), encoding="utf-8", errors="replace") as f:
            lines = f.read().splitlines(keepends=True)
        if len(lines) > 20:
            start = rng.randrange(0, len(lines) - 10)
            snippet = "".join(lines[start:start + rng.randint(3, 15)])[:max_chars]
            if snippet.strip():
                prompts.append(snippet)
    return prompts or [f"def f{i}(x):\n    return" for i in range(n)]


def actor_pids(app: str) -> dict[str, list[int]]:
    """The live ingress, pair-replica and drafter processes, by role: from Ray's state API (needs
    the dashboard), else from the pair replica itself (no ingress then)."""
    try:
        from ray.util.state import list_actors
        out: dict[str, list[int]] = {}
        for a in list_actors(filters=[("state", "=", "ALIVE")], limit=1000):
            role = next((r for c, r in ROLES.items() if a.class_name.endswith(c)), None)
            if role and a.pid:
                out.setdefault(role, []).append(a.pid)
        return out
    except Exception:
        from ray import serve
        info = serve.get_deployment_handle("PairReplica", app).drafter_info.remote().result(timeout_s=60) or {}
        return {ROLES["PairReplica"]: [info["replica_pid"]], **({ROLES["DrafterActor"]: [info["pid"]]} if "pid" in info else {})}


def actor_rss(app: str) -> dict[str, list[tuple[int, int]]]:
    """(pid, RSS bytes) of the live ingress, pair-replica and drafter processes, by role."""
    import psutil
    out: dict[str, list[tuple[int, int]]] = {}
    try:
        found = actor_pids(app)
    except Exception:  # e.g. the replica is busy restarting its drafter: skip this sample
        return out
    for role, pids in found.items():
        for pid in pids:
            try:
                out.setdefault(role, []).append((pid, psutil.Process(pid).memory_info().rss))
            except psutil.Error:
                pass
    return out


async def client_loop(ac, ep, prompts, rng, stop_at, records):
    headers = {"Authorization": f"Bearer {ep.api_key}"} if ep.api_key else {}
    while time.monotonic() < stop_at:
        stream = rng.random() < 0.5
        body = {"model": ep.model, "prompt": rng.choice(prompts), "max_tokens": rng.randint(16, 128),
                "temperature": rng.choice([0.0, 0.8]), "seed": rng.randrange(1 << 30), "stream": stream}
        if stream:
            body["stream_options"] = {"include_usage": True}
        t0, rec = time.monotonic(), {"stream": stream}
        try:
            if stream:
                async with ac.stream("POST", ep.url + "/v1/completions", json=body, headers=headers) as r:
                    rec["code"] = r.status_code
                    async for line in r.aiter_lines():
                        if line.startswith("data: ") and line != "data: [DONE]":
                            chunk = json.loads(line[6:])
                            if "error" in chunk:
                                rec["code"] = "stream_error"
                                rec["error"] = chunk["error"]["message"][:300]
                            elif chunk.get("usage"):
                                rec["tokens"] = chunk["usage"]["completion_tokens"]
            else:
                r = await ac.post(ep.url + "/v1/completions", json=body, headers=headers)
                rec["code"] = r.status_code
                if r.status_code == 200:
                    rec["tokens"] = r.json()["usage"]["completion_tokens"]
                else:
                    rec["error"] = r.text[:300]
        except Exception as e:  # a connection that broke: the worst outcome, counted as such
            rec["code"], rec["error"] = f"exception:{type(e).__name__}", str(e)[:300]
        rec["t"], rec["latency"] = t0, time.monotonic() - t0
        records.append(rec)


async def monitor(ac, ep, stop_at, t_start, samples, health, kills, kill_every, kill_fn, sample_every):
    next_kill = t_start + kill_every if kill_every else None
    next_sample = time.monotonic()
    while time.monotonic() < stop_at:
        now = time.monotonic()
        try:
            r = await ac.get(ep.url + "/health", timeout=10)
            health.append((now - t_start, r.status_code, r.json().get("status")))
        except Exception as e:
            health.append((now - t_start, None, type(e).__name__))
        if now >= next_sample and samples is not None:
            samples.append((now - t_start, await asyncio.to_thread(actor_rss, ep.app)))
            next_sample = now + sample_every
        if next_kill is not None and now >= next_kill:
            try:
                kills.append((now - t_start, await asyncio.to_thread(kill_fn)))
            except Exception as e:
                kills.append((now - t_start, f"kill failed: {e}"))
            next_kill = now + kill_every
        await asyncio.sleep(1.0)


def kill_drafter(app: str) -> int:
    """SIGKILLs the drafter process of the (first) pair; returns its pid."""
    from ray import serve
    pid = serve.get_deployment_handle("PairReplica", app).drafter_info.remote().result(timeout_s=60)["pid"]
    os.kill(pid, signal.SIGKILL)
    return pid


def percentile(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))] if xs else float("nan")


def summarize(records, samples, health, kills, minutes, concurrency, warmup_frac=0.1) -> dict:
    codes = Counter(str(r["code"]) for r in records)
    ok = [r for r in records if r["code"] == 200]
    lat = [r["latency"] for r in ok]
    duration = minutes * 60
    # RSS growth after warm-up, per role, for processes alive at both ends (a killed drafter is
    # measured over its last life)
    growth = {}
    warm = [s for s in samples if s[0] >= warmup_frac * duration]
    if warm:
        first, last = warm[0][1], samples[-1][1]
        for role in sorted(set(first) | set(last)):
            a, b = dict(first.get(role, [])), dict(last.get(role, []))
            common = set(a) & set(b)
            if not common and role == "drafter":
                lives = [s for s in warm if s[1].get(role)]
                pid = (last.get(role) or [(None, 0)])[0][0]
                mine = [(t, dict(s[role])[pid]) for t, s in lives if pid in dict(s[role])]
                if len(mine) >= 2:
                    growth[role] = {"pids": [pid], "from_bytes": mine[0][1], "to_bytes": mine[-1][1],
                                    "growth": mine[-1][1] / mine[0][1] - 1, "span_s": mine[-1][0] - mine[0][0],
                                    "note": "last life of a drafter that was killed"}
                continue
            if common:
                fa, fb = sum(a[p] for p in common), sum(b[p] for p in common)
                growth[role] = {"pids": sorted(common), "from_bytes": fa, "to_bytes": fb, "growth": fb / fa - 1,
                                "span_s": samples[-1][0] - warm[0][0]}
    return {
        "minutes": minutes, "concurrency": concurrency, "requests": len(records),
        "failed": len(records) - len(ok), "codes": dict(codes),
        "error_samples": [r.get("error") for r in records if r["code"] != 200][:10],
        "latency_p50_s": percentile(lat, 0.5), "latency_p99_s": percentile(lat, 0.99),
        "tokens": sum(r.get("tokens", 0) for r in ok), "tokens_per_s": sum(r.get("tokens", 0) for r in ok) / duration,
        "health_states": dict(Counter(str(h[2]) for h in health)),
        "drafter_kills": kills, "rss_growth_after_warmup": growth, "warmup_fraction": warmup_frac,
    }


def plot(path, records, samples, health, kills, t_start_records):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(3, 1, figsize=(9, 9), sharex=True)
    ts = sorted((r["t"] - t_start_records, r) for r in records)
    if ts:
        span = max(t for t, _ in ts)
        width = max(5.0, span / 60)
        bins = [i * width for i in range(int(span / width) + 2)]
        ends = [(t + r["latency"], r) for t, r in ts]  # tokens and failures count when the request ends
        tok = [sum(r.get("tokens", 0) for t, r in ends if b <= t < b + width and r["code"] == 200) / width
               for b in bins]
        bad = [sum(1 for t, r in ends if b <= t < b + width and r["code"] != 200) for b in bins]
        axes[0].plot(bins, tok, label="tokens/s (200s, by end time)")
        axes[0].bar(bins, bad, width=width, color="red", alpha=0.6, label="failed requests")
        axes[0].legend(loc="upper right")
        axes[0].set_ylabel("per second")
        p50 = [percentile([r["latency"] for t, r in ts if b <= t < b + width and r["code"] == 200], 0.5) for b in bins]
        p99 = [percentile([r["latency"] for t, r in ts if b <= t < b + width and r["code"] == 200], 0.99) for b in bins]
        axes[1].plot(bins, p50, label="p50")
        axes[1].plot(bins, p99, label="p99")
        axes[1].set_ylabel("latency (s)")
        axes[1].legend(loc="upper right")
    for role in ROLES.values():
        pts = [(t, sum(rss for _, rss in s.get(role, [])) / 2**20) for t, s in samples if s.get(role)]
        if pts:
            axes[2].plot(*zip(*pts), marker=".", label=role)
    axes[2].set_ylabel("RSS (MiB)")
    axes[2].set_xlabel("seconds")
    axes[2].legend(loc="upper right")
    for t, _ in kills:
        for ax in axes:
            ax.axvline(t, color="grey", linestyle=":", linewidth=1)
    axes[0].set_title("soak: throughput, failures, latency, memory (dotted: drafter killed)")
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def markdown(report: dict, command: str) -> str:
    lines = [f"Command: `{command}`", "", f"Started {report['started_utc']}, {report['minutes']} minutes, "
             f"concurrency {report['concurrency']}, endpoint started here: {report['started_here']}.", "",
             "| measure | value |", "|---|---|",
             f"| requests | {report['requests']} |", f"| failed (not 200) | {report['failed']} |",
             f"| responses by code | {report['codes']} |",
             f"| latency p50 / p99 (200s) | {report['latency_p50_s']:.2f} s / {report['latency_p99_s']:.2f} s |",
             f"| generated tokens/s | {report['tokens_per_s']:.1f} |",
             f"| drafter kills | {len(report['drafter_kills'])} |",
             f"| /health states seen (polled each second) | {report['health_states']} |", ""]
    if report["rss_growth_after_warmup"]:
        lines += ["RSS after warm-up (first sample past "
                  f"{report['warmup_fraction']:.0%} of the run) to the end:", "",
                  "| process | from | to | growth | over |", "|---|---|---|---|---|"]
        for role, g in report["rss_growth_after_warmup"].items():
            lines.append(f"| {role}{' (' + g['note'] + ')' if g.get('note') else ''} | {g['from_bytes'] / 2**20:.0f} MiB"
                         f" | {g['to_bytes'] / 2**20:.0f} MiB | {g['growth']:+.1%} | {g['span_s']:.0f} s |")
    if report["error_samples"]:
        lines += ["", "Error samples:", ""] + [f"- `{e}`" for e in report["error_samples"]]
    lines += ["", f"![soak]({Path(report['png']).name})", ""]
    return "\n".join(lines)


def run(args) -> dict:
    ep = open_endpoint(args)
    try:
        reachable = ray_reachable()
        if args.kill_drafter_every and not reachable:
            raise SystemExit("--kill-drafter-every needs this process connected to the endpoint's Ray cluster")
        prompts = text_prompts(200, max_chars=args.max_prompt_chars)
        records: list[dict] = []
        samples: list | None = [] if reachable else None
        health: list = []
        kills: list = []

        async def main():
            import httpx
            from tqdm import tqdm
            limits = httpx.Limits(max_connections=args.concurrency + 4)
            async with httpx.AsyncClient(timeout=args.request_timeout, limits=limits) as ac:
                t_start = time.monotonic()
                stop_at = t_start + args.minutes * 60
                rngs = [random.Random(args.seed * 1000 + i) for i in range(args.concurrency)]
                tasks = [asyncio.create_task(client_loop(ac, ep, prompts, rng, stop_at, records)) for rng in rngs]
                mon = asyncio.create_task(monitor(ac, ep, stop_at, t_start, samples, health, kills,
                                                  args.kill_drafter_every, lambda: kill_drafter(ep.app),
                                                  args.sample_every))
                with tqdm(total=int(args.minutes * 60), unit="s", desc="soak", disable=not sys.stderr.isatty()) as bar:
                    while time.monotonic() < stop_at:
                        await asyncio.sleep(1)
                        bar.n = int(time.monotonic() - t_start)
                        bar.set_postfix(requests=len(records), failed=sum(r["code"] != 200 for r in records))
                await asyncio.gather(*tasks, mon)
                if samples is not None:
                    samples.append((time.monotonic() - t_start, actor_rss(ep.app)))
                return t_start

        started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        t_start = asyncio.run(main())
        report = summarize(records, samples or [], health, kills, args.minutes, args.concurrency)
        report.update(started_utc=started, started_here=ep.started_here, url=ep.url, png=args.out + ".png",
                      rss_samples=samples or [], health=health)
        plot(args.out + ".png", records, samples or [], health, kills, t_start)
        return report
    finally:
        ep.stop()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="specserve bench soak", description=__doc__.split("\n\n")[0])
    add_endpoint_args(p)
    p.add_argument("--minutes", type=float, required=True)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--kill-drafter-every", type=float, default=0, metavar="S", help="seconds (0: never)")
    p.add_argument("--sample-every", type=float, default=10.0, help="seconds between RSS samples")
    p.add_argument("--request-timeout", type=float, default=300.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-prompt-chars", type=int, default=1500, help="keep prompts within a small model's context")
    p.add_argument("--out", type=out_prefix, default=str(RESULTS_DIR / "soak"), help="writes OUT.json, OUT.md and OUT.png")
    return p


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = build_parser()
    args = p.parse_args(argv)
    # (until stop 61 --minutes 0 divided by zero after the run; < 0 or --concurrency 0 passed with no request)
    if not args.minutes > 0 or args.concurrency < 1:
        p.error("--minutes must be > 0 and --concurrency >= 1")
    if args.kill_drafter_every < 0 or not args.sample_every > 0 or not args.request_timeout > 0:
        p.error("--kill-drafter-every must be >= 0, --sample-every and --request-timeout > 0")
    check_url(p, args.url)
    report = run(args)
    write_results(args.out, report, markdown(report, "specserve bench soak " + " ".join(argv)))
    return 0 if report["failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
