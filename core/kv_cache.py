"""The KV caches, and their O(1) rollback. Position-indexed, as in gpt-fast: a preallocated
buffer per layer and a length per sequence. Appending writes at [length, length + n); rolling back
n rejected draft positions only moves the length back: nothing is recomputed or copied, whatever
the sequence length. Buffers double when full, up to the model's context (amortised O(1) per
token); a compiled forward sees the capacity as a dynamic size, so growth does not recompile.

- `SlotKVCache`: the lean Llama forward's cache (`fast_llama`), K and V
  [slots + 1, kv_heads, capacity + 1, head_dim] per layer and a length per slot, so one batched pass
  serves several sequences (continuous batching). The extra row is a scratch slot: a batch padded
  to a fixed shape writes its padding there, so padding never touches a live sequence.
  A slot can be a branch of another (`fork`): it attends to the parent's positions below the
  fork and holds only what it writes from there on, so several continuations of one prefix
  (the drafter's prepared outcomes) share the prefix's K/V without a copy; `adopt` moves a
  branch's own positions into its parent when that continuation is the one that happened.
- `PositionLayer`: the same idea as a Hugging Face cache layer, for architectures that run
  through HF's own modules (one `Cache` per slot). Unlike HF's StaticCache, attention runs over
  the valid prefix only (a view of the buffer), so it costs what DynamicCache costs.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicLayer


class SlotKVCache:
    """Per layer, K and V buffers [slots + 1, kv_heads, capacity + 1, head_dim] (the last row is the
    scratch slot); per slot, a length."""

    def __init__(self, num_layers: int, slots: int, kv_heads: int, head_dim: int, max_length: int,
                 like: torch.Tensor, capacity: int = 256):
        self.slots, self.kv_heads, self.head_dim, self.max_length = slots, kv_heads, head_dim, max_length
        self._like = like  # buffers take its dtype and device
        self.lengths = [0] * slots
        self.written = [0] * slots  # per slot: its row holds what was written below this (see reset)
        self.parents: dict[int, tuple[int, int]] = {}  # branch slot -> (parent slot, fork position)
        self.k = [self._buffer(capacity) for _ in range(num_layers)]
        self.v = [self._buffer(capacity) for _ in range(num_layers)]

    def _buffer(self, capacity: int) -> torch.Tensor:
        """A buffer of `capacity` positions plus one never attended, made in inference mode. Both
        keep a compiled pass's graphs (until stop 51 the first sequence past 192 positions
        compiled every graph again, and hit dynamo's recompile limit, then ran eagerly):
        - a pass attends to a prefix of the buffer (its span), and a span as long as the whole
          buffer is a view of another layout, which compiles another graph;
        - a graph guards on its inputs' kind, and the buffers a pass grows (in inference mode)
          were inference tensors where the first ones were not."""
        with torch.inference_mode():
            return self._like.new_zeros(self.slots + 1, self.kv_heads, capacity + 1, self.head_dim)

    @property
    def scratch(self) -> int:
        """The row that padding writes to."""
        return self.slots

    @property
    def capacity(self) -> int:
        return self.k[0].shape[2] - 1

    def ensure_capacity(self, needed: int) -> None:
        """Grows every buffer (doubling, up to max_length) so positions [0, needed) fit."""
        capacity = self.capacity
        if needed <= capacity:
            return
        capacity = min(max(needed, 2 * capacity), self.max_length)
        for buffers in (self.k, self.v):
            for i, old in enumerate(buffers):
                new = self._buffer(capacity)
                new[:, :, : old.shape[2]] = old
                buffers[i] = new

    def _keep_forks(self, slot: int, length: int) -> None:
        """The fork rule: a slot keeps every position a live branch of it reads (length: what it
        would keep; -1: none, as a reset)."""
        if any(p == slot and at > length for p, at in self.parents.values()):
            raise ValueError(f"cannot take slot {slot} back to {max(length, 0)}: a branch forked from it lives")

    def wrote(self, slot: int, end: int) -> None:
        """A pass (or a copy) wrote the slot's row below `end`."""
        self.written[slot] = max(self.written[slot], end)

    def reset(self, slot: int = 0) -> None:
        """Frees a slot, and zeroes what its row holds. A pass attends to a span of the buffer
        rounded up past the sequence's length, weighting the positions past it by 0, and 0 times
        a non-finite value is not 0: until stop 52 a request whose K/V overflowed (failed alone, for
        its non-finite logits) left them in its slot, and failed the next requests there too."""
        self._keep_forks(slot, -1)
        low = self.parents.pop(slot, (slot, 0))[1]  # (a branch wrote from its fork on)
        if self.written[slot] > low:
            with torch.inference_mode():  # (the buffers are inference tensors)
                torch._foreach_zero_([b[slot, :, low:self.written[slot]] for b in (*self.k, *self.v)])
        self.lengths[slot] = self.written[slot] = 0

    def fork(self, slot: int, parent: int, at: int) -> None:
        """Makes `slot` a branch of `parent` at position `at`: it reads the parent's positions
        below `at` and writes its own from `at` on. Nothing is copied; the parent must not
        change its positions below `at` while the branch lives."""
        if not 0 <= at <= self.lengths[parent] or parent in self.parents or slot == parent:
            raise ValueError(f"cannot fork slot {slot} from slot {parent} at {at}")
        self.lengths[slot] = at
        self.parents[slot] = (parent, at)

    def adopt(self, parent: int, slot: int) -> None:
        """The parent takes over a branch: the branch's own positions [fork, its length) are copied
        into the parent (only the tokens written since the fork), the parent's length becomes the
        branch's, and the branch slot is free."""
        owner, at = self.parents[slot]
        if owner != parent:
            raise ValueError(f"slot {slot} is not a branch of slot {parent}")
        end = self.lengths[slot]
        for buffers in (self.k, self.v):
            for buf in buffers:
                buf[parent, :, at:end] = buf[slot, :, at:end]
        self.lengths[parent] = end
        self.wrote(parent, end)
        self.reset(slot)

    def move(self, src: int, dst: int) -> None:
        """Moves a sequence from slot `src` to the free slot `dst` (its positions are copied once),
        so the engine can keep its running sequences in slots 0..b-1, which attention reads as a
        view instead of gathering every slot's K/V in every pass. Branches cannot move."""
        if self.lengths[dst] or dst in self.parents or src in self.parents or src == dst \
                or any(p == src for p, _ in self.parents.values()):
            raise ValueError(f"cannot move slot {src} to slot {dst}")
        end = self.lengths[src]
        for buffers in (self.k, self.v):
            for buf in buffers:
                buf[dst, :, :end] = buf[src, :, :end]
        self.lengths[dst] = end
        self.wrote(dst, end)
        self.reset(src)

    def rollback(self, n: int, slot: int = 0) -> None:
        """Forgets the last n positions of a slot: only its length moves. Not below a live
        branch's fork (`fork`'s rule; until stop 50 unchecked here and in `reset`, and the branch
        then read positions its parent would write again)."""
        length = self.lengths[slot] - n
        self._keep_forks(slot, length)
        if slot in self.parents and length < self.parents[slot][1]:  # (below it, it reads its parent's)
            raise ValueError(f"cannot take branch slot {slot} back to {length}, below its fork")
        self.lengths[slot] = length


