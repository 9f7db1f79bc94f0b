"""KV rollback: lengths, O(1) cost, and logits equal to a fresh forward after a rollback."""

import json
import re

import pytest
import torch

from specserve.training.tiny import tiny_model
from specserve.drafter.draft_model import DraftModelProposer
from specserve.core.kv_cache import PositionLayer
from specserve.core.runner import ModelRunner
from specserve.core.sampling import SamplingParams
from specserve.verifier.engine import SpeculativeEngine


def full_logits(model, tokens):
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0]


def test_rollback_then_score_equals_fresh_forward():
    for arch in ("llama", "gpt2"):
        model = tiny_model(arch, 64, seed=0)
        r = ModelRunner(model)
        seq = torch.randint(0, 64, (400,), generator=torch.Generator().manual_seed(1)).tolist()
        r.prefill(seq[:100])
        assert r.length == 100
        r.score([7, 8, 9, 10, 11])  # a rejected round's drafts
        r.rollback(4)
        assert r.length == 101
        # continue past the first buffer capacity, with another rollback in between
        got = r.score(seq[101:300])
        assert torch.allclose(got, full_logits(model, seq[:100] + [7] + seq[101:300])[101:], atol=1e-4)
        r.rollback(150)
        got = r.score(seq[150:160])
        assert torch.allclose(got, full_logits(model, seq[:100] + [7] + seq[101:160])[150:], atol=1e-4)


def test_rollback_moves_a_length_not_data():
    """Both cache paths: HF modules (GPT-2 here) and the lean Llama forward."""
    hf = ModelRunner(tiny_model("gpt2", 64, seed=0))
    assert hf.fast is None
    hf.prefill(list(range(50)))
    layer = hf.caches[0].layers[0]
    assert isinstance(layer, PositionLayer)
    ptr = layer._k.data_ptr()
    hf.score([1, 2, 3, 4])
    hf.rollback(3)
    assert layer._k.data_ptr() == ptr and hf.length == 51 and layer.keys.shape[-2] == 51

    fast = ModelRunner(tiny_model("llama", 64, seed=0))
    assert fast.fast is not None
    fast.prefill(list(range(50)))
    ptr = fast.fast.cache.k[0].data_ptr()
    fast.score([1, 2, 3, 4])
    fast.rollback(3)
    assert fast.fast.cache.k[0].data_ptr() == ptr and fast.length == 51


def test_fast_llama_matches_hf_modules():
    model = tiny_model("llama", 64, seed=3, layers=3)
    fast, hf = ModelRunner(model), ModelRunner(model, fast=False)
    seq = torch.randint(0, 64, (300,), generator=torch.Generator().manual_seed(2)).tolist()
    for r in (fast, hf):
        r.prefill(seq[:280])
    assert torch.allclose(fast.score(seq[280:285]), hf.score(seq[280:285]), atol=1e-5)


def test_fused_projections_share_the_models_weights():
    """The lean forward stacks q/k/v and gate/up into one matrix each; the model's own weights
    become views of it (no second copy), and the model still computes what it did."""
    model = tiny_model("llama", 64, seed=5, layers=2)
    ids = torch.tensor([[3, 9, 27, 17, 51]])
    with torch.no_grad():
        before = model(ids).logits
    runner = ModelRunner(model)
    attn, mlp = model.model.layers[1].self_attn, model.model.layers[1].mlp
    lw = runner.fast.layer_weights[1]
    assert attn.q_proj.weight.data_ptr() == lw.qkv.data_ptr()
    assert attn.v_proj.weight.untyped_storage().data_ptr() == lw.qkv.untyped_storage().data_ptr()
    assert mlp.up_proj.weight.untyped_storage().data_ptr() == lw.gate_up.untyped_storage().data_ptr()
    assert torch.equal(lw.qkv[-attn.v_proj.weight.shape[0]:], attn.v_proj.weight)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, before)
    runner.prefill([3, 9, 27, 17])
    assert torch.allclose(runner.score([51])[-1], before[0, -1], atol=1e-5)


