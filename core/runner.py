"""A model runner: one Hugging Face causal LM over a number of sequence slots, each with a KV
cache that rolls back in O(1) (see `kv_cache`).

Both sides use it: the drafter (to propose and to get q) and the verifier (to score k+1
positions in one pass and get p). Llama checkpoints run through `fast_llama` (a lean forward
over the same weights, with a `SlotKVCache`); every other architecture runs through HF's modules
with a `PositionLayer` cache per slot. Loading (models and tokenizers, from local folders only)
and the shared-vocabulary check are here too.
"""

from __future__ import annotations

import logging
import os
import sys

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
from transformers.cache_utils import Cache

from specserve.core.device import to_device
from specserve.core.draft_vocab import resolve as draft_vocab_ids
from specserve.core.fast_llama import FastLlama
from specserve.core.fast_llama import supports as fast_llama_supports
from specserve.core.kv_cache import PositionLayer


log = logging.getLogger(__name__)


class ModelLoadError(ValueError):
    """A model or tokenizer path that cannot be loaded."""


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model",
                   "sentencepiece.bpe.model")  # (a folder with none of them: said so, not transformers' long guess)


def load_tokenizer(path: str):
    _check_dir(path)
    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as e:  # transformers raises many types here
        if not any(os.path.isfile(os.path.join(path, f)) for f in TOKENIZER_FILES):
            raise ModelLoadError(f"model path {path!r} has no tokenizer (tokenizer.json)") from None
        raise ModelLoadError(f"cannot load a tokenizer from {path!r}: {e}") from None


DEVICES = ("auto", "cpu", "cuda")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def ray_gpus() -> list[str] | None:
    """The GPUs Ray gave this process, when it is a Ray worker (an actor or a task); None outside
    one (a driver, a plain process). Ray 2.60 leaves CUDA_VISIBLE_DEVICES alone for a worker that
    holds no GPU, so such a worker sees every GPU of its node."""
    ray = sys.modules.get("ray")  # not imported: not a Ray worker (and no Ray session started here)
    if ray is None or not ray.is_initialized():
        return None
    context = ray.get_runtime_context()
    if context.worker.mode != ray.WORKER_MODE:
        return None
    return [str(i) for i in context.get_accelerator_ids().get("GPU", [])]


def resolve_device(device: str | torch.device) -> torch.device:
    """"auto": the first CUDA device this process sees (a Ray actor holding a GPU sees exactly that
    one), else the CPU; a Ray actor that holds no GPU runs on the CPU even where it sees one (until
    stop 49 it took GPU 0, whatever the placement reserved). "cuda" without a visible GPU is an
    error, not a silent fallback."""
    if isinstance(device, torch.device):
        return device
    if device == "auto":
        if not torch.cuda.is_available():
            return torch.device("cpu")
        if ray_gpus() == []:
            log.warning("device auto: this Ray actor holds no GPU (see use_gpu, gpus_per_actor), so it runs on the CPU")
            return torch.device("cpu")
        return torch.device("cuda")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ModelLoadError(f"device {device!r} asked for, but this process sees no CUDA GPU")
    try:
        return torch.device(device)
    except RuntimeError as e:
        raise ModelLoadError(f"unknown device {device!r}: {e}") from None


