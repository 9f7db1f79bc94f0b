"""`specserve bench serve` against a live endpoint (real Ray Serve, tiny models), and a short
`specserve bench peers` run in process."""

import json
import os

import pytest
from conftest import free_port

MODEL = "specserve-bench-serve"


@pytest.fixture(scope="module")
def url(ray_session, tiny_pair_dir):
    from ray import serve

    from specserve.cluster.serve_app import build_app
    serve.shutdown()  # a Serve left by another module keeps its own port
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    # one streamed message per round (no pacing): the checks below read the rounds from the chunks
    args = {"model": MODEL, "target": tiny_pair_dir["target"], "drafter": tiny_pair_dir["drafter"], "k": 3,
            "max_num_seqs": 4, "max_waiting": 16, "cpus_per_actor": 1, "stream_interval_ms": 0}
    serve.run(build_app(args), name="benchserve", route_prefix="/benchserve")
    yield f"http://127.0.0.1:{port}/benchserve"
    serve.delete("benchserve")


def run_serve(url, tiny_pair_dir, out, *extra):
    from specserve.benchmarks import serve
    rc = serve.main(["--url", url, "--model", MODEL, "--models", tiny_pair_dir["root"], "--requests", "6",
                     "--max-tokens", "12", "--prompt-tokens", "16", "--model-reps", "3", "--out", out, *extra])
    return rc, json.loads(open(out + ".json").read()), open(out + ".md").read()


def check_level(lv):
    assert lv["failed"] == 0 and lv["completed"] == lv["requests"] >= 6, lv["codes"]
    assert lv["output_tokens"] == 12 * lv["completed"]  # ignore_eos: every request runs to max_tokens
    assert lv["output_tokens_per_s"] > 0 and lv["request_throughput"] > 0
    assert 0 <= lv["goodput_rps"] <= lv["request_throughput"] and 0 <= lv["goodput_share"] <= 1
    for name in ("ttft", "itl", "tpot", "e2e"):
        p50, p90, p99 = (lv[f"{name}_p{q}_ms"] for q in (50, 90, 99))
        assert 0 < p50 <= p90 <= p99, (name, p50, p90, p99)
    assert lv["ttft_p50_ms"] <= lv["e2e_p50_ms"]
    counters = lv["counters"]  # /metrics, the difference over this level
    assert set(counters) == {"drafts", "draft_tokens", "accepted", "hits"} and min(counters.values()) >= 0
    assert counters["accepted"] <= counters["draft_tokens"]
    if counters["draft_tokens"]:  # the server's policy may turn speculation off for a random tiny pair
        assert lv["acceptance_rate"] == pytest.approx(counters["accepted"] / counters["draft_tokens"])
    assert 1 <= lv["tokens_per_chunk"] <= 4  # k = 3: at most k + 1 tokens per round


def test_closed_loop_and_poisson_against_a_live_endpoint(url, tiny_pair_dir, tmp_path):
    out = str(tmp_path / "serve")
    rc, report, md = run_serve(url, tiny_pair_dir, out, "--concurrency", "1,3", "--request-rates", "20,inf",
                               "--slo-ttft-ms", "60000", "--slo-e2e-ms", "0.001")
    assert rc == 0
    assert [(lv["kind"], lv["load"]) for lv in report["levels"]] == [
        ("concurrency", 1), ("concurrency", 3), ("rate", 20), ("rate", float("inf"))]
    for lv in report["levels"]:
        check_level(lv)
        assert lv["good_requests"] == 0  # nobody finishes within 1 µs: the SLO really filters
    closed = [lv for lv in report["levels"] if lv["kind"] == "concurrency"]
    assert all(lv["model_output_tokens_per_s"] > 0 for lv in closed)  # the cost model, from timed passes
    assert report["cost_model"]["pass_ms"]["target"]["1"]["1"] > 0
    assert os.path.getsize(out + ".png") > 1000
    assert md.startswith("Command: `specserve bench serve --url ")


def test_mixed_text_prompts_meet_a_loose_slo(url, tiny_pair_dir, tmp_path):
    out = str(tmp_path / "mixed")
    rc, report, md = run_serve(url, tiny_pair_dir, out, "--request-rates", "inf", "--dataset", "mixed",
                               "--prompt-format", "text", "--mixed-prompt-tokens", "8,40",
                               "--mixed-max-tokens", "4,12", "--slo-ttft-ms", "60000")
    (lv,) = report["levels"]
    assert rc == 0 and lv["failed"] == 0 and lv["completed"] == 6
    assert lv["good_requests"] == 6 and lv["goodput_rps"] == pytest.approx(lv["request_throughput"])
    assert lv["output_tokens"] < 12 * 6 and "cost_model" not in report  # mixed outputs; no closed loop, no model
    assert "stdlib source prompts" in md


