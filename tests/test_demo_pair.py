"""The shipped demo pair (models/demo, or $SPECSERVE_MODEL_DIR): loads offline, one shared
tokenizer, small enough to ship, and greedy speculation with it never changes the target's output."""

from pathlib import Path

import pytest
import torch
from conftest import top2_gap

from specserve.config import DEFAULT_MODEL_DIR

MODELS = Path(DEFAULT_MODEL_DIR)
TARGET, DRAFTER = MODELS / "target", MODELS / "drafter"
MAX_BYTES = 40e6  # target + drafter + split.json
NEAR_TIE = 1e-3  # fp32 logits scored 1 vs k+1 positions at a time may differ in the last bits

pytestmark = [
    pytest.mark.skipif(not (TARGET / "config.json").exists(),
                       reason=f"no demo pair at {MODELS} yet (run `specserve train-demo`)"),
    pytest.mark.skipif(not (DRAFTER / "config.json").exists(),
                       reason=f"the demo drafter {DRAFTER} is not trained yet"),
]


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    torch.set_num_threads(1)


@pytest.fixture(scope="module")
def engines():
    from specserve.builder import build_engine
    from specserve.config import SpecServeConfig
    from specserve.verifier.engine import SpeculativeEngine
    spec = build_engine(SpecServeConfig(target=str(TARGET), drafter=str(DRAFTER), max_num_seqs=1))
    return spec, SpeculativeEngine(spec.target, None)


def test_loads_offline():
    from transformers import AutoModelForCausalLM, AutoTokenizer
    for path in (TARGET, DRAFTER):
        model = AutoModelForCausalLM.from_pretrained(str(path), local_files_only=True)
        tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        assert model.config.vocab_size == len(tok), path
        assert model.config.eos_token_id == tok.eos_token_id, path
        with torch.no_grad():
            logits = model(torch.tensor([tok("import os\n")["input_ids"]])).logits
        assert torch.isfinite(logits).all(), path


def test_tokenizers_identical():
    from transformers import AutoTokenizer
    from specserve.core.runner import same_tokenizer
    t = AutoTokenizer.from_pretrained(str(TARGET), local_files_only=True)
    d = AutoTokenizer.from_pretrained(str(DRAFTER), local_files_only=True)
    assert t.get_vocab() == d.get_vocab()
    assert t.all_special_tokens == d.all_special_tokens
    assert (t.eos_token_id, t.bos_token_id, t.pad_token_id) == (d.eos_token_id, d.bos_token_id, d.pad_token_id)
    text = "def f(x):\n    return {'a': x ** 2}  # ünïcode\n<|endoftext|>"
    assert t(text)["input_ids"] == d(text)["input_ids"]
    assert same_tokenizer(t, d)


def test_total_size_fits():
    files = [f for d in (TARGET, DRAFTER) for f in d.rglob("*") if f.is_file()]
    files += [MODELS / "split.json"] if (MODELS / "split.json").exists() else []
    total = sum(f.stat().st_size for f in files)
    assert total <= MAX_BYTES, f"demo pair is {total / 1e6:.1f} MB (> {MAX_BYTES / 1e6:.0f} MB)"


def test_greedy_speculation_equals_plain_target(engines):
    from transformers import AutoModelForCausalLM

    from specserve.training.demo_pair import heldout_prompts
    from specserve.core.sampling import SamplingParams
    spec, plain = engines
    prompts = heldout_prompts(MODELS, 10, 32, spec.target.tokenizer, seed=1)
    hf = None
    drafted = accepted = 0
    for i, p in enumerate(prompts):
        want = plain.generate(p, 24, SamplingParams(), 0)
        got = spec.generate(p, 24, SamplingParams(), 4)
        drafted += got.stats.num_draft_tokens
        accepted += got.stats.num_accepted_tokens
        assert want.stats.num_draft_tokens == 0
        if got.token_ids == want.token_ids:
            assert got.finish_reason == want.finish_reason
            continue
        j = next((j for j, (a, b) in enumerate(zip(got.token_ids, want.token_ids)) if a != b),
                 min(len(got.token_ids), len(want.token_ids)))
        if hf is None:
            hf = AutoModelForCausalLM.from_pretrained(str(TARGET), local_files_only=True).float().eval()
        gap, _ = top2_gap(hf, p + want.token_ids[:j])
        assert gap < NEAR_TIE, (f"prompt {i}: speculative output differs from plain target output at token {j} "
                                f"({got.token_ids[j:j + 1]} vs {want.token_ids[j:j + 1]}), top-2 logit gap {gap:.3g}")
    if (MODELS / "split.json").exists():  # a trained pair, on held-out code: the drafter must be of use
        assert drafted and accepted / drafted > 0.25, f"greedy acceptance {accepted}/{drafted}"
