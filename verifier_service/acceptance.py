"""The acceptance rule of speculative decoding. This is the one place it is written.

Given k drafted tokens x_1..x_k, the drafter's distributions q_1..q_k they were drawn from and
the target's distributions p_1..p_{k+1} at the same positions (all warped by the same
`specserve.core.sampling.warp`):

- x_i is kept with probability min(1, p_i(x_i) / q_i(x_i)), scanning left to right;
- at the first rejection, the token written instead is drawn from normalise((p_i - q_i)+);
- if all k are kept, a bonus token is drawn from p_{k+1}.

The emitted tokens are then distributed exactly as if drawn from p one at a time (Leviathan et
al. 2023, Chen et al. 2023). Under greedy decoding p is the one-hot argmax, so the rule keeps a
draft while it equals the target's argmax and writes the argmax at the first mismatch, and no
random number is drawn: a draw happens only where the outcome is genuinely uncertain.
"""

from __future__ import annotations

from typing import Sequence

import torch

from specserve.core.sampling import sample


def accept(
    draft_tokens: Sequence[int],
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    generator: torch.Generator | None = None,
) -> tuple[int, int]:
    """Returns (num_accepted, next_token).

    draft_tokens: k token ids. draft_probs: [k, V] distributions the drafts were sampled from,
    or None for a drafter that proposes deterministically (q is then one-hot at each draft).
    target_probs: [k + 1, V]. next_token is the correction at the first rejection, or the
    bonus token when all k are kept.
    """
    k = len(draft_tokens)
    if target_probs.dim() != 2 or target_probs.shape[0] != k + 1:
        raise ValueError(f"target_probs must have k + 1 = {k + 1} rows, got shape {tuple(target_probs.shape)}")
    if draft_probs is not None and tuple(draft_probs.shape) != (k, target_probs.shape[1]):
        raise ValueError(f"draft_probs must have shape {(k, target_probs.shape[1])}, got {tuple(draft_probs.shape)}")

    for i, x in enumerate(draft_tokens):
        p = target_probs[i].double()
        if draft_probs is None:
            q = torch.zeros_like(p)
            q[x] = 1.0
        else:
            q = draft_probs[i].double()
            q = q / q.sum()  # exactly what the draft was sampled from (q may come rounded to the wire dtype)
        px, qx = float(p[x]), float(q[x])
        if px >= qx:  # ratio >= 1 (covers q(x) = 0 < p(x), and p == q): always kept
            continue
        if px > 0.0 and float(torch.rand((), dtype=torch.float64, device=p.device, generator=generator)) < px / qx:
            continue
        residual = torch.clamp(p - q, min=0.0)
        if float(residual.sum()) <= 0.0:  # only reachable through rounding: p and q agree
            residual = p
        return i, sample(residual / residual.sum(), generator)
    return k, sample(target_probs[k].double(), generator)