def resolve_dtype(dtype: str | torch.dtype, device: torch.device, role: str = "target",
                  packs: bool = True) -> torch.dtype:
    """"auto": bfloat16 on a GPU that supports it. On a CPU: bfloat16 for a model that the lean
    forward multiplies by prepacked bf16 weights (`packs`: see fast_llama.packs_bf16), where the
    CPU multiplies bf16 in hardware (AMX or AVX512-BF16: fast_llama.cpu_has_bf16_gemm); float32
    otherwise. Measured on the demo pair, one thread (docs/benchmarks/dtype.md): the prepacked
    bfloat16 target was faster than float32 at every batch and width measured on the AMX Xeon,
    and at most 1% slower (one sequence, width 1) on an AVX512-BF16 EPYC; a position scores the
    same bits at any width there, so greedy speculation stays exactly plain decoding, and a
    drafter's prepared drafts are the ones it would draft on demand.

    A drafter (role "drafter") there is float32 with only its output head multiplied in packed
    bfloat16 (ModelRunner.from_pretrained passes bf16_head; fast_llama.packed_bf16_head). Its
    layers' products are small, and a packed bfloat16 call costs more than a float32 one there,
    while its 8192-wide head is cheaper packed (0.89 ms against 0.14 ms at five rows). In the
    speculative loop at one sequence, on stop 34's AMD EPYC, speculation with that drafter ran
    1.29-1.41x plain decoding, against 1.23-1.30x with the all-bfloat16 drafter of stops 32-33
    and 1.07-1.12x with an all-float32 one (three runs of benchmarks/diagnostics/drafter_dtype_loop.py;
    in each, the float32 drafter with a bfloat16 head ran 1.05-1.09x the all-bfloat16 one). As a
    pipelined gRPC server in a child process (benchmarks/diagnostics/drafter_dtype_remote.py, two
    runs once the server kept the head: DrafterServicer's bf16_head) speculation ran 1.39 and 1.32x
    plain with it, against 1.22 and 1.22x all-bfloat16 and 1.09 and 1.10x all-float32; in process
    in the same runs 1.70 and 1.41x against 1.46 and 1.39x. The cost: a float32 product's rounding depends on the number of rows in the pass, so
    a sampled draft prepared in a batch of branches (or beside other sequences) equals the one
    drafted alone up to float rounding, as before stop 32, not bit for bit; the verifier gets
    the q each draft was drawn from, so the sampled distribution stays exact. `dtype: bfloat16`
    keeps the drafter all bfloat16 and those bits."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        if device.type == "cuda":
            with torch.cuda.device(device):  # (this device's, not the current one's)
                return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float32
        from specserve.core.fast_llama import cpu_has_bf16_gemm
        return torch.bfloat16 if packs and cpu_has_bf16_gemm() and role != "drafter" else torch.float32
    if dtype not in DTYPES:
        raise ModelLoadError(f"unknown dtype {dtype!r}; one of auto, {', '.join(DTYPES)}")
    return DTYPES[dtype]


def auto_bf16_head(dtype: str | torch.dtype, device: torch.device, role: str, packs: bool = True) -> bool:
    """Whether `dtype` gives this model float32 layers with a packed bfloat16 head: "auto" for a
    drafter on a CPU where bfloat16 would pack (see resolve_dtype)."""
    from specserve.core.fast_llama import cpu_has_bf16_gemm
    return dtype == "auto" and device.type == "cpu" and role == "drafter" and packs and cpu_has_bf16_gemm()


def resolve_compile(compile: bool | str, device: torch.device) -> bool:
    """"auto": compile where it pays. On the reference CPU the compiled rows of
    docs/benchmarks/runtime_9145069.md, and the whole-stack compile measured since (README, "Compiling
    the forward"), were slower than the eager ones (decoding there is bound by reading
    the weights); on a GPU, CUDA graphs remove the per-kernel launch cost that dominates
    small-batch decoding. So "auto" compiles on CUDA only."""
    if compile == "auto":
        return device.type == "cuda"
    if not isinstance(compile, bool):
        raise ModelLoadError(f"compile must be true, false or 'auto', got {compile!r}")
    return compile


def compile_cache_dir() -> str:
    """Where compiled code (and the CPU GEMM plan, `fast_llama.GemmPlan`) is kept across
    restarts: $SPECSERVE_COMPILE_CACHE, else ~/.cache/specserve/inductor."""
    return os.environ.get("SPECSERVE_COMPILE_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "specserve",
                                                                      "inductor")


def use_compile_cache() -> None:
    """Points inductor's on-disk caches (FX graph and AOT autograd caches, on by default) at
    compile_cache_dir(), unless TORCHINDUCTOR_CACHE_DIR names a place of the user's (inductor
    itself fills it in with a temporary folder, which does not survive a reboot or a new pod)."""
    import getpass
    import tempfile
    current = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    try:
        default = os.path.join(tempfile.gettempdir(), "torchinductor_" + getpass.getuser())
    except Exception:  # no user name (some containers)
        default = None
    if current and current != default and "SPECSERVE_COMPILE_CACHE" not in os.environ:
        return
    path = compile_cache_dir()
    os.makedirs(path, exist_ok=True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = path


def read_config(path: str):
    """A model folder's transformers config; ModelLoadError where it cannot be read."""
    try:
        return AutoConfig.from_pretrained(path, local_files_only=True)
    except Exception as e:  # transformers raises many types here
        raise ModelLoadError(f"cannot read a model config from {path!r}: {e}") from None