def test_fast_llama_batched_ragged_slots_match_single():
    from specserve.core.fast_llama import FastLlama
    model = tiny_model("llama", 64, seed=4)
    seqs = [torch.randint(0, 64, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (30, 7, 55)]
    batched = FastLlama(model, slots=3)
    for slot, s in enumerate(seqs):
        batched.forward([s[:-3]], [slot])
    outs = batched.forward([s[-3:] for s in seqs], [0, 1, 2])
    for s, out in zip(seqs, outs):
        assert torch.allclose(out, full_logits(model, s)[-3:], atol=1e-4)


def test_after_rejected_round_caches_hold_the_accepted_prefix():
    target, drafter = tiny_model("llama", 64, seed=1), tiny_model("llama", 64, seed=2)
    engine = SpeculativeEngine(ModelRunner(target), DraftModelProposer(ModelRunner(drafter)), eos_ids=set())
    engine.target.release = lambda slot=0: None  # keep the cache to inspect it after generate()
    r = engine.generate([3, 4, 5], 6, SamplingParams(), k=4)
    assert r.stats.num_accepted_tokens < r.stats.num_draft_tokens  # some round was rejected
    # the target holds prompt + all written tokens but the last one
    assert engine.target.length == 3 + len(r.token_ids) - 1
    got = engine.target.score([r.token_ids[-1]])
    assert torch.allclose(got[-1], full_logits(target, [3, 4, 5] + r.token_ids)[-1], atol=1e-4)


def test_ragged_batch_next_to_a_capacity_boundary():
    """A sequence one token short of the KV buffer's capacity, batched with a longer contribution
    from another slot: padded positions must not be written past the buffer (regression)."""
    from specserve.core.fast_llama import FastLlama
    model = tiny_model("llama", 64, seed=5, max_positions=512)
    fast = FastLlama(model, slots=2, capacity=256)
    near = torch.randint(0, 64, (255,), generator=torch.Generator().manual_seed(1)).tolist()
    short = torch.randint(0, 64, (15,), generator=torch.Generator().manual_seed(2)).tolist()
    fast.forward([near[:-1]], [0])
    fast.forward([short[:-5]], [1])
    assert fast.cache.capacity == 256 and fast.cache.lengths == [254, 10]
    out = fast.forward([near[-1:], short[-5:]], [0, 1])  # slot 0 ends at 255 < 256; slot 1 adds 5 tokens
    assert torch.allclose(out[0], full_logits(model, near)[-1:], atol=1e-4)
    assert torch.allclose(out[1], full_logits(model, short)[-5:], atol=1e-4)


def test_a_branch_reads_its_parents_prefix_and_adopting_it_moves_only_its_new_positions():
    """fork: a slot that attends to another slot's first positions without a copy; adopt: the
    parent takes the branch's continuation over."""
    model = tiny_model("llama", 64, seed=3)
    runner = ModelRunner(model, slots=3)
    prompt = [1, 2, 3, 4, 5, 6, 7]
    runner.prefill(prompt, slot=0)
    runner.fork(2, 0, 5)  # the branch continues after prompt[:5]
    alone = ModelRunner(model)
    alone.prefill(prompt[:5])
    assert torch.equal(runner.score([9, 8], slot=2), alone.score([9, 8]))
    after = ModelRunner(model)  # the parent is untouched by its branch
    after.prefill(prompt)
    assert torch.equal(runner.score([9], slot=0), after.score([9]))
    with pytest.raises(ValueError):
        runner.fork(1, 2, 3)  # a branch of a branch
    with pytest.raises(ValueError):
        runner.fork(1, 0, 99)  # past the parent's positions
    with pytest.raises(ValueError, match="branch"):
        runner.rollback(4, slot=0)  # below the fork: the branch would read what the parent writes again
    with pytest.raises(ValueError, match="branch"):
        runner.fast.cache.reset(0)  # nor reset
    with pytest.raises(ValueError, match="branch"):
        runner.release(0)  # (and the slot stays started: a refused release leaked it until stop 52)
    assert runner.started[0] and runner.score_batch([]) == []
    with pytest.raises(ValueError, match="below its fork"):
        runner.rollback(4, slot=2)  # a branch below its fork would write where it reads its parent's
    assert runner.seq_length(0) == 8
    runner.rollback(3, slot=0)  # back to prompt[:5]: the branch's outcome happened
    runner.adopt(0, 2)
    assert runner.seq_length(0) == 7 and runner.seq_length(2) == 0 and not runner.started[2]
    assert torch.allclose(runner.score([4], slot=0), alone.score([4]), atol=1e-5)


def test_what_a_freed_slot_held_cannot_reach_its_next_sequence():
    """A pass attends to a span rounded up past a sequence's length, weighting the positions past
    it by 0, and 0 times NaN is NaN: a request whose K/V overflowed (NaN written: it fails alone,
    for its non-finite logits) left them in its slot, and until stop 52 the next sequence there got
    non-finite logits too. Freed, a slot (or a branch's own positions) holds zeros again."""
    model = tiny_model("llama", 64, seed=3)
    runner, fresh = ModelRunner(model, slots=3), ModelRunner(model)
    fresh.prefill([5, 6, 7, 8, 9])
    want = fresh.score([4])
    runner.prefill(list(range(1, 13)), slot=0)
    runner.fork(2, 0, 12)
    runner.score([3, 4, 5], slot=2)
    cache = runner.fast.cache
    with torch.inference_mode():  # an overflow: its K/V non-finite, in the slot and in its branch
        for buffer in (*cache.k, *cache.v):
            buffer[0, :, 8:12] = float("nan")
            buffer[2, :, 12:15] = float("inf")
    runner.release(2)
    runner.release(0)
    runner.prefill([5, 6, 7, 8, 9], slot=0)
    assert torch.allclose(runner.score([4], slot=0), want, atol=1e-5)
    runner.prefill([5, 6, 7, 8, 9], slot=2)
    assert torch.allclose(runner.score([4], slot=2), want, atol=1e-5)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_moving_a_sequence_to_another_slot_keeps_its_numbers(arch):
    """move: the engine keeps its running sequences in slots 0..b-1; a moved sequence continues
    exactly as it would have in its old slot (the lean forward's cache and the HF path)."""
    model = tiny_model(arch, 64, seed=4)
    runner = ModelRunner(model, slots=3)
    # longer than the lean cache's first capacity (256): its buffers are regrown inside a pass, as
    # in serving, and are then inference tensors (a move outside inference mode failed on them)
    prompt = [(5 + 7 * i) % 64 for i in range(300)]
    runner.prefill(prompt, slot=2)
    runner.score([11, 12], slot=2)
    runner.rollback(1, slot=2)
    alone = ModelRunner(model)
    alone.prefill(prompt + [11])
    with pytest.raises(ValueError):
        runner.move(1, 0)  # nothing in slot 1
    runner.move(2, 0)
    assert runner.seq_length(0) == 301 and runner.seq_length(2) == 0 and not runner.started[2]
    assert torch.allclose(runner.score([3, 4], slot=0), alone.score([3, 4]), atol=1e-5)
    runner.prefill([1, 2], slot=1)
    with pytest.raises(ValueError):
        runner.move(0, 1)  # slot 1 is in use


def test_adopting_a_branch_works_once_the_cache_has_grown():
    """The cache's buffers regrown inside a pass are inference tensors; adopting a branch writes
    them (it failed outside inference mode for sequences past the first capacity of 256)."""
    model = tiny_model("llama", 64, seed=5)
    runner = ModelRunner(model, slots=2)
    prompt = [(3 + 5 * i) % 64 for i in range(300)]
    runner.prefill(prompt, slot=0)
    runner.fork(1, 0, 299)
    runner.score([7, 8], slot=1)
    runner.rollback(1, slot=0)
    runner.adopt(0, 1)
    alone = ModelRunner(model)
    alone.prefill(prompt[:299] + [7, 8])
    assert runner.seq_length(0) == 301
    assert torch.allclose(runner.score([9], slot=0), alone.score([9]), atol=1e-5)


def test_packed_bfloat16_products_give_the_same_bits_whatever_the_width():
    """On a CPU that multiplies bf16 in hardware (AMX or AVX512-BF16), a bfloat16 FastLlama multiplies by prepacked weights, and a position scores the same bits in a 1-, 2-, 5- (next
    to another sequence) or 9-wide pass, so a verify pass agrees exactly with plain decoding.
    Elsewhere (and for float32 weights) nothing is packed."""
    from specserve.core.fast_llama import FastLlama, cpu_has_bf16_gemm, packed_bf16
    from specserve.config import DEFAULT_MODEL_DIR
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(DEFAULT_MODEL_DIR / "target"), dtype=torch.bfloat16)
    assert packed_bf16([model.lm_head.weight.float()]) is None
    fast = FastLlama(model, slots=2)
    if not cpu_has_bf16_gemm():
        assert fast.packed is None
        pytest.skip("this CPU has no bf16 GEMM in hardware (AMX or AVX512-BF16): nothing is packed")
    assert fast.packed is not None and fast.gemm is None
    g = torch.Generator().manual_seed(0)
    prompt, cont = None, None

    def scored(width: int, packed: bool) -> torch.Tensor:
        saved = fast.packed
        fast.packed = saved if packed else None
        try:
            fast.cache.reset(0), fast.cache.reset(1)
            fast.forward([prompt], [0]), fast.forward([prompt[:50]], [1])
            outs = [fast.forward([cont[i:i + width], prompt[50:51]], [0, 1])[0] if width == 5
                    else fast.forward([cont[i:i + width]], [0])[0] for i in range(0, len(cont), width)]
        finally:
            fast.packed = saved
        return torch.cat(outs)

    linear = torch.ops.mkldnn._linear_pointwise
    for w in fast._weights():  # the packed product: F.linear's bits
        x = torch.randn(5, w.shape[1], generator=g).bfloat16()
        assert torch.equal(linear(x, fast.packed[id(w)], None, "none", [], ""), torch.nn.functional.linear(x, w))
    for n in (70, 125, 160):  # continuations crossing the attended length's 64-buckets
        prompt, cont = torch.randint(1, 8000, (n,), generator=g).tolist(), torch.randint(1, 8000, (9,), generator=g).tolist()
        one = scored(1, packed=True)
        assert torch.allclose(one, scored(1, packed=False), atol=0.25)  # F.linear and SDPA: close, not the same bits
        for width in (2, 5, 9):
            assert torch.equal(one, scored(width, packed=True)), f"prompt {n}, width {width}: different bits"


