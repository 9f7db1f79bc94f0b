"""The speculation policy: how many tokens each sequence drafts in each round. The one place
that decides it; the engine asks `choose` before every round and reports back with `observe_*`.

"fixed": every sequence drafts its request's k (today's behaviour, and the reproducible one).

"adaptive" (the default) maximises the batch's expected tokens per second. For a batch of b
sequences drafting k tokens each,

    rate(k) = sum_i E_i(k) / (T(b, k + 1) + D(b, k) + O(b, k > 0))

- E_i(k) = 1 + sum_{j<=k} prod_{l<=j} a_l * s_i: expected tokens of sequence i's round. a_l is
  the acceptance rate of draft position l over all sequences drafting with sequence i's proposer
  (given the earlier positions were accepted; later positions are accepted less often, so one
  rate for all would overrate long drafts; and a draft model's rates are not the n-gram's), and
  s_i scales it by sequence i's own rate against the proposer's: accepted drafts over trials
  (accepted drafts plus the round's rejection, if any), older rounds decaying, the proposer's
  rate its prior. How much that prior weighs (in trials) is learnt per proposer from how much
  the rates of its finished sequences spread beyond what chance alone gives (empirical Bayes,
  `SequenceSpread`): where sequences differ little, one rejected round of a sequence says
  little about it. Before SPREAD_MIN_SEQUENCES have finished it weighs PRIOR_TRIALS. Until
  stop 67 it weighed 4 trials always, and a fresh sequence whose first round rejected its
  first draft (14% of the demo pair's sequences) was scaled to 0.8, the model's expected
  tokens at k = 4 from 3.8 to 2.7: speculation went off for it until a probe or its end (in a scratch
  run, docs/benchmarks/README.md "Stop 67", the sequences' own estimates turned the model off in
  149 of 1,315 rounds at one sequence where the proposer's rates alone had it on, 87 of 660 at
  two; 16 of 1,235 and 7 of 635 with the first form of the learnt weight). On
  held-out and edit prompts (benchmarks/diagnostics/acceptance_spread.py) the weight that fits
  the spread came to 23 and 50 trials for the demo drafter, 8.8 and 5.5 for the n-gram proposer;
- T(b, w): one target pass of b sequences of w positions: profiled at startup on a grid of b and
  w (interpolated in between) and refined online by each round's measured pass;
- D(b, k): the proposer's time for a round. A call either finds every row's draft ready
  (pipelined drafting prepared it while the last round was verified: a "hit", costing H(b), the
  RPC and the wait for the preparation) or drafts on demand (a "miss", costing
  M(b, k) = M0(b) + k * m(b): a fixed part, the RPC and the catch-up pass, plus a part per drafted
  token). H is an online average of all-hit calls; M is fitted to miss calls per proposer and
  batch size (exponentially weighted least squares), starting from a profile of the drafter's
  miss calls at startup (`profile_drafter`: every batch size of the grid, k = 1 and the most k)
  that online calls soon outweigh, except in the slope m(b): the profile's holds it (a ridge,
  `DraftCosts`) until calls at several k say otherwise. A row's draft is ready when its last round
  accepted every draft and the drafter's guess of the bonus token was right: probability
  A_i(k) * h, A_i(k) = prod_{l<=k} a_l * s_i and h the proposer's measured hit rate after an
  all-accepted drafting round, in the round right after it (0 for a proposer that does not pipeline; PRIOR_READY, weighing one round,
  before any is measured for one that does, so a fresh server does not start at k = 0). So
  D(b, k) = P * H + (1 - P) * M(b, k), P = prod_i A_i(k) * h: hits hide drafting only at small
  batches and short k, which is where pipelining pays. Where P is below PREPARE_MIN_READY (at
  two sequences or more) the policy asks the drafter to prepare nothing for the round after
  (`ProposeItem.prepare`; D = M there): a preparation would almost never serve a whole call, and
  it is not free. It runs beside the target's pass and delays the drafter's next call. In the
  eight batching runs committed before stop 53, fixed k drafted sequentially ran at least as fast
  as pipelined at 8, 16 and 32 sequences in every run (by up to 0.17x of plain decoding) and at 4
  in five of eight (the others within 0.01x); pipelining was ahead at 1 and 2 sequences in every
  run;
- O(b, speculating): the rest of a round (bookkeeping, callbacks, catch-up calls of sequences
  that draft nothing), measured online apart for rounds with and without drafts.

What the model leaves out (thread hand-offs, contention between the two actors, estimates that
lag a change of load) is learnt too: the model's seconds for each round over the measured
seconds, per batch size with and without drafting, calibrates the model's rates (times, not
token counts: those are random per round, and acceptance has its own estimates).

One k serves the whole batch (its pass is as wide as its widest sequence); a sequence drafts
min(k, its request's k, tokens it has left). At two sequences or more, k = 0 (plain decoding) is
chosen unless speculating is predicted to gain GAIN_MARGIN (at one sequence the margin is 0), with
hysteresis per batch-size bucket (the guard's half-octaves): where the model has not decided yet,
speculation is on above 1 + margin; then it switches on above 1 + margin + HYSTERESIS and off below
1 + margin - HYSTERESIS, so it does not flap. That state is the model's own: a veto, a keep or a
trial of the guard does not change it. Until stop 66 the margin was 0 and one on/off state served
every batch size, so a load that grew from one sequence, where speculating pays, to four kept
speculating on the lower, stay-on threshold. The margin stands for part of what the model gets
wrong where sequences share a pass (the guard's trials of plain rounds, below TRIAL_MARGIN, cover
more): docs/benchmarks/README.md, "Stop 66", has the scratch runs behind it (at four sequences the
model rated speculating 1.0-1.25x plain, where fixed k ran 0.89x in its rounds of four; at one
sequence a margin turned speculation off for most of a level where fixed k ran 1.2x plain). k
itself changes only for a predicted 5% gain (a draft prepared by pipelining for the old k is then still usable). Probe rounds draft the most
k, on or off, to keep the estimates of acceptance and drafting cost current for every k: the
first after PROBE_EVERY rounds at a batch size (per power of two), the interval doubling (up to
MAX_PROBE_BACKOFF times) each time a probe leaves the decision as it was, so a load where
speculation does not pay (a wide probe round is dear there) is probed rarely. Probe rounds, and
the round after k changed (its draft was never prepared), and a round whose ask to prepare
(`PREPARE_MIN_READY`) differs from the last round's, do not calibrate the model; nor do
plain rounds within `SETTLE_ROUNDS` of a drafting round, whose pass (not measured either) runs
beside the drafter's leftover work, the drafts and the preparation that round asked for: a cost
of speculating, which charged to plain decoding made it look slower than it is and kept pulling
the policy back to speculating (plain calibrations of 0.53-0.93 at 2-31 sequences). Two such
rounds were too few: at two sequences the policy's T(2, 1) had come to 6.0 ms against 4.75 for
a plain pair's pass, and it kept drafting (mean k 2.1-3.4) where fixed k = 4 lost to plain
decoding; with eight it chose k = 0 there (mean k 0.13-0.19; docs/benchmarks/batching_ab.md); a
calibration not re-measured drifts back towards 1 (RELAX per round), so one learnt in a bad spell
(a busy machine) does not keep speculation off for good. While speculation is off (the model's
choice or the guard's veto) the drafter rests, in process or remote: it starts no sequence and is
fed no token, and is brought up to date (each sequence's committed tokens, a backlog through a
call of its own) in the round that drafts again, before it drafts, so acceptance does not suffer
(`SpeculativeEngine._resting`; until stop 67 a remote drafter was fed meanwhile, and its work beside
the plain passes slowed them). While speculation is on, a sequence that drafts nothing in a round
still feeds its drafter once CATCH_UP_TOKENS have piled up.

Over the model sits a guard (`Guard`): what each mode really wrote per second of the engine loop,
measured per batch size. Where speculating measured fewer tokens per second than plain decoding,
it vetoes speculation there for a while (and tries plain rounds where the model keeps
speculation on with a small expected gain and plain decoding is unmeasured), so a model that is wrong about a load (in stop 26's
runs it kept drafting at 4-16 sequences where every fixed-k row lost) is not wrong for long.
The other way round, where speculating measured clearly ahead of plain decoding
(GUARD_KEEP_MARGIN, GUARD_KEEP_MARGIN_ONE at one sequence), it keeps speculation on there for a
while whatever the model says.

The drafter's confidence can stop a draft early: the drafter cuts a draft before the first
position whose distribution's largest probability is below `min_confidence`
(`specserve.core.proposer.confidence_cut`; the cut depends on q at that position only, never on
the token drawn there, so sampling stays exact). MIN_CONFIDENCE is its default, chosen by
measurement on the demo pair (docs/benchmarks/adaptive.md).
"""

