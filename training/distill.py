"""Train a drafter for a given target: ``specserve distill --target PATH --out PATH``.

This is the code path for any target, not only the demo pair: the drafter is a small
``LlamaForCausalLM`` that shares the target's tokenizer (it is copied into the output folder),
trained on text tokenized with that tokenizer.

Losses (``--loss``):

* ``kl`` (default): forward KL(target || drafter) at temperature ``--temperature`` (default 1)
  on the target's full next-token distribution, computed on the fly with the frozen target under
  ``torch.no_grad``. With ``--gen-frac > 0`` part of every batch is *target-generated*: a real
  prompt continued by the target itself (greedy for half of those rows, sampled at T=1 for the
  other half), so the drafter also learns the contexts it will see when serving. The target's
  logits produced while generating are reused as the soft labels, so those rows cost no extra
  teacher forward.
* ``ce``: plain next-token cross-entropy on the real data, same drafter, same data order, same
  schedule. Use ``--steps-from DRAFTER_DIR`` to run exactly as many steps as an earlier run
  (its ``training_info.json``), which is how the KL-vs-CE comparison is meant to be made.

Training runs in fp32 on whatever torch device is chosen (CPU by default), budgeted by wall-clock
``--minutes`` and/or ``--steps``; checkpoints (model, optimizer, step, data position, RNG) go to
``--work-dir`` every ``--ckpt-minutes`` and a rerun with the same work dir resumes. The result is
written with ``save_pretrained`` (safetensors, half precision by default) plus the tokenizer,
a ``generation_config.json`` with the EOS token and ``training_info.json``.

The module also holds the training loop shared with the demo target pretraining
(:func:`train_loop`) and an offline greedy acceptance-rate estimate (:func:`greedy_acceptance`).
"""
from __future__ import annotations

import argparse
import fnmatch
import hashlib
import inspect
import json
import math
import os
import random
import sys
import time
from pathlib import Path
from typing import Callable, Sequence

import torch
import torch.nn.functional as F

__all__ = [
    "distill", "main", "train_loop", "make_llama", "save_hf", "greedy_acceptance",
    "generate", "load_token_stream", "files_from_split", "collect_files", "count_params",
]


def log(msg: str) -> None:
    print(msg, flush=True)


def _fmt_time(s: float) -> str:
    s = max(0, int(s))
    h, m, sec = s // 3600, (s // 60) % 60, s % 60
    return f"{h}h{m:02d}m{sec:02d}s" if h else f"{m}m{sec:02d}s"


def tune_malloc() -> None:
    """Keep freed memory in the process (glibc only, best effort): big tensors are otherwise
    mmap'ed and unmapped every step, and re-faulting those pages is slow in a VM."""
    try:
        import ctypes
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-4, 0)          # M_MMAP_MAX: serve big blocks from the heap
        libc.mallopt(-1, 1 << 30)    # M_TRIM_THRESHOLD: do not give the heap top back
    except Exception:
        pass


def count_params(model: torch.nn.Module) -> int:
    """Unique parameters (tied embeddings counted once)."""
    seen, n = set(), 0
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            n += p.numel()
    return n


# ----------------------------------------------------------------------------- data

def files_from_split(split_json: str | os.PathLike, which: str = "train") -> list[str]:
    """Absolute paths of the ``train`` or ``heldout`` files of a ``split.json``.

    Paths are stored relative to the stdlib root; they are resolved against the running
    interpreter's stdlib (``sysconfig``), falling back to the root recorded in the file.
    Missing files (another Python version) are skipped with a warning.
    """
    import sysconfig
    with open(split_json) as f:
        split = json.load(f)
    key = {"train": "train_files", "heldout": "heldout_files"}[which]
    roots = [sysconfig.get_paths()["stdlib"], split.get("stdlib", "")]
    out, missing = [], 0
    for rel in split[key]:
        for root in roots:
            p = os.path.join(root, rel)
            if root and os.path.isfile(p):
                out.append(os.path.abspath(p))
                break
        else:
            missing += 1
    if missing:
        log(f"warning: {missing} of {len(split[key])} {which} files of {split_json} not found")
    return out


class DataError(ValueError):
    """Data or an output folder that cannot work, found before a model loads: `distill`'s usage
    error (until stop 61 a traceback, or, for --out naming the target, the target overwritten)."""


def check_model_folder(path: str, flag: str) -> None:
    if not (Path(path) / "config.json").is_file():
        from specserve.core.runner import ModelLoadError
        raise ModelLoadError(f"{flag} {path!r} is not a model folder (no config.json)")


def check_paths(paths: Sequence[str], flag: str) -> None:
    for p in paths:
        if p.startswith("@"):  # a list of files: the list and each file it names
            if not os.path.isfile(p[1:]):
                raise DataError(f"{flag} {p!r}: {p[1:]!r} is not a file (a list of files, one per line)")
            with open(p[1:]) as f:
                missing = [ln.strip() for ln in f if ln.strip() and not os.path.isfile(ln.strip())]
            if missing:
                raise DataError(f"{flag} {p!r}: {len(missing)} of its files do not exist, e.g. {missing[0]!r}")
        elif not os.path.exists(p):
            raise DataError(f"{flag} {p!r}: no such file or folder")


