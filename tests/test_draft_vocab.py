"""The drafter's draft vocabulary (specserve.core.draft_vocab): greedy passes score its tokens only,
output never changes, sampled drafting is untouched, and bad settings are clear errors."""

import json
import os
import random
import subprocess
import sys

import pytest
import torch

from specserve.builder import check_pair
from specserve.config import SpecServeConfig
from specserve.core import draft_vocab
from specserve.core.proposer import ProposeItem
from specserve.core.runner import ModelRunner
from specserve.core.sampling import SamplingParams
from specserve.drafter.draft_model import DraftModelProposer
from specserve.training.draft_vocab import rank_tokens
from specserve.training.tiny import make_tiny_pair, tiny_model
from specserve.verifier.engine import SpeculativeEngine

V = 96


def subset(seed: int, n: int = 24) -> list[int]:
    return random.Random(seed).sample(range(V), n)


@pytest.mark.parametrize("arch,bf16_head", [("llama", False), ("llama", True), ("gpt2", False)])
def test_a_vocab_pass_scores_its_tokens_as_a_full_pass_does_and_no_other(arch, bf16_head):
    """Lean forward (float32 head or a bfloat16 one) and the HF path (gpt2): within the draft
    vocabulary the same logits as every token's pass, -inf outside it; without vocab=True, or
    without a draft vocabulary, every token's logits."""
    model = tiny_model(arch, V, seed=3)
    ids = subset(1)
    full, part = ModelRunner(model, slots=2, bf16_head=bf16_head), ModelRunner(model, slots=2, bf16_head=bf16_head,
                                                                                vocab=ids)
    assert (part.fast is not None) == (arch == "llama")
    for r in (full, part):
        r.prefill_batch([(0, [1, 2, 3]), (1, [4, 5])])
    want = full.score_ids(torch.tensor([[7], [8]]), [0, 1])
    got = part.score_ids(torch.tensor([[7], [8]]), [0, 1], vocab=True)
    inside = torch.zeros(V, dtype=torch.bool)
    inside[ids] = True
    assert torch.isneginf(got[:, ~inside]).all()
    torch.testing.assert_close(got[:, inside], want[:, inside], rtol=1e-5, atol=1e-5)
    for r in (full, part):
        r.rollback(1, slot=0)
        r.rollback(1, slot=1)
    assert torch.equal(part.score_ids(torch.tensor([[7], [8]]), [0, 1]), want)  # vocab=False: every token
    rows = part.score_batch([(0, [9, 10]), (1, [11])], last_only=True, vocab=True)
    assert all(torch.isneginf(row[:, ~inside]).all() for row in rows)


@pytest.mark.parametrize("seed", range(6))
def test_greedy_output_with_a_draft_vocabulary_equals_plain_decoding(seed):
    """Drafters whose vocabulary leaves out most tokens (often the target's choice): the tokens
    are plain decoding's, and every greedy draft is from the vocabulary."""
    rng = random.Random(seed)
    target = tiny_model(rng.choice(["llama", "gpt2"]), V, seed=seed)
    drafter = target if seed % 3 == 0 else tiny_model(rng.choice(["llama", "gpt2"]), V, seed=100 + seed, layers=1)
    ids = subset(seed, rng.choice([8, 24, 64]))
    plain = SpeculativeEngine(ModelRunner(target), None, eos_ids=set())
    spec = SpeculativeEngine(ModelRunner(target), DraftModelProposer(ModelRunner(drafter, vocab=ids)), eos_ids=set())
    for _ in range(3):
        prompt = [rng.randrange(V) for _ in range(rng.randint(1, 10))]
        n, k = rng.randint(1, 40), rng.randint(1, 6)
        assert spec.generate(prompt, n, SamplingParams(), k).token_ids == \
            plain.generate(prompt, n, SamplingParams(), 0).token_ids
    # the drafts themselves: from the vocabulary only
    p = DraftModelProposer(ModelRunner(drafter, vocab=ids))
    p.start("s", [1, 2, 3], SamplingParams().with_seed())
    tokens = []
    for _ in range(5):
        d = p.propose([ProposeItem("s", tokens[-1:] if tokens else [], 4)])[0]
        assert d.tokens and set(d.tokens) <= set(ids), d.tokens
        tokens = d.tokens


