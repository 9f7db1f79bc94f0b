"""Train the embedded demo pair: a small code-completion target and its distilled drafter.

``specserve train-demo`` (``python -m specserve.training.demo_pair``) runs, from nothing but the Python
standard library of the running interpreter:

1. corpus + split: every ``.py`` file under ``sysconfig.get_paths()["stdlib"]`` except test
   directories and ``site-packages``; modules (top-level module or package) are split into
   train and held-out with a fixed seed; ``<out>/split.json`` records the split;
2. a byte-level BPE tokenizer (``tokenizers``) trained on the train split only, EOS
   ``<|endoftext|>`` (also the document separator);
3. target pretraining (``LlamaForCausalLM``, ~14M params) on the pre-tokenized train split
   (cached in the work dir), saved to ``<out>/target``;
4. the drafter, by running ``python -m specserve.training.distill`` on the saved target: the same
   command any user runs for their own target; saved to ``<out>/drafter``.

Every stage checkpoints into ``--work-dir`` and a rerun with the same work dir resumes
(finished stages are skipped). ``--heldout-loss MODEL_DIR ...`` prints held-out loss/perplexity.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import subprocess
import sys
import sysconfig
import time
from pathlib import Path
from typing import Sequence

import torch
import torch.nn.functional as F

from specserve.training.distill import (check_model_folder, count_params, files_from_split, load_causal_lm,
                                     load_token_stream, log, make_llama, read_text, save_hf, tokenize_files, train_loop,
                                     ce_loss_fn, tune_malloc)

EOS = "<|endoftext|>"
SPLIT_SEED = 0
HELDOUT_FRAC = 0.06
# Directory names whose contents are tests (test/, tests/, idlelib/idle_test, lib2to3/tests,
# ctypes/test, unittest/test, ...) or third-party code.
EXCLUDED_DIRS = {"test", "tests", "idle_test", "site-packages", "__pycache__"}


def stdlib_root() -> str:
    return sysconfig.get_paths()["stdlib"]


# ----------------------------------------------------------------------------- corpus + split

def corpus_files(root: str | None = None) -> list[str]:
    """All stdlib ``.py`` files outside test dirs and site-packages, relative to ``root``, sorted."""
    root = root or stdlib_root()
    out = []
    for dirpath, dirs, names in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in EXCLUDED_DIRS)
        for n in sorted(names):
            if n.endswith(".py"):
                out.append(os.path.relpath(os.path.join(dirpath, n), root))
    return sorted(out)


def module_of(rel: str) -> str:
    """Top-level module or package name of a stdlib-relative path."""
    first = rel.split(os.sep)[0]
    return first[:-3] if first.endswith(".py") else first


def make_split(files: Sequence[str] | None = None, heldout_frac: float = HELDOUT_FRAC,
               seed: int = SPLIT_SEED, root: str | None = None) -> dict:
    """Split by module: ``round(heldout_frac * n_modules)`` modules, drawn with ``random.Random(seed)``
    from the sorted module list, are held out."""
    root = root or stdlib_root()
    files = list(files) if files is not None else corpus_files(root)
    modules = sorted({module_of(f) for f in files})
    n_held = max(1, round(heldout_frac * len(modules)))
    held = set(random.Random(seed).sample(modules, n_held))
    return {
        "seed": seed, "heldout_frac": heldout_frac, "stdlib": root,
        "python": sys.version.split()[0],
        "excluded_dirs": sorted(EXCLUDED_DIRS),
        "heldout_modules": sorted(held), "train_modules": sorted(set(modules) - held),
        "heldout_files": [f for f in files if module_of(f) in held],
        "train_files": [f for f in files if module_of(f) not in held],
    }


def write_split(path: str | os.PathLike, split: dict) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        json.dump(split, f, indent=1)
        f.write("\n")


def heldout_files(split_json_path: str | os.PathLike) -> list[str]:
    """Absolute paths of the held-out files of a ``split.json`` (prompts for evaluation)."""
    return files_from_split(split_json_path, "heldout")


def heldout_prompts(model_dir: Path, n: int, prompt_tokens: int, tokenizer, seed: int = 0) -> list[list[int]]:
    """Prompts from held-out stdlib files (demo pair), starting at random line starts."""
    split = model_dir / "split.json"
    if not split.exists():
        rng = random.Random(seed)
        return [[rng.randrange(tokenizer.vocab_size) for _ in range(prompt_tokens)] for _ in range(n)]
    rng = random.Random(seed)
    files = sorted(heldout_files(str(split)))
    prompts = []
    while len(prompts) < n:
        with open(rng.choice(files), encoding="utf-8", errors="replace") as f:
            lines = f.read().splitlines(keepends=True)
        if len(lines) < 20:
            continue
        start = rng.randrange(0, len(lines) - 10)
        ids = tokenizer("".join(lines[start:start + 60]))["input_ids"][:prompt_tokens]
        if len(ids) == prompt_tokens:
            prompts.append(ids)
    return prompts


def train_files(split_json_path: str | os.PathLike) -> list[str]:
    return files_from_split(split_json_path, "train")


# ----------------------------------------------------------------------------- tokenizer

def train_tokenizer(files: Sequence[str], vocab_size: int = 8192, out_dir: str | os.PathLike | None = None,
                    model_max_length: int = 2048):
    """Byte-level BPE trained on ``files``; returns a ``PreTrainedTokenizerFast`` (saved to
    ``out_dir`` if given) with EOS ``<|endoftext|>`` (also BOS/PAD/UNK placeholder)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=[EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    t0 = time.time()
    tok.train_from_iterator((read_text(f) for f in files), trainer=trainer, length=len(files))
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, bos_token=EOS, pad_token=EOS,
                                 unk_token=EOS, model_max_length=model_max_length,
                                 clean_up_tokenization_spaces=False)
    log(f"[tokenizer] byte-level BPE, vocab {len(hf)}, trained on {len(files)} files in {time.time() - t0:.1f}s")
    if out_dir is not None:
        hf.save_pretrained(str(out_dir))
    return hf