def collect_files(paths: Sequence[str], pattern: str = "*.py", which: str = "train") -> list[str]:
    """Expand data arguments: a ``split.json`` (its ``which`` files), a directory (files matching
    ``pattern``, recursively, sorted), ``@LIST`` (a file listing paths, one per line) or a
    single text file."""
    files: list[str] = []
    for p in paths:
        if p.startswith("@"):  # a list of files, one per line
            with open(p[1:]) as f:
                files += [ln.strip() for ln in f if ln.strip()]
        elif p.endswith(".json") and os.path.isfile(p):
            files += files_from_split(p, which)
        elif os.path.isdir(p):
            for root, dirs, names in os.walk(p):
                dirs.sort()
                files += [os.path.join(root, n) for n in sorted(names) if fnmatch.fnmatch(n, pattern)]
        elif os.path.isfile(p):
            files.append(p)
        else:
            raise FileNotFoundError(p)
    return files


def read_text(path: str) -> str:
    with open(path, "rb") as f:
        return f.read().decode("utf-8", errors="replace")


def tokenize_files(tokenizer, files: Sequence[str], eos_id: int) -> torch.Tensor:
    """One 1-D int32 stream: every file's tokens followed by EOS (the document separator)."""
    chunks = []
    for i in range(0, len(files), 64):
        texts = [read_text(f) for f in files[i:i + 64]]
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is not None:  # no max-length warnings, no Python-side overhead
            enc = [e.ids for e in backend.encode_batch(texts, add_special_tokens=False)]
        else:
            enc = tokenizer(texts, add_special_tokens=False)["input_ids"]
        for ids in enc:
            chunks.append(torch.tensor(ids + [eos_id], dtype=torch.int32))
    return torch.cat(chunks) if chunks else torch.zeros(0, dtype=torch.int32)


def _tokenizer_fingerprint(tokenizer) -> str:
    h = hashlib.sha256()
    h.update(json.dumps(sorted(tokenizer.get_vocab().items())).encode())
    return h.hexdigest()[:12]


def load_token_stream(tokenizer, files: Sequence[str], cache_dir: str | os.PathLike | None,
                      name: str = "train") -> torch.Tensor:
    """Tokenize ``files`` once and cache the stream as ``<cache_dir>/tokens-<name>-<key>.pt``;
    the key covers the tokenizer's vocab and the file list (paths, sizes)."""
    eos_id = tokenizer.eos_token_id
    if eos_id is None:
        raise ValueError("tokenizer has no eos_token; it is needed as document separator")
    h = hashlib.sha256(_tokenizer_fingerprint(tokenizer).encode())
    for f in files:
        h.update(f"{f}\0{os.path.getsize(f)}\0".encode())
    key = h.hexdigest()[:16]
    path = Path(cache_dir) / f"tokens-{name}-{key}.pt" if cache_dir else None
    if path is not None and path.exists():
        ids = torch.load(path)
        log(f"[data] {name}: {ids.numel():,} tokens from cache {path}")
        return ids
    t0 = time.time()
    ids = tokenize_files(tokenizer, files, eos_id)
    log(f"[data] {name}: tokenized {len(files)} files -> {ids.numel():,} tokens in {time.time() - t0:.1f}s")
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        torch.save(ids, tmp)
        os.replace(tmp, path)
    return ids


class ChunkSampler:
    """Shuffled non-overlapping windows of ``seq_len + 1`` tokens, epoch by epoch; the
    permutation of an epoch is derived from (seed, epoch) so the state is just two ints."""

    def __init__(self, n_tokens: int, seq_len: int, batch_size: int, seed: int = 0):
        self.seq_len, self.batch_size, self.seed = seq_len, batch_size, seed
        self.n_chunks = (n_tokens - 1) // seq_len
        if self.n_chunks < 1:
            raise ValueError(f"corpus of {n_tokens} tokens is shorter than seq_len={seq_len}")
        self.epoch, self.pos = 0, 0
        self._perm = None

    def _permutation(self) -> torch.Tensor:
        if self._perm is None or self._perm[0] != self.epoch:
            g = torch.Generator().manual_seed(self.seed * 100_003 + self.epoch)
            self._perm = (self.epoch, torch.randperm(self.n_chunks, generator=g))
        return self._perm[1]

    def next_starts(self) -> torch.Tensor:
        out = []
        while len(out) < self.batch_size:
            perm = self._permutation()
            take = min(self.batch_size - len(out), self.n_chunks - self.pos)
            out += perm[self.pos:self.pos + take].tolist()
            self.pos += take
            if self.pos >= self.n_chunks:
                self.epoch, self.pos = self.epoch + 1, 0
        return torch.tensor(out) * self.seq_len

    def batch(self, data: torch.Tensor) -> torch.Tensor:
        starts = self.next_starts()
        idx = starts[:, None] + torch.arange(self.seq_len + 1)[None, :]
        return data[idx].long()

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "pos": self.pos}

    def load_state_dict(self, s: dict) -> None:
        self.epoch, self.pos = int(s["epoch"]), int(s["pos"])


