"""A lean forward pass for Llama-architecture checkpoints, with a slot-indexed KV cache.

Hugging Face's modules cost about a millisecond of Python per layer and call on a CPU, which is
most of a small drafter's time. This module runs the same weights (shared with the HF model, no
copy) through a handful of tensor ops per layer, in the style of gpt-fast. The ModelRunner uses it
for `LlamaForCausalLM` checkpoints it can represent exactly (plain RoPE, SiLU MLP) and falls back
to HF otherwise; the tests compare it with HF's own `generate`.

One pass (`forward_ids`) appends tokens to several slots at once (ragged lengths allowed):

- Host work is a few integer lists; they cross to the device as ONE tensor, pinned and without
  waiting for the device (`core.device.to_device`). Token ids may already be on the device (the
  drafter feeds its sampled drafts back without reading them).
- Compiled, shapes are padded so the pass has one shape family: at least 2 rows and 2 columns (a
  compiled graph specialises sizes 0 and 1). Always, the attended length is rounded up to a multiple of
  `LENGTH_BUCKET`. Padding tokens write their K/V to the cache's scratch slot, never to a live one.
- New K/V are written in place by index (one indexed write per layer for the whole batch).
- q, k and v are one product, as are gate and up (`_fuse`: the model's weights become views of
  the stacked matrix), and q and k are rotated together.
- Attention reads each row's slot over [0, bucketed end) with a length mask built on the device
  from the positions. When the batch's slots are 0..b-1 in order (the engine hands out the lowest
  free slot, and the batch is sorted by slot) the keys are a view of the cache; otherwise the rows'
  slots are gathered.
- `torch.compile` (inductor on a CPU, CUDA graphs on a GPU through mode "reduce-overhead") wraps
  the layer stack, with the batch's sizes dynamic (rows, width, attended length, cache capacity)
  and the model's static (`_compiler`), so one compiled graph serves every batch size, width and
  length. On a GPU, though, CUDA graphs are recorded per concrete shape (rows, width, bucketed
  length): the first pass of each new shape records one (a stall, and memory kept for it), and
  warm-up records only the shapes it runs (not measured yet: no GPU has run this code; its output
  is copied, since the next replay of a graph rewrites it). `warmup()` compiles it ahead of the first request; the compiled code is cached on disk
  (`TORCHINDUCTOR_CACHE_DIR`, see `specserve.core.runner.compile_cache_dir`), so a restart skips it.

KV cache: a `kv_cache.SlotKVCache`. Writing appends at [length, length + n); rollback moves the
length back.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import platform
import statistics
import threading
import time
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F

from specserve.core.device import to_device
from specserve.core.kv_cache import SlotKVCache

log = logging.getLogger("specserve.compile")

LENGTH_BUCKET = 64  # the attended length is rounded up to a multiple of this
KEY_CHUNK = 256  # the prepacked bfloat16 path sums attention over keys in chunks of this many (_attend_same_bits)


def supports(model) -> bool:
    """Whether the lean forward represents this checkpoint exactly (a model or its config)."""
    cfg = getattr(model, "config", model)
    rope = getattr(cfg, "rope_parameters", None) or {}
    rope_type = rope.get("rope_type", "default") if isinstance(rope, dict) else "default"
    return (cfg.model_type == "llama" and rope_type == "default" and getattr(cfg, "hidden_act", "silu") == "silu"
            and not getattr(cfg, "attention_bias", False) and not getattr(cfg, "mlp_bias", False)
            and getattr(cfg, "pretraining_tp", 1) == 1)


def _compiler(device: torch.device):
    """torch.compile for the pass. Static by default: the model's sizes (its heads, head size,
    weights' shapes, RMSNorm epsilons) are constants of its graphs, and only the sizes that change
    from pass to pass are dynamic, as `FastLlama._mark_warm_up_inputs` marks them at warm-up. Until stop
    58 the pass was compiled with dynamic=True, every size symbolic, the model's too; and each
    epsilon, a Python float, became a graph input that inductor could not keep, so dynamo traced
    the first graph twice. On the 2-core AVX2 EPYC, from a cold cache, loading and warming up the
    demo drafter took 196 s and the target 376 s that way, 57 s and 52 s this way (6 s and 8 s
    eager), and the compiled passes ran as fast or a little faster
    (docs/benchmarks/ab/compile_static_sizes.txt)."""
    import torch._dynamo
    import torch.fx.experimental._config as fx_config
    fx_config.use_duck_shape = False  # equal sizes (b == t) must not be assumed equal forever
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 16)
    torch._dynamo.config.specialize_float = True  # (floats this process compiles are constants)
    mode = "reduce-overhead" if device.type == "cuda" else None  # CUDA graphs on a GPU
    return lambda fn: torch.compile(fn, dynamic=None, mode=mode)


ROW_BUCKETS = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 24, 32, 48, 64)

# CUDA graph trees (mode "reduce-overhead") keep their managers in thread-local storage
# (torch._inductor.cudagraph_trees.local). A thread that did not create them either asserts on its
# first replay (torch 2.11, pytorch issue 123177) or, in later torch, records every graph again
# into trees and a memory pool of its own. Here a model is warmed up on one thread and served
# from others (the engine's loop; the drafter's RPC handlers and its preparation thread, one at a
# time under its model lock), so the first thread to run a compiled pass on a GPU lends its trees
# to every thread after it (`share_graph_trees`).
_GRAPH_TREE_TLS = ("tree_manager_containers", "tree_manager_locks")
_graph_trees: tuple | None = None  # the trees every thread of this process replays from
_graph_threads: set[int] = set()  # threads that have them
_graph_lock = threading.Lock()


def share_graph_trees() -> None:
    """Gives the calling thread this process's CUDA graph trees (the first caller's: see above).
    Private torch state: if it is not where this expects, nothing is shared, and a pass that fails
    for it runs eagerly (`FastLlama.forward`)."""
    global _graph_trees
    me = threading.get_ident()
    if me in _graph_threads:
        return
    with _graph_lock:
        try:
            from torch._inductor import cudagraph_trees as trees
            if _graph_trees is None:
                _graph_trees = tuple(trees.get_obj(trees.local, name) for name in _GRAPH_TREE_TLS)
            else:
                for name, value in zip(_GRAPH_TREE_TLS, _graph_trees):
                    setattr(trees.local, name, value)
        except Exception:
            log.warning("CUDA graph trees not shared with thread %s", threading.current_thread().name, exc_info=True)
        _graph_threads.add(me)


def _rows_bucket(rows: int) -> int:
    for b in ROW_BUCKETS:
        if rows <= b:
            return b
    return ROW_BUCKETS[-1] + 1


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "cpu"


class GemmPlan:
    """On a CPU, decoding is bound by reading the weights, and MKL's speed for a few rows depends
    on the layout (F.linear, x @ w_t with a transposed copy, or (w @ x.T).T are each fastest
    somewhere; docs/benchmarks/forward.md has what it buys per pass). A float32 weight has a
    fourth way: oneDNN's product over a copy reordered once into its blocked layout ("packed",
    as packed_bf16 does for bfloat16). On stop 35's AVX2-only AMD EPYC, MKL took 3-5x longer for
    2-5 rows than for one against the demo target's 8192 x 384 head (2.7 ms at five rows, 0.48 at
    one), oneDNN 0.85 ms at five; at one row MKL is faster for the small matrices
    (benchmarks/diagnostics/packed_f32_products.py). So at load,
    for each weight shape and row-count bucket, the layouts are timed over the model's own weights
    of that shape and the fastest is kept; a transposed or packed copy is made only of weights
    some bucket uses it for. Results are shared
    by every model of the same shapes in the process, and kept in `store` (a JSON file, keyed by
    shape, dtype, thread count and CPU model), so a restarted process measures nothing.

    Only float32 weights are measured. A half-precision weight here (float16, or bfloat16 on a CPU
    without bf16 GEMM, where packed_bf16 does not apply) takes F.linear: timing its layouts took 70 s
    at the demo pair's first float16 load on the 2-core Zen 4 EPYC (no fast half-precision product
    to time), and F.linear won 131 of its 140 (shape, bucket) cells, the rest by a noise margin."""

    _plans: dict[str, dict] = {}
    REPEATS = 7
    # of the measurement (2: layouts interleaved, medians; 3: "packed"; 4: weights evicted from the
    # cache before each timing): older plans are redone
    VERSION = 4
    # What is read before each timing, so the weights come from beyond the core's own caches (out of
    # L1 and L2; from the shared L3, or memory where the L3 holds less), as in a real pass. Hot (the
    # same products back to back), (w @ x.T).T won at one row for every demo-drafter shape; in its
    # passes, where the head and the target's pass evict the weights between one use and the
    # next, those products took 34-98 µs against 4.5-14 hot (diagnostics/drafter_products_in_pass.py),
    # and the plan measured this way (x @ w_t for three of its four shapes) ran the pass in 1.44
    # against 1.68 ms, interleaved (diagnostics/gemm_plan_evicted_ab.py; stop 36, the Zen 4 EPYC).
    EVICT_BYTES = 16 * 2**20

    LAYOUTS = ("linear", "transposed", "swapped", "packed")

    def __init__(self, weights: list[torch.Tensor], store: str | None = None,
                 layouts: tuple[str, ...] = LAYOUTS):
        """layouts: the candidates (a subset of LAYOUTS, for tests and benches); with one, every
        product takes it and nothing is measured."""
        if not layouts or any(how not in self.LAYOUTS for how in layouts):
            raise ValueError(f"layouts must be some of {self.LAYOUTS}, got {layouts!r}")
        self.layouts = tuple(layouts)
        by_shape: dict[tuple, list[torch.Tensor]] = {}
        for w in weights:
            by_shape.setdefault((tuple(w.shape), w.dtype), []).append(w)
        self.plan: dict[tuple, str] = {}
        stored = self._load(store)
        for (shape, dtype), ws in by_shape.items():
            if len(self.layouts) == 1 or dtype != torch.float32:
                how = self.layouts[0] if len(self.layouts) == 1 else "linear"
                self.plan.update({(shape, rows): how for rows in ROW_BUCKETS})
                continue
            key = f"{'x'.join(map(str, shape))}|{dtype}|{torch.get_num_threads()}|{_cpu_model()}|v{self.VERSION}"
            if self.layouts != self.LAYOUTS:
                key += "|" + ",".join(self.layouts)
            if key not in self._plans:
                if key in stored:
                    self._plans[key] = {int(rows): how for rows, how in stored[key].items()}
                else:
                    self._plans[key] = stored[key] = self._measure(ws, self.layouts)
                    self._save(store, stored)
            self.plan.update({(shape, rows): how for rows, how in self._plans[key].items()})
        def copies(layout: str, make: Callable) -> dict[int, torch.Tensor]:
            shapes = {shape for (shape, _), how in self.plan.items() if how == layout}
            return {w.data_ptr(): make(w) for w in weights if tuple(w.shape) in shapes}
        self.transposed = copies("transposed", lambda w: w.t().contiguous())
        self.packed = copies("packed", _pack)

    @staticmethod
    def _load(store: str | None) -> dict:
        try:
            with open(store) as f:
                return json.load(f)
        except (TypeError, OSError, ValueError):
            return {}

    @staticmethod
    def _save(store: str | None, plans: dict) -> None:
        if store is None:
            return
        try:
            os.makedirs(os.path.dirname(store), exist_ok=True)
            tmp = f"{store}.{os.getpid()}.tmp"
            with open(tmp, "w") as f:
                json.dump(plans, f)
            os.replace(tmp, store)  # atomic: processes starting together never read half a file
        except OSError:
            pass  # an unwritable cache only costs the next process a measurement

    @classmethod
    @torch.inference_mode()
    def _measure(cls, ws: list[torch.Tensor], layouts: tuple[str, ...]) -> dict[int, str]:
        """For each row bucket, the layout with the smallest median time over the model's weights
        of this shape, evicted from L1/L2 first (EVICT_BYTES); the layouts alternate within each repeat,
        so a slow spell of the machine hits all of them alike."""
        wts = [w.t().contiguous() for w in ws]
        ways = {"linear": lambda x, i: F.linear(x, ws[i]), "transposed": lambda x, i: x @ wts[i],
                "swapped": lambda x, i: (ws[i] @ x.t()).t().contiguous()}
        if "packed" in layouts and ws[0].dtype == torch.float32 and torch.backends.mkldnn.is_available():
            packed = [_pack(w) for w in ws]
            ways["packed"] = lambda x, i: _packed_product(x, packed[i])
        ways = {name: fn for name, fn in ways.items() if name in layouts}
        other = torch.ones(cls.EVICT_BYTES // 4)
        out = {}
        for rows in ROW_BUCKETS:
            x = torch.randn(rows, ws[0].shape[1], dtype=ws[0].dtype)
            times: dict[str, list[float]] = {name: [] for name in ways}
            for _ in range(cls.REPEATS):
                for name, fn in ways.items():
                    other.sum()  # the weights out of L1/L2 (not timed)
                    t0 = time.perf_counter()
                    for i in range(len(ws)):
                        fn(x, i)
                    times[name].append(time.perf_counter() - t0)
            out[rows] = min(times, key=lambda name: statistics.median(times[name]))
        return out


PACK_ROWS_HINT = 8  # the row count oneDNN's weight layout is chosen for (results do not depend on it)


def _pack(w: torch.Tensor) -> torch.Tensor:
    """w reordered once into oneDNN's blocked layout for `_packed_product` (bfloat16 or float32)."""
    return torch.ops.mkldnn._reorder_linear_weight(w.detach(), PACK_ROWS_HINT)