# ----------------------------------------------------------------------------- eval

@torch.no_grad()
def heldout_loss(model_path: str, split_json: str, max_tokens: int = 200_000, seq_len: int = 256,
                 batch_size: int = 8) -> dict:
    """Mean next-token loss (nats) and perplexity of the HF model at ``model_path`` (fp32) on
    the first ``max_tokens`` tokens of the held-out files (sorted, EOS-separated), in
    non-overlapping windows of ``seq_len``."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(model_path, local_files_only=True)
    model = load_causal_lm(model_path)
    files = heldout_files(split_json)
    ids = tokenize_files(tok, files, tok.eos_token_id)[: max_tokens + 1].long()
    n_win = max(1, (ids.numel() - 1) // seq_len)
    total, count = 0.0, 0
    for b in range(0, n_win, batch_size):
        rows = []
        for w in range(b, min(n_win, b + batch_size)):
            rows.append(ids[w * seq_len: w * seq_len + seq_len + 1])
        L = min(r.numel() for r in rows)
        batch = torch.stack([r[:L] for r in rows])
        logits = model(input_ids=batch[:, :-1]).logits.float()
        total += float(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1),
                                       reduction="sum"))
        count += batch[:, 1:].numel()
    loss = total / max(1, count)
    return {"model": model_path, "loss": loss, "ppl": math.exp(loss), "tokens": count,
            "heldout_files": len(files)}


# ----------------------------------------------------------------------------- pipeline

def pretrain_target(tokenizer, stream: torch.Tensor, out_dir: str, work_dir: str, *, hidden=384,
                    layers=6, heads=6, intermediate=1024, max_pos=2048, seq_len=256, batch_size=8,
                    lr=2e-3, warmup=50, steps=None, minutes=40.0, ckpt_minutes=5.0, seed=0,
                    log_every=10, dtype="float16") -> dict:
    model = make_llama(len(tokenizer), hidden, layers, heads, intermediate,
                       eos_token_id=tokenizer.eos_token_id, max_position_embeddings=max_pos, seed=seed)
    n = count_params(model)
    log(f"[target] LlamaForCausalLM {hidden}x{layers}L {heads}H ff{intermediate} vocab {len(tokenizer)}: "
        f"{n / 1e6:.2f}M params")
    meta = {"hidden": hidden, "layers": layers, "heads": heads, "intermediate": intermediate,
            "seq_len": seq_len, "batch_size": batch_size, "lr": lr, "seed": seed,
            "vocab": len(tokenizer), "n_tokens": int(stream.numel())}
    state = train_loop(model, stream, ce_loss_fn, name="target", work_dir=work_dir,
                       batch_size=batch_size, seq_len=seq_len, lr=lr, steps=steps, minutes=minutes,
                       warmup=warmup, weight_decay=0.1, ckpt_minutes=ckpt_minutes,
                       log_every=log_every, seed=seed, meta=meta)
    info = dict(meta, steps=state["step"], tokens_seen=state["tokens"],
                train_seconds=round(state["train_seconds"], 1), final_stats=state.get("last", {}),
                params=n, dtype=dtype)
    save_hf(model, tokenizer, out_dir, dtype=dtype, info=info)
    log(f"[target] saved to {out_dir}")
    return info


def _check_saved(path: str, tokenizer) -> None:
    """Reload a saved model in fp32 and greedily continue a short code prompt."""
    from transformers import AutoTokenizer
    from specserve.training.distill import generate
    tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    m = load_causal_lm(path)
    ids = torch.tensor([tok("def main():\n    ", add_special_tokens=False)["input_ids"]])
    out = generate(m, ids, 24)
    log(f"[check] {path}: {json.dumps(tok.decode(out[0].tolist()))}")


def folder_mb(path: str) -> float:
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file()) / 1e6


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="specserve train-demo", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--out", default="models/demo", help="writes <out>/target, <out>/drafter, <out>/split.json")
    p.add_argument("--work-dir", default="runs/demo", help="checkpoints, tokenizer, token cache")
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="torch threads")
    p.add_argument("--seed", type=int, default=0, help="init / data-order seed (the split seed is fixed)")
    p.add_argument("--heldout-frac", type=float, default=HELDOUT_FRAC)
    p.add_argument("--max-files", type=int, default=None,
                   help="train on a fixed random slice of N train files (tests)")
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--hidden", type=int, default=384, help="target hidden size")
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--heads", type=int, default=6)
    p.add_argument("--intermediate", type=int, default=1024)
    p.add_argument("--max-position-embeddings", type=int, default=2048)
    p.add_argument("--lr", type=float, default=2e-3, help="target peak LR")
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--minutes", type=float, default=40.0, help="target wall-clock budget (0: none)")
    p.add_argument("--steps", type=int, default=None, help="target max steps")
    p.add_argument("--ckpt-minutes", type=float, default=5.0)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--dtype", choices=["float16", "bfloat16", "float32"], default="float16")
    d = p.add_argument_group("drafter (passed to python -m specserve.training.distill)")
    d.add_argument("--skip-drafter", action="store_true")
    d.add_argument("--loss", choices=["kl", "ce"], default="kl")
    d.add_argument("--drafter-hidden", type=int, default=192)
    d.add_argument("--drafter-layers", type=int, default=3)
    d.add_argument("--drafter-heads", type=int, default=6)
    d.add_argument("--drafter-intermediate", type=int, default=384)
    d.add_argument("--drafter-lr", type=float, default=4e-3)
    d.add_argument("--drafter-minutes", type=float, default=18.0, help="(0: none)")
    d.add_argument("--drafter-steps", type=int, default=None)
    d.add_argument("--drafter-args", default="", help="extra arguments for distill, one string")
    p.add_argument("--heldout-loss", nargs="+", metavar="MODEL_DIR", default=None,
                   help="only print held-out loss/perplexity of these model folders and exit")
    p.add_argument("--split", default=None, help="split.json for --heldout-loss (default <out>/split.json)")
    p.add_argument("--eval-tokens", type=int, default=200_000)
    p.add_argument("--draft-vocab", type=int, default=1024,
                   help="the drafter's draft vocabulary: its N most frequent training tokens (draft_vocab.json)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    if args.heldout_loss:  # (until stop 61 a folder that is not a model was a transformers traceback)
        for m in args.heldout_loss:
            check_model_folder(m, "--heldout-loss")
        split = args.split or str(Path(args.out) / "split.json")
        if not os.path.isfile(split):
            p.error(f"--heldout-loss needs the split: {split!r} is not a file (give --split or --out)")
    tune_malloc()
    if args.threads:
        torch.set_num_threads(args.threads)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    out, work = Path(args.out), Path(args.work_dir)
    split_path = out / "split.json"

    if args.heldout_loss:
        for m in args.heldout_loss:
            print(json.dumps(heldout_loss(m, args.split or str(split_path), args.eval_tokens)), flush=True)
        return 0

    t_start = time.time()
    work.mkdir(parents=True, exist_ok=True)
    # 1. corpus + split (deterministic; rewritten every run)
    split = make_split(heldout_frac=args.heldout_frac, seed=SPLIT_SEED)
    write_split(split_path, split)
    files = train_files(split_path)
    log(f"[split] {len(split['train_files'])} train / {len(split['heldout_files'])} held-out files; "
        f"held-out modules: {', '.join(split['heldout_modules'])} -> {split_path}")
    if args.max_files:
        files = sorted(random.Random(args.seed).sample(files, min(args.max_files, len(files))))
        log(f"[split] using a slice of {len(files)} train files")

    # 2. tokenizer (train split only), cached in the work dir
    tok_dir = work / f"tokenizer-{args.vocab}-{len(files)}"
    if (tok_dir / "tokenizer.json").exists():
        from transformers import AutoTokenizer
        tokenizer = AutoTokenizer.from_pretrained(str(tok_dir), local_files_only=True)
        log(f"[tokenizer] loaded {tok_dir}")
    else:
        tokenizer = train_tokenizer(files, args.vocab, tok_dir)
    stream = load_token_stream(tokenizer, files, work, "train")
    chars = sum(os.path.getsize(f) for f in files)
    log(f"[data] {chars / 1e6:.1f} MB of source, {chars / max(1, stream.numel()):.2f} bytes/token")

    # 3. target
    target_dir = str(out / "target")
    pretrain_target(tokenizer, stream, target_dir, str(work), hidden=args.hidden,
                             layers=args.layers, heads=args.heads, intermediate=args.intermediate,
                             max_pos=args.max_position_embeddings, seq_len=args.seq_len,
                             batch_size=args.batch_size, lr=args.lr, warmup=args.warmup,
                             steps=args.steps, minutes=args.minutes or None,
                             ckpt_minutes=args.ckpt_minutes, seed=args.seed,
                             log_every=args.log_every, dtype=args.dtype)
    _check_saved(target_dir, tokenizer)

    # 4. drafter: the user-facing distill command on the saved target
    if not args.skip_drafter:
        data_arg = str(split_path)
        if args.max_files:  # the same slice as the target
            data_arg = "@" + str(work / "train_files.txt")
            (work / "train_files.txt").write_text("".join(f + "\n" for f in files))
        cmd = [sys.executable, "-m", "specserve.training.distill", "--target", target_dir,
               "--out", str(out / "drafter"), "--data", data_arg, "--eval-data", str(split_path),
               "--work-dir", str(work / "drafter"), "--loss", args.loss,
               "--hidden", str(args.drafter_hidden), "--layers", str(args.drafter_layers),
               "--heads", str(args.drafter_heads), "--intermediate", str(args.drafter_intermediate),
               "--lr", str(args.drafter_lr), "--seq-len", str(args.seq_len),
               "--minutes", str(args.drafter_minutes or 0), "--threads", str(args.threads or 0),
               "--seed", str(args.seed), "--ckpt-minutes", str(args.ckpt_minutes),
               "--log-every", str(args.log_every), "--dtype", args.dtype]
        if args.drafter_steps:
            cmd += ["--steps", str(args.drafter_steps)]
        cmd += args.drafter_args.split()
        log("[drafter] " + " ".join(cmd))
        subprocess.run(cmd, check=True)
        _check_saved(str(out / "drafter"), tokenizer)
        # 5. its draft vocabulary: the training files' tokens by frequency (specserve.core.draft_vocab)
        from specserve.training.draft_vocab import rank_tokens, read_texts, write
        path = write(str(out / "drafter"), rank_tokens(tokenizer, read_texts(files)), args.draft_vocab,
                     f"{len(files)} training files of {split_path.name}")
        log(f"[drafter] draft vocabulary: {path}, size {args.draft_vocab}")

    for d in ("target", "drafter"):
        if (out / d).exists():
            log(f"[done] {out / d}: {folder_mb(str(out / d)):.1f} MB")
    log(f"[done] total {(time.time() - t_start) / 60:.1f} min")
    return 0


if __name__ == "__main__":
    sys.exit(main())
