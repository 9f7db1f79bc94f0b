"""Pipelined drafting, in process: prepared drafts never change the output, for both policies."""

import pytest
import torch

from specserve.training.tiny import tiny_model
from specserve.drafter.pipeline import PipelinedProposer
from specserve.drafter.draft_model import DraftModelProposer
from specserve.core.proposer import ProposeItem
from specserve.core.runner import ModelRunner
from specserve.core.sampling import SamplingParams
from specserve.verifier.engine import SpeculativeEngine

V = 96


class SpeculateEveryRound(PipelinedProposer):
    """What the drafter server does between rounds, done synchronously."""

    def propose(self, items):
        drafts = super().propose(items)
        self.speculate([item.seq_id for item in items])
        return drafts


@pytest.mark.parametrize("policy,fanout", [("all-accepted", 1), ("most-likely", 1), ("all-accepted", 3)])
def test_pipelined_output_equals_on_demand_drafting(policy, fanout):
    """Greedy and sampled: the same tokens with drafts prepared (for one outcome, or for three
    on branch slots) as with drafts made on demand."""
    hits = branch_hits = 0
    for seed in range(8):
        target = tiny_model("llama", V, seed=seed)
        drafter = target if seed % 2 == 0 else tiny_model("llama", V, seed=50 + seed, layers=1)
        for params in (SamplingParams(), SamplingParams(temperature=0.8, top_p=0.9, seed=seed)):
            want = SpeculativeEngine(ModelRunner(target), DraftModelProposer(ModelRunner(drafter)),
                                     eos_ids=set()).generate([1, 2, 3], 40, params, 4)
            inner = DraftModelProposer(ModelRunner(drafter, slots=1 + 2 * (fanout - 1)), branch_slots=2 * (fanout - 1))
            got = SpeculativeEngine(ModelRunner(target), SpeculateEveryRound(inner, policy, fanout=fanout),
                                    eos_ids=set()).generate([1, 2, 3], 40, params, 4)
            assert got.token_ids == want.token_ids
            hits += got.stats.num_pipeline_hits
            s = got.stats  # hits by the outcome of the round before: every drafted round after the first
            assert sum(s.outcome_rounds) == s.num_drafts - 1 and sum(s.outcome_hits) == s.num_pipeline_hits
            if policy == "all-accepted" and fanout == 1:  # prepared for "all 4 accepted" only
                assert sum(s.outcome_hits[:4]) == 0
            branch_hits += sum(s.outcome_hits[:4])
            assert len(inner.branch_free) == 2 * (fanout - 1)  # every branch slot back
    assert hits > 0  # drafter == target: the prepared drafts are used
    assert (branch_hits > 0) == (fanout > 1 or policy == "most-likely")


@pytest.mark.parametrize("temperature,bf16_head,vocab", [(0.0, False, None), (0.9, False, None), (0.9, True, None),
                                                         (0.0, True, list(range(0, V, 2))),
                                                         (0.9, True, list(range(0, V, 2)))])