def _packed_product(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """x @ w.T over w's packed copy (oneDNN): a row's result is the same bits whatever the
    number of rows."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")


@functools.cache  # asked at every load and FastLlama; the CPU does not change
def cpu_has_bf16_gemm() -> bool:
    """True on a CPU whose bfloat16 products torch's oneDNN runs in hardware: AMX tiles (Xeon
    Sapphire Rapids and later) or AVX512-BF16 dot products (AMD Zen 4 and later, Xeon Cooper
    Lake). Until stop 31 this asked for AMX only, and an AVX512-BF16 CPU ran float32: on the
    project's 2-core AMD EPYC (Zen 4) the prepacked bfloat16 target's pass took 0.47-1.01x the
    float32 one's at 1-32 sequences and widths 1 and 5, with the same bits at every width
    (docs/benchmarks/dtype.md)."""
    try:
        return bool(torch.backends.mkldnn.is_available()
                    and (torch.cpu._is_amx_tile_supported() or torch.cpu._is_avx512_bf16_supported())
                    and torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def packs_bf16(config) -> bool:
    """Whether a bfloat16 model of this config gets the prepacked path on this CPU (eager lean
    forward: see packed_bf16). The width of its attention products must be past oneDNN's size
    floor: below 16^3 multiply-adds (heads x head_dim x the 64 keys of the shortest attended
    length, at one query) torch's bf16 bmm takes a native kernel that sums in another order
    than the oneDNN one a wider pass gets, and a position would no longer score the same bits at
    every width; the check keeps a factor 2 to spare. Models that small (the tests' tiny ones) run
    float32 under `dtype: auto`."""
    if not supports(config) or not cpu_has_bf16_gemm():
        return False
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return heads * head_dim * LENGTH_BUCKET > 2 * 16 ** 3


def packed_bf16_head(head: torch.Tensor) -> torch.Tensor | None:
    """A bfloat16 copy of a float32 model's output head, reordered once for oneDNN (see
    packed_bf16), or None (no bf16 GEMM in hardware). For a small float32 model (the demo
    drafter, `dtype: auto`: see runner.resolve_dtype) the head is most of a pass's multiply-adds:
    on stop 34's AMD EPYC its float32 head of 8192 x 192 took 229 us at one row and 891 us at
    five, against 94 and 136 us packed in bfloat16, while its layers' products took 4.5-16 us at
    one row in float32 against 15.5-22.6 us packed (benchmarks/diagnostics/drafter_dtype_loop.py
    --products). Like every packed product, a row's head logits are
    the same bits whatever the number of rows."""
    if head.dtype != torch.float32 or not cpu_has_bf16_gemm():
        return None
    return _pack(head.to(torch.bfloat16))


def packed_bf16(weights: list[torch.Tensor]) -> dict[int, torch.Tensor] | None:
    """bfloat16 weights reordered once into oneDNN's blocked layout, by id of the weight, or None
    (not bfloat16, or no bf16 GEMM in hardware: `cpu_has_bf16_gemm`). F.linear in bfloat16 reorders its weight on every
    call, which for these small matrices costs more than the product. The packed product gives the
    same bits as F.linear, and, unlike float32 MKL, the same bits for a row whatever the number of
    rows in the call; with the path's own attention (`FastLlama._attend_same_bits`) a (k+1)-wide
    verify pass scores each position exactly as a one-token pass does (tests/test_runner.py).
    Pass times against float32 on the demo pair: docs/benchmarks/dtype.md. The packed copies are
    kept beside the model's own weights (twice a bfloat16 model's weight memory)."""
    if not weights or any(w.dtype != torch.bfloat16 for w in weights) or not cpu_has_bf16_gemm():
        return None
    return {id(w): _pack(w) for w in weights}


class _LayerWeights(NamedTuple):
    ln1: torch.Tensor
    eps1: float
    qkv: torch.Tensor  # q, k and v projections stacked: one product (see _fuse)
    o: torch.Tensor
    ln2: torch.Tensor
    eps2: float
    gate_up: torch.Tensor  # gate and up projections stacked
    down: torch.Tensor


@torch.no_grad()
def _fuse(modules: list) -> torch.Tensor:
    """The weights of `modules` (linears of one input) stacked into one [sum of outputs, in]
    matrix, so a pass runs one product where it ran several (a small model's pass is mostly the
    cost of each op call; with the rotation and RMSNorm changes beside it, the demo target's
    bfloat16 pass took 0.89-0.93x its time and the float32 drafter's 0.92-0.94x:
    docs/benchmarks/ab/fused_projections.txt). The modules' own weights become views of it: no
    copy is kept, and the model itself still runs on them."""
    fused = torch.cat([m.weight.detach() for m in modules])
    at = 0
    for m in modules:
        rows = m.weight.shape[0]
        m.weight.data = fused[at:at + rows]
        at += rows
    return fused


class FastLlama:
    def __init__(self, model, slots: int = 1, capacity: int = 256, compile: bool = False,
                 plan_store: str | None = None, bf16_head: bool = False, vocab: list[int] | None = None):
        """bf16_head: a float32 model multiplies by a bfloat16 copy of its output head
        (packed_bf16_head), eager on a CPU with bf16 GEMM in hardware; elsewhere it is ignored.
        vocab: a drafter's draft vocabulary (token ids, `specserve.core.draft_vocab`): a pass asked
        for it (`forward_ids(..., vocab=True)`) multiplies by those rows of the head only (a copy
        kept beside the head) and gives every other token's logit -inf."""
        cfg = model.config
        self.cfg = cfg
        inner = model.model
        self.embed = inner.embed_tokens.weight
        self.layers = inner.layers
        self.norm_w, self.eps = inner.norm.weight, inner.norm.variance_epsilon
        self.lm_head = model.lm_head.weight
        self.vocab_size = self.lm_head.shape[0]
        self.vocab = self.vocab_head = None  # the draft vocabulary's ids (sorted, on the device), its head rows
        if vocab is not None:
            self.vocab = torch.tensor(sorted(vocab), dtype=torch.long, device=self.lm_head.device)
            self.vocab_head = self.lm_head.detach().index_select(0, self.vocab).contiguous()
        self.heads = cfg.num_attention_heads
        self.kv_heads = cfg.num_key_value_heads
        # a constant of the model, as a plain bool: compiled with dynamic shapes, `kv_heads != heads`
        # becomes a SymBool, which SDPA refuses, and the whole pass then fell back to eager
        self._sdpa_kwargs = {"enable_gqa": True} if self.kv_heads != self.heads else {}
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.heads
        self.max_length = cfg.max_position_embeddings
        rope = getattr(cfg, "rope_parameters", None) or {}
        theta = rope.get("rope_theta", getattr(cfg, "rope_theta", 10000.0)) if isinstance(rope, dict) else 10000.0
        inv_freq = 1.0 / (theta ** (torch.arange(0, self.head_dim, 2, dtype=torch.int64).float() / self.head_dim))
        freqs = torch.outer(torch.arange(self.max_length, dtype=torch.float32), inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)
        half = self.head_dim // 2  # sin with its first half negated: see _rotate
        sin_signed = torch.cat((-emb.sin()[:, :half], emb.sin()[:, half:]), dim=-1)
        # computed once in float32 on the host, then kept on the model's device in its dtype
        self.cos, self.sin_signed = (t.to(device=self.embed.device, dtype=self.embed.dtype)
                                     for t in (emb.cos(), sin_signed))
        # each layer's weights, looked up once (a module attribute costs a Python call per pass)
        self.layer_weights = [_LayerWeights(
            l.input_layernorm.weight, l.input_layernorm.variance_epsilon,
            _fuse([l.self_attn.q_proj, l.self_attn.k_proj, l.self_attn.v_proj]), l.self_attn.o_proj.weight,
            l.post_attention_layernorm.weight, l.post_attention_layernorm.variance_epsilon,
            _fuse([l.mlp.gate_proj, l.mlp.up_proj]), l.mlp.down_proj.weight) for l in inner.layers]
        self.intermediate = cfg.intermediate_size
        self.slots = slots
        self.cache = SlotKVCache(len(self.layers), slots, self.kv_heads, self.head_dim, self.max_length,
                                 like=self.embed, capacity=capacity)
        self.key_index = torch.arange(max(self.max_length, self.cache.capacity), device=self.embed.device)  # (_pass_eager)
        self.compiled = compile
        self._warming = False  # in warmup(): the passes mark their inputs for compiling (_mark_warm_up_inputs)
        self._min_size = 2 if compile else 1  # a compiled graph specialises sizes 0 and 1: pad past them
        self._pass = _compiler(self.embed.device)(self._pass_eager) if compile else self._pass_eager
        if compile:  # what the pass reads that is no module parameter (fused weights, tables) is static
            # too: on a GPU its CUDA graphs would otherwise copy them into their own buffers each replay
            # (unguarded, as parameters are: another model of these shapes runs the same graphs)
            for t in (self.cos, self.sin_signed, self.vocab, self.vocab_head,
                      *(w for lw in self.layer_weights for w in (lw.qkv, lw.gate_up))):
                if t is not None:
                    torch._dynamo.mark_static_address(t, guard=False)
        # the output head alone packed in bfloat16 (a float32 model, asked for: see packed_bf16_head)
        self.head_packed = packed_bf16_head(self.lm_head) \
            if bf16_head and not compile and self.device.type == "cpu" else None
        self.vocab_head_packed = packed_bf16_head(self.vocab_head) \
            if self.head_packed is not None and self.vocab_head is not None else None
        # Eager on a CPU: bfloat16 weights prepacked for oneDNN where the CPU multiplies bf16 in hardware
        # (see packed_bf16); otherwise each weight's GEMM layout picked by measurement (GemmPlan)
        self.packed = packed_bf16(self._weights()) \
            if not compile and self.device.type == "cpu" and packs_bf16(cfg) else None
        # the packed path's own attention (a position's bits independent of the pass's width)
        self.exact_attention = self.packed is not None
        self.gemm = GemmPlan(self._weights(), plan_store) \
            if not compile and self.device.type == "cpu" and self.packed is None else None
        self._gemm_tables: dict[int, dict[int, Callable]] = {}  # row bucket -> {id(weight): x -> x @ w.T}

    def _weights(self) -> list[torch.Tensor]:
        """Every matrix the pass multiplies by (the head's own copy aside, where it has one)."""
        head = [] if self.head_packed is not None else [self.lm_head]
        if self.vocab_head is not None and self.vocab_head_packed is None:
            head.append(self.vocab_head)
        return [*head, *(w for lw in self.layer_weights for w in (lw.qkv, lw.o, lw.gate_up, lw.down))]

    @property
    def device(self) -> torch.device:
        return self.embed.device

    # ---------------------------------------------------------------- forward
    @torch.inference_mode()
    def forward(self, tokens: list[list[int]], slots: list[int], last_only: bool = False,
                vocab: bool = False) -> list[torch.Tensor]:
        """Appends tokens[i] to slot slots[i] (ragged lengths allowed) in ONE batched pass.
        Returns, per sequence, logits [len(tokens[i]), V] (or [1, V] with last_only), float32."""
        n = [len(t) for t in tokens]
        t = max(max(n), self._min_size)
        ids = to_device([seq + [0] * (t - len(seq)) for seq in tokens], self.device)
        logits = self.forward_ids(ids, n, slots, last_only, vocab)
        return [logits[i, :1] if last_only else logits[i, :m] for i, m in enumerate(n)]

    @torch.inference_mode()
    def forward_ids(self, ids: torch.Tensor, n: list[int], slots: list[int], last_only: bool = False,
                    vocab: bool = False) -> torch.Tensor:
        """ids [b, t] on the device (row i's first n[i] are real); appends them to slots[i].
        Returns logits [b, L, V] (float32): L = 1 (each row's last real position) with last_only,
        else L = t (positions past n[i] are padding). vocab: the draft vocabulary's logits only
        (every other token's -inf; the whole head's without one)."""
        if not ids.is_inference():  # one kind of input: compiled, a graph guards on it (see _warm)
            ids = ids.clone()
        b = len(slots)
        lengths = self.cache.lengths
        starts = [lengths[s] for s in slots]
        end = max(s0 + m for s0, m in zip(starts, n))
        if end > self.max_length:
            raise ValueError(f"sequence would exceed the context of {self.max_length} tokens")
        # rows sorted by slot (so slots 0..b-1 are a view); compiled: one shape family, b, t, L >= 2
        order = sorted(range(b), key=lambda i: slots[i])
        rows = order + [-1] * (self._min_size - b)
        t = max(ids.shape[1], self._min_size)
        if ids.shape[1] < t:
            ids = F.pad(ids, (0, t - ids.shape[1]))
        big = len(rows)
        self.cache.ensure_capacity(max(end, t))
        if self.compiled:  # the cache is written in place: CUDA graphs keep its address, no copy in
            for buffer in (*self.cache.k, *self.cache.v):
                torch._dynamo.mark_static_address(buffer)
        keys_at = self.key_index[:min(-(-end // LENGTH_BUCKET) * LENGTH_BUCKET, self.cache.capacity)]
        scratch = self.cache.scratch
        pos, wslot, wpos, slot_of, last = [], [], [], [], []
        for r in rows:
            s0, m, s = (starts[r], n[r], slots[r]) if r >= 0 else (0, 0, scratch)
            pos += [min(s0 + j, self.max_length - 1) for j in range(t)]
            wslot += [s if j < m else scratch for j in range(t)]
            wpos += [s0 + j if j < m else j for j in range(t)]
            slot_of.append(s)
            last += [max(m - 1, 0)] * self._min_size if last_only else list(range(t))
        parents = self.cache.parents
        branched = any(s in parents for s in slot_of)
        compact = slot_of[:b] == list(range(b)) and not branched
        extra = ([parents.get(s, (s, 0))[0] for s in slot_of] + [parents.get(s, (s, 0))[1] for s in slot_of]
                 if branched else [])
        meta = to_device(pos + wslot + wpos + last + slot_of + [r if r >= 0 else 0 for r in rows] + extra,
                         self.device)
        nt = big * t
        nl = len(last)
        pos_t, wslot_t, wpos_t = meta[:nt].view(big, t), meta[nt:2 * nt].view(big, t), meta[2 * nt:3 * nt].view(big, t)
        last_t = meta[3 * nt:3 * nt + nl].view(big, -1)
        slot_t = meta[3 * nt + nl:3 * nt + nl + big]
        row_t = meta[3 * nt + nl + big:3 * nt + nl + 2 * big]
        # branch rows read their parent's slot below the fork (see SlotKVCache.fork)
        parent_t, fork_t = (meta[3 * nt + nl + 2 * big:3 * nt + nl + 3 * big], meta[3 * nt + nl + 3 * big:]) \
            if branched else (None, None)
        ids = ids.index_select(0, row_t) if (order != list(range(b)) or big != b) else ids
        for s, s0, m in zip(slots, starts, n):  # (first: a pass that fails may have written some layers)
            self.cache.wrote(s, s0 + m)
        args = (ids, pos_t, wslot_t, wpos_t, last_t, slot_t, keys_at, compact, self.cache.k, self.cache.v, parent_t,
                fork_t, vocab and self.vocab is not None)
        if self.compiled and self._warming:
            self._mark_warm_up_inputs(args)
        if self.compiled and self.device.type == "cuda":
            share_graph_trees()
        try:
            logits = self._pass(*args)
        except Exception:
            if not self.compiled:
                raise
            # a compiled pass that fails in serving runs eagerly from now on: the same positions are
            # written again, so the retry is the pass
            self._go_eager("the compiled forward failed: it runs eagerly from now on")
            logits = self._pass(*args)
        for s, m in zip(slots, n):
            lengths[s] += m
        if last_only:
            logits = logits[:, :1]
        if order != list(range(b)) or big != b:  # back to the caller's row order
            inverse = [0] * b
            for pos_in_batch, r in enumerate(order):
                inverse[r] = pos_in_batch
            logits = logits.index_select(0, to_device(inverse, self.device))
        elif self.compiled and self.device.type == "cuda":
            # CUDA graphs (mode reduce-overhead) own their outputs: the next call rewrites them, and
            # the drafter keeps a pass's logits across later passes (its catch-up, one token at a time)
            logits = logits.clone()
        return logits

    def _pass_eager(self, ids, pos, wslot, wpos, last, slot_idx, keys_at, compact: bool, kcache, vcache,
                    parent_idx=None, fork=None, vocab: bool = False):
        """The layer stack over a padded batch; the part that is compiled. keys_at: the key
        positions attended, 0..span-1 (a view of `key_index`: the span is a tensor's size, which
        compiled is one dynamic size where an int argument would be a constant of each graph)."""
        b, t = ids.shape
        span = keys_at.shape[0]
        if fork is not None:  # [b, 1, span, 1]: key positions a branch row reads from its parent
            below = (keys_at[None, :] < fork[:, None])[:, None, :, None]
        cos, sin = self.cos[pos][:, :, None], self.sin_signed[pos][:, :, None]  # [b, t, 1, d]
        # key j of a row is visible to query q when j <= the query's position
        mask = (keys_at[None, None, :] <= pos[:, :, None])[:, None]  # [b, 1, t, span]
        hidden = ~mask if self.exact_attention else None  # keys a query may not see (see _attend_same_bits)
        linear = self._linear_for(b * t)
        heads, kv_heads, d, inter = self.heads, self.kv_heads, self.head_dim, self.intermediate
        x = F.embedding(ids, self.embed)
        for li, (ln1, eps1, wqkv, wo, ln2, eps2, wgu, wd) in enumerate(self.layer_weights):
            h = self._rms(x, ln1, eps1)
            qkv = linear(h, wqkv).view(b, t, heads + 2 * kv_heads, d)
            qk = self._rotate(qkv[:, :, :heads + kv_heads], cos, sin)  # q and k: one rotation
            q, k, v = qk[:, :, :heads].transpose(1, 2), qk[:, :, heads:], qkv[:, :, heads + kv_heads:]
            kb, vb = kcache[li], vcache[li]
            kb[wslot, :, wpos] = k  # [b, t, kv_heads, d] written at (slot, position)
            vb[wslot, :, wpos] = v
            if compact:
                keys, values = kb[:b, :, :span], vb[:b, :, :span]
            else:
                keys, values = kb[slot_idx, :, :span], vb[slot_idx, :, :span]
            if fork is not None:
                keys = torch.where(below, kb[parent_idx, :, :span], keys)
                values = torch.where(below, vb[parent_idx, :, :span], values)
            o = self._attend_same_bits(q, keys, values, hidden) if hidden is not None else \
                F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, **self._sdpa_kwargs)
            x = x + linear(o.transpose(1, 2).reshape(b, t, -1), wo)
            h = self._rms(x, ln2, eps2)
            gu = linear(h, wgu)
            x = x + linear(F.silu(gu[..., :inter]) * gu[..., inter:], wd)
        x = x.gather(1, last[:, :, None].expand(-1, -1, x.shape[-1]))  # [b, L, d]: the positions asked for
        return self.head(self._rms(x, self.norm_w, self.eps), vocab)

    def head(self, x: torch.Tensor, vocab: bool = False) -> torch.Tensor:
        """Logits (float32, [..., V]) of normed hidden states x [..., d]: the output head's
        product; vocab: the draft vocabulary's rows only, put in place, -inf for every other token
        (stop 46's Xeon, one row: the demo drafter's 8192 x 192 head 168 us, 1024 of its rows
        36 us, put in place included: `specserve bench draft-vocab`)."""
        w, packed = (self.vocab_head, self.vocab_head_packed) if vocab else (self.lm_head, self.head_packed)
        if packed is not None:
            logits = _packed_product(x.to(torch.bfloat16), packed).float()
        else:
            logits = self._linear_for(x[..., 0].numel())(x, w).float()
        if not vocab:
            return logits
        return logits.new_full((*logits.shape[:-1], self.vocab_size), float("-inf")).index_copy_(-1, self.vocab, logits)

    def _attend_same_bits(self, q, keys, values, hidden):
        """Attention for the prepacked bfloat16 path: scores and the weighted sum as bfloat16
        products (oneDNN, like the linears: a query's row comes out the same whatever the number
        of queries or of masked keys after its own), the softmax in float32. SDPA's CPU kernel
        does not keep those bits: with it, some positions scored in a 2-, 5- or 9-wide pass
        differ from the same position scored alone (bench dtype's "packed, SDPA" row), and in
        bfloat16 that moved greedy outputs (all four speculative rows of the ngram bench's edit
        prompts parted from plain decoding).

        A pass of one position per row (plain decoding) multiplies two query rows, the row twice:
        oneDNN takes another kernel for a one-row bf16 product, whose bits differ from those of
        two or more rows (which agree for any number of rows), and until stop 62 a position
        decoded alone and the same position in a verify pass could part once the weighted sum ran
        over about 1300 keys (found by a user trial: greedy speculative output parted from plain
        decoding after about 900 tokens; `tests/test_runner.py`'s long prompts)."""
        if self.kv_heads != self.heads:
            keys = keys.repeat_interleave(self.heads // self.kv_heads, dim=1)
            values = values.repeat_interleave(self.heads // self.kv_heads, dim=1)
        one = q.shape[2] == 1
        if one:
            q, hidden = q.expand(-1, -1, 2, -1), hidden.expand(-1, -1, 2, -1)
        b, h, t, d = q.shape
        span = keys.shape[2]
        # packed first: a product over a strided slice of the cache took twice as long as copying
        # the slice and multiplying (at 32 sequences, 0.83 against 0.17 + 0.22 ms for the scores;
        # benchmarks/diagnostics/bf16_products.py)
        k3 = keys.reshape(b * h, span, d).contiguous()
        scores = torch.bmm(q.reshape(b * h, t, d), k3.transpose(1, 2)).view(b, h, t, span)
        scores = scores.float().mul_(self.head_dim ** -0.5).masked_fill_(hidden, float("-inf"))
        probs = scores.softmax(-1).to(q.dtype).view(b * h, t, span)
        # the weighted sum in chunks of KEY_CHUNK keys from key 0 (the last padded with zeros), one product
        # of KEY_CHUNK keys each, added in order in float32: oneDNN splits a longer sum over keys as the
        # span (the batch's longest row) decides, and a row then came out with other bits beside a longer
        # row, or in a pass whose span crossed into another bucket (until stop 62: greedy speculative
        # output parted from plain decoding in long, batched requests); a chunk past a row's keys adds 0
        # (a span of one chunk or less: one product over the span, unpadded, whose bits are those of the
        # padded chunk: zeros at the end of a short sum change nothing; `tests/test_runner.py` checks both)
        v3 = values.reshape(b * h, span, d)
        if span <= KEY_CHUNK:
            out = torch.bmm(probs, v3.contiguous())
        else:
            n = -(-span // KEY_CHUNK)
            if n * KEY_CHUNK != span:
                probs, v3 = F.pad(probs, (0, n * KEY_CHUNK - span)), F.pad(v3, (0, 0, 0, n * KEY_CHUNK - span))
            chunks = probs.view(b * h, t, n, KEY_CHUNK).transpose(1, 2).reshape(b * h * n, t, KEY_CHUNK)
            parts = torch.bmm(chunks, v3.reshape(b * h * n, KEY_CHUNK, d)).view(b * h, n, t, d)
            out = parts[:, 0].float()
            for i in range(1, n):
                out += parts[:, i]
            out = out.to(q.dtype)
        out = out.view(b, h, t, d)
        return out[:, :, :1] if one else out

    def _linear_for(self, rows: int) -> Callable:
        """linear(x, w) = x @ w.T for inputs of `rows` rows. Eager on a CPU: in the layout `GemmPlan`
        measured fastest for that many rows, each weight's product made once per row bucket;
        compiled or on a GPU: F.linear."""
        if self.packed is not None:
            packed = self.packed
            return lambda x, w: _packed_product(x, packed[id(w)])
        if self.gemm is None:
            return F.linear
        bucket = _rows_bucket(rows)
        table = self._gemm_tables.get(bucket)
        if table is None:
            table = self._gemm_tables[bucket] = {id(w): self._product(w, bucket) for w in self._weights()}
        return lambda x, w: table[id(w)](x)

    def _product(self, w, bucket: int) -> Callable:
        how = self.gemm.plan.get((tuple(w.shape), bucket), "linear")
        if how == "transposed":  # [in, out] copy: x @ w_t
            w_t = self.gemm.transposed[w.data_ptr()]
            return lambda x: x @ w_t
        if how == "packed":  # oneDNN over the weight's reordered copy
            packed = self.gemm.packed[w.data_ptr()]
            return lambda x: _packed_product(x, packed)
        if how == "swapped":  # (w @ x.T).T, made row-major again: the plan was measured on row-major
            # inputs, and MKL is several times slower on some column-major ones (the next linear's)
            return lambda x: (w @ x.reshape(-1, x.shape[-1]).t()).t().contiguous().reshape(*x.shape[:-1], w.shape[0])
        return lambda x: F.linear(x, w)

    def _rms(self, x, w, eps):
        dtype = x.dtype
        if dtype == torch.float32:  # one op for the eight below, with their bits in float32
            return F.rms_norm(x, (x.shape[-1],), w, eps)
        x = x.float()
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)).to(dtype)

    @staticmethod
    def _rotate(x, cos, sin_signed):
        """RoPE: x * cos + rotate_half(x) * sin, with rotate_half(x) = (-x2, x1). Written as
        (x2, x1) * (-sin1, sin2) (sin_signed): one roll instead of two slices, a negation and a
        concatenation, and the same bits ((-a) * b == a * (-b) exactly)."""
        return x * cos + x.roll(x.shape[-1] // 2, -1) * sin_signed

    # ---------------------------------------------------------------- compile
    def warmup(self, widths: tuple[int, ...] = (1, 5), branches: bool = False) -> float:
        """Runs the pass over the shape families serving uses (batches of 1 and 2, compact and
        gathered slots, these widths, last position only or all), so compiling happens now and
        not on the first request. Needs every slot empty, and leaves them so. If compiling fails
        (a backend this machine lacks), the error is logged and the forward runs eagerly.
        Returns the seconds it took."""
        if any(self.cache.lengths):
            raise RuntimeError("warm up before serving: sequences are live")
        t0 = time.perf_counter()
        self._warming = True
        try:
            self._warm(widths, branches)
        except Exception:
            if not self.compiled:
                raise
            self._go_eager("compiling the forward failed: it runs eagerly")
            self._warm(widths, branches)
        finally:
            self._warming = False
        seconds = time.perf_counter() - t0
        if self.compiled:
            log.info("forward compiled and warm in %.1f s", seconds)
        return seconds

    @staticmethod
    def _mark_warm_up_inputs(args: tuple) -> None:
        """The sizes that change from pass to pass, marked dynamic for the graphs warm-up compiles:
        rows and width of the ids, positions and write targets, the attended length, and the
        cache's capacity (it grows). Everything else is a constant of the graphs (`_compiler`).
        Marked at warm-up only: a graph compiled with these sizes symbolic serves later passes
        unmarked (test_compiled: serving compiles nothing). `maybe_mark_dynamic`: a size the
        trace pins to a constant costs a graph per value (which test_compiled would see), where
        `mark_dynamic` would fail the compile and run the forward eagerly. And `keys_at`, a view at
        the start of a table that does not move, as a static address, as the tables in __init__
        (unguarded: read when a graph is compiled, so later passes need no mark)."""
        import torch._dynamo
        ids, pos, wslot, wpos, last, slot_idx, keys_at, _, kcache, vcache, parent_idx, fork, _ = args
        torch._dynamo.mark_static_address(keys_at, guard=False)
        for t in (ids, pos, wslot, wpos, last):
            torch._dynamo.maybe_mark_dynamic(t, (0, 1))
        for t in (slot_idx, keys_at, parent_idx, fork):
            if t is not None:
                torch._dynamo.maybe_mark_dynamic(t, 0)
        for buffer in (*kcache, *vcache):
            torch._dynamo.maybe_mark_dynamic(buffer, 2)

    def _go_eager(self, why: str) -> None:
        """Logs the exception being handled and runs the forward eagerly from now on."""
        log.exception(why)
        self.compiled, self._min_size, self._pass = False, 1, self._pass_eager

    def _warm(self, widths: tuple[int, ...], branches: bool = False) -> None:
        # Every pass's ids are inference tensors (forward_ids makes them so), as in serving: a
        # compiled graph guards on its inputs' dispatch keys, and warming with ordinary tensors
        # compiled graphs that serving never ran (stop 47: 3 graphs for the tests' tiny target
        # where 2 serve, about 20 s each on the 2-core CPU)
        vocabs = (False, True) if self.vocab is not None else (False,)  # a draft vocabulary's passes too
        shapes = [(b, w, last) for b in (1, min(2, self.slots)) for w in widths for last in (True, False)]
        for i, (b, w, last_only) in enumerate(shapes):
            for slots in ([*range(b)], [*range(b)][::-1] if b > 1 else [self.slots - 1]):
                if self.compiled:
                    log.info("compiling the forward: shape %d of %d (batch %d, width %d)", i + 1, len(shapes), b, w)
                for vocab in vocabs:
                    for s in slots:
                        self.cache.reset(s)
                    self.forward([[1] * w] * b, slots, last_only=last_only, vocab=vocab)
                    self.forward([[1] * w] * b, slots, last_only=last_only, vocab=vocab)
            if branches and self.slots > 2 and b == 1:  # a branch row (the drafter's prepared outcomes)
                for vocab in vocabs:
                    self.cache.reset(0)
                    self.cache.reset(self.slots - 1)
                    self.forward([[1] * w], [0], last_only=last_only, vocab=vocab)
                    self.cache.fork(self.slots - 1, 0, 1)
                    self.forward([[1] * w] * 2, [0, self.slots - 1], last_only=last_only, vocab=vocab)
                    self.cache.reset(self.slots - 1)  # (the branch first: the fork rule)
        for s in range(self.slots):
            self.cache.reset(s)
