"""CI-sized run of the demo training pipeline (`specserve train-demo`): tiny models, a few steps,
a slice of the stdlib corpus, vocab 512. Checks the split, the saved pair (offline loading, one
tokenizer, EOS wiring, half precision), resume, and the held-out loss helper."""
import json
import os

import pytest
import torch

from specserve.training import demo_pair

TINY = [
    "--threads", "1", "--max-files", "25", "--vocab", "512", "--seq-len", "64", "--batch-size", "4",
    "--hidden", "64", "--layers", "2", "--heads", "2", "--intermediate", "128",
    "--steps", "4", "--minutes", "0", "--log-every", "2",
    "--drafter-hidden", "32", "--drafter-layers", "1", "--drafter-heads", "2",
    "--drafter-intermediate", "64", "--drafter-steps", "3", "--drafter-minutes", "0",
    "--drafter-args", "--eval-prompts 2 --gen-tokens 16 --gen-pool 8 --batch-size 4",
]


def test_split_by_module_is_disjoint_and_fixed():
    files = demo_pair.corpus_files()
    assert files and all(f.endswith(".py") for f in files)
    assert not any(set(f.split(os.sep)[:-1]) & {"test", "tests", "idle_test", "site-packages"} for f in files)
    s1, s2 = demo_pair.make_split(files), demo_pair.make_split(files)
    assert s1 == s2 and s1["seed"] == 0
    held, train = set(s1["heldout_modules"]), set(s1["train_modules"])
    assert held and not held & train
    assert 0.04 <= len(held) / (len(held) + len(train)) <= 0.09
    assert {demo_pair.module_of(f) for f in s1["heldout_files"]} == held
    assert not set(s1["heldout_files"]) & set(s1["train_files"])
    assert len(s1["heldout_files"]) + len(s1["train_files"]) == len(files)


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("train_demo")
    out, work = root / "out", root / "work"
    args = ["--out", str(out), "--work-dir", str(work)] + TINY
    assert demo_pair.main(args) == 0
    return out, work, args


def test_tiny_pipeline_writes_loadable_pair(tiny_run):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    out, work, _ = tiny_run
    split = json.loads((out / "split.json").read_text())
    held = demo_pair.heldout_files(out / "split.json")
    assert held and all(os.path.isabs(p) and os.path.isfile(p) for p in held)
    assert len(held) == len(split["heldout_files"])
    # the training slice never contains held-out files
    sliced = (work / "train_files.txt").read_text().split()
    assert sliced and not set(sliced) & set(held)

    toks, models = {}, {}
    for name in ("target", "drafter"):
        path = str(out / name)
        assert os.path.isfile(os.path.join(path, "model.safetensors"))
        toks[name] = AutoTokenizer.from_pretrained(path, local_files_only=True)
        models[name] = AutoModelForCausalLM.from_pretrained(path, local_files_only=True)
        cfg = models[name].config
        assert cfg.model_type == "llama" and cfg.tie_word_embeddings
        assert cfg.vocab_size == 512
        assert cfg.eos_token_id == toks[name].eos_token_id == toks[name].convert_tokens_to_ids("<|endoftext|>")
        assert models[name].generation_config.eos_token_id == cfg.eos_token_id
        assert json.loads((out / name / "config.json").read_text())["dtype"] == "float16"
    assert toks["target"].get_vocab() == toks["drafter"].get_vocab()
    assert len(toks["target"]) == 512
    n_t = sum(p.numel() for p in models["target"].parameters())
    n_d = sum(p.numel() for p in models["drafter"].parameters())
    assert n_d < n_t

    text = "def f(x):\n    return x + 1\n"
    ids = toks["target"](text, add_special_tokens=False)["input_ids"]
    assert toks["target"].decode(ids) == text
    # loaded half-precision weights run in fp32 and generate in-vocab tokens
    m = models["target"].float().eval()
    with torch.no_grad():
        gen = m.generate(torch.tensor([ids]), max_new_tokens=5, do_sample=False)
    assert gen.shape[1] == len(ids) + 5 or int(gen[0, -1]) == m.config.eos_token_id
    assert int(gen.max()) < 512

    info = json.loads((out / "drafter" / "training_info.json").read_text())
    assert info["steps"] == 3 and info["loss"] == "kl"
    assert 0.0 <= info["heldout_greedy_acceptance"]["acceptance"] <= 1.0


def test_rerun_resumes_finished_stages(tiny_run, capsys):
    out, work, args = tiny_run
    before = (out / "target" / "model.safetensors").read_bytes()
    assert demo_pair.main(args) == 0
    log = capsys.readouterr().out
    assert "[target] resumed from" in log and "already done" in log
    assert "tokens from cache" in log
    assert (out / "target" / "model.safetensors").read_bytes() == before


def test_heldout_loss(tiny_run):
    out, _, _ = tiny_run
    res = demo_pair.heldout_loss(str(out / "target"), str(out / "split.json"), max_tokens=1000, seq_len=64)
    assert 0 < res["tokens"] <= 1000
    assert 0 < res["loss"] < 10 and res["ppl"] > 1
