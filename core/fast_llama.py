"""A lean forward pass for Llama-architecture checkpoints, with a slot-indexed KV cache.

Hugging Face's modules cost about a millisecond of Python per layer and call on a CPU, which is
most of a small drafter's time. This module runs the same weights (shared with the HF model, no
copy) through a handful of tensor ops per layer, in the style of gpt-fast. The ModelRunner uses it
for `LlamaForCausalLM` checkpoints it can represent exactly (plain RoPE, SiLU MLP) and falls back
to HF otherwise; the tests compare it with HF's own `generate`.

KV cache: a `kv_cache.SlotKVCache`. Writing appends at [length, length + n); rollback moves the
length back. Attention reads only [0, max length in the batch) with a mask, so cost follows the
live lengths, not the capacity.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specserve.core.kv_cache import SlotKVCache


def supports(model) -> bool:
    cfg = model.config
    rope = getattr(cfg, "rope_parameters", None) or {}
    rope_type = rope.get("rope_type", "default") if isinstance(rope, dict) else "default"
    return (cfg.model_type == "llama" and rope_type == "default" and getattr(cfg, "hidden_act", "silu") == "silu"
            and not getattr(cfg, "attention_bias", False) and not getattr(cfg, "mlp_bias", False)
            and getattr(cfg, "pretraining_tp", 1) == 1)


class FastLlama:
    def __init__(self, model, slots: int = 1, capacity: int = 256):
        cfg = model.config
        self.cfg = cfg
        inner = model.model
        self.embed = inner.embed_tokens.weight
        self.layers = inner.layers
        self.norm_w, self.eps = inner.norm.weight, inner.norm.variance_epsilon
        self.lm_head = model.lm_head.weight
        self.heads = cfg.num_attention_heads
        self.kv_heads = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.heads
        self.max_length = cfg.max_position_embeddings
        rope = getattr(cfg, "rope_parameters", None) or {}
        theta = rope.get("rope_theta", getattr(cfg, "rope_theta", 10000.0)) if isinstance(rope, dict) else 10000.0
        inv_freq = 1.0 / (theta ** (torch.arange(0, self.head_dim, 2, dtype=torch.int64).float() / self.head_dim))
        freqs = torch.outer(torch.arange(self.max_length, dtype=torch.float32), inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)
        # computed once in float32 on the host, then kept on the model's device in its dtype
        self.cos, self.sin = (t.to(device=self.embed.device, dtype=self.embed.dtype) for t in (emb.cos(), emb.sin()))
        self.slots = slots
        self.cache = SlotKVCache(len(self.layers), slots, self.kv_heads, self.head_dim, self.max_length,
                                 like=self.embed, capacity=capacity)

    # ---------------------------------------------------------------- forward
    def _rms(self, x, w, eps):
        dtype = x.dtype
        x = x.float()
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)).to(dtype)

    @staticmethod
    def _rotate(x, cos, sin):
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin

    @torch.inference_mode()
    def forward(self, tokens: list[list[int]], slots: list[int], last_only: bool = False) -> list[torch.Tensor]:
        """Appends tokens[i] to slot slots[i] (ragged lengths allowed) in ONE batched pass.
        Returns, per sequence, logits [len(tokens[i]), V] (or [1, V] with last_only)."""
        n = [len(t) for t in tokens]
        b, t = len(tokens), max(n)
        lengths = self.cache.lengths
        starts = [lengths[s] for s in slots]
        end = max(s0 + m for s0, m in zip(starts, n))
        if end > self.max_length:
            raise ValueError(f"sequence would exceed the context of {self.max_length} tokens")
        self.cache.ensure_capacity(end)
        # Every tensor of the pass is made on the model's device (host lists go over in one copy
        # each; nothing comes back to the host until the logits).
        dev = self.embed.device
        ids = torch.tensor([seq + [0] * (t - len(seq)) for seq in tokens], device=dev)
        pos = torch.tensor(starts, device=dev)[:, None] + torch.arange(t, device=dev)[None, :]  # [b, t]
        pos_c = pos.clamp(max=self.max_length - 1)
        cos, sin = self.cos[pos_c][:, None], self.sin[pos_c][:, None]  # [b, 1, t, d]
        # key j of slot i is visible to query q (at position pos[i, q]) when j <= pos[i, q]
        mask = (torch.arange(end, device=dev)[None, None, :] <= pos[:, :, None])[:, None]  # [b, 1, t, end]
        single = b == 1 and slots[0] == 0 and self.slots == 1
        slot_idx = torch.tensor(slots, device=dev)
        # New K/V go to (slot, position) for the real tokens only: one indexed write per layer, and
        # padding (ragged batches) is never written, so it cannot reach past the buffer. The
        # indices come from host lists (no boolean mask: that would be a device->host sync).
        real = [(i, j) for i, m in enumerate(n) for j in range(m)]
        rows = torch.tensor([i * t + j for i, j in real], device=dev)  # into the flattened [b * t]
        write_slot = torch.tensor([slots[i] for i, _ in real], device=dev)
        write_pos = torch.tensor([starts[i] + j for i, j in real], device=dev)
        x = F.embedding(ids, self.embed)
        for li, layer in enumerate(self.layers):
            attn = layer.self_attn
            h = self._rms(x, layer.input_layernorm.weight, layer.input_layernorm.variance_epsilon)
            q = F.linear(h, attn.q_proj.weight).view(b, t, self.heads, self.head_dim).transpose(1, 2)
            k = F.linear(h, attn.k_proj.weight).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
            v = F.linear(h, attn.v_proj.weight).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
            q, k = self._rotate(q, cos, sin), self._rotate(k, cos, sin)
            kb, vb = self.cache.k[li], self.cache.v[li]
            if single:
                s0 = starts[0]
                kb[0, :, s0:s0 + t] = k[0]
                vb[0, :, s0:s0 + t] = v[0]
                keys, values = kb[:1, :, :end], vb[:1, :, :end]
                o = F.scaled_dot_product_attention(q, keys, values, is_causal=False,
                                                   attn_mask=None if t == 1 else mask,
                                                   enable_gqa=self.kv_heads != self.heads)
            else:
                kb[write_slot, :, write_pos] = k.transpose(1, 2).reshape(b * t, self.kv_heads, self.head_dim)[rows]
                vb[write_slot, :, write_pos] = v.transpose(1, 2).reshape(b * t, self.kv_heads, self.head_dim)[rows]
                keys, values = kb[slot_idx, :, :end], vb[slot_idx, :, :end]
                o = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask,
                                                   enable_gqa=self.kv_heads != self.heads)
            x = x + F.linear(o.transpose(1, 2).reshape(b, t, -1), attn.o_proj.weight)
            mlp = layer.mlp
            h = self._rms(x, layer.post_attention_layernorm.weight, layer.post_attention_layernorm.variance_epsilon)
            x = x + F.linear(F.silu(F.linear(h, mlp.gate_proj.weight)) * F.linear(h, mlp.up_proj.weight),
                             mlp.down_proj.weight)
        x = self._rms(x, self.norm_w, self.eps)
        for s, m in zip(slots, n):
            lengths[s] += m
        if last_only:
            x = torch.stack([x[i, m - 1] for i, m in enumerate(n)])[:, None]
            return [row.float() for row in F.linear(x, self.lm_head)]
        logits = F.linear(x, self.lm_head).float()
        return [logits[i, :m] for i, m in enumerate(n)]