# ----------------------------------------------------------------------------- models

def make_llama(vocab_size: int, hidden: int, layers: int, heads: int, intermediate: int, *,
               eos_token_id: int, max_position_embeddings: int = 2048, seed: int = 0,
               rope_theta: float = 10000.0):
    """A ``LlamaForCausalLM`` with tied embeddings, MHA (kv heads = heads), fp32."""
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(
        vocab_size=vocab_size, hidden_size=hidden, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=heads, intermediate_size=intermediate,
        max_position_embeddings=max_position_embeddings, tie_word_embeddings=True,
        rms_norm_eps=1e-5, rope_theta=rope_theta, eos_token_id=eos_token_id,
        bos_token_id=eos_token_id, pad_token_id=eos_token_id, initializer_range=0.02,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg)
    return model.float()


def _rope_theta(cfg) -> float:
    rp = getattr(cfg, "rope_parameters", None) or {}
    return float(rp.get("rope_theta") or getattr(cfg, "rope_theta", None) or 10000.0)


def _cache_kwarg(model) -> str:
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def _out_cache(out):
    for k in ("cache", "past_key_values"):
        c = getattr(out, k, None)
        if c is not None:
            return c
    return None


@torch.no_grad()
def generate(model, prompts: torch.Tensor, n_new: int, *, greedy_rows: int | None = None,
             temperature: float = 1.0, return_logits: bool = False):
    """Continue equal-length ``prompts`` (B, P) by ``n_new`` tokens with a KV cache.

    Rows ``< greedy_rows`` (default: all) are greedy, the rest are sampled from
    softmax(logits / temperature) with the global torch RNG. Returns the (B, P + n_new) token
    tensor and, with ``return_logits``, the fp32 logits at positions 0 .. P + n_new - 1 (the
    distribution of the token after each position); that needs n_new decode steps, the last
    one only for its logits.
    """
    B = prompts.shape[0]
    greedy_rows = B if greedy_rows is None else greedy_rows
    kw = _cache_kwarg(model)
    out = model(input_ids=prompts, use_cache=True)
    cache = _out_cache(out)
    logits_all = [out.logits.float()] if return_logits else None
    last = out.logits[:, -1, :].float()
    toks = [prompts]
    for i in range(n_new):
        nxt = torch.empty(B, dtype=torch.long, device=prompts.device)
        if greedy_rows > 0:
            nxt[:greedy_rows] = last[:greedy_rows].argmax(-1)
        if greedy_rows < B:
            probs = torch.softmax(last[greedy_rows:] / temperature, dim=-1)
            nxt[greedy_rows:] = torch.multinomial(probs, 1).squeeze(1)
        toks.append(nxt[:, None])
        if i == n_new - 1 and not return_logits:
            break
        out = model(input_ids=nxt[:, None], use_cache=True, **{kw: cache})
        cache = _out_cache(out)
        last = out.logits[:, -1, :].float()
        if return_logits:
            logits_all.append(out.logits.float())
    seq = torch.cat(toks, dim=1)
    if return_logits:
        return seq, torch.cat(logits_all, dim=1)
    return seq


@torch.no_grad()
def init_embeddings_from(drafter, target) -> None:
    """Initialize the drafter's (tied) token embeddings with the target's projected on their
    top principal directions (best rank-h approximation coordinates, E_t @ V_h), so every token,
    rare ones included, starts where the target put it."""
    e_t = target.get_input_embeddings().weight.detach().float()
    h = drafter.get_input_embeddings().weight.shape[1]
    if h >= e_t.shape[1]:
        w = torch.zeros(e_t.shape[0], h)
        w[:, :e_t.shape[1]] = e_t
    else:
        _, _, vh = torch.linalg.svd(e_t, full_matrices=False)
        w = e_t @ vh[:h].T
    drafter.get_input_embeddings().weight.copy_(w)
    log(f"[distill] drafter embeddings: target's projected to {h} dims "
        f"(rms {float(w.pow(2).mean().sqrt()):.3g})")


def save_hf(model, tokenizer, out_dir: str | os.PathLike, *, dtype: str = "float16",
            info: dict | None = None) -> str:
    """``save_pretrained`` (safetensors) in ``dtype`` + tokenizer + generation config with EOS."""
    from transformers import GenerationConfig
    out_dir = str(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    import copy
    m = copy.deepcopy(model).to(getattr(torch, dtype)).eval()
    eos = tokenizer.eos_token_id
    m.config.eos_token_id = eos
    m.config.bos_token_id = eos
    m.config.pad_token_id = eos
    m.config.use_cache = True
    m.generation_config = GenerationConfig(eos_token_id=eos, bos_token_id=eos, pad_token_id=eos,
                                           do_sample=False)
    m.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    if info is not None:
        with open(os.path.join(out_dir, "training_info.json"), "w") as f:
            json.dump(info, f, indent=2, sort_keys=True)
    return out_dir


# ----------------------------------------------------------------------------- training loop

def lr_factor(step: int, progress: float, warmup: int, min_ratio: float) -> float:
    """Linear warmup over ``warmup`` steps, then cosine from 1 to ``min_ratio`` over progress."""
    w = min(1.0, (step + 1) / max(1, warmup))
    p = min(1.0, max(0.0, progress))
    return w * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * p)))