from __future__ import annotations

import bisect
import math
import statistics
import time
from collections import deque
from dataclasses import dataclass

POLICIES = ("adaptive", "fixed")
MIN_CONFIDENCE = 0.0  # adaptive: stop a draft before a position whose top q is below this (0: off)
HYSTERESIS = 0.05  # either side of the margin (on above 1.15x plain by the model at 2+ sequences, 1.05x at one;
# off below 1.05x, 0.95x), and the predicted gain that moves k
GAIN_MARGIN = 0.10  # at two sequences or more, speculating must be predicted this much ahead of plain decoding
DECAY = 0.9  # per round, of a sequence's acceptance counts
PRIOR_TRIALS = 16.0  # weight of its proposer's acceptance rate in a sequence's estimate, until learnt (4 until stop 67)
PRIOR_TRIALS_RANGE = (2.0, 64.0)  # the learnt weight stays within these (see SequenceSpread)
SPREAD_MIN_SEQUENCES = 16  # finished sequences of a proposer before its prior weight is learnt from them,
SPREAD_WINDOW = 64  # the last this many of them count,
SPREAD_MIN_TRIALS = 8.0  # each with at least this many trials
EMA = 0.1  # weight of a new measured pass time (and call, and round overhead)
DRAFT_EMA = 0.05  # in M(k)'s fit, each new call weighs this much (the slope needs calls at several k)
SLOPE_PRIOR_WEIGHT = 4.0  # M(k)'s slope: the startup profile's weighs as much as 4 calls one token apart
# M(k) at a batch size the profile did not time starts from the nearest timed size's, as this many
# calls: in stop 34's batching.json at 1c6af9b one call at 6 sequences (a drain) made M(6, 1..4)
# 38-43 ms, against 4-17 ms fitted at 4 and 8, and that fit stood for the rest of the run
LEVEL_PRIOR_CALLS = 2
CAL_DECAY = 0.95  # calibration: per round, of the summed model and measured seconds
# a new calibration starts at the nearest batch size's (1 before any) with this many rounds' weight (of 20
# at most: 1 / (1 - CAL_DECAY)); until stop 66 its first round set it alone, and one slow round could turn
# speculation on where it lost (docs/benchmarks/README.md, "Stop 66")
CAL_PRIOR_ROUNDS = 8.0
RELAX = 0.01  # per round, a calibration not re-measured drifts this far back towards 1
PROBE_EVERY = 32  # rounds before a batch size's first probe round (each request drafts its most k)
MAX_PROBE_BACKOFF = 4  # the probe interval doubles up to 2**4 times while probes confirm the decision
PRIOR_ACCEPTANCE = 0.7  # a draft position's acceptance before any is measured
CATCH_UP_TOKENS = 16  # a non-drafting sequence's drafter is fed once this many tokens are unsent
SETTLE_ROUNDS = 8  # plain rounds this soon after a drafting one neither calibrate nor time T(b, 1) (2 until stop 25)
PRIOR_READY = 0.5  # h of a proposer that prepares drafts (pipelines), before any is measured (weight 1)
PREPARE_MIN_READY = 0.1  # adaptive: a pipelining drafter prepares a round only if P(its every row ready) is this
PROFILE_SETTLE = 2.0  # profile_drafter of a pipelining drafter: idle 2x each call's time before the next
GUARD_DECAY = 0.99  # the guard: per round it measures at a batch size, of that mode's tokens and seconds there
GUARD_MIN_ROUNDS = 8.0  # the guard compares the two modes at a batch size once each has this much weight there,
GUARD_MIN_SEQUENCE_ROUNDS = 64.0  # and this much in sequence-rounds (a round of b sequences weighs b),
GUARD_MIN_PLAIN_ROUNDS = 32.0  # of which plain decoding (b tokens a round, not random) needs no more than this many rounds
GUARD_HOLD = 512  # rounds a veto holds (256 until stop 29) (doubling, up to 2**MAX_GUARD_BACKOFF times, each time it is confirmed)
MAX_GUARD_BACKOFF = 4
GUARD_MARGIN = 0.05  # a veto needs speculating measured below (1 - this) of plain decoding: not at a near-tie
GUARD_CLEAR_LOSS = 0.85  # speculating below this of plain decoding holds the veto GUARD_HOLD rounds; a loss between
# this and 1 - GUARD_MARGIN, which may be noise, holds it a quarter as long (see Guard)
GUARD_KEEP_MARGIN = 0.25  # speculating measured this much above plain decoding keeps it on GUARD_HOLD rounds (see Guard),
GUARD_KEEP_MARGIN_ONE = 0.10  # and this much at one sequence
TRIAL_EVERY = 256  # rounds before a trial of plain rounds at a bucket is tried again (if it measured nothing)
TRIAL_MARGIN = 1.25  # the guard tries plain decoding at a batch size where the model expects speculating to gain less


def expected_tokens(alpha: float, k: int) -> float:
    """Tokens written per round with k drafts accepted i.i.d. with rate alpha (plus the target's)."""
    return k + 1.0 if alpha >= 1 else (1 - alpha ** (k + 1)) / (1 - alpha)


@dataclass
class Acceptance:
    """A sequence's (or the engine's) discounted acceptance counts."""

    accepted: float = 0.0
    trials: float = 0.0
    total_accepted: int = 0  # the same, never decaying (a finished sequence's, for SequenceSpread)
    total_trials: int = 0

    def add(self, k: int, accepted: int, decay: float = DECAY) -> None:
        self.accepted = decay * self.accepted + accepted
        self.trials = decay * self.trials + accepted + (accepted < k)
        self.total_accepted += accepted
        self.total_trials += accepted + (accepted < k)

    def rate(self, prior: float, weight: float = PRIOR_TRIALS) -> float:
        return (self.accepted + weight * prior) / (self.trials + weight)


def prior_trials(seen) -> float:
    """The weight in trials of a beta prior that fits the spread of these sequences' rates
    ((accepted, trials) each, two or more), by the method of moments for a beta-binomial: a
    sequence's rate a_i / n_i varies by m (1 - m) / n_i by chance and by V (1 - 1 / n_i) by its
    own difference from the others (m: the mean rate, V: the variance of the sequences' true
    rates), so V = (s^2 - m (1 - m) mean(1 / n_i)) / (1 - mean(1 / n_i)), s^2 the rates' sample
    variance, and a beta prior of mean m and variance V weighs m (1 - m) / V - 1 trials. Infinite
    where the rates spread no more than chance gives."""
    rates = [a / t for a, t in seen]
    m = sum(rates) / len(rates)
    s2 = sum((r - m) ** 2 for r in rates) / (len(rates) - 1)
    inv = sum(1 / t for _, t in seen) / len(seen)
    v = (s2 - m * (1 - m) * inv) / (1 - inv) if inv < 1 else 0.0
    return m * (1 - m) / v - 1 if v > 0 else math.inf