def test_sampled_drafts_and_q_are_unchanged_by_a_draft_vocabulary():
    """A sampled sequence (alone, and beside a greedy one) drafts the same tokens with the same q
    with a draft vocabulary as without: its passes score every token."""
    model = tiny_model("llama", V, seed=5)
    ids = subset(2, 16)
    runs = {}
    for name, vocab in (("full", None), ("vocab", ids)):
        p = DraftModelProposer(ModelRunner(model, slots=2, vocab=vocab))
        p.start("sampled", [1, 2, 3], SamplingParams(temperature=0.9, seed=7))
        p.start("greedy", [4, 5], SamplingParams().with_seed())
        out = []
        new = {"sampled": [], "greedy": []}
        for step in range(4):
            which = ["sampled"] if step % 2 == 0 else ["sampled", "greedy"]
            drafts = p.propose([ProposeItem(s, new[s], 3) for s in which])
            out.append((drafts[0].tokens, drafts[0].probs))
            if vocab is not None and len(drafts) > 1:  # greedy beside sampled rows: still the draft vocabulary's
                assert set(drafts[1].tokens) <= set(ids), drafts[1].tokens  # (not until stop 51)
            new = {"sampled": drafts[0].tokens[:1], "greedy": drafts[1].tokens[:1] if len(drafts) > 1 else []}
        runs[name] = out
    for (ta, qa), (tb, qb) in zip(runs["full"], runs["vocab"]):
        assert ta == tb
        assert torch.equal(qa, qb)
    assert any(t not in ids for tokens, _ in runs["vocab"] for t in tokens)  # sampled: any token


def test_pipelined_greedy_output_with_a_draft_vocabulary_equals_plain_decoding():
    """Prepared drafts (fan-out 3, on branch slots) with a draft vocabulary: plain decoding's
    tokens, and prepared drafts are used."""
    from test_pipeline import SpeculateEveryRound

    hits = 0
    for seed in range(4):
        target = tiny_model("llama", V, seed=seed)
        drafter = target if seed % 2 == 0 else tiny_model("llama", V, seed=60 + seed, layers=1)
        ids = sorted(set(subset(seed, 48)) | set(range(8)))
        inner = DraftModelProposer(ModelRunner(drafter, slots=5, vocab=ids), branch_slots=4)
        got = SpeculativeEngine(ModelRunner(target), SpeculateEveryRound(inner, fanout=3),
                                eos_ids=set()).generate([1, 2, 3], 40, SamplingParams(), 4)
        want = SpeculativeEngine(ModelRunner(target), None, eos_ids=set()).generate([1, 2, 3], 40, SamplingParams(), 0)
        assert got.token_ids == want.token_ids
        hits += got.stats.num_pipeline_hits
    assert hits > 0


# ----------------------------------------------------------------- settings, files, the tool

@pytest.fixture(scope="module")
def pair_dirs(tmp_path_factory):
    return make_tiny_pair(str(tmp_path_factory.mktemp("vocab_pair")), seed=4)


def test_the_tool_ranks_tokens_by_count_and_the_runner_loads_its_size(pair_dirs, tmp_path):
    target, drafter = pair_dirs
    text = tmp_path / "corpus.py"
    text.write_text("def f(x):\n    return x + 1\n" * 50 + "class A:\n    pass\n")
    rc = subprocess.run([sys.executable, "-m", "specserve.cli", "draft-vocab", "--drafter", drafter, "--text",
                         str(text), "--size", "5"], capture_output=True, text=True)
    assert rc.returncode == 0, rc.stderr
    data = json.load(open(os.path.join(drafter, draft_vocab.FILE)))
    tok = ModelRunner.from_pretrained(drafter, role="drafter").tokenizer
    assert data["ranked_ids"] == rank_tokens(tok, [text.read_text()])
    counts = {t: tok(text.read_text())["input_ids"].count(t) for t in data["ranked_ids"]}
    assert [counts[t] for t in data["ranked_ids"]] == sorted(counts.values(), reverse=True)
    assert ModelRunner.from_pretrained(drafter, role="drafter", draft_vocab="auto").vocab == data["ranked_ids"][:5]
    assert ModelRunner.from_pretrained(drafter, role="drafter", draft_vocab=3).vocab == data["ranked_ids"][:3]
    assert ModelRunner.from_pretrained(drafter, role="drafter", draft_vocab="off").vocab is None
    assert ModelRunner.from_pretrained(drafter, role="drafter").vocab == data["ranked_ids"][:5]  # default: auto
    assert ModelRunner.from_pretrained(drafter).vocab is None  # a target has none
    os.remove(os.path.join(drafter, draft_vocab.FILE))