def context_length(config) -> int:
    """A model's context in tokens, from its transformers config."""
    return int(getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", 1 << 30))


def check_weights(path: str) -> None:
    """A model folder holds weights (safetensors or a PyTorch .bin, whole or sharded) under a name
    transformers loads: checked before a server starts actors that would fail to load it."""
    _check_dir(path)
    explicit = _named_weights(path)
    if explicit is not None:  # transformers 5 loads the file config.json names, whatever it is called
        if explicit == "adapter_model.bin":
            return  # (the one other name it takes: loading it is the check)
        if not os.path.isfile(os.path.join(path, explicit)):
            raise ModelLoadError(f"model path {path!r} lacks {explicit!r}, the weights its config.json names "
                                 "(transformers_weights)")
        _check_safetensors(path, explicit)
        return
    files = os.listdir(path)
    if not any(f.endswith((".safetensors", ".bin")) for f in files):
        raise ModelLoadError(f"model path {path!r} has no weights (model.safetensors)")
    loaded = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")
    if not any(f in files for f in loaded):  # (until stop 60 any such file passed, and the actors failed loading)
        found = sorted(f for f in files if f.endswith((".safetensors", ".bin")))
        raise ModelLoadError(f"model path {path!r} has no weights under a name transformers loads "
                             f"({', '.join(loaded)}, or the file config.json's transformers_weights names); it has "
                             f"{', '.join(found[:3])}{', ...' if len(found) > 3 else ''}")
    for name in ("model.safetensors", "model.safetensors.index.json"):  # (as transformers picks: the first there)
        if name in files:
            _check_safetensors(path, name)
            break  # (neither: PyTorch .bin weights, and loading them is the check)


def _named_weights(path: str) -> str | None:
    """config.json's `transformers_weights`: the weights file transformers 5 loads instead of its
    standard names (None: not there, or a config that does not read, which loading reports).
    Refused as transformers refuses it: a name neither safetensors nor adapter_model.bin, or one
    outside the folder."""
    import json
    try:
        with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict) or "transformers_weights" not in config or config["transformers_weights"] is None:
        return None
    name, fault = config["transformers_weights"], None
    if not isinstance(name, str) or not name:
        fault = "is not a file name"
    elif not name.endswith((".safetensors", ".safetensors.index.json")) and name != "adapter_model.bin":
        fault = "is neither safetensors (*.safetensors, *.safetensors.index.json) nor adapter_model.bin"
    elif os.path.isabs(name) or ".." in name.replace("\\", "/").split("/"):
        fault = "is outside the model folder"
    if fault:
        raise ModelLoadError(f"config.json in {path!r} names weights that transformers does not load: "
                             f"transformers_weights {name!r} {fault}")
    return name


def _check_safetensors(path: str, name: str) -> None:
    """The safetensors weights transformers would load (the file `name`, or the shards that the
    index `name`, *.index.json, names) have headers that read and tensors within the file (a download cut short, a file that
    is not safetensors), and the index names no missing shard: until stop 59 these failed only in
    the actors, after the target had loaded, and a Serve replica retried the load three times
    before `specserve serve` said 'Failed to update the deployments'. Reads the headers only
    (milliseconds, whatever the model's size)."""
    import json

    from safetensors import safe_open
    if not name.endswith(".index.json"):
        names = [name]
    else:
        index = name
        try:
            with open(os.path.join(path, index), encoding="utf-8") as f:
                content = json.load(f)
            names = sorted({str(s) for s in content["weight_map"].values()})
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise ModelLoadError(f"cannot read the shard index {index!r} in {path!r}: {e}") from None
        if not isinstance(content.get("metadata"), dict):  # (transformers reads it: a KeyError at load without it)
            raise ModelLoadError(f"the shard index {index!r} in {path!r} has no 'metadata' object, which "
                                 "transformers reads (it may be empty: {})")
        missing = [s for s in names if not os.path.isfile(os.path.join(path, s))]
        if missing:
            raise ModelLoadError(f"model path {path!r} lacks {len(missing)} of the {len(names)} weight shards "
                                 f"its {index} names, {missing[0]!r} first")
    for weights in names:
        try:
            with safe_open(os.path.join(path, weights), framework="np"):
                pass
        except Exception as e:  # (safetensors' own error type, or an OSError)
            raise ModelLoadError(f"the weights {weights!r} in {path!r} do not load: {e}") from None