def test_packed_bfloat16_positions_keep_their_bits_in_long_and_batched_passes():
    """The same bits as decoded alone, in a wider pass and beside a longer sequence (whose span the
    pass takes), past the attention's chunk of keys (KEY_CHUNK) and across it. Until stop 62 a
    one-position pass took oneDNN's one-row kernel, and a long sum over keys was split as the span
    decided: a position at 1300 keys scored in a 2- or 5-wide pass, and one at 900 beside a
    sequence of 1400, came out with other bits, and greedy speculative output of long batched
    requests parted from plain decoding (a user trial)."""
    from specserve.core.fast_llama import KEY_CHUNK, FastLlama, cpu_has_bf16_gemm
    from specserve.config import DEFAULT_MODEL_DIR
    import transformers

    if not cpu_has_bf16_gemm():
        pytest.skip("this CPU has no bf16 GEMM in hardware (AMX or AVX512-BF16): nothing is packed")
    model = transformers.AutoModelForCausalLM.from_pretrained(str(DEFAULT_MODEL_DIR / "target"), dtype=torch.bfloat16)
    fast = FastLlama(model, slots=2)
    assert fast.packed is not None and KEY_CHUNK < 1300
    g = torch.Generator().manual_seed(0)
    # (100 beside 300: alone, one unpadded product over 128 keys; beside, the first of two padded chunks)
    for n, beside in ((1300, 0), (900, 1400), (KEY_CHUNK - 6, KEY_CHUNK + 44), (100, 300)):
        prompt, cont = torch.randint(1, 8000, (n,), generator=g).tolist(), torch.randint(1, 8000, (10,), generator=g).tolist()
        other = torch.randint(1, 8000, (beside + 10,), generator=g).tolist()

        def scored(width: int) -> torch.Tensor:
            fast.cache.reset(0), fast.cache.reset(1)
            fast.forward([prompt], [0])
            if beside:
                fast.forward([other[:beside]], [1])
            outs = [fast.forward([cont[i:i + width]] + ([other[beside + i:beside + i + width]] if beside else []),
                                 [0, 1] if beside else [0])[0] for i in range(0, len(cont), width)]
            return torch.cat(outs)

        fast.cache.reset(1)
        fast.cache.reset(0)
        fast.forward([prompt], [0])
        alone = torch.cat([fast.forward([[t]], [0])[0] for t in cont])
        for width in (1, 2, 5):
            assert torch.equal(alone, scored(width)), f"{n} keys beside {beside}, width {width}: different bits"