def test_bad_settings_and_files_are_clear_errors(pair_dirs):
    target, drafter = pair_dirs
    for bad in (0, -3, "all", 1.5, True):
        with pytest.raises(ValueError, match="draft_vocab must be auto, off or an integer"):
            SpecServeConfig(target=target, drafter=drafter, draft_vocab=bad)
    assert check_pair(SpecServeConfig(target=target, drafter=drafter, draft_vocab="auto"))  # no file: every token
    with pytest.raises(ValueError, match="has no draft_vocab.json"):
        check_pair(SpecServeConfig(target=target, drafter=drafter, draft_vocab=64))
    path = os.path.join(drafter, draft_vocab.FILE)
    try:
        for content, message in (("{not json", "cannot read the draft vocabulary"),
                                 (json.dumps({"ranked_ids": [1, 2, 2]}), "repeated"),
                                 (json.dumps({"ranked_ids": "1,2"}), "non-empty list of token ids"),
                                 (json.dumps({"ranked_ids": [1, 2], "size": 0}), "size must be"),
                                 (json.dumps({"ranked_ids": [1, 100000]}), "below the drafter's vocabulary")):
            with open(path, "w") as f:
                f.write(content)
            with pytest.raises(ValueError, match=message):
                check_pair(SpecServeConfig(target=target, drafter=drafter))
    finally:
        os.remove(path)
    with pytest.raises(ValueError, match="for a drafter only"):
        ModelRunner.from_pretrained(target, draft_vocab=4)


def test_the_cli_refuses_a_bad_draft_vocab_with_a_message(pair_dirs):
    target, drafter = pair_dirs
    for args, message in ((["--draft-vocab", "0"], "must be auto, off or an integer >= 1"),
                          (["--draft-vocab", "12"], "has no draft_vocab.json")):
        rc = subprocess.run([sys.executable, "-m", "specserve.cli", "generate", "--target", target, "--drafter",
                             drafter, "--prompt", "def", "--max-tokens", "4", *args], capture_output=True, text=True)
        assert rc.returncode == 2 and message in rc.stderr, rc.stderr
        assert "Traceback" not in rc.stderr


def test_a_pair_refuses_a_bad_draft_vocab_before_its_drafter_actor_starts(ray_session, pair_dirs):
    """`serve run` and the distributed CLI start the drafter actor through `start_drafter`: a bad
    setting is the same ValueError as in process, raised before any actor (not an actor that died
    loading its model), and the pair leaves nothing behind."""
    from ray._private.state import actors  # from the GCS (ray.util.state needs the dashboard)

    from specserve.cluster.pair import SpeculativePair
    target, drafter = pair_dirs
    before = set(actors())
    with pytest.raises(ValueError, match="has no draft_vocab.json"):
        SpeculativePair(target, drafter, pipeline=False, draft_vocab=12, cpus_per_actor=1)
    new = [a["ActorClassName"] for actor_id, a in actors().items() if actor_id not in before]
    assert not [name for name in new if "Drafter" in name or "Verifier" in name], new  # (others' actors aside)


def test_the_demo_drafter_ships_its_draft_vocabulary():
    """The demo drafter's file: every ranked id a token of its vocabulary, and `auto` uses it."""
    from specserve.config import DEFAULT_MODEL_DIR
    drafter = str(DEFAULT_MODEL_DIR / "drafter")
    data = draft_vocab.read(drafter)
    assert data is not None and 1 <= data["size"] < 8192
    assert draft_vocab.resolve(drafter, "auto", 8192) == data["ranked_ids"][:data["size"]]
