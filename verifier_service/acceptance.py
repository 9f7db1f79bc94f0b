"""The acceptance rule of speculative decoding. This is the one place it is written.

Given k drafted tokens x_1..x_k, the drafter's distributions q_1..q_k they were drawn from and
the target's distributions p_1..p_{k+1} at the same positions (all warped by the same
`specserve.core.sampling.warp`):

- x_i is kept with probability min(1, p_i(x_i) / q_i(x_i)), scanning left to right;
- at the first rejection, the token written instead is drawn from normalise((p_i - q_i)+);
- if all k are kept, a bonus token is drawn from p_{k+1}.

The emitted tokens are then distributed exactly as if drawn from p one at a time (Leviathan et
al. 2023, Chen et al. 2023). Under greedy decoding p is the one-hot argmax, so the rule keeps a
draft while it equals the target's argmax and writes the argmax at the first mismatch.

Greedy requests take a shortcut with the same outcome (`accept_greedy`): from the target's
logits, only each position's argmax (and whether its largest logit is finite) crosses to the host,
and the comparison with the drafts runs there; nothing of vocabulary size is built (the general
rule on one-hot distributions cost 3.4 ms per round of 32 plain sequences on the reference CPU,
the shortcut 0.23).

`accept_batch` applies the rule to every sequence of a round at once, on the device of the
target's distributions (as vLLM's rejection sampler): the kept prefix is a cumulative product
of the per-position tests, and the written token is an exponential race (argmax of w / E with
E ~ Exp(1), which picks i with probability w_i / sum(w)) over the residual, or over p_{k+1}
where a row kept everything. Random numbers come from each request's own generator (greedy
requests pass None and draw nothing). The only device -> host transfer is the result: one
small tensor per round.
"""

from __future__ import annotations

from typing import Sequence

import torch

from specserve.core.device import to_device
from specserve.core.sampling import no_zero


def greedy_on_device(target_logits: Sequence[torch.Tensor]) -> torch.Tensor:
    """[2, N] long tensor on the logits' device, N = all rows of all sequences: each position's
    argmax (the token greedy decoding writes there; max and `warp`'s argmax both take the first
    of equal maxima) and whether its largest logit is finite (NaN or +inf anywhere makes it not;
    -inf entries, tokens a model rules out, do not). Reads nothing back to the host."""
    best = [lg.max(-1) for lg in target_logits]
    values = torch.cat([b.values for b in best])
    return torch.stack([torch.cat([b.indices for b in best]), torch.isfinite(values).long()])


def accept_greedy(draft_tokens: Sequence[Sequence[int]],
                  target_logits: Sequence[torch.Tensor]) -> list[tuple[int, int] | None]:
    """The rule for greedy requests, from the target's logits ([k_b + 1, V] per sequence): a draft
    is kept while it equals the target's argmax, and the argmax is written at the first mismatch
    (or as the bonus after k kept drafts): what `accept_batch` gives on the one-hot distributions
    of `warp`, whatever the drafter's q (a greedy drafter's token has q > 0). None where a
    position's logits hold NaN or +inf (that request fails, as a sampled one does; the one-hot
    distributions hid them). One transfer to the host per round."""
    if not draft_tokens:
        return []
    for d, lg in zip(draft_tokens, target_logits, strict=True):
        if lg.dim() != 2 or lg.shape[0] != len(d) + 1:
            raise ValueError(f"target_logits must have k + 1 = {len(d) + 1} rows, got shape {tuple(lg.shape)}")
    argmax, finite = greedy_on_device(target_logits).tolist()
    out, at = [], 0
    for drafts in draft_tokens:
        k = len(drafts)
        best = argmax[at:at + k + 1]
        if not all(finite[at:at + k + 1]):
            out.append(None)
        else:
            a = next((i for i in range(k) if drafts[i] != best[i]), k)
            out.append((a, best[a]))
        at += k + 1
    return out


def accept_batch(
    draft_tokens: Sequence[Sequence[int]],
    draft_probs: Sequence[torch.Tensor | None],
    target_probs: Sequence[torch.Tensor],
    generators: Sequence[torch.Generator | None],
) -> list[tuple[int, int] | None]:
    """One round of B sequences -> per sequence (num_accepted, next_token), or None where the
    target's numbers are not finite (that request fails; the others are unaffected; a drafter's
    non-finite q only drops its drafts). See accept_on_device
    for the arguments; this adds the round's one transfer to the host."""
    if not draft_tokens:
        return []
    out = accept_on_device(draft_tokens, draft_probs, target_probs, generators).tolist()
    return [(a, t) if ok else None for a, t, ok in zip(*out)]