def test_a_run_no_request_of_which_is_answered_writes_its_errors(url, tiny_pair_dir, tmp_path):
    """A wrong --model (or --api-key): every request a 4xx. Until stop 61 the plot's log scale raised
    after the run, and neither the results nor the server's error were written."""
    out = str(tmp_path / "new" / "wrong")  # (a folder that does not exist yet: made when the flags are read)
    rc, report, md = run_serve(url, tiny_pair_dir, out, "--request-rates", "inf", "--model", "no-such-model")
    (lv,) = report["levels"]
    assert rc == 1 and lv["completed"] == 0 and lv["failed"] == 6 and lv["codes"] == {"404": 6}
    assert "does not exist" in md and "k not reported" in md and "max_num_seqs" not in md.split("\n")[2]
    assert os.path.getsize(out + ".png") > 1000


def test_bench_flags_that_cannot_work_are_refused_before_the_run(tmp_path, capsys, monkeypatch):
    """Each ran (some for minutes) and then failed, or reported nothing, until stop 61 (a user trial)."""
    from specserve.benchmarks import bench, fuzz, serve, soak
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    blocked = tmp_path / "a_file"
    blocked.write_text("")
    cases = [(soak.main, ["--url", dead, "--minutes", "0.1"], "no server answers there"),
             (fuzz.main, ["--url", dead, "--requests", "3"], "no server answers there"),
             (serve.main, ["--url", dead, "--concurrency", "1"], "no server answers there"),
             (serve.main, ["--url", "localhost:8000", "--concurrency", "1"], "not an http(s) URL"),
             (soak.main, ["--url", dead, "--minutes", "0"], "--minutes must be > 0"),
             (soak.main, ["--url", dead, "--minutes", "1", "--concurrency", "0"], "--minutes must be > 0"),
             (fuzz.main, ["--url", dead, "--concurrency", "0"], "--requests and --concurrency must be >= 1"),
             (bench.main, ["batching", "--out", str(blocked / "x")], "cannot make the folder"),
             (soak.main, ["--minutes", "1", "--out", str(blocked / "x")], "cannot make the folder")]
    for main, argv, message in cases:
        with pytest.raises(SystemExit) as e:
            main(argv)
        err = capsys.readouterr().err
        assert e.value.code == 2 and message in err, (argv, err)
    from specserve.benchmarks.endpoint import out_prefix
    monkeypatch.chdir(tmp_path)
    assert out_prefix("bare") == "bare"  # (`bench batching --out bare` raised at its end until stop 61)
    assert out_prefix(str(tmp_path / "new" / "deeper" / "x")) and (tmp_path / "new" / "deeper").is_dir()


@pytest.mark.parametrize("argv", [["--concurrency", "0"], ["--request-rates", "fast"], [],
                                  ["--url", "http://x", "--num-pairs", "1,2", "--concurrency", "1"]])
def test_bad_arguments_are_usage_errors(argv, capsys):
    from specserve.benchmarks import serve
    with pytest.raises(SystemExit) as e:
        serve.main(argv)
    assert e.value.code == 2 and "usage:" in capsys.readouterr().err


def test_peers_in_process_and_hf(tiny_pair_dir, tmp_path):
    """Our rows and HF's on the tiny pair, batch 1 and 2, no vLLM: speculation keeps the greedy
    output of plain decoding, and the result names its command."""
    from specserve.benchmarks import peers
    out = str(tmp_path / "peers")
    rc = peers.main(["--models", tiny_pair_dir["root"], "--batches", "1,2", "--prompts", "2", "--prompt-tokens", "8",
                     "--max-tokens", "6", "--repeats", "1", "-k", "2", "--out", out])
    report = json.loads(open(out + ".json").read())
    rows = report["rows"]
    (draft,) = [name for name in rows if name.startswith("ours, draft model")]
    assert rc == 0
    for name in ("ours, plain", draft, "HF transformers, plain"):
        assert rows[name]["b1"] > 0 and rows[name]["b2"] > 0, name
    assert rows[draft]["outputs_equal_ours_plain"] == 2  # speculation never changes a greedy token
    acc = rows[draft]["acceptance_rate"]  # None when the engine's policy drafted nothing (random tiny pair)
    assert acc is None or 0 <= acc <= 1
    assert "HF transformers, assisted (k = 2)" in rows and "vLLM rows skipped" in report["notes"][0]
    assert os.path.getsize(out + ".png") > 1000
    assert open(out + ".md").read().startswith("Command: `specserve bench peers --models ")