class SequenceSpread:
    """How much a proposer's sequences differ in acceptance, from its last finished ones: the
    weight in trials of the proposer's rate as the prior of one sequence's (empirical Bayes:
    `prior_trials`, within PRIOR_TRIALS_RANGE). Sequences that differ little make it heavy (one
    unlucky round of a sequence then moves its estimate little); a mix of easy and hard ones,
    light. Before SPREAD_MIN_SEQUENCES have finished with SPREAD_MIN_TRIALS each it is
    PRIOR_TRIALS. Few sequences estimate it roughly, and the estimate, a ratio, reads heavy on
    average: about 5-10% from 64 sequences in a reviewer's simulation, more from 16."""

    def __init__(self):
        self.seen: deque[tuple[float, float]] = deque(maxlen=SPREAD_WINDOW)  # (accepted, trials) per sequence
        self.weight = PRIOR_TRIALS

    @property
    def learnt(self) -> bool:
        return len(self.seen) >= SPREAD_MIN_SEQUENCES

    def add(self, accepted: float, trials: float) -> None:
        if trials < SPREAD_MIN_TRIALS:
            return
        self.seen.append((accepted, trials))
        if self.learnt:
            lo, hi = PRIOR_TRIALS_RANGE
            self.weight = min(max(prior_trials(self.seen), lo), hi)


class PositionalAcceptance:
    """Engine-wide acceptance rate per draft position, given the earlier positions were accepted."""

    def __init__(self, decay: float = 0.99):
        self.decay = decay
        self.accepted: list[float] = []
        self.trials: list[float] = []

    def add(self, k: int, accepted: int) -> None:
        while len(self.trials) < k:
            self.accepted.append(0.0)
            self.trials.append(0.0)
        for j in range(k):
            self.accepted[j] *= self.decay
            self.trials[j] *= self.decay
        for j in range(min(accepted + 1, k)):  # positions 1..accepted accepted, the next one tried
            self.trials[j] += 1
            self.accepted[j] += j < accepted

    def rates(self, k: int, prior: float = 0.5) -> list[float]:
        out, last = [], prior
        for j in range(k):
            if j < len(self.trials) and self.trials[j] > 0:
                last = (self.accepted[j] + prior) / (self.trials[j] + 1)
            out.append(last)  # a position not tried yet: the rate of the one before
        return out


class DraftCosts:
    """M(k) = M0 + k * m for one proposer at one batch size (calls that drafted on demand): least
    squares over the calls seen, older calls weighing less (each new one multiplies the old sums
    by 1 - DRAFT_EMA). The slope m is pulled towards `prior_slope` (the startup profile's, fitted
    over k = 1 and the most k: `profile_drafter`) with the weight of SLOPE_PRIOR_WEIGHT calls one
    token apart, a ridge: online calls mostly come at one k (the policy's choice), and from them
    alone the slope was noise; in stop 29's batching runs the fit put a miss at k = 1 for one
    sequence anywhere between 3.9 and 17.7 ms, and k choices went with it. Calls spread over
    several k outweigh the prior soon; the level (M at the k's called) is the online calls'."""

    def __init__(self, prior_slope: float | None = None):
        self.n = self.sk = self.skk = self.st = self.skt = 0.0
        self.prior_slope = prior_slope

    def observe(self, k: int, seconds: float) -> None:
        f = 1 - DRAFT_EMA
        self.n, self.sk, self.skk = f * self.n + 1, f * self.sk + k, f * self.skk + k * k
        self.st, self.skt = f * self.st + seconds, f * self.skt + k * seconds

    def slope(self) -> float | None:
        """m of the fit (None before two k were seen, without a prior)."""
        if self.n <= 0:
            return self.prior_slope
        sxx = self.skk - self.sk ** 2 / self.n  # the calls' weighted spread of k, and covariance
        sxt = self.skt - self.sk * self.st / self.n
        if self.prior_slope is not None:
            return max((sxt + SLOPE_PRIOR_WEIGHT * self.prior_slope) / (sxx + SLOPE_PRIOR_WEIGHT), 0.0)
        if sxx <= 1e-6 * max(self.skk, 1e-12):
            return None
        return max(sxt / sxx, 0.0)

    def __call__(self, k: int) -> float:
        d = self.slope()
        if d is None:  # one k seen so far, no prior: per pass (k + 1 with the catch-up)
            return (k + 1) * self.st / max(self.sk + self.n, 1e-12)
        d0 = max((self.st - d * self.sk) / self.n, 0.0) if self.n > 0 else 0.0
        return d0 + k * d


class PassCosts:
    """T(b, w): seconds of one target pass, from a startup profile on a (b, w) grid, bilinear in
    between (linear extrapolation past the largest b), replaced per (b, w) by an online average.
    A wide pass costs at least T(b, 1) times the profile's ratio T(b, w) / T(b, 1): each cell is
    measured apart, in its own rounds and conditions, and at 32 sequences the averages had come
    to T(32, 2) = 39 ms against T(32, 1) = 63 ms, so drafting one token looked nearly free there."""

    def __init__(self, grid: dict[tuple[int, int], float] | None = None):
        self.grid = dict(grid or {})  # fixed from here on: its interpolations are kept
        self.measured: dict[tuple[int, int], float] = {}
        self._interpolated: dict[tuple[int, int], float] = {}

    def __call__(self, b: int, w: int) -> float:
        t = self._own(b, w)
        if w > 1 and self.grid:
            t = max(t, self._own(b, 1) * self._interpolate(b, w) / max(self._interpolate(b, 1), 1e-12))
        return t

    def _own(self, b: int, w: int) -> float:
        if (b, w) in self.measured:
            return self.measured[(b, w)]
        return self._interpolate(b, w) if self.grid else 0.0

    def observe(self, b: int, w: int, seconds: float) -> None:
        old = self.measured.get((b, w))
        self.measured[(b, w)] = seconds if old is None and not self.grid else \
            (1 - EMA) * (old if old is not None else self._own(b, w)) + EMA * seconds

    def _interpolate(self, b: int, w: int) -> float:
        t = self._interpolated.get((b, w))
        if t is None:
            t = self._interpolated[(b, w)] = self._bilinear(b, w)
        return t

    def _bilinear(self, b: int, w: int) -> float:
        bs = sorted({g[0] for g in self.grid})
        ws = sorted({g[1] for g in self.grid})

        def along(axis: list[int], x: int, f) -> float:
            if len(axis) == 1:
                return f(axis[0])
            i = min(max(bisect.bisect_left(axis, x), 1), len(axis) - 1)
            x0, x1 = axis[i - 1], axis[i]
            y0, y1 = f(x0), f(x1)
            return max(y0 + (y1 - y0) * (x - x0) / (x1 - x0), 0.0)

        return along(bs, b, lambda bb: along(ws, w, lambda ww: self.grid[(bb, ww)]))