def same_tokenizer(a, b) -> bool:
    """Speculation compares token ids, so drafter and target must share one vocabulary."""
    return a.get_vocab() == b.get_vocab() and a.all_special_tokens == b.all_special_tokens


def _check_dir(path: str) -> None:
    if not os.path.isdir(path):
        raise ModelLoadError(f"model path {path!r} is not a directory")
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ModelLoadError(f"model path {path!r} has no config.json (not a Hugging Face model folder)")


class ModelRunner:
    """Runs one causal LM over `slots` sequences, each with a rollback-able KV cache.

    Slot-taking methods default to slot 0, so single-sequence use reads naturally. `score_batch`
    appends tokens to several slots in ONE forward pass (ragged lengths allowed) on the Llama
    path; on the HF path it runs one pass per slot.
    """

    def __init__(self, model, tokenizer=None, name: str = "model", slots: int = 1, fast: bool = True,
                 compile: bool = False, bf16_head: bool = False, vocab: list[int] | None = None):
        """bf16_head: a float32 Llama multiplies by a bfloat16 copy of its head where the CPU
        multiplies bf16 in hardware (fast_llama.packed_bf16_head; `dtype: auto` for a drafter).
        vocab: a drafter's draft vocabulary (`specserve.core.draft_vocab`): a pass asked for it
        (`score_batch` / `score_ids` with vocab=True) gives every other token's logit -inf (the
        lean forward multiplies by those rows of the head only)."""
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.name = name
        self.slots = slots
        self.vocab_size = model.get_output_embeddings().weight.shape[0]
        self.bf16_head = bf16_head  # as asked (a drafter server builds its own runner of the model with it)
        # Llama checkpoints run through the lean forward (same weights, same numbers, less Python).
        self.fast = (FastLlama(model, slots=slots, compile=compile,
                               plan_store=os.path.join(compile_cache_dir(), "gemm_plan.json"), bf16_head=bf16_head,
                               vocab=vocab)
                     if fast and fast_llama_supports(model) else None)
        self.vocab = vocab  # as given (a drafter server builds its own runner of the model with it)
        # -inf outside the draft vocabulary (the HF path adds it to its logits when asked; `in_vocab`)
        self._outside = None
        if vocab is not None:
            self._outside = torch.full((self.vocab_size,), float("-inf"), device=self.device)
            self._outside[torch.tensor(sorted(vocab), dtype=torch.long, device=self.device)] = 0.0
        if compile and self.fast is not None:
            use_compile_cache()
        self.caches: list[Cache | None] = [None] * slots  # HF path
        self.started = [False] * slots

    @classmethod
    def from_pretrained(cls, path: str, name: str = "model", dtype: str | torch.dtype = "auto",
                        device: str | torch.device = "cpu", slots: int = 1, compile: bool | str = False,
                        role: str = "target", draft_vocab: str | int = "auto"):
        """Loads a local HF folder onto `device` in `dtype` ("auto" for either: see resolve_device
        and resolve_dtype; role: "target" or "drafter": on a CPU, "auto" gives a drafter float32 layers and a bfloat16 head where
        a target gets bfloat16). compile: True, False or
        "auto" (see resolve_compile). draft_vocab: a drafter's draft vocabulary, "auto" (as served:
        its folder's, if it has one), "off" or a number of token ids
        (`specserve.core.draft_vocab.resolve`); a target has none."""
        if role not in ("target", "drafter"):
            raise ValueError(f"role must be 'target' or 'drafter', got {role!r}")
        if role == "target" and draft_vocab not in ("auto", "off"):
            raise ValueError("a draft vocabulary is for a drafter only")
        _check_dir(path)
        device = resolve_device(device)
        config, packs = None, True
        if dtype == "auto" and device.type == "cpu":  # bf16 only where it packs
            from specserve.core.fast_llama import packs_bf16
            config = read_config(path)
            packs = packs_bf16(config) and not resolve_compile(compile, device)
        bf16_head = auto_bf16_head(dtype, device, role, packs)
        dtype = resolve_dtype(dtype, device, role, packs=packs)
        try:
            model = AutoModelForCausalLM.from_pretrained(path, config=config, dtype=dtype, local_files_only=True)
        except Exception as e:
            raise ModelLoadError(f"cannot load a causal LM from {path!r}: {e}") from None
        vocab = draft_vocab_ids(path, draft_vocab, model.get_output_embeddings().weight.shape[0]) \
            if role == "drafter" else None
        return cls(model.to(device), load_tokenizer(path), name=name, slots=slots,
                   compile=resolve_compile(compile, device), bf16_head=bf16_head, vocab=vocab)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def seq_length(self, slot: int = 0) -> int:
        """Number of cached positions of a slot."""
        if self.fast is not None:
            return self.fast.cache.lengths[slot]
        cache = self.caches[slot]
        return cache.get_seq_length() if cache is not None else 0

    @property
    def length(self) -> int:
        return self.seq_length(0)

    @property
    def max_length(self) -> int:
        return context_length(self.model.config)

    def prefill(self, prompt_ids: list[int], slot: int = 0) -> torch.Tensor | None:
        """Start a sequence in `slot`: a fresh cache holding `prompt_ids`. Returns the last logits."""
        return self.prefill_batch([(slot, prompt_ids)])[0]

    def prefill_batch(self, batch: list[tuple[int, list[int]]], vocab: bool = False) -> list[torch.Tensor | None]:
        """Start several sequences, [(slot, prompt_ids), ...], in ONE batched pass. Returns each
        one's last logits (None for an empty prompt); vocab: as in `score_batch` (a caller that
        does not read the logits passes True, so a drafter's head multiplies its vocabulary only)."""
        for slot, _ in batch:
            self.started[slot] = True
            if self.fast is not None:
                self.fast.cache.reset(slot)
            else:
                self.caches[slot] = Cache(layer_class_to_replicate=PositionLayer)
        todo = [(slot, ids) for slot, ids in batch if ids]
        out = iter(self.score_batch(todo, last_only=True, vocab=vocab) if todo else [])
        return [next(out)[-1] if ids else None for _, ids in batch]

    def score(self, tokens: list[int], slot: int = 0, last_only: bool = False) -> torch.Tensor:
        """Append `tokens` to a slot's cache in ONE forward pass; logits [len(tokens), V] (float32)."""
        return self.score_batch([(slot, tokens)], last_only=last_only)[0]

    @torch.inference_mode()
    def score_batch(self, batch: list[tuple[int, list[int]]], last_only: bool = False,
                    vocab: bool = False) -> list[torch.Tensor]:
        """[(slot, tokens), ...] -> per entry logits [len(tokens), V] (or [1, V] with last_only).
        vocab: -inf outside the draft vocabulary (none: every token's logit)."""
        if not batch:  # (the lean forward's padding needs a row)
            return []
        for slot, tokens in batch:
            if not self.started[slot]:
                raise RuntimeError(f"{self.name}: score() on slot {slot} before prefill()")
            if not tokens:
                raise ValueError(f"{self.name}: nothing to score in slot {slot}")
            if self.seq_length(slot) + len(tokens) > self.max_length:
                raise ValueError(f"{self.name}: sequence would exceed the context of {self.max_length} tokens")
        if self.fast is not None:
            return self.fast.forward([list(t) for _, t in batch], [slot for slot, _ in batch], last_only=last_only,
                                     vocab=vocab)
        out = []
        for slot, tokens in batch:
            ids = to_device([tokens], self.device)
            logits = self.model(input_ids=ids, cache=self.caches[slot], use_cache=True,
                                logits_to_keep=1 if last_only else 0).logits
            out.append(self._in_vocab(logits[0].float(), vocab))
        return out

    @torch.inference_mode()
    def score_ids(self, ids: torch.Tensor, slots: list[int], vocab: bool = False) -> torch.Tensor:
        """Appends ids [b, t], already on the device, to slots[i] in one pass; returns the logits
        after each row's last token, [b, V] (float32). Nothing is read back to the host.
        vocab: -inf outside the draft vocabulary (none: every token's logit)."""
        for slot in slots:
            if not self.started[slot]:
                raise RuntimeError(f"{self.name}: score() on slot {slot} before prefill()")
            if self.seq_length(slot) + ids.shape[1] > self.max_length:
                raise ValueError(f"{self.name}: sequence would exceed the context of {self.max_length} tokens")
        if self.fast is not None:
            return self.fast.forward_ids(ids, [ids.shape[1]] * len(slots), slots, last_only=True, vocab=vocab)[:, 0]
        return self._in_vocab(torch.cat([self.model(input_ids=ids[i:i + 1], cache=self.caches[slot], use_cache=True,
                                                    logits_to_keep=1).logits[:, -1].float()
                                         for i, slot in enumerate(slots)]), vocab)

    def _in_vocab(self, logits: torch.Tensor, vocab: bool) -> torch.Tensor:
        """The HF path's logits, with vocab every token outside the draft vocabulary's at -inf."""
        return self.in_vocab(logits) if vocab and self.fast is None else logits

    def in_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """Logits [..., V] with every token outside the draft vocabulary at -inf (unchanged without one)."""
        return logits + self._outside if self._outside is not None else logits

    def warmup(self, widths: tuple[int, ...] = (1, 5), branches: bool = False) -> float:
        """Compiles (when compiled) and warms the forward for these widths (and branch rows)
        before serving; returns the seconds it took (0 on the HF path)."""
        return self.fast.warmup(widths, branches) if self.fast is not None else 0.0

    @property
    def branches(self) -> bool:
        """Whether slots can branch (`fork`): the lean forward's cache can, the HF path cannot."""
        return self.fast is not None

    def fork(self, slot: int, parent: int, at: int) -> None:
        """Starts `slot` as a branch of `parent` at position `at` (kv_cache.SlotKVCache.fork):
        it reads the parent's first `at` positions without a copy."""
        if not self.branches:
            raise NotImplementedError(f"{self.name}: branches need the lean forward")
        self.fast.cache.fork(slot, parent, at)
        self.started[slot] = True

    @torch.inference_mode()  # (as `move`: it writes the cache's buffers)
    def adopt(self, parent: int, slot: int) -> None:
        """The parent takes over a branch's continuation (only its new positions are copied); the
        branch slot is released."""
        self.fast.cache.adopt(parent, slot)
        self.started[slot] = False

    @property
    def compiled(self) -> bool:
        return self.fast is not None and self.fast.compiled

    def rollback(self, n: int, slot: int = 0) -> None:
        """Forget the last n cached positions of a slot. O(1): only a length moves."""
        if n < 0 or n > self.seq_length(slot):
            raise ValueError(f"cannot roll back {n} of {self.seq_length(slot)} cached positions")
        if n and self.fast is not None:
            self.fast.cache.rollback(n, slot)
        elif n:
            self.caches[slot].crop(-n)

    @torch.inference_mode()  # (the cache's buffers are inference tensors)
    def move(self, src: int, dst: int) -> None:
        """Moves the sequence in slot `src` to the free slot `dst` (same numbers, new slot)."""
        if self.started[dst] or not self.started[src]:
            raise ValueError(f"{self.name}: cannot move slot {src} to slot {dst}")
        if self.fast is not None:
            self.fast.cache.move(src, dst)
        self.caches[dst], self.caches[src] = self.caches[src], None
        self.started[dst], self.started[src] = True, False

    def release(self, slot: int = 0) -> None:
        if self.fast is not None:  # (first: a slot with a live branch is refused, and stays started)
            self.fast.cache.reset(slot)
        self.caches[slot] = None
        self.started[slot] = False
