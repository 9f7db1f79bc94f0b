"""The compiled forward (torch.compile of fast_llama's layer stack, the batch's sizes dynamic): greedy
speculative output equals plain target decoding and HF `generate`, batched (compact and gathered
slots), and sampled output follows the target's distribution. The rest of the suite runs the
same code eagerly (`compile` defaults to off on a CPU)."""

import numpy as np
import pytest
import torch
from conftest import assert_follows, sequence_probs

from specserve.core.runner import ModelRunner
from specserve.core.sampling import SamplingParams
from specserve.drafter.draft_model import DraftModelProposer
from specserve.training.tiny import tiny_model
from specserve.verifier.engine import SpeculativeEngine

V = 96


def hf_greedy(model, prompt, n):
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                         eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def compiled_pair(tmp_path_factory):
    """The pair compiled into a cache of its own (cold, as in CI), which
    `test_a_restart_reuses_the_compiled_code` then compiles from again."""
    import torch._dynamo
    from torch._dynamo.utils import compilation_time_metrics, counters
    cache = tmp_path_factory.mktemp("compile_cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SPECSERVE_COMPILE_CACHE", str(cache))
        # set (as use_compile_cache sets it), so that the module's end restores it, unset included:
        # a delenv of an unset variable records nothing, and the fixture's path would outlive it
        mp.setenv("TORCHINDUCTOR_CACHE_DIR", str(cache))
        torch._dynamo.reset()
        counters.clear()
        compilation_time_metrics.clear()
        target = tiny_model("llama", V, seed=21, hidden=48, layers=2)
        # the drafter: other weights in the target's shapes, so its pass is the graph the target's
        # warm-up compiled (weights are graph inputs), not a second one: on a cold cache (CI)
        # compiling a second architecture costs 45 s of the 2 cores, and tests nothing the first does not
        drafter = tiny_model("llama", V, seed=22, hidden=48, layers=2)
        t_runner = ModelRunner(target, slots=4, compile=True)
        # with a draft vocabulary (every other token): greedy passes run the graph with its head
        # (compiled by the warm-up too), sampled passes the whole head's
        d_runner = ModelRunner(drafter, slots=4, compile=True, vocab=list(range(0, V, 2)))
        assert t_runner.compiled and d_runner.compiled
        t_runner.warmup((1, 5))
        d_runner.warmup((1,))
        # the warm-up's frames dynamo could not trace whole: what `test_the_compiled_pass_is_one_graph` checks
        # (and the frames dynamo traced again from the start: until stop 58 each RMSNorm epsilon, a
        # Python float, made it trace the first graph twice, 20-50 s of the 2 cores)
        breaks = {**counters["graph_break"], **counters["unimplemented"],
                  "frames skipped": counters["frames"]["total"] - counters["frames"]["ok"],
                  "analyses restarted": sum(len(times) for name, times in compilation_time_metrics.items()
                                            if name.startswith("compile_attempt_") and name != "compile_attempt_0")}
        breaks = {reason: n for reason, n in breaks.items() if n}
        cold = (counters["inductor"]["fxgraph_cache_miss"], counters["inductor"]["fxgraph_cache_hit"])
        yield target, t_runner, d_runner, breaks, cache, cold, graphs()


def graphs() -> int:
    from torch._dynamo.utils import counters
    return counters["stats"]["unique_graphs"]


def test_the_compiled_pass_is_one_graph(compiled_pair):
    """No graph break in the layer stack, and each graph traced once: a break makes dynamo skip the whole pass and compile
    only the small functions it calls (as when SDPA's enable_gqa was a SymBool), which ran the
    drafter's pass 2.1x slower than eager on the reference CPU, and would on a GPU leave most of
    each pass outside its CUDA graph."""
    breaks = compiled_pair[3]
    assert not breaks, f"graph breaks in the compiled pass: {breaks}"


def test_the_warm_up_compiles_what_serving_runs(compiled_pair):
    """The warm-up (the fixture, before any test served) compiled 4 graphs: the target's pass over compact and over gathered slots, and the drafter's with its draft
    vocabulary's head, both ways (its whole-head passes are the target's graphs: the same shapes,
    weights are inputs). Each graph guards on its inputs' kind, and until stop 47 the warm-up fed
    ordinary tensors where serving feeds inference tensors: 2 more graphs, never run while serving,
    about 20 s each here. Serving compiles none (test_compiled_greedy_equals_plain_and_hf_generate)."""
    warm_graphs = compiled_pair[6]
    assert warm_graphs == 4, f"the warm-up compiled {warm_graphs} graphs"


def test_compiled_greedy_equals_plain_and_hf_generate(compiled_pair):
    """Batched, with the drafter's draft vocabulary (its greedy drafts: even token ids only)."""
    target, t_runner, d_runner = compiled_pair[:3]
    compiled_graphs = graphs()
    assert compiled_graphs >= 1  # the warm-up compiled
    spec = SpeculativeEngine(t_runner, DraftModelProposer(d_runner), eos_ids=set(), max_num_seqs=4)
    rng = np.random.default_rng(0)
    # the last prompt grows the KV cache past its first 256 positions: growth recompiles nothing
    prompts = [rng.integers(0, V, int(n)).tolist() for n in [*rng.integers(2, 20, 5), 250]]
    spec.start()
    try:
        # 6 requests over 4 slots: batches of several sizes, slots freed and reused out of order
        reqs = [spec.submit(p, 24, SamplingParams(), k=int(k)) for p, k in zip(prompts, [4, 2, 5, 1, 3, 4])]
        outs = [r.done.wait(300) and r.result().token_ids for r in reqs]
    finally:
        spec.stop()
    for p, out in zip(prompts, outs):
        assert out == hf_greedy(target, p, 24)
    plain = SpeculativeEngine(t_runner, None, eos_ids=set(), max_num_seqs=4)
    assert [plain.generate(p, 24, SamplingParams(), k=0).token_ids for p in prompts[:2]] == outs[:2]
    # the warm-up's graphs served every shape and kind of input: serving compiled nothing more
    assert graphs() == compiled_graphs, "the compiled forward compiled again while serving"