def profile_grid(max_batch: int, max_width: int) -> tuple[list[int], list[int]]:
    """The batch sizes (powers of two up to max_batch, and max_batch) and widths (1, 2, the middle
    and max_width) the startup profiles time."""
    return (sorted({1 << i for i in range(max_batch.bit_length()) if 1 << i <= max_batch} | {max_batch}),
            sorted({1, min(2, max_width), (max_width + 1) // 2, max_width}))


def profile_target(runner, max_batch: int, max_width: int, reps: int = 7,
                   interleaved: bool = True) -> dict[tuple[int, int], float]:
    """Times target passes on a grid: b in powers of two up to max_batch, w in {1, 2, mid, max}.
    Runs at startup, on free slots 0..max_batch-1 (released after). At each b the widths take
    turns within every repetition (the order reversed every other one; the first repetition warms
    up), and each cell is the median of its reps, so a slow spell of the machine hits every
    width alike: PassCosts holds a wide pass to at least T(b, 1) times this profile's ratio
    T(b, w) / T(b, 1) for good, so a ratio measured in a bad moment steers k until a restart.
    Timed one width after another, 3 reps each (until stop 37), six profiles of the demo target on
    the 2-core Zen 4 EPYC put T(1, 5) / T(1, 1) anywhere in 0.76-1.21 and T(4, 2) / T(4, 1) in
    0.80-1.57; six this way, alternating with those, 0.83-1.03 and 0.98-1.18 (profiling up to 32
    sequences then takes 2.3-3.0 s instead of 1.4-1.8; benchmarks/diagnostics/profile_noise.py).
    One adaptive engine whose profile had T(1, 5) = 1.6 T(1, 1) drafted one token a round at one
    sequence, 1.33x plain where fixed k = 4 ran 1.50x (diagnostics/adaptive_vs_fixed_one.py).
    interleaved=False: each width's repetitions back to back, as until stop 37 (with reps=3, the old
    profile exactly; for that diagnostic)."""
    bs, ws = profile_grid(max_batch, max_width)
    prompt = [i % runner.vocab_size for i in range(1, 9)]
    # the tokens each pass scores, as many as its width (until stop 50 at most the prompt's 8, and
    # the rollback of the width failed the engine's start for k >= 9)
    scored = [i % runner.vocab_size for i in range(1, max(ws) + 1)]
    grid = {}
    for b in bs:
        for slot in range(b):
            runner.prefill(prompt, slot=slot)
        times: dict[int, list[float]] = {w: [] for w in ws}
        calls = [(rep, w) for rep in range(reps + 1) for w in (ws if rep % 2 else ws[::-1])] if interleaved \
            else [(rep, w) for w in ws for rep in range(reps + 1)]
        for rep, w in calls:
            t0 = time.perf_counter()
            out = runner.score_batch([(slot, scored[:w]) for slot in range(b)], last_only=True)
            float(out[-1][-1, 0])  # waits for the device
            if rep:
                times[w].append(time.perf_counter() - t0)
            for slot in range(b):
                runner.rollback(w, slot=slot)
        grid.update({(b, w): statistics.median(times[w]) for w in ws})
        for slot in range(b):
            runner.release(slot)
    return grid


def profile_drafter(proposer, vocab_size: int, max_batch: int, max_k: int, reps: int = 3,
                    settle: float = 0.0) -> dict[int, DraftCosts]:
    """Times on-demand drafting calls on a grid, so that a batch size the policy has not seen yet
    does not start from a guess: b in powers of two up to max_batch, k in {1, max_k}. Each timed
    call is a miss, as on the critical path: it commits two tokens the drafter did not draft
    (nothing pipelining prepared can match) and drafts k. settle: after each call, wait this many
    times its duration, so that a pipelining drafter has finished preparing the next round (as it
    has, at small batches, by the time a verification pass ends) before the next call; back to
    back, every timed call also waited for the preparation the call before it started, and the
    profile put a miss at k = 4 for one sequence at 12.1-12.6 ms, settled at 6.1-6.9, and the
    misses of real rounds took 6.33 (median; benchmarks/diagnostics/profile_settle.py). Each k's
    calls enter the fit as their median (weighing reps calls), as profile_target's passes do: with
    each call entering alone, one stalled call at k = 1 (a busy 2-core CI machine) flattened the
    fitted slope to 0 and M(1) = M(4). The ks take turns within each repetition (until stop 57
    each k's calls ran back to back, so a slow spell of the machine could raise one k's median
    alone). Runs at startup on
    sequences of its own (released after); returns {b: M(k) fitted to its calls}, up to the
    largest batch the proposer took (a drafter with fewer free sequences stops the grid there)."""
    from specserve.core.proposer import CapacityError, ProposeItem
    from specserve.core.sampling import SamplingParams

    bs, _ = profile_grid(max_batch, max_k)
    prompt = [i % vocab_size for i in range(1, 9)]
    fits: dict[int, DraftCosts] = {}
    for b in bs:
        ids = [f"profile-{b}-{i}" for i in range(b)]
        try:
            proposer.start_many([(s, prompt, SamplingParams().with_seed()) for s in ids])
        except CapacityError:
            break
        try:
            costs, drafted = DraftCosts(), [[] for _ in ids]
            ks = sorted({1, max_k})
            times: dict[int, list[float]] = {k: [] for k in ks}
            # the ks take turns, as profile_target's widths do: a slow spell hits both alike
            for rep, k in [(rep, k) for rep in range(reps + 1) for k in (ks if rep % 2 else ks[::-1])]:
                # two tokens, the first unlike the last draft's first: a miss for any outcome
                new = [[(d[0] + 1) % vocab_size if d else prompt[0]] * 2 for d in drafted]
                t0 = time.perf_counter()
                out = proposer.propose([ProposeItem(s, n, k) for s, n in zip(ids, new)])
                seconds = time.perf_counter() - t0
                drafted = [d.tokens for d in out]
                if rep:  # the first call of each k warms up
                    times[k].append(seconds)
                if settle:  # let a pipelining drafter finish preparing the next round first
                    time.sleep(settle * seconds)
            for k in ks:
                for _ in times[k]:
                    costs.observe(k, statistics.median(times[k]))
            costs.prior_slope = costs.slope()  # (its own calls': the prior of the online fit)
            fits[b] = costs
        finally:
            proposer.release_many(ids)
    return fits


class Guard:
    """What each mode really gave at a batch size, and a veto on speculating where plain decoding
    gave more. The model's rates are estimates (a target pass measured beside the drafter's
    leftover work, hit rates, calibrations that lag a change of load); in stop 26's batching runs
    they kept speculation on at 4-16 sequences where every fixed-k row lost to plain decoding
    (the adaptive row 0.62-0.85x plain).

    The guard measures the tokens each round wrote against the seconds of the engine loop it took
    (the round, and the starts of joining requests on the drafter; not the target's prefill of
    them, which either mode pays alike for the same prompts and which comes in bursts: equal
    requests finish together under plain decoding, and a burst within a mode's memory of ~100
    rounds swung its rate widely: in batching.md at 3c60a0f the plain rates held for 7-38
    sequences were 0.22-0.75 worth per second, speculating's at 7-9 sequences 1.00, where fixed k
    ran 0.83x plain), per mode and per half-octave bucket
    of batch sizes (..., 5-6, 7-9, 10-13, 14-19, 20-26, 27-38, ...). A round's tokens are weighed
    by the startup profile's plain pass at its batch size over b (the seconds of quiet plain passes
    they are worth), so rounds of nearby batch sizes pool fairly. "On" are the rounds that drafted
    and the plain rounds settling after them (their pass runs beside the drafter's leftover work:
    a cost of speculating), "off" the other plain rounds; a probe round and the rounds settling
    after it count for neither (a single drafting round is no pipelined stretch, and plain rounds
    beside its leftovers no plain stretch).

    Once both modes have GUARD_MIN_ROUNDS of weight at a bucket, and GUARD_MIN_SEQUENCE_ROUNDS of
    sequence-rounds (a round's tokens are random, 1 to k + 1 per sequence: at one sequence eight
    rounds vetoed speculation where it ran 1.5x plain; plain rounds, b tokens each, need at most
    GUARD_MIN_PLAIN_ROUNDS rounds of them: `min_sequence_rounds`), and speculating measured less than
    1 - GUARD_MARGIN of plain decoding (a veto at a near-tie, 0.908 against 0.911, left 4
    sequences at 0.89x plain where fixed k ran 1.05-1.08x), speculation is vetoed there and at every larger batch size (speculating gains less the more
    sequences share a pass) for GUARD_HOLD rounds: no drafting, no probes, and its measurement
    dropped. After a clear loss (below GUARD_CLEAR_LOSS of plain decoding) the larger buckets stay
    vetoed when the hold ends, until speculating is measured again at the bucket that lost and
    loses no more there: it gains less the more sequences share a pass, so where it clearly lost
    at 8 sequences it need not be re-tried at 16 or 32 (in stop 29's runs each re-try at 16
    sequences cost about a second of drafting in a level of ten). A marginal loss (speculating at GUARD_CLEAR_LOSS to 1 - GUARD_MARGIN of plain
    decoding) holds a quarter as long: at two sequences, where a mode's rate over the minimum
    weights swings by several percent, such a veto held most of a batching level (0.90x plain;
    fixed k 1.24x in the same run, batching_ab.md, stop 29). When the veto ends the model decides again; a new stretch of speculating that
    measures worse again vetoes for twice as long (up to 2**MAX_GUARD_BACKOFF times), one that
    measures better ends the doubling. Where the model keeps speculation on with a small expected
    gain (its average over the bucket's rounds below TRIAL_MARGIN: not at one sequence, where
    speculating clearly pays), plain rounds are tried: speculation pauses for SETTLE_ROUNDS + 4
    rounds plus as many as the minimum weights need at that batch size (decaying: 39 rounds at one
    sequence, 102 until stop 34; until stop 29 the trial counted 64 there, which the decayed weight never reached, so
    the first trial measured nothing), and again TRIAL_EVERY rounds later if those did not measure plain decoding there (the batch size moved to another
    bucket meanwhile).

    The other way round, where speculating measured more than 1 + GUARD_KEEP_MARGIN times plain
    decoding (1 + GUARD_KEEP_MARGIN_ONE at one sequence), the guard keeps speculation on at that
    bucket for GUARD_HOLD rounds whatever the model says, with no trial of plain rounds there meanwhile, and drops plain decoding's
    measurement there (so the next comparison measures it afresh, as a veto drops speculating's). Until stop 39 the guard only turned speculation off:
    in batching_6514ef5.md the pair's model, its miss cost put at 15 ms on a slow day, chose k = 0
    in 179 of 419 rounds at one sequence, rating plain decoding at about 165 tok/s and speculating
    at 133, while the guard had measured speculating ahead (0.82 worth per second against 0.72);
    that row ran 1.05x plain, fixed k 1.18x. That margin, 0.10, holds at one sequence
    (GUARD_KEEP_MARGIN_ONE); at two or more it is 0.25 (GUARD_KEEP_MARGIN; 0.10 until stop 66, when
    it kept speculation on at four sequences on plain rounds timed in a slow spell of the machine,
    and 0.25 everywhere came too late at one sequence: docs/benchmarks/README.md, "Stop 66")."""

    def __init__(self):
        self.sums: dict[tuple[int, bool], list[float]] = {}  # (bucket, on) -> [worth, seconds, rounds, sequence-rounds]
        self.until: dict[int, int] = {}  # bucket -> the policy round its veto ends
        self.trial_until: dict[int, int] = {}  # bucket -> the policy round its trial of plain rounds ends
        self.tried: dict[int, int] = {}  # bucket -> the policy round its last trial of plain rounds began
        self.gains: dict[int, float] = {}  # bucket -> the model's expected gain of speculating, averaged
        self.backoff: dict[int, int] = {}
        self.lost: set[int] = set()  # buckets whose last comparison was a clear loss (see vetoed)
        self.vetoes = 0  # vetoes so far
        self.kept: dict[int, int] = {}  # bucket -> the policy round its keeping speculation on ends
        self.keepings = 0  # times it kept speculation on so far

    @staticmethod
    def bucket(b: int) -> int:
        return round(2 * math.log2(max(b, 1)))

    def vetoed(self, b: int, now: int) -> bool:
        """Plain rounds at b: a veto at a bucket holds for every larger batch too; after a clear
        loss, for the larger ones even once it has ended, until speculating measures no loss at that
        bucket. A trial of plain rounds holds at its own bucket only (until stop 50 at every larger
        one too: a trial at two sequences held 32 plain for its 51 rounds)."""
        bucket = self.bucket(b)
        return any(end > now and bk <= bucket for bk, end in self.until.items()) \
            or self.trial_until.get(bucket, -1) > now or any(bk < bucket for bk in self.lost)

    def keeps(self, b: int, now: int) -> bool:
        """Speculation stays on at b's bucket whatever the model says (see the class)."""
        return self.kept.get(self.bucket(b), -1) > now

    def try_plain(self, b: int, now: int, gain: float) -> bool:
        """Notes the model's expected gain of speculating at b; starts a trial of plain rounds at
        b's bucket if it wants one (see the class). True if so."""
        bucket = self.bucket(b)
        avg = self.gains[bucket] = gain if bucket not in self.gains else 0.9 * self.gains[bucket] + 0.1 * gain
        if avg >= TRIAL_MARGIN or self.rate(b, True) is None or self.rate(b, False) is not None \
                or now - self.tried.get(bucket, -TRIAL_EVERY) < TRIAL_EVERY:
            return False
        self.tried[bucket] = now
        # rounds until plain decoding's decaying weights reach the minimums (at one sequence 39, not 32)
        need = max(GUARD_MIN_ROUNDS, self.min_sequence_rounds(b, False) / b) * (1 - GUARD_DECAY)
        self.trial_until[bucket] = now + SETTLE_ROUNDS + 4 + math.ceil(math.log(1 - need) / math.log(GUARD_DECAY))
        return True

    @staticmethod
    def min_sequence_rounds(b: int, on: bool) -> float:
        """The sequence-rounds a mode needs at b before it is compared: GUARD_MIN_SEQUENCE_ROUNDS for
        the random token counts of speculating rounds; plain rounds, whose count is fixed (b), need
        only as many rounds as the timing noise does, GUARD_MIN_PLAIN_ROUNDS at most (32 at one
        sequence instead of 64, as at two: a trial of plain rounds there took 114 rounds of 406 in
        a batching level's colocated row at one sequence, batching_106faea.md, where speculating
        then measured 1.55x plain)."""
        return GUARD_MIN_SEQUENCE_ROUNDS if on else min(GUARD_MIN_SEQUENCE_ROUNDS, GUARD_MIN_PLAIN_ROUNDS * b)

    def rate(self, b: int, on: bool) -> float | None:
        """The mode's measured worth per second at b's bucket (None: not enough rounds yet)."""
        sums = self.sums.get((self.bucket(b), on))
        enough = sums and sums[2] >= GUARD_MIN_ROUNDS and sums[1] > 0 and sums[3] >= self.min_sequence_rounds(b, on)
        return sums[0] / sums[1] if enough else None

    def observe(self, b: int, on: bool, tokens: int, seconds: float, now: int, plain_pass: float | None = None) -> None:
        """A round of b sequences in mode `on` wrote `tokens` in `seconds`; plain_pass: the
        profile's plain pass at b (None: none, tokens then weigh 1 / b each)."""
        bucket = self.bucket(b)
        sums = self.sums.setdefault((bucket, on), [0.0, 0.0, 0.0, 0.0])
        for i, x in enumerate((tokens * (plain_pass or 1.0) / b, seconds, 1.0, b)):
            sums[i] = GUARD_DECAY * sums[i] + x
        rate_on, rate_off = self.rate(b, True), self.rate(b, False)
        if rate_on is None or rate_off is None:
            return
        if rate_on < (1 - GUARD_MARGIN) * rate_off:  # (a near-tie is no reason to give up what speculating may gain)
            hold = GUARD_HOLD << self.backoff.get(bucket, 0)
            if rate_on >= GUARD_CLEAR_LOSS * rate_off:  # a marginal loss: perhaps the noise of a few rounds
                hold //= 4
            else:
                self.lost.add(bucket)
            self.until[bucket] = now + hold
            self.backoff[bucket] = min(self.backoff.get(bucket, 0) + 1, MAX_GUARD_BACKOFF)
            del self.sums[(bucket, True)]
            self.vetoes += 1
        else:
            self.backoff[bucket] = 0
            self.lost.discard(bucket)
            margin = GUARD_KEEP_MARGIN_ONE if b == 1 else GUARD_KEEP_MARGIN
            if rate_on > (1 + margin) * rate_off:  # a clear win: the model, if it says off, is wrong here
                self.kept[bucket] = now + GUARD_HOLD
                del self.sums[(bucket, False)]  # (a later comparison measures plain decoding afresh)
                self.keepings += 1

    def state(self, now: int) -> dict:
        return {"vetoes": self.vetoes, "keepings": self.keepings,
                "vetoed_buckets": sorted(bk for bk, end in self.until.items() if end > now),
                "trial_buckets": sorted(bk for bk, end in self.trial_until.items() if end > now),
                "kept_buckets": sorted(bk for bk, end in self.kept.items() if end > now),
                "lost_buckets": sorted(self.lost),
                "tried_buckets": sorted(self.tried),
                "worth_per_s": {f"{bk}{'+spec' if on else ''}": round(t / s, 4)
                                for (bk, on), (t, s, w, _) in sorted(self.sums.items()) if s > 0 and w >= GUARD_MIN_ROUNDS}}


class SpeculationPolicy:
    def __init__(self, mode: str = "fixed", costs: PassCosts | None = None, min_confidence: float | None = None):
        if mode not in POLICIES:
            raise ValueError(f"speculation must be one of {POLICIES}, got {mode!r}")
        self.mode = mode
        self.costs = costs or PassCosts()
        self.min_confidence = (MIN_CONFIDENCE if mode == "adaptive" else 0.0) if min_confidence is None \
            else min_confidence
        self.draft_costs: dict[tuple[str, int], DraftCosts] = {}  # (proposer, b) -> M(k), calls that drafted
        self.hit_costs: dict[tuple[str, int], float] = {}  # (proposer, b) -> H, calls whose drafts were all ready
        self.hit_rates: dict[str, Acceptance] = {}  # proposer -> hits after all-accepted rounds (h)
        self.prepared: set[str] = set()  # proposers that prepare drafts (h starts at PRIOR_READY, not 0)
        self.overhead: dict[tuple[int, bool], float] = {}  # (b, speculating) -> seconds per round, O
        # proposer -> its acceptance over all sequences, and per draft position: a draft model's and
        # the n-gram's differ (0.81 against 0.58 on the n-gram bench's edit prompts), and one
        # engine serves both (per request, and the n-gram while the drafter is down)
        self.acceptances: dict[str | None, tuple[Acceptance, PositionalAcceptance]] = {}
        self.spreads: dict[str, SequenceSpread] = {}  # proposer -> its finished sequences' spread in acceptance
        self.on = True  # adaptive: speculating (k > 0) in the last round
        self.model_on: dict[int, bool] = {}  # adaptive: the model's last on/off per batch-size bucket (hysteresis)
        self.k = 0  # adaptive: the k > 0 chosen last
        self.rounds = 0  # rounds chosen for
        self.last_round_k = 0  # the k the last round drafted
        self.since_drafted = SETTLE_ROUNDS + 1  # rounds since the last one that drafted
        self.since_probe: dict[int, int] = {}  # batch-size bucket -> rounds since its last probe
        self.probe_backoff: dict[int, int] = {}  # batch-size bucket -> doublings of its probe interval
        self.probes = 0
        self._last_decision: dict[int, tuple[bool, int]] = {}  # bucket -> (on, k) at its last probe
        self.cal_sums: dict[tuple[int, bool], list[float]] = {}  # (b, speculating) -> [model s, measured s], decaying
        self.predicted: tuple[int, bool, float] | None = None  # the last choice's (b, speculating, model rate)
        # the last choices, for operators and benchmarks: (b, k, calibrated tokens/s at k = 0 and at
        # the best k > 0, probe)
        self.recent: deque[tuple[int, int, float, float, bool]] = deque(maxlen=32)
        self.guard = Guard()
        self.since_probed = SETTLE_ROUNDS + 1  # rounds since the last probe round
        self.round_mode: bool | None = None  # what the guard counts the round chosen last for (None: nothing)
        self.prepare = True  # whether the drafter is asked to prepare the next round (see PREPARE_MIN_READY)
        self.prepare_last = True  # the last model-chosen round's flag
        self.unprepared = 0  # drafting rounds that asked for no preparation

    # ------------------------------------------------------------------ choosing
    def choose(self, limits: list[int], acceptance: list[Acceptance], proposers: list[str | None],
               fixed: list[bool] | None = None) -> list[int]:
        """k for each sequence of a round. limits: each sequence's most (its request's k, capped
        by the tokens it has left, a seeded request's by the context's: `SpeculativeEngine._draft_room`;
        0 when it is not drafting); proposers: each one's proposer;
        fixed: sequences that always draft their limit (a seeded sampled request, whose text
        must not depend on timings)."""
        self.predicted = self.round_mode = None
        self.prepare = True
        if fixed and any(fixed):
            free = [i for i, f in enumerate(fixed) if not f]
            ks = list(limits)
            unprepared = self.unprepared
            if free:
                for i, k in zip(free, self.choose([limits[i] for i in free], [acceptance[i] for i in free],
                                                  [proposers[i] for i in free])):
                    ks[i] = k
            # the seeded rows draft whatever the mode: the guard counts nothing, and the round's time
            # (their drafting, a wider pass) is not the model's for the free rows: nothing calibrates;
            # the drafter prepares (a seeded row's next round drafts for sure)
            self.round_mode = self.predicted = None
            self.prepare = self.prepare_last = True
            self.unprepared = unprepared
            return ks
        if self.mode == "fixed" or not any(limits):
            if self.mode == "adaptive":  # nobody can draft: a plain round (the guard's "off", unless settling)
                return self._chose(limits, len(limits), 0, False, 0.0, None, calibrates=False)
            return list(limits)
        b = len(limits)
        if self.guard.vetoed(b, self.rounds):  # plain rounds until the veto ends: no model to run
            self.on = False
            settling = self.since_drafted < SETTLE_ROUNDS  # (after the round that drafted when the veto came)
            ks = self._chose(limits, b, 0, False, self.costs(b, 1) + self.overhead.get((b, False), 0.0), None)
            if settling:  # not speculating's: its measurement was dropped, a new stretch measures it afresh
                self.round_mode = None
            return ks
        tokens, seconds, ready = self.model_round(limits, acceptance, proposers)
        cal = (self.calibration(b, False), self.calibration(b, True))
        rates = [t / s * cal[k > 0] for k, (t, s) in enumerate(zip(tokens, seconds))]
        best = max(range(1, len(rates)), key=rates.__getitem__)
        if 0 < self.k < len(rates) and rates[best] <= (1 + HYSTERESIS) * rates[self.k]:
            best = self.k  # k sticks too: a pipelined draft prepared for it stays usable
        self.k = best
        margin = GAIN_MARGIN if b > 1 else 0.0
        gain, size = rates[best] / max(rates[0], 1e-12), Guard.bucket(b)
        was = self.model_on.get(size)  # the model's own last decision at this batch size
        on = gain > 1 + margin if was is None else \
            gain >= 1 + margin - HYSTERESIS if was else gain > 1 + margin + HYSTERESIS
        self.model_on[size] = on
        kept = self.guard.keeps(b, self.rounds)  # the guard measured speculating clearly ahead here
        self.on = on or kept
        trial = self.on and not kept and self.guard.try_plain(b, self.rounds, gain)
        self.on = self.on and not trial
        k = best if self.on else 0
        bucket = b.bit_length()
        self.since_probe[bucket] = self.since_probe.get(bucket, 0) + 1
        probe = not trial and self.since_probe[bucket] >= PROBE_EVERY << self.probe_backoff.get(bucket, 0)
        if probe:  # a probe round now and then drafts the most: it keeps the estimates of
            self.since_probe[bucket] = 0  # acceptance and drafting cost current for every k
            self.probes += 1
            decision = (self.on, self.k)  # as at the last probe: probe half as often from now on
            settled = self._last_decision.get(bucket) == decision
            self.probe_backoff[bucket] = min(self.probe_backoff.get(bucket, 0) + 1, MAX_PROBE_BACKOFF) if settled else 0
            self._last_decision[bucket] = decision
            k = max(limits)
        # the drafter prepares after answering the call that carries this flag (this round's, or with
        # drafts asked for early the one at this round's end), for a round that drafts `best` (a
        # probe's wider draft serves it) or nothing. One sequence always prepares, so that h stays
        # measured: it learns from prepared rounds only, and would otherwise never recover from a low
        # spell. (With early asks a flag's change reaches readiness a round later than the check
        # below assumes: one round misplaced per change)
        was = self.prepare_last
        pipelines = any(lim and p in self.prepared for p, lim in zip(proposers, limits))
        self.prepare = self.prepare_last = not (k and pipelines) or \
            (self.on and (b == 1 or ready[best] >= PREPARE_MIN_READY))
        self.unprepared += not self.prepare
        ks = self._chose(limits, b, k, probe, seconds[k], (rates[0], rates[best]))
        if self.prepare != was:  # this round's call was prepared (or not) as the last round asked,
            self.predicted = None  # not as the model costed it now: it calibrates nothing
        return ks

    def _chose(self, limits: list[int], b: int, k: int, probe: bool, model_seconds: float,
               rates: tuple[float, float] | None, calibrates: bool = True) -> list[int]:
        """The bookkeeping of a choice of k for a round of b sequences (rates: the calibrated
        model's at k = 0 and the best k, None where the guard's veto left the model unasked;
        calibrates: False for a round nobody could draft in, which neither calibrates the model nor
        shows in `recent`)."""
        self.rounds += 1
        if calibrates:
            self.recent.append((b, k, *(round(r, 1) for r in rates or (0.0, 0.0)), probe))
        # a probe, or a change of k (no draft was prepared for it), is no steady-state round
        changed, self.last_round_k = k != self.last_round_k, k
        self.since_drafted = 0 if k else self.since_drafted + 1
        self.since_probed = 0 if probe else self.since_probed + 1
        self.predicted = None if probe or changed or self.settling or not calibrates else (b, k > 0, model_seconds)
        # for the guard: drafting rounds and those settling after them are speculation's; a probe
        # and the plain rounds settling after it, nobody's
        self.round_mode = None if probe or (not k and self.since_probed <= SETTLE_ROUNDS) else \
            bool(k) or self.since_drafted <= SETTLE_ROUNDS
        return [min(k, lim) for lim in limits]

    def model_rates(self, limits: list[int], acceptance: list[Acceptance], proposers: list[str | None]) -> list[float]:
        """The model's tokens per second of this batch for k = 0 .. max(limits) (uncalibrated)."""
        tokens, seconds, _ = self.model_round(limits, acceptance, proposers)
        return [t / s for t, s in zip(tokens, seconds)]

    def model_round(self, limits: list[int], acceptance: list[Acceptance],
                    proposers: list[str | None]) -> tuple[list[float], list[float], list[float]]:
        """The model's expected tokens and seconds of this batch's round for k = 0 .. max(limits),
        and the chance that a pipelining proposer's call finds every row's draft ready (adaptive, at
        two sequences or more: below PREPARE_MIN_READY nothing is prepared, and the round's
        drafting costs a miss)."""
        b = len(limits)
        top = max(limits)
        priors, position_rates = {}, {}  # per proposer: its acceptance, and per draft position
        for p in set(proposers):
            overall, positions = self.acceptances.get(p) or (Acceptance(), PositionalAcceptance())  # (read only)
            priors[p] = overall.rate(PRIOR_ACCEPTANCE, weight=1.0)
            position_rates[p] = positions.rates(top, PRIOR_ACCEPTANCE)
        scales = [a.rate(priors[p], self.prior_weight(p)) / max(priors[p], 1e-6) for a, p in zip(acceptance, proposers)]
        used = {p for p, lim in zip(proposers, limits) if lim}
        hit = {p: self.hit_rate(p) for p in used}
        # per k: expected tokens (1 + sum_{j<=k} prod_{l<=j} min(1, a_l * s_i) per row, a row drafting
        # min(k, its limit)), and P(every row of p finds its draft ready): one pass over each row's positions
        tokens_by_k = [0.0] * (top + 1)
        ready = [dict.fromkeys(used, 1.0) for _ in range(top + 1)]
        for sc, lim, p in zip(scales, limits, proposers):
            total, run = 1.0, 1.0
            for k in range(top + 1):
                if 0 < k <= lim:
                    run *= min(1.0, position_rates[p][k - 1] * sc)
                    total += run
                tokens_by_k[k] += total
                if lim:
                    ready[k][p] *= run * hit[p]
        if self.mode == "adaptive" and b > 1:  # (one sequence always prepares: see choose)
            for by_p in ready:
                for p in by_p:
                    by_p[p] *= by_p[p] >= PREPARE_MIN_READY
        seconds_by_k = [max(self.costs(b, k + 1) + sum(self.draft_cost(p, b, k, ready[k][p]) for p in used)
                            + self.overhead.get((b, k > 0), 0.0), 1e-9) for k in range(top + 1)]
        ready_by_k = [max((by_p[p] for p in used if p in self.prepared), default=0.0) for by_p in ready]
        return tokens_by_k, seconds_by_k, ready_by_k

    def acceptance_of(self, proposer: str | None) -> tuple[Acceptance, PositionalAcceptance]:
        """The proposer's acceptance over all sequences, and per draft position."""
        stats = self.acceptances.get(proposer)
        if stats is None:
            stats = self.acceptances[proposer] = (Acceptance(), PositionalAcceptance())
        return stats

    def hit_rate(self, proposer: str | None) -> float:
        """h: how often a row's draft was ready after a round that accepted all its drafts."""
        prior = PRIOR_READY if proposer in self.prepared else 0.0
        counts = self.hit_rates.get(proposer)
        return counts.rate(prior, weight=1.0) if counts is not None else prior

    @property
    def calibrations(self) -> dict[tuple[int, bool], float]:
        """(b, speculating) -> measured / modelled rate: modelled over measured round seconds."""
        return {key: min(max(m / s, 0.05), 20.0) for key, (m, s) in self.cal_sums.items()}

    def calibration(self, b: int, speculating: bool) -> float:
        """Measured / modelled rate of past rounds like these (nearest batch size; 1 before any)."""
        near = [(abs(bb - b), bb) for bb, spec in self.cal_sums if spec == speculating]
        if not near:
            return 1.0
        m, s = self.cal_sums[(min(near)[1], speculating)]
        return min(max(m / s, 0.05), 20.0)

    def observe_round(self, seconds: float) -> None:
        """How long the last chosen round really took, against the model's seconds for it (the
        target pass, drafting, the rest): the ratio (unmodelled costs: contention between the
        actors, estimates lagging a change of load) is learnt per batch size, with and without
        drafting, and multiplies the model's rates from then on. Times only: a round's token
        count is random (1 to k + 1 per sequence), and calibrating on it can swing the ratio enough
        to switch speculation off for stretches at one sequence (likely what kept 161 of 425
        rounds at k = 0 in a batching run where fixed k = 4 ran 1.17x plain); acceptance has its
        own estimates."""
        if self.predicted is None or seconds <= 0:
            return
        b, spec, model = self.predicted
        for key, sums in self.cal_sums.items():  # the others drift back towards 1: one learnt in a
            sums[1] += RELAX * (sums[0] - sums[1])  # bad spell must not keep a mode off
        sums = self.cal_sums.get((b, spec))
        if sums is None:  # starts where the model stood: the nearest batch size's calibration (CAL_PRIOR_ROUNDS)
            sums = self.cal_sums[(b, spec)] = [CAL_PRIOR_ROUNDS * model,
                                                CAL_PRIOR_ROUNDS * model / self.calibration(b, spec)]
        # a ratio of (decaying) sums, not an average of per-round ratios: round times are bimodal
        # with pipelining (a ready draft or not), and averaged ratios swung 0.9-2.0 in a few rounds
        sums[0] = CAL_DECAY * sums[0] + model
        sums[1] = CAL_DECAY * sums[1] + seconds
        self.predicted = None

    def observe_outcome(self, b: int, tokens: int, seconds: float) -> None:
        """The round chosen last wrote `tokens` (all b sequences together) in `seconds` of the
        engine loop (the starts of joining requests and the round, not their prefill): for the guard."""
        if self.mode == "adaptive" and self.round_mode is not None and seconds > 0:
            plain_pass = self.costs._interpolate(b, 1) if self.costs.grid else None
            self.guard.observe(b, self.round_mode, tokens, seconds, self.rounds, plain_pass)
        self.round_mode = None

    def draft_cost(self, proposer: str | None, b: int, k: int, ready: float = 0.0) -> float:
        """D(b, k) = ready * H + (1 - ready) * M(b, k); ready: P(every row's draft is ready)."""
        if not k or proposer is None:
            return 0.0
        fit = self._nearest_fit(proposer, b)
        if fit is not None:
            miss = fit(k)
        else:  # before any measurement: a drafter pass a quarter of a target pass (the n-gram: nothing)
            miss = 0.0 if proposer == "ngram" else 0.25 * k * self.costs(b, 1)
        hits = [(abs(bb - b), bb, h) for (p, bb), h in self.hit_costs.items() if p == proposer]
        hit = min(hits)[2] if hits else miss
        return ready * hit + (1 - ready) * miss

    def _nearest_fit(self, proposer: str, b: int, profiled: bool = False) -> DraftCosts | None:
        """The proposer's M(k) fit at the batch size nearest b (the smaller on a tie); profiled:
        among the fits with a profile's slope only."""
        near = [(abs(bb - b), bb, d) for (p, bb), d in self.draft_costs.items()
                if p == proposer and (not profiled or d.prior_slope is not None)]
        return min(near, key=lambda x: x[:2])[2] if near else None

    def gauges(self) -> dict[str, int]:
        """For /metrics: whether the policy drafts now (adaptive: the last round it chose for
        drafted; fixed: always), the guard's vetoes so far, whether a veto (or a trial of plain
        rounds) holds now at some batch size, the times the guard kept speculation on, and the
        drafting rounds that asked a pipelining drafter to prepare nothing."""
        holds = any(end > self.rounds for end in [*self.guard.until.values(), *self.guard.trial_until.values()])
        return {"speculating": int(self.mode == "fixed" or self.last_round_k > 0),
                "guard_vetoes": self.guard.vetoes, "guard_holds": int(holds), "guard_keepings": self.guard.keepings,
                "unprepared_rounds": self.unprepared}

    def state(self) -> dict:
        """What the policy believes now (for operators and benchmarks): times in ms."""
        ms = {f"{b}x{w}": round(self.costs(b, w) * 1e3, 3) for b, w in sorted(set(self.costs.grid) | set(self.costs.measured))}
        return {"mode": self.mode, "speculating": self.on, "min_confidence": self.min_confidence,
                "engine_acceptance": {str(p): round(a.rate(0.5, weight=1.0), 4)
                                      for p, (a, _) in sorted(self.acceptances.items(), key=str)},
                "position_acceptance": {str(p): [round(a, 4) for a in pos.rates(len(pos.trials))]
                                        for p, (_, pos) in sorted(self.acceptances.items(), key=str)},
                "target_pass_ms": ms,
                "draft_ms_for_k_1_and_4": {f"{p}@{b}": [round(d(1) * 1e3, 3), round(d(4) * 1e3, 3)]
                                           for (p, b), d in sorted(self.draft_costs.items())},
                "ready_call_ms": {f"{p}@{b}": round(h * 1e3, 3) for (p, b), h in sorted(self.hit_costs.items())},
                "ready_after_all_accepted": {p: round(self.hit_rate(p), 4) for p in sorted(self.hit_rates)},
                # proposer -> [the prior's weight in trials, finished sequences it was learnt from (0: not yet)]
                "sequence_prior_trials": {p: [round(sp.weight, 1), len(sp.seen) if sp.learnt else 0]
                                          for p, sp in sorted(self.spreads.items())},
                "probes": self.probes,
                "unprepared_rounds": self.unprepared,
                "guard": self.guard.state(self.rounds),
                "recent_choices_b_k_rate0_ratebest_probe": list(self.recent),
                "calibration": {f"{b}{'+spec' if spec else ''}": round(c, 3)
                                for (b, spec), c in sorted(self.calibrations.items())},
                "round_overhead_ms": {f"{b}{'+spec' if spec else ''}": round(t * 1e3, 3)
                                      for (b, spec), t in sorted(self.overhead.items())}}

    # ------------------------------------------------------------------ observing
    @property
    def settling(self) -> bool:
        """A plain round right after drafting ones: the drafter's leftover work runs beside it."""
        return not self.last_round_k and self.since_drafted <= SETTLE_ROUNDS

    def observe_pass(self, b: int, width: int, seconds: float) -> None:
        if width == 1 and self.mode == "adaptive" and self.settling:
            return
        self.costs.observe(b, width, seconds)

    def observe_draft(self, proposer: str, b: int, k: int, seconds: float, all_ready: bool = False) -> None:
        """A call that drafted up to k for b rows; all_ready: every row's draft was prepared."""
        if not k:
            return
        if all_ready:
            old = self.hit_costs.get((proposer, b))
            self.hit_costs[(proposer, b)] = seconds if old is None else (1 - EMA) * old + EMA * seconds
        else:
            fit = self.draft_costs.get((proposer, b))
            if fit is None:  # a batch size the profile did not time: the slope of the nearest it did,
                # and its M(k) as LEVEL_PRIOR_CALLS calls, which fade as this size's own calls come in
                nearest = self._nearest_fit(proposer, b, profiled=True)
                fit = self.draft_costs[(proposer, b)] = DraftCosts(nearest.prior_slope if nearest else None)
                if nearest is not None:
                    for _ in range(LEVEL_PRIOR_CALLS):
                        fit.observe(k, nearest(k))
            fit.observe(k, seconds)

    def observe_ready(self, proposer: str, ready: bool) -> None:
        """A row drafted after a round that accepted all its drafts: was its draft ready?"""
        self.hit_rates.setdefault(proposer, Acceptance()).add(1, int(ready), decay=0.99)

    def observe_overhead(self, b: int, speculating: bool, seconds: float) -> None:
        old = self.overhead.get((b, speculating))
        self.overhead[(b, speculating)] = seconds if old is None else (1 - EMA) * old + EMA * seconds

    def prior_weight(self, proposer: str | None) -> float:
        """The weight in trials of the proposer's acceptance rate in one sequence's estimate."""
        spread = self.spreads.get(proposer)
        return spread.weight if spread is not None else PRIOR_TRIALS

    def observe_finished(self, seq: Acceptance, proposer: str | None) -> None:
        """A sequence that drafted with `proposer` only has finished: its acceptance over its whole
        life goes into the proposer's spread."""
        if proposer is not None and seq.total_trials:
            self.spreads.setdefault(proposer, SequenceSpread()).add(seq.total_accepted, seq.total_trials)

    def observe_acceptance(self, seq: Acceptance, k: int, accepted: int, proposer: str | None = None) -> None:
        """A round of one sequence that drafted k with `proposer`, of which `accepted` were accepted."""
        if k:
            seq.add(k, accepted)
            overall, positions = self.acceptance_of(proposer)
            overall.add(k, accepted, decay=0.99)
            positions.add(k, accepted)
