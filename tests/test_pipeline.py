"""Pipelined drafting, in process: prepared drafts never change the output, for both policies."""

import pytest

from specserve.training.tiny import tiny_model
from specserve.drafter.pipeline import PipelinedProposer
from specserve.drafter.draft_model import DraftModelProposer
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


@pytest.mark.parametrize("policy", ["all-accepted", "most-likely"])
def test_pipelined_output_equals_on_demand_drafting(policy):
    hits = 0
    for seed in range(8):
        target = tiny_model("llama", V, seed=seed)
        drafter = target if seed % 2 == 0 else tiny_model("llama", V, seed=50 + seed, layers=1)
        for params in (SamplingParams(), SamplingParams(temperature=0.8, top_p=0.9, seed=seed)):
            want = SpeculativeEngine(ModelRunner(target), DraftModelProposer(ModelRunner(drafter)),
                                     eos_ids=set()).generate([1, 2, 3], 40, params, 4)
            got = SpeculativeEngine(ModelRunner(target),
                                    SpeculateEveryRound(DraftModelProposer(ModelRunner(drafter)), policy),
                                    eos_ids=set()).generate([1, 2, 3], 40, params, 4)
            assert got.token_ids == want.token_ids
            hits += got.stats.num_pipeline_hits
            s = got.stats  # hits by the outcome of the round before: every drafted round after the first
            assert sum(s.outcome_rounds) == s.num_drafts - 1 and sum(s.outcome_hits) == s.num_pipeline_hits
            if policy == "all-accepted":  # prepared for "all 4 accepted" only
                assert sum(s.outcome_hits[:4]) == 0
    assert hits > 0  # drafter == target: the prepared drafts are used


def test_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="policy"):
        PipelinedProposer(DraftModelProposer(ModelRunner(tiny_model("llama", V, seed=0))), "sometimes")