def train_loop(model: torch.nn.Module, data: torch.Tensor, loss_fn: Callable, *, name: str,
               work_dir: str | os.PathLike, batch_size: int, seq_len: int, lr: float,
               steps: int | None = None, minutes: float | None = None, warmup: int = 50,
               min_lr_ratio: float = 0.1, weight_decay: float = 0.1, betas=(0.9, 0.95),
               grad_clip: float = 1.0, ckpt_minutes: float = 5.0, log_every: int = 10,
               seed: int = 0, meta: dict | None = None) -> dict:
    """Generic LM training loop with budget, schedule, logging, checkpoint and resume.

    ``loss_fn(model, batch)`` gets a (B, seq_len + 1) LongTensor and returns ``(loss, stats)``
    where ``stats`` is a dict of floats to log. The schedule's progress is
    ``max(step / steps, train_seconds / (minutes * 60))`` (whichever budgets are given), so a
    wall-clock budget always ends with the fully decayed LR; training stops when it reaches 1.
    The checkpoint ``<work_dir>/<name>.pt`` holds model, optimizer, step, elapsed training time,
    data position and RNG states; a finished run is marked ``done`` and not trained again.
    """
    if not steps and not minutes:
        raise ValueError("give a budget: steps and/or minutes")
    budget_s = minutes * 60 if minutes else None
    work_dir = Path(work_dir)
    work_dir.mkdir(parents=True, exist_ok=True)
    ckpt_path = work_dir / f"{name}.pt"
    if steps:
        warmup = min(warmup, max(1, steps // 10))

    decay, no_decay = [], []
    seen = set()
    for n, p in model.named_parameters():
        if id(p) in seen or not p.requires_grad:
            continue
        seen.add(id(p))
        (decay if p.dim() >= 2 else no_decay).append(p)
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=lr, betas=betas)
    sampler = ChunkSampler(data.numel(), seq_len, batch_size, seed=seed)
    state = {"step": 0, "train_seconds": 0.0, "tokens": 0, "done": False, "last": {}}
    torch.manual_seed(seed)
    random.seed(seed)

    if ckpt_path.exists():
        ck = torch.load(ckpt_path, weights_only=False)
        if meta is not None and ck.get("meta") is not None:
            diff = {k: (ck["meta"].get(k), v) for k, v in meta.items()
                    if k in ck["meta"] and ck["meta"][k] != v}
            if diff:
                raise RuntimeError(f"checkpoint {ckpt_path} was made with other settings {diff}; "
                                   "use another --work-dir or delete it")
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["optimizer"])
        sampler.load_state_dict(ck["sampler"])
        torch.set_rng_state(ck["torch_rng"])
        random.setstate(ck["py_rng"])
        state.update(ck["state"])
        log(f"[{name}] resumed from {ckpt_path} at step {state['step']} "
            f"({_fmt_time(state['train_seconds'])} trained){' - already done' if state['done'] else ''}")
        if state["done"]:
            return dict(state)

    def save_ckpt():
        tmp = ckpt_path.with_suffix(".tmp")
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(),
                    "sampler": sampler.state_dict(), "torch_rng": torch.get_rng_state(),
                    "py_rng": random.getstate(), "state": state, "meta": meta}, tmp)
        os.replace(tmp, ckpt_path)

    def progress() -> float:
        p = 0.0
        if steps:
            p = max(p, state["step"] / steps)
        if budget_s:
            p = max(p, state["train_seconds"] / budget_s)
        return p

    model.train()
    last_ckpt = time.time()
    win_t, win_tok, win_stats, win_n = 0.0, 0, {}, 0
    log(f"[{name}] training: batch {batch_size}x{seq_len}, lr {lr:g}, warmup {warmup}, "
        f"budget {'%d steps' % steps if steps else ''}{' / ' if steps and minutes else ''}"
        f"{'%g min' % minutes if minutes else ''}, corpus {data.numel():,} tokens, "
        f"threads {torch.get_num_threads()}")
    while progress() < 1.0:
        t0 = time.time()
        f = lr_factor(state["step"], progress(), warmup, min_lr_ratio)
        for g in opt.param_groups:
            g["lr"] = lr * f
        batch = sampler.batch(data)
        loss, stats = loss_fn(model, batch)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gn = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip) if grad_clip else None
        opt.step()
        dt = time.time() - t0
        ntok = batch_size * seq_len
        state["step"] += 1
        state["train_seconds"] += dt
        state["tokens"] += ntok
        stats = dict(stats, loss=float(loss.detach()))
        if gn is not None:
            stats["gnorm"] = float(gn)
        win_t += dt
        win_tok += ntok
        win_n += 1
        for k, v in stats.items():
            win_stats[k] = win_stats.get(k, 0.0) + v
        done = progress() >= 1.0
        if state["step"] % log_every == 0 or state["step"] == 1 or done:
            p = progress()
            rate = win_t / win_n
            etas = []
            if steps:
                etas.append((steps - state["step"]) * rate)
            if budget_s:
                etas.append(budget_s - state["train_seconds"])
            total = f"~{int(state['step'] / p)}" if p > 0 else "?"
            avg = {k: v / win_n for k, v in win_stats.items()}
            state["last"] = avg
            extra = " ".join(f"{k} {v:.4g}" for k, v in avg.items() if k != "loss")
            log(f"[{name}] step {state['step']}/{total} loss {avg['loss']:.4f} {extra} "
                f"lr {lr * f:.2e} tok/s {win_tok / win_t:.0f} "
                f"elapsed {_fmt_time(state['train_seconds'])} eta {_fmt_time(min(etas))}")
            win_t, win_tok, win_stats, win_n = 0.0, 0, {}, 0
        if done:
            state["done"] = True
        if done or time.time() - last_ckpt > ckpt_minutes * 60:
            save_ckpt()
            last_ckpt = time.time()
    log(f"[{name}] done: {state['step']} steps, {state['tokens']:,} tokens, "
        f"{_fmt_time(state['train_seconds'])}, {state['tokens'] / max(1e-9, state['train_seconds']):.0f} tok/s")
    return dict(state)