def test_every_prepared_outcome_equals_drafting_it_on_demand(temperature, bf16_head, vocab):
    """For each outcome the drafter prepared on a branch (or its own slot), answering with that
    outcome returns what a drafter that prepared nothing drafts: the same tokens, and q equal up
    to float rounding (the prepared outcomes are drafted as one batch of 5 rows, on demand as one
    row, and a CPU GEMM's rounding depends on the row count; the verifier is sent the q each
    token was drawn from, so the sampled distribution is exact either way). bf16_head: the
    float32 drafter multiplies by a bfloat16 head (`dtype: auto` for a drafter where the CPU
    multiplies bf16 in hardware): a float32 rounding step in the head's input can move its
    bfloat16 rounding, so q is equal within 1e-3 there. vocab: a draft vocabulary (even token
    ids; its greedy passes score those only, its sampled ones every token), on both drafters."""
    from specserve.core.fast_llama import cpu_has_bf16_gemm
    if bf16_head and not cpu_has_bf16_gemm():
        pytest.skip("this CPU has no bf16 GEMM in hardware: a bfloat16 head is not packed")
    drafter = tiny_model("llama", V, seed=5, layers=1)
    params = SamplingParams(temperature=temperature, seed=3) if temperature else SamplingParams(seed=3)
    first = ProposeItem("s", [], 4)
    probe = PipelinedProposer(DraftModelProposer(ModelRunner(drafter, slots=5, bf16_head=bf16_head, vocab=vocab),
                                                 branch_slots=4), fanout=5)
    assert (probe.inner.runner.fast.head_packed is not None) == bf16_head
    probe.start("s", [1, 2, 3, 4], params)
    probe.propose([first])
    probe.speculate(["s"])
    outcomes = [p.assumed for p in probe.ready["s"]]
    assert len(outcomes) == 5 and len({tuple(o) for o in outcomes}) == 5
    for outcome in outcomes:
        pipelined = PipelinedProposer(DraftModelProposer(ModelRunner(drafter, slots=5, bf16_head=bf16_head, vocab=vocab),
                                                         branch_slots=4), fanout=5)
        on_demand = DraftModelProposer(ModelRunner(drafter, bf16_head=bf16_head, vocab=vocab))
        for p in (pipelined, on_demand):
            p.start("s", [1, 2, 3, 4], params)
            p.propose([first])
        pipelined.speculate(["s"])
        got = pipelined.propose([ProposeItem("s", outcome, 4)])[0]
        want = on_demand.propose([ProposeItem("s", outcome, 4)])[0]
        assert got.pipeline_hit and got.prepared == 5 and got.tokens == want.tokens
        if vocab is not None and temperature == 0:  # greedy drafts from the vocabulary only
            assert set(got.tokens) <= set(vocab)
        assert (got.probs is None) == (want.probs is None) == (temperature == 0)
        if want.probs is not None:
            assert torch.allclose(got.probs, want.probs, rtol=0, atol=1e-3 if bf16_head else 1e-6)
        # and the round after: the adopted branch drafts on as the on-demand drafter does
        nxt = [ProposeItem("s", got.tokens[:1] + [7], 3)]
        assert pipelined.propose(nxt)[0].tokens == on_demand.propose(nxt)[0].tokens
        assert len(pipelined.inner.branch_free) == 4


def test_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="policy"):
        PipelinedProposer(DraftModelProposer(ModelRunner(tiny_model("llama", V, seed=0))), "sometimes")


def sampled_pair_after_one_round(fanout):
    """A pipelined drafter (two branch slots) and an on-demand one, a sampled sequence started on
    each and drafted for once."""
    drafter = tiny_model("llama", V, seed=6, layers=1)
    params = SamplingParams(temperature=0.9, seed=4)
    pipelined = PipelinedProposer(DraftModelProposer(ModelRunner(drafter, slots=3), branch_slots=2), fanout=fanout)
    on_demand = DraftModelProposer(ModelRunner(drafter))
    for p in (pipelined, on_demand):
        p.start("s", [1, 2, 3, 4], params)
        p.propose([ProposeItem("s", [], 4)])
    return pipelined, on_demand


@pytest.mark.parametrize("fanout", [1, 3])
def test_an_interrupted_preparation_leaves_nothing_behind(fanout):
    """The drafter server stops a preparation between passes when the verifier comes back with an
    outcome it does not cover: nothing is kept, every branch slot is free again, and the next
    draft equals the on-demand one."""
    pipelined, on_demand = sampled_pair_after_one_round(fanout)
    passes = []
    pipelined.interrupt = type("AfterOnePass", (), {"is_set": lambda self: passes.append(1) or len(passes) > 1})()
    pipelined.speculate(["s"])
    assert pipelined.interrupted == 1 and "s" not in pipelined.ready and not pipelined.preparing
    assert len(pipelined.inner.branch_free) == 2
    runner, seq = pipelined.inner.runner, pipelined.inner.seqs["s"]
    assert runner.seq_length(seq.slot) == len(seq.cached) and seq.tokens == [1, 2, 3, 4]  # the guess undone
    for answer in ([9, 8], [3]):
        got = pipelined.propose([ProposeItem("s", answer, 4)])[0]
        want = on_demand.propose([ProposeItem("s", answer, 4)])[0]
        assert not got.pipeline_hit and got.tokens == want.tokens


