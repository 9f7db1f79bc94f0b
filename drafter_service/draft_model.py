"""The draft-model proposer: a small causal LM drafts k tokens per sequence, q = warp(logits).

It holds one KV-cache slot per live sequence in a `ModelRunner`. On each call it is told which
tokens were committed since its last call, rolls its cache back to the longest prefix that agrees
with them, feeds the rest and drafts; all sequences of a call advance together (one batched
drafter pass per drafted position). A draft stops early before a position whose top q is below
the item's `min_confidence` (`confidence_cut`); k = 0 only takes in the committed tokens.

Branches (for pipelining's prepared outcomes, `specserve.drafter.pipeline`): `branch` starts a
continuation of a sequence in one of `branch_slots` spare slots, forked from the sequence's slot
(`ModelRunner.fork`: it reads the shared prefix there, without a copy); `propose_seqs` drafts for
sequences and branches in the same batched passes; `adopt` makes a branch the sequence's state
(its few new positions are copied into the sequence's slot), `drop_branch` frees it.

A draft vocabulary (the runner's `vocab`, `specserve.core.draft_vocab`): a pass whose rows are all
greedy multiplies by those rows of the drafter's head only, so its drafts are the drafter's
likeliest tokens among them. Greedy output never depends on the drafts (only how many are
accepted does). A pass with a sampled row scores every token: q, and so sampled output, is exactly
what it is without a draft vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from specserve.core.device import to_device
from specserve.core.proposer import MAX_K, CapacityError, Draft, ProposeItem, Proposer, common_prefix_len, confidence_cut
from specserve.core.runner import ModelRunner
from specserve.core.sampling import SamplingParams, draw, request_generator, warp


@dataclass
class _Seq:
    slot: int
    params: SamplingParams
    tokens: list[int]  # committed tokens
    cached: list[int] = field(default_factory=list)  # tokens in the slot's KV cache (committed prefix + drafts)
    # per drafted position of the last draft: (drafter prob. of the draft, runner-up token, its prob.)
    confidence: list[tuple[float, int, float]] = field(default_factory=list)


def _step_info(q: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For rows q [r, V] and their drawn tokens x [r]: (x, [r, 5] of token, q(token), runner-up,
    q(runner-up), largest q), on the device."""
    top = torch.topk(q.float(), 2, -1)
    alt = torch.where(top.indices[:, 0] == x, top.indices[:, 1], top.indices[:, 0])
    picked = q.gather(-1, torch.stack([x, alt], -1)).double()  # (q(x), q(alt)); q[x] would read x
    return x, torch.stack([x.double(), picked[:, 0], alt.double(), picked[:, 1], top.values[:, 0].double()], -1)


class Interrupted(Exception):
    """Drafting was stopped between passes (`stop`): the slots hold only what `cached` says."""