# ----------------------------------------------------------------------------- losses

def ce_loss_fn(model, batch):
    x, y = batch[:, :-1], batch[:, 1:]
    logits = model(input_ids=x).logits.float()
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
    return loss, {}


class KLLoss:
    """Forward KL(target || drafter) on the target's full distribution at temperature T.

    With a ``pool`` (N, L + 1) of target-generated rows, ``round(gen_frac * B)`` rows of every
    batch are drawn from it (global torch RNG) instead of the real data."""

    def __init__(self, target, temperature: float = 1.0, pool: torch.Tensor | None = None,
                 gen_frac: float = 0.0, ce_weight: float = 0.0):
        self.target = target.eval()
        for p in self.target.parameters():
            p.requires_grad_(False)
        self.T, self.pool, self.ce_weight = temperature, pool, ce_weight
        self.gen_frac = gen_frac if pool is not None and len(pool) else 0.0

    def __call__(self, model, batch):
        B = batch.shape[0]
        n_gen = int(round(B * self.gen_frac))
        if n_gen:  # real rows first, pool rows last
            rows = self.pool[torch.randint(len(self.pool), (n_gen,))].to(batch)
            batch = torch.cat([batch[:B - n_gen], rows[:, :batch.shape[1]]])
        n_real = B - n_gen
        x, y = batch[:, :-1], batch[:, 1:]
        with torch.no_grad():
            t_logits = self.target(input_ids=x).logits.float()
            t_logp = F.log_softmax(t_logits / self.T, dim=-1)
        d_logits = model(input_ids=x).logits.float()
        V = d_logits.shape[-1]
        d_logp = F.log_softmax(d_logits / self.T, dim=-1)
        kl = F.kl_div(d_logp.reshape(-1, V), t_logp.reshape(-1, V), log_target=True,
                      reduction="batchmean") * self.T ** 2
        loss = kl
        with torch.no_grad():
            agree = (d_logits.argmax(-1) == t_logits.argmax(-1)).float()
            stats = {"kl": float(kl), "agree": float(agree[:n_real].mean()) if n_real else 0.0}
            if n_real:  # drafter / target CE against the real data
                yr = y[:n_real].reshape(-1)
                stats["ce"] = float(F.cross_entropy(d_logits[:n_real].reshape(-1, V), yr))
                stats["t_ce"] = float(F.cross_entropy(t_logits[:n_real].reshape(-1, V), yr))
            if n_gen:
                stats["agree_gen"] = float(agree[n_real:].mean())
        if self.ce_weight and n_real:
            ce = F.cross_entropy(d_logits[:n_real].reshape(-1, V), y[:n_real].reshape(-1))
            loss = loss + self.ce_weight * ce
        return loss, stats