def test_compiled_sampling_follows_the_target_distribution(compiled_pair):
    """Each of three sampled tokens, batched through the compiled passes, follows the target's
    distribution exactly (until stop 39 the first token only, which always comes from the first
    round; the later ones mostly come from later rounds: the drafter is unlike the target). Over 96
    tokens this has little power: a verifier taking q as uniform past the first token passed it (a
    mutation run at stop 39), where the six-token tests over vocabularies of 6 and 8 fail it (the
    compiled pass is exact, as the greedy tests check; this checks that sampling goes through it)."""
    target, t_runner, d_runner = compiled_pair[:3]
    engine = SpeculativeEngine(t_runner, DraftModelProposer(d_runner), eos_ids=set(), max_num_seqs=4,
                               max_waiting=2000)
    params = dict(temperature=1.5)
    prompt = [3, 4, 5]
    length = 3
    want = sequence_probs(target, prompt, SamplingParams(**params), length)
    n = 1500
    engine.start()
    try:
        reqs = [engine.submit(prompt, length, SamplingParams(seed=s, **params), k=3) for s in range(n)]
        for r in reqs:
            r.done.wait(300)
    finally:
        engine.stop()
    later = sum(r.result().stats.num_rounds > 1 for r in reqs)
    assert later > n // 2, later  # most requests took more than one round
    assert_follows([r.result().token_ids for r in reqs], want, keeps=((0,), (1,), (2,)))



def test_a_restart_reuses_the_compiled_code(compiled_pair, monkeypatch):
    """The compiled code is kept on disk in SPECSERVE_COMPILE_CACHE: after dynamo's in-memory
    state is dropped (as in a new process), compiling the same model again finds every graph
    the fixture's cold warm-up made in that cache, and generates no code."""
    import torch._dynamo
    from torch._dynamo.utils import counters
    target, _, d_runner, _, cache, (misses, hits), _ = compiled_pair
    assert misses > 0  # the fixture's cache was cold: code generated
    monkeypatch.setenv("SPECSERVE_COMPILE_CACHE", str(cache))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(cache))  # restored (or unset) after the test
    torch._dynamo.reset()
    counters.clear()
    ModelRunner(target, slots=4, compile=True).warmup((1, 5))
    ModelRunner(d_runner.model, slots=4, compile=True, vocab=d_runner.vocab).warmup((1,))  # its vocabulary's graph
    assert counters["inductor"]["fxgraph_cache_miss"] == 0  # again: all of it from the cache
    assert counters["inductor"]["fxgraph_cache_hit"] >= misses  # every graph the cold warm-up generated
    assert any(cache.iterdir())


def test_a_machine_that_cannot_compile_runs_eagerly(tmp_path, monkeypatch):
    """No working C++ compiler (a slim container): warm-up logs the failure and the forward runs
    eagerly, with the same numbers, instead of failing at the first request."""
    import torch._dynamo
    import torch._inductor.config as inductor_config
    monkeypatch.setenv("SPECSERVE_COMPILE_CACHE", str(tmp_path / "cache"))  # nothing cached to fall back on
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "cache"))  # restored (or unset) after the test
    torch._dynamo.reset()
    model = tiny_model("llama", 64, seed=2, hidden=40, layers=1)
    runner = ModelRunner(model, slots=2, compile=True)
    with inductor_config.patch({"cpp.cxx": (str(tmp_path / "no-such-compiler"),)}):  # (restored after, unlike
        runner.warmup((1,))                                                         # a monkeypatch of the proxy)
    assert not runner.compiled
    eager = ModelRunner(model, slots=2)
    torch.testing.assert_close(runner.prefill([1, 2, 3, 4]), eager.prefill([1, 2, 3, 4]))


def test_a_compiled_pass_that_fails_in_serving_runs_eagerly_from_then_on(tmp_path, monkeypatch):
    """A compiled pass that fails after warm-up (here: compiled first at a request, on a machine
    that cannot compile; on a GPU, torch before 2.13 asserts when a thread other than the warm-up's
    replays a CUDA graph) logs it and runs that pass and every later one eagerly, with the same
    numbers; until stop 53 every round failed."""
    import torch._dynamo
    import torch._inductor.config as inductor_config
    monkeypatch.setenv("SPECSERVE_COMPILE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "cache"))
    torch._dynamo.reset()
    model = tiny_model("llama", 64, seed=2, hidden=40, layers=1)
    runner = ModelRunner(model, slots=2, compile=True)  # (no warm-up: the first request compiles)
    assert runner.compiled
    eager = ModelRunner(model, slots=2)
    with inductor_config.patch({"cpp.cxx": (str(tmp_path / "no-such-compiler"),)}):
        torch.testing.assert_close(runner.prefill([1, 2, 3, 4]), eager.prefill([1, 2, 3, 4]))
    assert not runner.compiled
    torch.testing.assert_close(runner.score_batch([(0, [5, 6])])[0], eager.score_batch([(0, [5, 6])])[0])