def test_fan_out_prepares_the_outcome_this_rounds_drafts_make_likeliest():
    """The speculation cache ranks outcomes by this round's P(a accepted), from each draft's
    calibrated chance given the drafter's probability of it: with confident drafts accepted and
    unsure ones rejected so far, a draft unsure only at d_2 gets the branch "d_1 accepted, the
    runner-up to d_2 written", though by the runner-ups' shares alone (0.8 at d_1 and d_3 against
    0.125 at d_2) d_1's or d_3's would win."""
    inner = DraftModelProposer(ModelRunner(tiny_model("llama", V, seed=1), slots=2), branch_slots=1)
    pipelined = PipelinedProposer(inner, fanout=2)
    for _ in range(200):
        pipelined.calibration.observe([0.95, 0.95, 0.2, 0.95], 2)
    assert pipelined.calibration.chance(0.95) > 0.95 and pipelined.calibration.chance(0.2) < 0.05
    assert pipelined.calibration.chance(0.5) == 0.5  # a bin with no answers yet
    pipelined.start("s", [1, 2, 3], SamplingParams(seed=0))
    d = pipelined.propose([ProposeItem("s", [], 4)])[0].tokens
    alts = [alt for _, alt, _ in pipelined.last_conf["s"]]
    pipelined.last_conf["s"] = [(0.95, alts[0], 0.04), (0.2, alts[1], 0.1), (0.95, alts[2], 0.04), (0.95, alts[3], 0.04)]
    pipelined.speculate(["s"])
    main, branch = pipelined.ready["s"]
    assert main.assumed[:4] == d and branch.assumed == d[:1] + [alts[1]]


def test_a_draft_the_verifier_cut_short_teaches_no_rejection():
    """A draft the verifier used only in part (its policy asked fewer drafts than the early send)
    comes back with the drafted token at the cut: the calibration learnt a rejection there, of a
    draft never judged (stop 49's noticed list). Greedy, that token is the target's own choice (an
    acceptance); sampled, the draft there was not judged. A real rejection still counts as one."""
    for params, judged_at_cut in ((SamplingParams(seed=0), 3), (SamplingParams(temperature=1.0, seed=0), 2)):
        inner = DraftModelProposer(ModelRunner(tiny_model("llama", V, seed=1), slots=2))
        pipelined = PipelinedProposer(inner)  # (no speculate: every draft on demand)
        pipelined.start("s", [1, 2, 3], params)
        d = pipelined.propose([ProposeItem("s", [], 4)])[0].tokens
        judged = lambda: sum(pipelined.calibration.judged)
        accepted = lambda: sum(pipelined.calibration.accepted)
        cut = pipelined.propose([ProposeItem("s", d[:2] + [d[2]], 4)])[0].tokens  # cut to 2 drafts, both accepted
        assert round(judged()) == judged_at_cut == round(accepted()), params  # (decayed counts)
        before = judged(), accepted()
        wrong = next(t for t in range(V) if t != cut[0])
        pipelined.propose([ProposeItem("s", [wrong], 4)])  # d_1 rejected: one more judged, none accepted
        assert judged() > before[0] and accepted() <= before[1]


@pytest.mark.parametrize("fails,fanout", [("bonus", 1), ("catch_up", 1), ("draft", 1), ("draft", 3), ("fork", 3)])
def test_a_failed_preparation_leaves_nothing_behind(fails, fanout):
    """A preparation whose pass fails (out of memory on a GPU, say) is logged by the server and the
    sequence goes on. Until stop 49 such a failure left the slot and its `cached` tokens a
    position apart for the sequence's life (its drafts came from a shifted context), and a fork
    that failed lost the branch slots taken before it. Now each slot agrees with its tokens, every
    branch slot is free, and the next drafts equal on-demand ones. The failure is injected into the
    guess of the bonus token's pass, the catch-up on the assumed outcome, the drafting loop's second
    pass, or the second branch's fork."""
    pipelined, on_demand = sampled_pair_after_one_round(fanout)
    runner = pipelined.inner.runner
    method, nth = {"bonus": ("score_batch", 1), "catch_up": ("score_batch", 2), "draft": ("score_ids", 2),
                   "fork": ("fork", 2)}[fails]
    real, calls = getattr(runner, method), []

    def failing(*args, **kwargs):
        calls.append(1)
        if len(calls) == nth:
            raise RuntimeError("injected: out of memory")
        return real(*args, **kwargs)

    setattr(runner, method, failing)
    with pytest.raises(RuntimeError, match="injected"):
        pipelined.speculate(["s"])
    setattr(runner, method, real)
    assert len(calls) == nth  # it failed where meant to
    assert "s" not in pipelined.ready and not pipelined.preparing and not pipelined.guessed
    assert len(pipelined.inner.branch_free) == 2
    seq = pipelined.inner.seqs["s"]
    assert runner.seq_length(seq.slot) == len(seq.cached) and seq.tokens == [1, 2, 3, 4]
    for answer in ([9, 8], [3], [5, 6, 7]):
        got = pipelined.propose([ProposeItem("s", answer, 4)])[0]
        want = on_demand.propose([ProposeItem("s", answer, 4)])[0]
        assert got.tokens == want.tokens and torch.allclose(got.probs, want.probs, rtol=0, atol=1e-6)
        pipelined.speculate(["s"])  # and preparing works again