def build_gen_pool(target, stream: torch.Tensor, n_rows: int, seq_len: int, gen_tokens: int, *,
                   seed: int = 0, batch_size: int = 64, cache_path: str | os.PathLike | None = None):
    """``n_rows`` rows of ``seq_len + 1`` tokens: a real prompt of ``seq_len + 1 - gen_tokens``
    tokens (random train positions) continued by the target, greedily for even rows and sampled
    at T=1 for odd rows, i.e. the contexts the drafter meets when serving that target.
    Returns ``(pool, seconds it took to generate)``; cached at ``cache_path``."""
    if cache_path is not None and os.path.exists(cache_path):
        saved = torch.load(cache_path)
        log(f"[distill] generation pool: {tuple(saved['pool'].shape)} from cache {cache_path}")
        return saved["pool"], saved["seconds"]
    P = seq_len + 1 - gen_tokens
    g = torch.Generator().manual_seed(seed + 7919)
    starts = torch.randint(0, stream.numel() - P, (n_rows,), generator=g)
    prompts = torch.stack([stream[s:s + P] for s in starts.tolist()]).long()
    rng_state = torch.get_rng_state()
    torch.manual_seed(seed + 104729)
    t0, rows = time.time(), []
    for b in range(0, n_rows, batch_size):
        pr = prompts[b:b + batch_size]
        order = torch.cat([torch.arange(0, len(pr), 2), torch.arange(1, len(pr), 2)])
        seq = generate(target, pr[order], gen_tokens, greedy_rows=(len(pr) + 1) // 2)
        out = torch.empty_like(seq)
        out[order] = seq
        rows.append(out)
        log(f"[distill] generation pool: {b + len(pr)}/{n_rows} rows ({time.time() - t0:.0f}s)")
    torch.set_rng_state(rng_state)
    pool, seconds = torch.cat(rows).to(torch.int32), time.time() - t0
    if cache_path is not None:
        tmp = str(cache_path) + ".tmp"
        torch.save({"pool": pool, "seconds": seconds}, tmp)
        os.replace(tmp, cache_path)
    return pool, seconds


# ----------------------------------------------------------------------------- evaluation

@torch.no_grad()
def greedy_acceptance(target, drafter, stream: torch.Tensor, *, k: int = 4, n_prompts: int = 32,
                      prompt_len: int = 64, new_tokens: int = 128, seed: int = 0,
                      batch_size: int = 16, eos_id: int | None = None) -> dict:
    """Offline estimate of greedy speculative decoding with ``k`` drafted tokens per round.

    Prompts are ``n_prompts`` windows of ``prompt_len`` tokens from ``stream`` (fixed seed, no
    EOS inside); the target continues each greedily by ``new_tokens``. Under greedy decoding the
    output equals that continuation, and the drafter, fed the accepted prefix, proposes its own
    argmax chain, so one teacher-forced drafter pass gives every proposal: at round start i the
    number accepted is the run of positions j >= i (at most k) where the drafter's argmax equals
    the target's token; the target then adds one token (correction or bonus) and the next round
    starts at i + accepted + 1. Returns accepted / drafted and mean tokens per target pass.
    """
    target.eval(), drafter.eval()
    g = random.Random(seed)
    starts = []
    n = stream.numel()
    tries = 0
    while len(starts) < n_prompts and tries < 100 * n_prompts:
        tries += 1
        s = g.randrange(0, max(1, n - prompt_len))
        w = stream[s:s + prompt_len]
        if w.numel() == prompt_len and (eos_id is None or not bool((w == eos_id).any())):
            starts.append(s)
    prompts = torch.stack([stream[s:s + prompt_len] for s in starts]).long()
    accepted = drafted = rounds = 0
    match_total = match_n = 0
    for b in range(0, len(prompts), batch_size):
        seq = generate(target, prompts[b:b + batch_size], new_tokens)
        d_pred = drafter(input_ids=seq[:, :-1]).logits.argmax(-1)   # prediction for position j+1
        match = (d_pred[:, prompt_len - 1:] == seq[:, prompt_len:])  # (B, new_tokens)
        match_total += int(match.sum())
        match_n += match.numel()
        for row in match.tolist():
            i = 0
            while i < len(row):
                kk = min(k, len(row) - i)
                a = 0
                while a < kk and row[i + a]:
                    a += 1
                accepted += a
                drafted += kk
                rounds += 1
                i += a + 1
    return {"acceptance": accepted / max(1, drafted), "tokens_per_round": (accepted + rounds) / max(1, rounds),
            "top1_agreement": match_total / max(1, match_n), "k": k, "prompts": len(prompts),
            "new_tokens": new_tokens}


def load_causal_lm(path: str, dtype=torch.float32):
    from transformers import AutoModelForCausalLM
    m = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True)
    return m.float().eval() if dtype == torch.float32 else m.eval()


# ----------------------------------------------------------------------------- distill