class DraftModelProposer(Proposer):
    """Drafts with a small causal LM; q = warp(drafter logits) with each request's settings."""

    def __init__(self, runner: ModelRunner, q_dtype: torch.dtype | None = None, branch_slots: int = 0):
        """q_dtype: the dtype q is sent in (a remote drafter); drafts are sampled from q in that
        dtype, so the verifier receives exactly the distribution each draft was drawn from.
        branch_slots: the runner's last slots kept for branches (none on the HF path)."""
        self.runner = runner
        self.q_dtype = q_dtype
        self.max_length = runner.max_length
        self.vocab_size = runner.vocab_size
        self.seqs: dict[str, _Seq] = {}
        branch_slots = min(branch_slots, runner.slots - 1) if runner.branches else 0
        self.free = list(range(runner.slots - branch_slots - 1, -1, -1))
        self.branch_free = list(range(runner.slots - 1, runner.slots - branch_slots - 1, -1))

    def start(self, seq_id: str, prompt_ids: list[int], params: SamplingParams) -> None:
        self.start_many([(seq_id, prompt_ids, params)])

    def start_many(self, items: list[tuple[str, list[int], SamplingParams]]) -> None:
        """Checks every item first (all or none start), then one batched prefill."""
        ids = [seq_id for seq_id, _, _ in items]
        for seq_id, _, params in items:
            if params.seed is None:
                raise ValueError("the proposer needs a fixed seed (SamplingParams.with_seed())")
            if seq_id in self.seqs or ids.count(seq_id) > 1:
                raise ValueError(f"sequence {seq_id!r} already started")
        if len(items) > len(self.free):
            raise CapacityError(f"all {self.runner.slots} drafter slots are in use")
        seqs = []
        for seq_id, prompt_ids, params in items:
            slot = min(self.free)  # the lowest free slot (see fast_llama: slots 0..b-1 are a view)
            self.free.remove(slot)
            seqs.append(_Seq(slot, params, list(prompt_ids), list(prompt_ids[:-1])))
        try:
            self.runner.prefill_batch([(seq.slot, seq.cached) for seq in seqs], vocab=True)  # its logits are not read
        except BaseException:  # none started: their slots go back
            for seq in seqs:
                self.runner.release(seq.slot)
                self.free.append(seq.slot)
            raise
        self.seqs.update(zip(ids, seqs))

    def release(self, seq_id: str) -> None:
        seq = self.seqs.pop(seq_id, None)
        if seq is not None:
            self.runner.release(seq.slot)
            self.free.append(seq.slot)

    def propose(self, items: list[ProposeItem]) -> list[Draft]:
        return self.propose_seqs([self.seqs[item.seq_id] for item in items], items)

    def propose_seqs(self, seqs: list[_Seq], items: list[ProposeItem], stop=None) -> list[Draft]:
        """`propose` for sequences and branches (items[i] for seqs[i]; its seq_id is not read).
        stop: checked before each drafting pass; when it returns True, the drafted positions are
        rolled back (each slot holds its `cached` tokens) and Interrupted is raised."""
        try:
            if not any(item.k for item in items):  # catch-up only: take the tokens in, no logits wanted
                self._catch_up([(seq, item.new_tokens) for seq, item in zip(seqs, items)], want_logits=False)
                for seq in seqs:
                    seq.confidence = []
                return [Draft([], None) for _ in items]
            logits = self._catch_up([(seq, item.new_tokens) for seq, item in zip(seqs, items)])
            return self._draft(seqs, logits, [item.k for item in items], [item.min_confidence for item in items], stop)
        except BaseException as e:  # Interrupted, or a pass that failed (out of memory, ...)
            self.resync(seqs, torn=not isinstance(e, Interrupted))
            raise

    def resync(self, seqs: list[_Seq], torn: bool = True) -> None:
        """After a pass that did not finish: each slot and its `cached` agree again, on the positions
        both hold. `cached` names its tokens before they are fed, and drafted positions are
        named only once the drafting loop ends, while a slot counts a position once its pass
        succeeded; a position the two disagreed on was fed anew or not at all, and until stop 49
        that offset stayed for the sequence's life (its drafts came from a shifted context).
        torn: a pass failed part way. The lean forward counts a pass's positions only once it
        succeeded, but the HF path's layers may then hold different lengths: its slots start
        over (their tokens are fed again on the next call)."""
        for seq in seqs:
            if torn and self.runner.fast is None:
                self.runner.prefill_batch([(seq.slot, [])])
                seq.cached.clear()
                continue
            n = min(len(seq.cached), self.runner.seq_length(seq.slot))
            self.runner.rollback(self.runner.seq_length(seq.slot) - n, slot=seq.slot)
            del seq.cached[n:]

    # ---------------------------------------------------------------- branches
    def branch(self, seq_id: str, assumed: list[int]) -> _Seq | None:
        """A branch for the outcome "`assumed` committed next": it shares the sequence's cached
        positions up to the last assumed token (which must be cached there already, right after
        the committed tokens) and holds the rest itself. Feed it [assumed[-1]] through
        `propose_seqs`. None when no branch slot is free (or the prefix is not cached)."""
        seq = self.seqs[seq_id]
        prefix = seq.tokens + assumed[:-1]
        if not self.branch_free or common_prefix_len(seq.cached, prefix) < len(prefix):
            return None
        slot = self.branch_free.pop()
        try:
            self.runner.fork(slot, seq.slot, len(prefix))
        except BaseException:
            self.branch_free.append(slot)
            raise
        return _Seq(slot, seq.params, list(prefix), list(prefix))

    def adopt(self, seq_id: str, branch: _Seq) -> None:
        """The branch's outcome happened: the sequence takes over its state (the branch's new
        positions move into the sequence's slot) and the branch slot is freed."""
        seq = self.seqs[seq_id]
        self.runner.adopt(seq.slot, branch.slot)
        self.branch_free.append(branch.slot)
        seq.tokens, seq.cached, seq.confidence = branch.tokens, branch.cached, branch.confidence

    def drop_branch(self, branch: _Seq) -> None:
        self.runner.release(branch.slot)
        self.branch_free.append(branch.slot)

    def _catch_up(self, updates: list[tuple[_Seq, list[int]]], want_logits: bool = True) -> list[torch.Tensor]:
        """Commit new tokens, roll each cache back to what agrees with them, feed the rest.
        Returns each sequence's logits after its last committed token. want_logits=False (nothing is
        drafted): the last committed token is left unfed, as after Start, so a call that brings
        nothing new runs no pass."""
        todo = []
        for seq, new_tokens in updates:
            committed_before = len(seq.tokens)
            seq.tokens.extend(new_tokens)
            # keep what agrees with the committed tokens; at least one token is fed, for its logits
            keep = min(common_prefix_len(seq.cached, seq.tokens, start=min(committed_before, len(seq.cached))),
                       len(seq.tokens) - 1)
            self.runner.rollback(len(seq.cached) - keep, slot=seq.slot)
            todo.append(seq.tokens[keep:] if want_logits else seq.tokens[keep:-1])
            seq.cached = seq.tokens[:keep] + todo[-1]
        if not want_logits:  # only sequences with something to feed
            fed = [i for i, t in enumerate(todo) if t]
            updates, todo = [updates[i] for i in fed], [todo[i] for i in fed]
        # Sampled requests: one token per forward, so a cache holds the same numbers whichever path
        # led to it (on demand or pipelined), up to the rounding of a pass's row count where products
        # depend on it (see specserve.drafter.pipeline): q, and so sampled output, does not depend on timing.
        # Greedy output never depends on the drafter's numbers, so greedy sequences feed all at
        # once; so do longer catch-ups (after rounds without drafting), which no pipelined path mirrors.
        logits: list[torch.Tensor | None] = [None] * len(updates)
        at_once = [i for i, ((seq, _), t) in enumerate(zip(updates, todo))
                   if seq.params.greedy or len(t) > self.ONE_BY_ONE]
        if at_once:
            out = self.runner.score_batch([(updates[i][0].slot, todo[i]) for i in at_once], last_only=True,
                                          vocab=not want_logits or self._greedy([updates[i][0] for i in at_once]))
            for i, row in zip(at_once, out):
                logits[i] = row[-1]
        stepwise = [i for i in range(len(updates)) if logits[i] is None]
        for step in range(max((len(todo[i]) for i in stepwise), default=0)):
            live = [i for i in stepwise if step < len(todo[i])]
            out = self.runner.score_batch([(updates[i][0].slot, [todo[i][step]]) for i in live], last_only=True,
                                          vocab=not want_logits)
            for i, row in zip(live, out):
                logits[i] = row[-1]
        return logits

    ONE_BY_ONE = MAX_K + 1  # the most tokens a round commits

    @staticmethod
    def _greedy(seqs: list[_Seq]) -> bool:
        """Whether a pass of these rows may use the draft vocabulary: every row greedy."""
        return all(seq.params.greedy for seq in seqs)

    def _draft(self, seqs: list[_Seq], logits: list[torch.Tensor], ks: list[int],
               min_confidence: list[float] | None = None, stop=None) -> list[Draft]:
        """k_i tokens per sequence, one batched pass per position (`_draft_on_device`); drafts
        and confidences then come to the host in one transfer, and each draft is cut at its
        first position below min_confidence."""
        qs, steps = self._draft_on_device(seqs, logits, ks, stop)
        drafts: list[list[int]] = [[] for _ in seqs]
        tops: list[list[float]] = [[] for _ in seqs]
        for seq in seqs:
            seq.confidence = []
        if steps:
            host = torch.cat([info for _, info in steps]).tolist()  # the round's one transfer
            at = 0
            for step, (live, _) in enumerate(steps):
                for i in live:
                    x, qx, alt, qalt, top = host[at]
                    at += 1
                    drafts[i].append(int(x))
                    tops[i].append(top)
                    seqs[i].confidence.append((qx, int(alt), qalt))
                    if step < ks[i] - 1:
                        seqs[i].cached.append(int(x))
        cuts = [confidence_cut(t, c) for t, c in zip(tops, min_confidence or [0.0] * len(seqs))]
        return [Draft(d[:n], torch.stack(q[:n]) if q[:n] else None) for d, q, n in zip(drafts, qs, cuts)]

    def _draft_on_device(self, seqs: list[_Seq], logits: list[torch.Tensor], ks: list[int], stop=None):
        """The drafting loop, all on the drafter's device: drafted tokens are fed back from there.
        Greedy rows are handled together, a few tensor ops per step for the whole batch (per row,
        they cost 0.07-0.09 ms a step on the reference CPU, benchmarks/diagnostics/drafter_pass.py: at 8
        sequences a fifth of a round);
        sampled rows one by one (each its own warp and random stream). Returns (q rows per
        sequence, per step (live rows, [rows, 5] of token, q(token), runner-up, q(runner-up),
        largest q))."""
        device = self.runner.device
        generators = [None if seq.params.greedy else
                      request_generator(seq.params.seed, "draft", len(seq.tokens), device) for seq in seqs]
        qs: list[list[torch.Tensor]] = [[] for _ in seqs]
        steps: list[tuple[list[int], torch.Tensor]] = []  # (rows, [rows, 5]: see above)
        rows_logits = torch.stack(logits)  # [n, V]: each sequence's logits for its next position
        for step in range(max(ks, default=0)):
            live = [i for i, k in enumerate(ks) if step < k]
            greedy = [i for i in live if seqs[i].params.greedy]
            sampled = [i for i in live if not seqs[i].params.greedy]
            parts = []  # (tokens [r], info [r, 5]) per group of rows, in the order of `order` below
            if greedy:  # q only as the drafter's confidence, for pipelining
                # (in_vocab: a pass with sampled rows scores greedy rows on the whole head too, and their drafts
                # and confidences then left the draft vocabulary: a prepared draft was not what drafting alone gives)
                q = torch.softmax(self.runner.in_vocab(rows_logits if len(greedy) == len(seqs) else
                                                       rows_logits.index_select(0, to_device(greedy, device))), -1)
                parts.append(_step_info(q, q.argmax(-1)))
            for i in sampled:
                q = warp(rows_logits[i], seqs[i].params)
                if self.q_dtype is not None:
                    q = q.to(self.q_dtype)  # sampled from exactly what is sent
                qs[i].append(q)
                parts.append(_step_info(q[None], draw(q, generators[i])[None]))
            order = greedy + sampled
            xs, info = (torch.cat(t) if len(parts) > 1 else t[0] for t in zip(*parts))
            if order != live:  # back to the order of `live`
                where = to_device([order.index(i) for i in live], device)
                xs, info = xs.index_select(0, where), info.index_select(0, where)
            steps.append((live, info))
            feed = [j for j, i in enumerate(live) if step < ks[i] - 1]
            if feed and stop is not None and stop():
                raise Interrupted
            if feed:
                fed = [live[j] for j in feed]
                ids = xs if len(feed) == len(live) else xs.index_select(0, to_device(feed, device))
                out = self.runner.score_ids(ids[:, None], [seqs[i].slot for i in fed],
                                            vocab=self._greedy([seqs[i] for i in fed]))
                rows_logits = out if fed == list(range(len(seqs))) else \
                    rows_logits.index_copy(0, to_device(fed, device), out)
        return qs, steps

    def confidence(self, seq_id: str) -> list[tuple[float, int, float]]:
        return self.seqs[seq_id].confidence

    def guess_bonus(self, seq_ids: list[str], last_drafts: list[list[int]], top: int = 1) \
            -> tuple[list[list[int]], list[list[float]]]:
        """Feed each sequence's last drafted token (one batched pass) and return the drafter's
        `top` likeliest tokens after it, and their probabilities: its guesses of the target's
        bonus token if every draft is accepted. A draft cut short by confidence holds drafted
        tokens past its end: they are rolled back."""
        seqs = [self.seqs[s] for s in seq_ids]
        for seq, d in zip(seqs, last_drafts):
            keep = len(seq.tokens) + len(d) - 1  # committed + d_1 .. d_{n-1}, all in the cache
            self.runner.rollback(len(seq.cached) - keep, slot=seq.slot)
            seq.cached = seq.cached[:keep] + [d[-1]]
        try:
            out = self.runner.score_batch([(seq.slot, [d[-1]]) for seq, d in zip(seqs, last_drafts)], last_only=True,
                                          vocab=self._greedy(seqs))
        except BaseException:
            self.resync(seqs)
            raise
        logits = torch.cat(out)
        best = torch.softmax(logits, -1).topk(min(top, logits.shape[-1]), -1)
        top = best.indices.shape[-1]
        both = torch.cat([best.indices.double(), best.values.double()], -1).tolist()  # one transfer
        return [[int(t) for t in row[:top]] for row in both], [row[top:] for row in both]

    def uncommit(self, seq_id: str, length: int) -> None:
        """Forget committed tokens past `length` (an assumed commit that did not happen); the cache
        is rolled back on the next propose."""
        del self.seqs[seq_id].tokens[length:]

    def committed_length(self, seq_id: str) -> int:
        return len(self.seqs[seq_id].tokens)
