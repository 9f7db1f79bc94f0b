"""Continuous batching: mixed batches stay exact, sequences join and leave, the queue is bounded."""

import random
import threading
import time

import pytest
from conftest import top2_gap

from specserve.training.tiny import tiny_model
from specserve.drafter.draft_model import DraftModelProposer
from specserve.core.runner import ModelRunner
from specserve.core.sampling import SamplingParams
from specserve.verifier.engine import Overloaded, SpeculativeEngine

V = 96
NEAR_TIE = 1e-4


def engine(target, drafter, slots, **kw):
    return SpeculativeEngine(ModelRunner(target, slots=slots), DraftModelProposer(ModelRunner(drafter, slots=slots)),
                             eos_ids=set(), **kw)


def solo_plain(target, prompt, n):
    return SpeculativeEngine(ModelRunner(target), None, eos_ids=set()).generate(prompt, n, SamplingParams(), 0)


def assert_same_or_near_tie(model, prompt, got, want, near_ties):
    if got == want:
        return
    i = next(i for i, (a, b) in enumerate(zip(got, want)) if a != b)
    gap, _ = top2_gap(model, prompt + want[:i])
    assert gap < NEAR_TIE, f"token {i} differs and the top-2 logit gap is {gap:.3g}: not a near-tie"
    near_ties.append((prompt, i, gap))


@pytest.mark.parametrize("seed", [0, 1])
def test_mixed_batch_greedy_equals_solo_plain(seed):
    target, drafter = tiny_model("llama", V, seed=seed), tiny_model("llama", V, seed=100 + seed, layers=1)
    eng = engine(target, drafter, slots=10)
    rng = random.Random(seed)
    reqs = []
    for i in range(10):
        prompt = [rng.randrange(V) for _ in range(rng.randint(1, 30))]
        n, k = rng.randint(5, 40), rng.choice([0, 1, 3, 5, 8])
        sampling = SamplingParams() if i % 3 else SamplingParams(temperature=rng.choice([0.5, 1.0]),
                                                                   top_p=rng.choice([0.8, 1.0]),
                                                                   top_k=rng.choice([0, 10]), seed=i)
        reqs.append((prompt, n, sampling, eng.submit(prompt, n, sampling, k)))
    moved = 0
    while any(not r.done.is_set() for *_, r in reqs):
        slots = {r: r.slot for r in eng.running}
        eng.step()
        # the running sequences sit in slots 0..b-1 (attention reads them as a view): ragged
        # finishes leave holes, which the sequences above them move into
        assert sorted(r.slot for r in eng.running) == list(range(len(eng.running)))
        moved += sum(r.slot != slots[r] for r in eng.running if r in slots)
    assert moved  # (requests of 5..40 tokens finish raggedly)
    near_ties = []
    for prompt, n, sampling, r in reqs:
        result = r.result()
        assert len(result.token_ids) == n
        if sampling.greedy:
            assert_same_or_near_tie(target, prompt, result.token_ids, solo_plain(target, prompt, n).token_ids,
                                    near_ties)
    assert len(near_ties) <= 1, near_ties
    assert sorted(eng.free_slots) == list(range(10)) and not eng.running
    assert not eng.proposer.seqs and len(eng.proposer.free) == 10


def test_join_and_leave_mid_flight():
    target, drafter = tiny_model("llama", V, seed=3), tiny_model("gpt2", V, seed=4)
    eng = engine(target, drafter, slots=4)
    first = [eng.submit([1 + i, 2, 3], 30, SamplingParams(), k=3) for i in range(3)]
    for _ in range(4):
        eng.step()
    assert all(not r.done.is_set() for r in first)
    late = [eng.submit([7, 8 + i], 12, SamplingParams(), k=2) for i in range(3)]  # one must wait for a slot
    while any(not r.done.is_set() for r in first + late):
        eng.step()
    for i, r in enumerate(first):
        assert r.result().token_ids == solo_plain(target, [1 + i, 2, 3], 30).token_ids
    for i, r in enumerate(late):
        assert r.result().token_ids == solo_plain(target, [7, 8 + i], 12).token_ids
    assert len(eng.free_slots) == 4