def distill(target: str, out: str, *, data: Sequence[str] | None = None, eval_data: Sequence[str] | None = None,
            pattern: str = "*.py", loss: str = "kl", hidden: int = 192, layers: int = 3, heads: int = 6,
            intermediate: int = 384, seq_len: int = 256, batch_size: int = 8, lr: float = 4e-3,
            warmup: int = 30, min_lr_ratio: float = 0.1, weight_decay: float = 0.0,
            minutes: float | None = 18.0, steps: int | None = None, temperature: float = 1.0,
            gen_frac: float = 0.25, gen_tokens: int = 128, gen_pool: int = 512, ce_weight: float = 0.0,
            work_dir: str | None = None, threads: int | None = None, seed: int = 0,
            ckpt_minutes: float = 5.0, log_every: int = 10, dtype: str = "float16",
            max_files: int | None = None, eval_prompts: int = 32, eval_k: int = 4,
            init_embeddings: str = "auto") -> dict:
    """Train a drafter for the HF causal LM at ``target`` and save it (with the target's
    tokenizer) to ``out``. ``data``: split.json / directories / files (default: the
    ``split.json`` next to the target folder's parent, as written by the demo pipeline).
    Returns the training summary (also written to ``out/training_info.json``)."""
    from transformers import AutoTokenizer
    if threads:
        torch.set_num_threads(threads)
    if loss not in ("kl", "ce"):
        raise ValueError("loss must be 'kl' or 'ce'")
    if loss == "ce":
        gen_frac = 0.0
    check_model_folder(target, "--target")  # (before the split's check, which blamed that instead)
    if Path(out).resolve() == Path(target).resolve():
        raise DataError(f"--out {out!r} is the --target folder: the drafter would be saved over the target")
    if data is None:
        guess = Path(target).resolve().parent / "split.json"
        if not guess.exists():
            raise DataError(f"no --data given and no split.json next to the target folder ({guess})")
        data = [str(guess)]
    check_paths(data, "--data")
    check_paths(eval_data or [], "--eval-data")
    if eval_data is None:
        splits = [d for d in data if d.endswith(".json")]
        eval_data = splits or None
    if work_dir is None:
        tag = "".join(c if c.isalnum() else "_" for c in os.path.abspath(out).strip("/"))[-80:]
        work_dir = os.path.join("runs", "distill", tag)
    os.makedirs(work_dir, exist_ok=True)

    tok = AutoTokenizer.from_pretrained(target, local_files_only=True)
    t_model = load_causal_lm(target)
    files = collect_files(data, pattern, "train")
    if max_files:
        files = files[:max_files]
    stream = load_token_stream(tok, files, work_dir, "train")
    vocab = t_model.config.vocab_size
    drafter = make_llama(vocab, hidden, layers, heads, intermediate, eos_token_id=tok.eos_token_id,
                         max_position_embeddings=t_model.config.max_position_embeddings, seed=seed,
                         rope_theta=_rope_theta(t_model.config))
    if init_embeddings == "auto":
        init_embeddings = "pca" if loss == "kl" else "random"
    if init_embeddings == "pca":
        init_embeddings_from(drafter, t_model)
    n_t, n_d = count_params(t_model), count_params(drafter)
    log(f"[distill] target {target}: {n_t / 1e6:.2f}M params; drafter {hidden}x{layers}L "
        f"{heads}H ff{intermediate}: {n_d / 1e6:.2f}M params (1/{n_t / n_d:.1f}); loss {loss}"
        + (f", T={temperature}, gen_frac={gen_frac}" if loss == "kl" else ""))
    pool, gen_seconds = None, 0.0
    if loss == "kl" and gen_frac > 0:
        pool, gen_seconds = build_gen_pool(t_model, stream, gen_pool, seq_len, min(gen_tokens, seq_len - 1), seed=seed,
                              cache_path=os.path.join(work_dir, f"genpool-{gen_pool}x{seq_len}-{gen_tokens}-{seed}.pt"))
        if minutes:  # the pool is part of the wall-clock budget
            minutes = max(minutes - gen_seconds / 60, minutes / 2)
    loss_fn = ce_loss_fn if loss == "ce" else KLLoss(t_model, temperature, pool, gen_frac, ce_weight)
    meta = {"loss": loss, "hidden": hidden, "layers": layers, "heads": heads,
            "intermediate": intermediate, "seq_len": seq_len, "batch_size": batch_size, "lr": lr,
            "temperature": temperature, "gen_frac": gen_frac, "gen_tokens": gen_tokens,
            "gen_pool": gen_pool if gen_frac else 0, "seed": seed, "init_embeddings": init_embeddings,
            "target": os.path.abspath(target), "n_tokens": int(stream.numel())}
    state = train_loop(drafter, stream, loss_fn, name=f"drafter-{loss}", work_dir=work_dir,
                       batch_size=batch_size, seq_len=seq_len, lr=lr, steps=steps, minutes=minutes,
                       warmup=warmup, min_lr_ratio=min_lr_ratio, weight_decay=weight_decay,
                       ckpt_minutes=ckpt_minutes, log_every=log_every, seed=seed, meta=meta)
    info = dict(meta, steps=state["step"], tokens_seen=state["tokens"],
                train_seconds=round(state["train_seconds"], 1), final_stats=state.get("last", {}),
                params=n_d, target_params=n_t, data_files=len(files), dtype=dtype,
                gen_pool_seconds=round(gen_seconds, 1))
    save_hf(drafter, tok, out, dtype=dtype, info=info)
    if eval_data and eval_prompts:  # on the saved (half-precision) weights, run in fp32
        ev_files = collect_files(eval_data, pattern, "heldout")
        ev_stream = load_token_stream(tok, ev_files, work_dir, "heldout")
        t0 = time.time()
        res = greedy_acceptance(t_model, load_causal_lm(out), ev_stream, k=eval_k,
                                n_prompts=eval_prompts, eos_id=tok.eos_token_id)
        log(f"[distill] held-out greedy acceptance (k={eval_k}, fp32, {res['prompts']} prompts x "
            f"{res['new_tokens']} tokens): {res['acceptance']:.3f}, top-1 agreement "
            f"{res['top1_agreement']:.3f}, tokens/round {res['tokens_per_round']:.2f} "
            f"({time.time() - t0:.0f}s)")
        info["heldout_greedy_acceptance"] = res
        with open(os.path.join(out, "training_info.json"), "w") as f:
            json.dump(info, f, indent=2, sort_keys=True)
    log(f"[distill] saved drafter to {out}")
    return info


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="specserve distill", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--target", required=True, help="HF folder of the target model (with tokenizer)")
    p.add_argument("--out", required=True, help="output folder for the drafter")
    p.add_argument("--data", nargs="+", default=None,
                   help="split.json (its train files), directories, @FILELIST or text files; "
                        "default: split.json next to the target folder")
    p.add_argument("--eval-data", nargs="+", default=None,
                   help="held-out data for the acceptance estimate (default: the split's held-out files)")
    p.add_argument("--pattern", default="*.py", help="file pattern inside data directories")
    p.add_argument("--max-files", type=int, default=None, help="use only the first N data files")
    p.add_argument("--loss", choices=["kl", "ce"], default="kl")
    p.add_argument("--temperature", type=float, default=1.0, help="KL temperature")
    p.add_argument("--gen-frac", type=float, default=0.25,
                   help="KL only: fraction of each batch's rows taken from a pool of target "
                        "continuations of real prompts (half greedy, half sampled); 0 disables")
    p.add_argument("--gen-tokens", type=int, default=128, help="generated tokens per pool row")
    p.add_argument("--gen-pool", type=int, default=512, help="pool rows (generated once, cached)")
    p.add_argument("--ce-weight", type=float, default=0.0, help="KL only: add this x data CE")
    p.add_argument("--init-embeddings", choices=["auto", "pca", "random"], default="auto",
                   help="drafter token embeddings: the target's projected on its top principal "
                        "directions (pca) or random; auto = pca for kl, random for ce")
    p.add_argument("--hidden", type=int, default=192)
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--heads", type=int, default=6)
    p.add_argument("--intermediate", type=int, default=384)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--lr", type=float, default=4e-3)
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--minutes", type=float, default=18.0, help="wall-clock training budget (0: none)")
    p.add_argument("--steps", type=int, default=None, help="max steps")
    p.add_argument("--steps-from", default=None,
                   help="drafter folder whose training_info.json gives --steps (and disables --minutes)")
    p.add_argument("--work-dir", default=None, help="checkpoints + token cache (default runs/distill/<out>)")
    p.add_argument("--ckpt-minutes", type=float, default=5.0)
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="torch threads")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--dtype", choices=["float16", "bfloat16", "float32"], default="float16")
    p.add_argument("--eval-prompts", type=int, default=32, help="0 disables the acceptance estimate")
    p.add_argument("--eval-k", type=int, default=4)
    p.add_argument("--eval-only", action="store_true",
                   help="only print the held-out acceptance of the existing drafter at --out")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    try:
        return run(args)
    except DataError as e:
        p.error(str(e))