@pytest.mark.parametrize("key_chunk", [256, 16])
def test_the_packed_paths_attention_equals_sdpa_within_rounding(key_chunk, monkeypatch):
    """`FastLlama._attend_same_bits` (the prepacked bfloat16 path's attention, callable on any
    CPU) against SDPA, on a tiny grouped-query Llama in float32: batched ragged rows, gathered
    (out of order) slots, and a branch row reading its parent's prefix; its keys summed in one
    product, and (KEY_CHUNK 16) in chunks, the last padded."""
    from specserve.core import fast_llama
    from specserve.core.fast_llama import FastLlama
    monkeypatch.setattr(fast_llama, "KEY_CHUNK", key_chunk)
    model = tiny_model("llama", 64, seed=6, hidden=64)  # 4 query heads over 2 key/value heads
    seqs = [torch.randint(0, 64, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (90, 7, 40)]
    outs = {}
    for exact in (False, True):
        fast = FastLlama(model, slots=4)
        fast.exact_attention = exact
        for slot, s in zip((2, 0, 1), seqs):
            fast.forward([s[:-3]], [slot])
        got = fast.forward([s[-3:] for s in seqs], [2, 0, 1])
        fast.cache.fork(3, 2, 60)  # slot 3 branches off slot 2 after 60 positions
        got += fast.forward([seqs[0][60:64], seqs[1][-1:]], [3, 0])
        outs[exact] = got
    for a, b in zip(outs[False], outs[True]):
        assert torch.allclose(a, b, atol=1e-4)


def test_a_half_precision_plan_measures_nothing(tmp_path, monkeypatch):
    """GemmPlan times layouts for float32 weights only: float16 (and bfloat16 where it is not
    prepacked) takes F.linear for every bucket, and nothing goes into the plan's store (timing them
    took 70 s at the demo pair's first float16 load on the reference CPU)."""
    from specserve.core.fast_llama import ROW_BUCKETS, GemmPlan

    monkeypatch.setattr(GemmPlan, "_plans", {})  # none shared from earlier tests' models of this shape
    store = tmp_path / "plan.json"
    ws = [torch.randn(96, 48, dtype=dtype) for dtype in (torch.float16, torch.bfloat16)]
    plan = GemmPlan(ws, str(store))
    assert plan.plan == {((96, 48), rows): "linear" for rows in ROW_BUCKETS}
    assert not store.exists() and not plan.transposed and not plan.packed
    GemmPlan([torch.randn(96, 48)], str(store))  # float32: measured, and kept
    keys = list(json.loads(store.read_text()))
    assert keys and all("float32" in key for key in keys)


def test_every_gemm_layout_scores_what_hugging_face_scores():
    """Eager float32 on a CPU, the lean forward multiplies each weight in the layout its GemmPlan
    measured fastest for that many rows: F.linear, a transposed copy, (w @ x.T).T, or oneDNN over
    a packed copy. Each, used for every product, scores the logits HF's own forward does, batched
    beside another sequence too; and a packed product's row is the same bits whatever the number
    of rows in the call."""
    from specserve.core.fast_llama import FastLlama, GemmPlan, _pack, _packed_product

    model = tiny_model("llama", 64, seed=0)
    g = torch.Generator().manual_seed(3)
    seqs = [torch.randint(0, 64, (n,), generator=g).tolist() for n in (40, 23)]
    want = [full_logits(model, s) for s in seqs]
    fast = FastLlama(model, slots=2)
    assert fast.gemm is not None  # float32: planned, not prepacked
    assert set(fast.gemm.plan.values()) <= set(GemmPlan.LAYOUTS)
    if not torch.backends.mkldnn.is_available():
        pytest.skip("no oneDNN in this torch build: the packed layout is not offered")
    for layout in GemmPlan.LAYOUTS:
        fast.gemm, fast._gemm_tables = GemmPlan(fast._weights(), layouts=(layout,)), {}
        for s in (0, 1):
            fast.cache.reset(s)
        first = fast.forward([seqs[0][:30], seqs[1][:20]], [0, 1])  # prefill, ragged
        nxt = fast.forward([seqs[0][30:35], seqs[1][20:21]], [0, 1])  # a 5-wide row beside a 1-wide one
        last = fast.forward([seqs[0][35:36]], [0])
        assert torch.allclose(torch.cat([first[0], nxt[0], last[0]]), want[0][:36], atol=1e-4), layout
        assert torch.allclose(torch.cat([first[1], nxt[1]]), want[1][:21], atol=1e-4), layout
    with pytest.raises(ValueError, match="layouts must be some of"):
        GemmPlan(fast._weights(), layouts=("fastest",))
    w = model.lm_head.weight
    x = torch.randn(9, w.shape[1], generator=g)
    packed = _pack(w)
    assert torch.allclose(_packed_product(x, packed), torch.nn.functional.linear(x, w), atol=1e-5)
    assert all(torch.equal(_packed_product(x[:n], packed), _packed_product(x, packed)[:n]) for n in (1, 2, 5))


def test_weights_are_checked_as_transformers_picks_them(tiny_pair_dir, tmp_path):
    """check_weights reads the headers of the safetensors files transformers would load: the file
    config.json's transformers_weights names, where it names one; else model.safetensors where
    there is one (a stale shard index beside it, left by a re-save, and other safetensors files
    are not its), else the shards its index names."""
    import shutil

    from specserve.core.runner import ModelLoadError, check_weights
    folder = tmp_path / "drafter"
    shutil.copytree(tiny_pair_dir["drafter"], folder)

    def refused(match: str) -> None:
        with pytest.raises(ModelLoadError, match=match):
            check_weights(str(folder))

    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"x": "gone.safetensors"}}))
    (folder / "adapter.safetensors").write_bytes(b"not safetensors")
    check_weights(str(folder))  # loads: transformers takes model.safetensors
    weights = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(weights[:-8])
    refused("'model.safetensors' in .* do not load")
    (folder / "model.safetensors").write_bytes(weights)
    (folder / "model.safetensors").rename(folder / "part-1.safetensors")  # sharded: the index names its shards
    index = {"metadata": {}, "weight_map": {"x": "part-1.safetensors"}}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": index["weight_map"]}))
    refused("has no 'metadata' object")  # (a KeyError in transformers)
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    check_weights(str(folder))
    (folder / "part-1.safetensors").write_bytes(weights[:-8])
    refused("'part-1.safetensors' in .* do not load")
    (folder / "part-1.safetensors").unlink()
    refused("lacks 1 of the 1 weight shards")
    (folder / "model.safetensors.index.json").unlink()  # weights, but none under a name transformers loads
    (folder / "weights.safetensors").write_bytes(weights)
    refused("no weights under a name transformers loads .* it has adapter.safetensors, weights.safetensors$")
    config = json.loads((folder / "config.json").read_text())  # unless config.json names them (transformers 5)
    (folder / "config.json").write_text(json.dumps({**config, "transformers_weights": "weights.safetensors"}))
    check_weights(str(folder))
    (folder / "weights.safetensors").write_bytes(weights[:-8])
    refused("'weights.safetensors' in .* do not load")
    (folder / "weights.safetensors").unlink()
    refused("lacks 'weights.safetensors', the weights its config.json names")
    (folder / "adapter.safetensors").unlink()
    (folder / "sub").mkdir()  # (a file under a subfolder, or an index there naming shards from the folder's root)
    (folder / "sub" / "w.safetensors").write_bytes(weights)
    (folder / "sub" / "index.safetensors.index.json").write_text(json.dumps({"metadata": {},
                                                                             "weight_map": {"x": "sub/w.safetensors"}}))
    for named in ("sub/w.safetensors", "sub/index.safetensors.index.json"):
        (folder / "config.json").write_text(json.dumps({**config, "transformers_weights": named}))
        check_weights(str(folder))
    for named, fault in (("weights.bin", "is neither safetensors"), ("", "is not a file name"),
                         ("../w.safetensors", "is outside the model folder")):
        (folder / "config.json").write_text(json.dumps({**config, "transformers_weights": named}))
        refused(f"transformers_weights '{re.escape(named)}' {fault}")