def test_a_call_asking_more_than_was_prepared_is_not_taken_for_served():
    """The server stops a preparation when the call that came in is not served by it (the call
    then drafts on demand at once). A prepared draft serves a call for its outcome with at most its
    k and the same min_confidence: until stop 49 the hint looked at the outcome only, so a call for
    more k waited for the preparation it could not use."""
    pipelined = PipelinedProposer(DraftModelProposer(ModelRunner(tiny_model("llama", V, seed=6, layers=1))))
    pipelined.start("s", [1, 2, 3, 4], SamplingParams(seed=1))
    pipelined.propose([ProposeItem("s", [], 3)])
    pipelined.speculate(["s"])
    outcome = pipelined.ready["s"][0].assumed
    assert pipelined.served_by_preparation("s", outcome, 3) and pipelined.served_by_preparation("s", outcome, 2)
    assert not pipelined.served_by_preparation("s", outcome, 4)
    assert not pipelined.served_by_preparation("s", outcome, 3, min_confidence=0.5)
    assert not pipelined.served_by_preparation("s", outcome[:-1] + [outcome[-1] + 1], 3)
    assert pipelined.propose([ProposeItem("s", outcome, 4)])[0].pipeline_hit is False  # as the hint said


def test_a_pass_torn_between_layers_restarts_an_hf_path_slot():
    """On the HF path (a non-Llama drafter) a pass that fails part way leaves its first layers one
    position longer than the rest, which no rollback lines up: that slot starts over, fed again
    on the next call, and drafts as the on-demand drafter does (a GPT-2 drafter whose second
    layer fails in the drafting loop's second pass)."""
    drafter = tiny_model("gpt2", V, seed=6)
    params = SamplingParams(temperature=0.9, seed=4)
    pipelined = PipelinedProposer(DraftModelProposer(ModelRunner(drafter)))
    on_demand = DraftModelProposer(ModelRunner(drafter))
    assert pipelined.inner.runner.fast is None  # the HF path
    for p in (pipelined, on_demand):
        p.start("s", [1, 2, 3, 4], params)
        p.propose([ProposeItem("s", [], 4)])
    layer, calls = drafter.transformer.h[1], []
    real = layer.forward

    def failing(*args, **kwargs):
        calls.append(1)
        if len(calls) == 4:  # the bonus guess, the catch-up, the first drafting pass, then this one
            raise RuntimeError("injected: out of memory")
        return real(*args, **kwargs)

    layer.forward = failing
    with pytest.raises(RuntimeError, match="injected"):
        pipelined.speculate(["s"])
    layer.forward = real
    runner, seq = pipelined.inner.runner, pipelined.inner.seqs["s"]
    assert runner.seq_length(seq.slot) == len(seq.cached) == 0 and seq.tokens == [1, 2, 3, 4]
    for answer in ([9, 8], [3]):
        got = pipelined.propose([ProposeItem("s", answer, 4)])[0]
        want = on_demand.propose([ProposeItem("s", answer, 4)])[0]
        assert got.tokens == want.tokens and torch.allclose(got.probs, want.probs, rtol=0, atol=1e-5)