def run(args) -> int:
    tune_malloc()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.eval_only:
        from transformers import AutoTokenizer
        check_model_folder(args.target, "--target")
        check_model_folder(args.out, "--out")
        data = args.eval_data or args.data or [str(Path(args.target).resolve().parent / "split.json")]
        check_paths(data, "--eval-data" if args.eval_data else "--data" if args.data else "the split.json guessed")
        tok = AutoTokenizer.from_pretrained(args.target, local_files_only=True)
        files = collect_files(data, args.pattern, "heldout")
        stream = tokenize_files(tok, files, tok.eos_token_id)
        res = greedy_acceptance(load_causal_lm(args.target), load_causal_lm(args.out), stream,
                                k=args.eval_k, n_prompts=args.eval_prompts or 32, eos_id=tok.eos_token_id)
        print(json.dumps(res, indent=2))
        return 0
    steps, minutes = args.steps, (args.minutes or None)
    if args.steps_from:
        check_paths([os.path.join(args.steps_from, "training_info.json")], "--steps-from: its")
        with open(os.path.join(args.steps_from, "training_info.json")) as f:
            steps, minutes = int(json.load(f)["steps"]), None
        log(f"[distill] --steps-from {args.steps_from}: {steps} steps, no time budget")
    distill(args.target, args.out, data=args.data, eval_data=args.eval_data, pattern=args.pattern,
            loss=args.loss, hidden=args.hidden, layers=args.layers, heads=args.heads,
            intermediate=args.intermediate, seq_len=args.seq_len, batch_size=args.batch_size,
            lr=args.lr, warmup=args.warmup, weight_decay=args.weight_decay, minutes=minutes,
            steps=steps, temperature=args.temperature, gen_frac=args.gen_frac,
            gen_tokens=args.gen_tokens, gen_pool=args.gen_pool, ce_weight=args.ce_weight, work_dir=args.work_dir,
            threads=args.threads, seed=args.seed, ckpt_minutes=args.ckpt_minutes,
            log_every=args.log_every, dtype=args.dtype, max_files=args.max_files,
            eval_prompts=args.eval_prompts, eval_k=args.eval_k, init_embeddings=args.init_embeddings)
    return 0


if __name__ == "__main__":
    sys.exit(main())