class PositionLayer(DynamicLayer):
    """One layer's K/V: a preallocated buffer [batch, heads, capacity, head_dim] and a length."""

    initial_capacity = 256

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self.length = 0
        self._k = key_states.new_zeros(self._shape(key_states, self.initial_capacity))
        self._v = value_states.new_zeros(self._shape(value_states, self.initial_capacity))
        self.is_initialized = True

    @staticmethod
    def _shape(states: torch.Tensor, capacity: int) -> tuple[int, ...]:
        return (*states.shape[:-2], capacity, states.shape[-1])

    def _grow(self, needed: int) -> None:
        capacity = max(needed, 2 * self._k.shape[-2])
        for name in ("_k", "_v"):
            old = getattr(self, name)
            new = old.new_zeros(self._shape(old, capacity))
            new[..., : self.length, :] = old[..., : self.length, :]
            setattr(self, name, new)

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        end = self.length + key_states.shape[-2]
        if end > self._k.shape[-2]:
            self._grow(end)
        self._k[..., self.length : end, :] = key_states
        self._v[..., self.length : end, :] = value_states
        self._set_length(end)
        return self.keys, self.values

    def _set_length(self, length: int) -> None:
        self.length = length
        self.keys = self._k[..., :length, :]
        self.values = self._v[..., :length, :]

    def get_seq_length(self) -> int:
        return self.length if self.is_initialized else 0

    def crop(self, tokens_to_remove: int) -> None:
        """HF convention (transformers 5.x): a negative count of tokens to remove."""
        if tokens_to_remove > 0:
            raise ValueError("crop takes a negative number: the count of tokens to remove")
        if self.is_initialized and tokens_to_remove:
            self._set_length(self.length + tokens_to_remove)
