"""Pipelined drafting: the drafter works on round r+1 while the target verifies round r.

Right after answering round r with drafts d_1..d_k, the drafter guesses the outcome of the
verification and drafts round r+1 as if that outcome had been committed. Two policies:

- "all-accepted" (default): the outcome is d_1..d_k plus a bonus token g, the drafter's own
  most likely token after d_k.
- "most-likely": the more frequent of two outcomes, "all accepted, bonus = g" and "d_1
  rejected, the target writing the drafter's runner-up token instead", by the rates this drafter
  has observed: (share of rounds with all k accepted) x (accuracy of g) against (share of rounds
  with d_1 rejected) x (accuracy of the runner-up). Acceptances come in runs, so these shares
  are measured, not derived from the per-token acceptance rate.

- Hit: the verifier then reports exactly the guessed tokens as committed. The prepared draft is
  returned at once; round r+1's drafting was hidden behind round r's verification.
- Miss: the guess is discarded: the committed tokens are reset and the KV cache rolls back to
  the longest prefix that agrees with what was really committed, then round r+1 is drafted.

The speculation cache (fan-out F > 1): besides that outcome, the drafter prepares the F - 1
likeliest others. An outcome is an accepted length a and the token the target writes at a:
for a < k, the drafter's runner-up to d_{a+1}; for a = k, its next likeliest bonus tokens. Each
is ranked by this round's P(exactly a accepted) times the drafter's probability of the token
(for a < k, the runner-up's share of what d_{a+1} leaves). P(a) comes from each draft's chance
of acceptance given the drafter's probability of it, learnt from the verifier's answers
(`AcceptanceCalibration`). Until stop 41 P(a) was the share of past rounds with a accepted, the
same for every round: free preparation of F outcomes would then have hit 0.65, 0.70 and 0.77 of
greedy rounds at F = 4, 8 and 16, against 0.67, 0.75 and 0.82 now (F <= 3 about alike; 40
held-out prompts, `benchmarks/diagnostics/hit_ceiling.py`, docs/benchmarks/hit_ceiling.md).
Outcomes are prepared in the order of that rank while branch slots are free (the pool is shared
by all sequences, so at large batches only the likeliest few get one).

Branches share the committed prefix: the main outcome drafts in the sequence's own slot, as
without fan-out; every other outcome drafts in a branch slot forked from it at the outcome's
first new position (`DraftModelProposer.branch`, `kv_cache.SlotKVCache.fork`). A branch row
attends to the sequence's slot below the fork (committed tokens plus d_1..d_a, all already
there) and writes only its own tokens, so nothing is copied per branch per round. All outcomes
of all sequences draft in the same batched passes (one feed of each outcome's first token, then
one pass per drafted position). When the verifier reports the outcome, the matching entry is
returned at once; a branch that matched is adopted (its at most k + 1 new positions are copied
into the sequence's slot), every other one is freed. A miss drafts on demand, as before.

The prepared draft uses the sequence's last k and confidence threshold. It serves a request for
the same threshold and at most that k (cut to k: a shorter draft is a prefix of a longer one);
anything else is a miss. A k = 0 call (only catching up) is never served from a prepared draft.

Output is unchanged by this: a sampled draft's random stream is derived from the committed
length (see specserve.core.sampling.request_generator), and the drafter feeds one token per pass, so a prepared
draft (on the sequence's slot or on a branch) equals the one that would have been drafted on
demand, bit for bit where a position's numbers do not depend on the pass's rows (the packed
bfloat16 CPU path); elsewhere (a float32 drafter's GEMMs on a CPU, cuBLAS on a GPU) up to float
rounding, which can, rarely, flip a drawn token. The verifier gets the q each draft was drawn
from, so the sampled distribution stays exact either way (core.runner.resolve_dtype).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from specserve.config import PIPELINE_POLICIES as POLICIES
from specserve.core.proposer import Draft, ProposeItem, Proposer
from specserve.core.sampling import SamplingParams
from specserve.drafter.draft_model import DraftModelProposer, Interrupted


class AcceptanceCalibration:
    """P(the verifier accepts a draft | the drafter's probability x of it), from the verifier's
    answers: decayed counts of accepted and judged drafts in BINS bins of x, a Beta(1, 1) prior
    in each (so 0.5 before any answer)."""

    BINS = 10
    DECAY = 0.995  # per judged draft in the bin: recent answers count more

    def __init__(self):
        self.accepted = [0.0] * self.BINS
        self.judged = [0.0] * self.BINS

    def _bin(self, x: float) -> int:
        return min(max(int(x * self.BINS), 0), self.BINS - 1)

    def chance(self, x: float) -> float:
        b = self._bin(x)
        return (self.accepted[b] + 1) / (self.judged[b] + 2)

    def observe(self, confidences: list[float], accepted: int) -> None:
        """A round's answer: the drafts before position `accepted` were accepted, the one there
        (if any) rejected; those after it were not judged."""
        for i, x in enumerate(confidences[:accepted + 1]):
            b = self._bin(x)
            self.accepted[b] = self.DECAY * self.accepted[b] + (i < accepted)
            self.judged[b] = self.DECAY * self.judged[b] + 1

    def accepted_distribution(self, confidences: list[float]) -> list[float]:
        """P(exactly a of these drafts accepted), a = 0..len(confidences)."""
        out, run = [], 1.0
        for x in confidences:
            c = self.chance(x)
            out.append(run * (1 - c))
            run *= c
        return out + [run]


@dataclass
class _Prepared:
    base: int  # committed length before the assumed tokens
    assumed: list[int]
    draft: Draft
    k: int  # asked for (the draft may be shorter: cut by confidence)
    min_confidence: float
    confidence: list[tuple[float, int, float]]  # the draft's, see DraftModelProposer
    branch: object = None  # the drafter's branch holding it; None: the sequence's own slot


class PipelinedProposer(Proposer):
    def __init__(self, inner: DraftModelProposer, policy: str = POLICIES[0], fanout: int = 1):
        """fanout: outcomes prepared per sequence (1: the main one only); more need the inner
        proposer's branch slots (see DraftModelProposer), and put the all-accepted outcome on
        the sequence's own slot whatever the policy (the others' branches read it)."""
        if policy not in POLICIES:
            raise ValueError(f"unknown pipelining policy {policy!r}; one of {POLICIES}")
        if not isinstance(fanout, int) or fanout < 1:
            raise ValueError(f"fanout must be an integer >= 1, got {fanout!r}")
        self.policy = policy
        self.fanout = fanout
        self.calibration = AcceptanceCalibration()  # ranks the outcomes of fan-out
        self.speculated = 0  # sequence-rounds prepared
        self.prepared = 0  # outcomes prepared in them
        self.inner = inner
        self.max_length = inner.max_length
        self.vocab_size = inner.vocab_size
        self.last: dict[str, Draft] = {}  # the draft most recently returned, per sequence
        self.last_ask: dict[str, tuple[int, float]] = {}  # its (k, min_confidence)
        self.last_conf: dict[str, list[tuple[float, int, float]]] = {}
        # what the verifier did with past drafts, for "most-likely": rounds seen, rounds with all
        # drafts accepted / with the first rejected, and how often g / the runner-up was right
        self.rounds = self.all_accepted = self.first_rejected = 0
        self.guess_right = self.guesses = self.runner_up_right = 0
        self.guessed: dict[str, int] = {}  # the bonus guess g made for a sequence's last draft
        self.ready: dict[str, list[_Prepared]] = {}  # the main outcome first
        # while `speculate` drafts: the outcomes it prepares, per sequence; `interrupt` stops it
        # between passes (the drafter server sets it when a Propose arrives that none will serve)
        self.preparing: dict[str, list[list[int]]] = {}
        self.interrupt = threading.Event()
        self.interrupted = 0
        self.hits = 0
        self.misses = 0

    def start(self, seq_id: str, prompt_ids: list[int], params: SamplingParams) -> None:
        self.inner.start(seq_id, prompt_ids, params)

    def start_many(self, items) -> None:
        self.inner.start_many(items)

    def propose(self, items: list[ProposeItem]) -> list[Draft]:
        out: list[Draft | None] = [None] * len(items)
        todo = []
        for i, item in enumerate(items):
            self._observe(item)
            entries = self.ready.pop(item.seq_id, [])
            match = next((p for p in entries if p.assumed == item.new_tokens and 0 < item.k <= p.k
                          and p.min_confidence == item.min_confidence), None)
            for p in entries:
                if p.branch is not None and p is not match:
                    self.inner.drop_branch(p.branch)
            if match is not None:
                self.hits += 1
                if match.branch is not None:
                    self.inner.adopt(item.seq_id, match.branch)
                d = match.draft
                out[i] = Draft(d.tokens[:item.k], d.probs[:item.k] if d.probs is not None else None,
                               pipeline_hit=True, prepared=len(entries))
                self.last_conf[item.seq_id] = match.confidence
                continue
            if entries:
                self.misses += item.k > 0
                self.inner.uncommit(item.seq_id, entries[0].base)  # propose() rolls the cache back
            todo.append((i, len(entries)))
        if todo:
            for (i, n), draft in zip(todo, self.inner.propose([items[i] for i, _ in todo])):
                draft.prepared = n
                out[i] = draft
                self.last_conf[items[i].seq_id] = list(self.inner.confidence(items[i].seq_id))
        for item, draft in zip(items, out):
            self.last[item.seq_id] = draft
            self.last_ask[item.seq_id] = (item.k, item.min_confidence)
        return out

    def base_length(self, seq_id: str) -> int:
        """The sequence's committed tokens, without the outcome a preparation assumed (whose
        tokens a Propose's new_tokens carry again)."""
        ready = self.ready.get(seq_id)
        return ready[0].base if ready else self.inner.committed_length(seq_id)

    def served_by_preparation(self, seq_id: str, new_tokens: list[int], k: int, min_confidence: float = 0.0) -> bool:
        """Whether a call for this sequence would be served by what is prepared or being
        prepared now (called from another thread, without the lock: a hint). A preparation drafts
        the k and min_confidence of the sequence's last call: one that asks more k, or another
        min_confidence, drafts on demand (until stop 49 it waited for the preparation first)."""
        if k == 0:
            return True
        ready = self.ready.get(seq_id)
        outcomes = [p.assumed for p in ready] if ready else self.preparing.get(seq_id, [])
        asked = self.last_ask.get(seq_id)
        return new_tokens in outcomes and asked is not None and k <= asked[0] and min_confidence == asked[1]

    def _observe(self, item: ProposeItem) -> None:
        """Learn from the verifier's answer to this sequence's last draft."""
        last = self.last.get(item.seq_id)
        if last is None or not last.tokens or not item.new_tokens:
            return
        k = len(last.tokens)
        n = 0
        while n < k and n < len(item.new_tokens) - 1 and item.new_tokens[n] == last.tokens[n]:
            n += 1
        # the verifier writes the drafted token at n only when it cut the draft there (its policy
        # asked fewer drafts than were sent early): a rejection never writes it, greedy or sampled
        # ((p - q)+ is 0 at a rejected token). Greedy, that token is the target's own choice, so d_n
        # counts as accepted; sampled, d_n and on were never judged. (A cut whose token differs
        # reads as a rejection at n: greedy it is one; sampled it may not be, and nothing tells.)
        judged, accepted = k, n
        if n < k and item.new_tokens[n] == last.tokens[n]:
            seq = self.inner.seqs.get(item.seq_id)
            judged = accepted = n + 1 if seq is not None and seq.params.greedy else n
        self.rounds += 1
        conf = self.last_conf.get(item.seq_id) or []
        self.calibration.observe([c[0] for c in conf[:judged]], accepted)
        guess = self.guessed.pop(item.seq_id, None)
        if n == k:
            self.all_accepted += 1
            if guess is not None:
                self.guesses += 1
                self.guess_right += item.new_tokens[k] == guess
        elif n == 0:
            self.first_rejected += 1
            self.runner_up_right += bool(conf) and item.new_tokens[0] == conf[0][1]

    def speculate(self, seq_ids: list[str]) -> None:
        """Prepare the next round of these sequences (same k as their last) for the likeliest
        outcomes of their verification: the main one, and with fan-out the F - 1 next on branches.
        Runs between rounds, as one batch."""
        ids = [s for s in seq_ids if s in self.inner.seqs and s not in self.ready and self.last.get(s)
               and self.last[s].tokens
               and self.inner.committed_length(s) + len(self.last[s].tokens) + self.last_ask[s][0] + 1
               <= self.max_length]
        if not ids:
            return
        bases = {s: self.inner.committed_length(s) for s in ids}
        assumed = {s: self._likeliest_rejection(s) for s in ids} \
            if self.policy == "most-likely" and self.fanout == 1 else {}
        full = [s for s in ids if assumed.get(s) is None]
        bonus: dict[str, tuple[list[int], list[float]]] = {}
        branches: list[tuple[str, list[int], object]] = []
        try:
            if full:
                lasts = [self.last[s].tokens for s in full]
                tokens, probs = self.inner.guess_bonus(full, lasts, top=self.fanout)
                for s, d, t, p in zip(full, lasts, tokens, probs):
                    assumed[s] = d + [t[0]]
                    self.guessed[s] = t[0]
                    bonus[s] = t, p
            if self.fanout > 1:
                self._branch(ids, bonus, branches)
            seqs = [self.inner.seqs[s] for s in ids] + [b for _, _, b in branches]
            asks = [ProposeItem(s, assumed[s], *self.last_ask[s]) for s in ids] + \
                [ProposeItem(s, out[-1:], *self.last_ask[s]) for s, out, _ in branches]
            self.preparing = {s: [assumed[s]] for s in ids}
            for s, out, _ in branches:
                self.preparing[s].append(out)
            drafts = self.inner.propose_seqs(seqs, asks, stop=self.interrupt.is_set)
        except BaseException as e:  # Interrupted: the verifier is back with an outcome nobody prepares, it
            for s in ids:  # goes first; anything else (out of memory, ...): undone too (each slot agrees with
                self.inner.uncommit(s, bases[s])  # its cached tokens: DraftModelProposer.resync), and raised
                self.guessed.pop(s, None)  # (the server logs it)
            for _, _, b in branches:
                self.inner.drop_branch(b)
            if not isinstance(e, Interrupted):
                raise
            self.interrupted += 1
            return
        finally:
            self.preparing = {}
        for s, d in zip(ids, drafts):
            self.ready[s] = [_Prepared(bases[s], assumed[s], d, *self.last_ask[s], list(self.inner.confidence(s)))]
        for (s, out, b), d in zip(branches, drafts[len(ids):]):
            self.ready[s].append(_Prepared(bases[s], out, d, *self.last_ask[s], list(b.confidence), branch=b))
        self.speculated += len(ids)
        self.prepared += len(ids) + len(branches)

    def _branch(self, ids: list[str], bonus: dict, out: list[tuple[str, list[int], object]]) -> None:
        """Branches for the likeliest outcomes past the main one, as many per sequence as the
        fan-out allows and the branch slots last, likeliest first over all sequences, appended to
        `out` as they are taken (so a failure leaves the caller those to drop):
        (sequence, the outcome's committed tokens, its branch)."""
        candidates = []  # (rank, sequence, outcome)
        for s in ids:
            d, conf = self.last[s].tokens, self.last_conf.get(s) or []
            conf = conf[:len(d)]  # (a draft cut by confidence or k has drafted past its end)
            p = self.calibration.accepted_distribution([c[0] for c in conf])
            tokens, probs = bonus.get(s, ([], []))
            candidates += [(p[-1] * q, s, d + [t]) for t, q in zip(tokens[1:], probs[1:])]
            candidates += [(p[a] * qalt / max(1.0 - qx, 1e-6), s, d[:a] + [alt])
                           for a, (qx, alt, qalt) in enumerate(conf)]
        candidates.sort(key=lambda c: -c[0])
        per_seq = dict.fromkeys(ids, 1)
        for _, s, outcome in candidates:
            if per_seq[s] >= self.fanout:
                continue
            b = self.inner.branch(s, outcome)
            if b is None:
                break  # no branch slot left
            out.append((s, outcome, b))
            per_seq[s] += 1

    def _likeliest_rejection(self, seq_id: str) -> list[int] | None:
        """The committed tokens of the outcome "d_1 rejected, runner-up written" when it has been
        the more frequent bet, else None (bet on "all accepted")."""
        conf = self.last_conf.get(seq_id)
        p_all = (self.all_accepted + 1) / (self.rounds + 2) * (self.guess_right + 1) / (self.guesses + 2)
        p_rej = (self.first_rejected + 1) / (self.rounds + 2) * (self.runner_up_right + 1) / (self.first_rejected + 2)
        if not conf or p_rej <= p_all:
            return None
        return [conf[0][1]]

    def release(self, seq_id: str) -> None:
        for p in self.ready.get(seq_id, []):
            if p.branch is not None:
                self.inner.drop_branch(p.branch)
        self.inner.release(seq_id)
        self.last.pop(seq_id, None)
        self.last_ask.pop(seq_id, None)
        self.last_conf.pop(seq_id, None)
        self.guessed.pop(seq_id, None)
        self.ready.pop(seq_id, None)