def accept_on_device(
    draft_tokens: Sequence[Sequence[int]],
    draft_probs: Sequence[torch.Tensor | None],
    target_probs: Sequence[torch.Tensor],
    generators: Sequence[torch.Generator | None],
) -> torch.Tensor:
    """The rule for B sequences, on the device of target_probs: a [3, B] long tensor of
    (num_accepted, next_token, finite) per sequence. Reads nothing back to the host.

    draft_tokens[b]: k_b ids (k_b may be 0). draft_probs[b]: [k_b, V], the distributions the drafts
    were sampled from (normalised here: they may arrive rounded to the wire dtype), or None for a
    deterministic drafter (q one-hot at each draft). target_probs[b]: [k_b + 1, V].
    generators[b]: the request's generator, or None for a greedy request (p one-hot: no draw).
    """
    B = len(draft_tokens)
    ks = [len(d) for d in draft_tokens]
    for b in range(B):
        p, q = target_probs[b], draft_probs[b]
        if p.dim() != 2 or p.shape[0] != ks[b] + 1:
            raise ValueError(f"target_probs must have k + 1 = {ks[b] + 1} rows, got shape {tuple(p.shape)}")
        if q is not None and tuple(q.shape) != (ks[b], p.shape[1]):
            raise ValueError(f"draft_probs must have shape {(ks[b], p.shape[1])}, got {tuple(q.shape)}")
    dev, V, K = target_probs[0].device, target_probs[0].shape[1], max(ks)
    host = [b for b in range(B) if ks[b] and draft_probs[b] is not None and draft_probs[b].device != dev] \
        if dev.type == "cuda" else []
    if len(host) > 1:  # the round's q rows from the wire: one pinned copy, not one each
        moved = torch.cat([draft_probs[b].float() for b in host]).pin_memory().to(dev, non_blocking=True)
        draft_probs = list(draft_probs)
        for b, qb in zip(host, moved.split([ks[b] for b in host])):
            draft_probs[b] = qb
    p = torch.zeros(B, K + 1, V, device=dev)
    q = torch.zeros(B, K + 1, V, device=dev)  # row k_b stays 0: the residual there is p (the bonus)
    drafts = to_device([list(d) + [0] * (K - len(d)) for d in draft_tokens], dev).view(B, K)
    for b in range(B):
        p[b, : ks[b] + 1] = target_probs[b]
        if ks[b] and draft_probs[b] is not None:
            qb = draft_probs[b].to(device=dev, dtype=torch.float32)
            q[b, : ks[b]] = qb / qb.sum(-1, keepdim=True)  # exactly what each draft was drawn from
    one_hot = [b for b in range(B) if ks[b] and draft_probs[b] is None]
    if one_hot:
        rows = to_device(one_hot, dev)
        live = torch.arange(K, device=dev)[None, :] < to_device([ks[b] for b in one_hot], dev)[:, None]
        q[rows, :K] = torch.zeros(len(one_hot), K, V, device=dev).scatter_(-1, drafts[rows][..., None],
                                                                            live[..., None].float())
    # one uniform per draft position and one exponential per vocabulary entry, per sampled request;
    # as many as its own drafts (one at least), so what a seeded request draws never depends on the
    # other requests of its batch (until stop 47: as many as the batch's longest draft)
    u = torch.zeros(B, max(K, 1), device=dev)
    race = torch.ones(B, V, device=dev)
    for b, g in enumerate(generators):
        if g is not None:
            u[b, :max(ks[b], 1)] = torch.rand(max(ks[b], 1), generator=g, device=dev)
            race[b].exponential_(generator=g)
    u = u[:, :K]
    px = p[:, :K].gather(2, drafts[..., None])[..., 0]
    qx = q[:, :K].gather(2, drafts[..., None])[..., 0]
    # keep x with probability min(1, p/q): always when p >= q (q(x) = 0 included), else when u < p/q
    kept = (px >= qx) | (u * qx < px)
    kept &= torch.arange(K, device=dev)[None, :] < to_device(ks, dev)[:, None]
    # a drafter's non-finite q (its numbers overflowed, not the target's): its drafts are dropped and the
    # token is drawn from p, as a round without drafts would; exact, since that choice depends on the
    # drafter only (until stop 52 the request failed, though the target's numbers were sound)
    q_ok = torch.isfinite(q).flatten(1).all(1)
    kept &= q_ok[:, None]
    num_accepted = kept.long().cumprod(1).sum(1)  # the longest kept prefix
    rows = torch.arange(B, device=dev)
    pa, qa = p[rows, num_accepted], torch.where(q_ok[:, None], q[rows, num_accepted], 0.0)
    residual = (pa - qa).clamp(min=0.0)
    # an all-zero residual is reachable only through rounding (p and q agree): fall back to p
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, pa)
    next_token = (residual / no_zero(race)).argmax(-1)
    finite = torch.isfinite(p).flatten(1).all(1)
    return torch.stack([num_accepted, next_token, finite.long()])


def accept(
    draft_tokens: Sequence[int],
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    generator: torch.Generator | None = None,
) -> tuple[int, int]:
    """One sequence: (num_accepted, next_token). See accept_batch; ValueError where the target's
    p is not finite."""
    (result,) = accept_batch([draft_tokens], [draft_probs], [target_probs], [generator])
    if result is None:
        raise ValueError("the target's distributions are not finite")
    return result