def test_round_times_hold_the_passes_cpu_time_beside_their_wall_time():
    """`RoundTimes.pass_cpu`: the loop thread's CPU seconds in the passes, some and never more
    than their wall seconds (plus the clocks' granularity)."""
    eng = engine(tiny_model("llama", V, seed=3), tiny_model("gpt2", V, seed=4), slots=2)
    reqs = [eng.submit([1 + i, 2, 3], 20, SamplingParams(), k=3) for i in range(2)]
    while any(not r.done.is_set() for r in reqs):
        eng.step()
    times = eng.times.to_dict()
    assert times["rounds"] > 0 and 0 < times["pass_cpu"] <= times["seconds"]["pass"] + 0.01 * times["rounds"]


def test_sampled_output_does_not_depend_on_the_batch():
    target, drafter = tiny_model("llama", V, seed=5), tiny_model("llama", V, seed=6, layers=1)
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=1234)
    alone = engine(target, drafter, slots=1).generate([4, 5, 6], 30, params, k=4).token_ids
    eng = engine(target, drafter, slots=6)
    others = [eng.submit([9, i], 25, SamplingParams(temperature=0.7, seed=i), k=2) for i in range(5)]
    mine = eng.submit([4, 5, 6], 30, params, k=4)
    while not all(r.done.is_set() for r in others + [mine]):
        eng.step()
    assert mine.result().token_ids == alone


def test_queue_bound_and_cancellation_free_slots():
    target, drafter = tiny_model("llama", V, seed=7), tiny_model("llama", V, seed=8, layers=1)
    eng = engine(target, drafter, slots=2, max_waiting=3)
    eng.start()
    try:
        gate = threading.Event()
        held = [eng.submit([1, 2], 200, SamplingParams(), k=2, on_tokens=lambda _: gate.wait(10) or True)
                for _ in range(2)]
        while eng.num_running < 2:
            pass
        queued = [eng.submit([3, i], 5, SamplingParams(), k=2) for i in range(3)]
        with pytest.raises(Overloaded, match="overloaded"):
            eng.submit([4], 5, SamplingParams(), k=2)
        assert eng.cancel(held[0].id) and eng.cancel(queued[2].id)
        gate.set()
        for r in held + queued:
            assert r.done.wait(60), "a request hung"
        assert held[0].result().finish_reason == "cancelled" and len(held[0].result().token_ids) < 200
        assert queued[2].result().finish_reason == "cancelled"
        assert [len(r.result().token_ids) for r in queued[:2]] == [5, 5]
        assert held[1].result().finish_reason == "length"
        deadline = time.monotonic() + 10  # the proposer releases a finished sequence right after its round
        while eng.proposer.seqs and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(eng.free_slots) == 2 and not eng.proposer.seqs
    finally:
        eng.stop()


def test_a_failed_slot_move_never_ends_the_loop():
    """Keeping slots 0..b-1 is an optimisation: if moving a sequence fails, the engine logs it,
    stops compacting and serves on (each sequence keeps its slot, output unchanged)."""
    target, drafter = tiny_model("llama", V, seed=3), tiny_model("llama", V, seed=4, layers=1)
    eng = engine(target, drafter, slots=4)

    def broken(src, dst):
        raise RuntimeError("no move today")

    eng.target.move = broken
    reqs = [eng.submit([1 + i, 2, 3], n, SamplingParams(), k=3) for i, n in enumerate((5, 30, 30))]
    eng.start()
    try:
        for i, (r, n) in enumerate(zip(reqs, (5, 30, 30))):
            assert r.done.wait(60) and r.result().token_ids == solo_plain(target, [1 + i, 2, 3], n).token_ids
        assert eng._compact_failed and eng.health()["status"] == "ok"
    finally:
        eng.stop()
