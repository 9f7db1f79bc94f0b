"""The acceptance rule: closed form, sampled distributions, edge cases, and the yield formula."""

import numpy as np
import pytest
import torch
from scipy import stats

from specserve.core.sampling import SamplingParams, warp
from specserve.verifier.acceptance import accept, accept_batch, accept_greedy


def first_token_law(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    """Closed form of the first emitted token's law for k = 1: the draft x ~ q is kept with
    probability min(1, p(x)/q(x)); otherwise a token is drawn from normalise((p - q)+)."""
    keep = np.minimum(p, q)  # q(x) * min(1, p(x)/q(x))
    reject = 1.0 - keep.sum()
    residual = np.maximum(p - q, 0.0)
    return keep + (reject * residual / residual.sum() if residual.sum() > 0 else 0.0)


def random_dist(rng, v, zeros):
    w = rng.random(v)
    w[rng.choice(v, size=zeros, replace=False)] = 0.0
    return w / w.sum()


@pytest.mark.parametrize("case", range(20))
def test_closed_form_equals_p(case):
    rng = np.random.default_rng(case)
    v = int(rng.integers(2, 12))
    p, q = random_dist(rng, v, int(rng.integers(0, v - 1))), random_dist(rng, v, int(rng.integers(0, v - 1)))
    assert np.allclose(first_token_law(p, q), p, atol=1e-12)


def sample_first_tokens(p, q, n, seed):
    g = torch.Generator().manual_seed(seed)
    pt, qt = torch.tensor(p, dtype=torch.float64), torch.tensor(q, dtype=torch.float64)
    p2 = torch.stack([pt, pt])  # k = 1: the draft's position and the bonus position
    counts = np.zeros(len(p))
    kept = np.zeros(len(p))
    drafted = np.zeros(len(p))
    xs = torch.multinomial(qt, n, replacement=True, generator=g).tolist()
    # one batched call of n sequences (the rule as the engine runs it), each drawing from g in turn
    for x, (n_acc, nxt) in zip(xs, accept_batch([[x] for x in xs], [qt[None]] * n, [p2] * n, [g] * n)):
        first = x if n_acc == 1 else nxt
        counts[first] += 1
        drafted[x] += 1
        kept[x] += n_acc
    return counts, kept, drafted


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_sampled_first_token_matches_p(seed):
    rng = np.random.default_rng(100 + seed)
    v = 6
    p = random_dist(rng, v, zeros=seed % 3)  # zeros in p
    q = random_dist(rng, v, zeros=(seed + 1) % 3)  # zeros in q
    n = 20000
    counts, kept, drafted = sample_first_tokens(p, q, n, seed)
    support = p > 0
    assert counts[~support].sum() == 0, "a token with p = 0 was emitted"
    chi2 = stats.chisquare(counts[support], n * p[support])
    assert chi2.pvalue > 1e-3, (counts / n, p)
    # per-token acceptance frequency matches min(1, p/q)
    for x in np.nonzero(drafted > 200)[0]:
        want = min(1.0, p[x] / q[x])
        sd = np.sqrt(want * (1 - want) / drafted[x]) + 1e-9
        assert abs(kept[x] / drafted[x] - want) < 5 * sd + 1e-9


def test_a_biased_rule_is_detected():
    """The statistical test can fail: emitting the draft always (no correction) is caught."""
    rng = np.random.default_rng(7)
    p, q = random_dist(rng, 6, 0), random_dist(rng, 6, 0)
    g = torch.Generator().manual_seed(0)
    draws = torch.multinomial(torch.tensor(q), 20000, replacement=True, generator=g).numpy()
    counts = np.bincount(draws, minlength=6)
    assert stats.chisquare(counts, 20000 * p).pvalue < 1e-6


def test_multi_position_distribution_matches_p():
    """k = 3, same p and q at every position: each emitted position's marginal is p."""
    rng = np.random.default_rng(11)
    v = 5
    p, q = random_dist(rng, v, 1), random_dist(rng, v, 0)
    pt, qt = torch.tensor(p), torch.tensor(q)
    g = torch.Generator().manual_seed(5)
    first, second = np.zeros(v), np.zeros(v)
    n = 15000
    for _ in range(n):
        drafts = torch.multinomial(qt, 3, replacement=True, generator=g).tolist()
        n_acc, nxt = accept(drafts, qt.expand(3, v), pt.expand(4, v), g)
        out = drafts[:n_acc] + [nxt]
        first[out[0]] += 1
        if len(out) > 1:
            second[out[1]] += 1
    sup = p > 0
    assert stats.chisquare(first[sup], n * p[sup]).pvalue > 1e-3
    m = second.sum()
    assert stats.chisquare(second[sup], m * p[sup]).pvalue > 1e-3


def onehot(i, v=5):
    t = torch.zeros(v, dtype=torch.float64)
    t[i] = 1
    return t


def test_greedy_keeps_while_argmax_and_draws_nothing():
    g = torch.Generator().manual_seed(123)
    p = torch.stack([onehot(1), onehot(2), onehot(3), onehot(4)])
    assert accept([1, 2, 0], None, p, g) == (2, 3)  # mismatch at position 3: the argmax is written
    assert accept([1, 2, 3], None, p, g) == (3, 4)  # all kept: bonus
    assert accept([0, 2, 3], None, p, g) == (0, 1)
    q = torch.stack([onehot(1), onehot(2), onehot(0)])  # a greedy drafter's one-hot q
    assert accept([1, 2, 0], q, p, g) == (2, 3)
    # the engine passes no generator for a greedy request: nothing is drawn, and the rule holds
    assert accept([1, 2, 0], None, p, None) == (2, 3)


def test_edge_cases():
    g = torch.Generator().manual_seed(123)
    v = 5
    p = torch.tensor([0.0, 0.5, 0.5, 0.0, 0.0], dtype=torch.float64)
    # q(x) = 0 < p(x): ratio is infinite, always kept, no draw
    q = torch.tensor([0.0, 0.0, 1.0, 0.0, 0.0], dtype=torch.float64)
    assert accept([1], q[None], torch.stack([p, onehot(4)]), g) == (1, 4)
    # p == q: always kept, no draw
    assert accept([2], p[None], torch.stack([p, onehot(3)]), g) == (1, 3)
    # p(x) = 0: always rejected, and the correction has p > 0
    for _ in range(50):
        n, nxt = accept([0], torch.full((1, v), 0.2, dtype=torch.float64), torch.stack([p, p]), g)
        assert n == 0 and nxt in (1, 2)
    # deterministic drafter (q one-hot / None): rejected draft is never the correction
    for _ in range(50):
        n, nxt = accept([1], None, torch.stack([p, p]), g)
        assert (n, nxt) in ((1, 1), (1, 2)) or (n == 0 and nxt == 2)
    # an all-zero residual (p and q equal up to rounding) falls back to p, never NaN
    p2 = torch.tensor([0.3, 0.7], dtype=torch.float64)
    q2 = p2 + torch.tensor([1e-17, -1e-17], dtype=torch.float64)
    n, nxt = accept([0], q2[None], torch.stack([p2, p2]), g)
    assert nxt in (0, 1)


def test_a_drafters_non_finite_q_drops_its_drafts_and_the_token_follows_p():
    """A drafter whose numbers overflowed (NaN or inf in q): the round keeps none of its drafts and
    draws the token from the target's p, as a round without drafts would, and the request goes
    on (until stop 52 it failed, though the target's numbers were sound). The target's non-finite
    p still fails its row only."""
    rng = np.random.default_rng(5)
    p = torch.tensor(np.stack([random_dist(rng, 6, 1), random_dist(rng, 6, 0)]))
    bad_q = torch.tensor(random_dist(rng, 6, 0))[None]
    bad_q[0, 3] = float("nan")
    bad_p = p.clone()
    bad_p[1, 0] = float("inf")
    n = 20000
    g = torch.Generator().manual_seed(0)
    counts = np.zeros(6)
    for _ in range(n // 500):  # 500 rows a call, each its own generator's draw
        out = accept_batch([[2]] * 500 + [[2]], [bad_q] * 500 + [bad_q.nan_to_num()], [p] * 500 + [bad_p],
                           [g] * 501)
        assert all(a == 0 for a, _ in out[:500]) and out[500] is None
        counts += np.bincount([t for _, t in out[:500]], minlength=6)
    support = p[0].numpy() > 0
    assert counts[~support].sum() == 0
    assert stats.chisquare(counts[support], n * p[0].numpy()[support]).pvalue > 1e-3


def test_shape_errors():
    with pytest.raises(ValueError):
        accept([1, 2], None, torch.ones(2, 5) / 5)
    with pytest.raises(ValueError):
        accept([1, 2], torch.ones(1, 5) / 5, torch.ones(3, 5) / 5)


@pytest.mark.parametrize("alpha,k", [(0.3, 2), (0.6, 4), (0.8, 6), (0.9, 3)])
def test_yield_formula(alpha, k):
    """With independent acceptance probability alpha, tokens per round = (1 - alpha^(k+1)) / (1 - alpha).

    p = (alpha, 1 - alpha) over two tokens and a deterministic drafter that always proposes 0:
    each draft is kept with probability min(1, p(0)/1) = alpha, independently."""
    p = torch.tensor([alpha, 1 - alpha], dtype=torch.float64).expand(k + 1, 2)
    n = 20000  # one batched call: n sequences of one round
    gens = [torch.Generator().manual_seed(i) for i in range(n)]
    total = sum(a + 1 for a, _ in accept_batch([[0] * k] * n, [None] * n, [p] * n, gens))
    expected = (1 - alpha ** (k + 1)) / (1 - alpha)
    # per-round variance is bounded by (k+1)^2 / 4
    assert abs(total / n - expected) < 5 * (k + 1) / 2 / np.sqrt(n)


@pytest.mark.parametrize("seed", range(6))
def test_the_greedy_shortcut_gives_the_full_rules_outcome(seed):
    """accept_greedy on the logits equals accept_batch on warp's one-hot distributions, drafts
    with and without q, ties (small integer logits: equal maxima in most rows) and -inf entries
    included, for batches of mixed k (0 included)."""
    rng = torch.Generator().manual_seed(seed)
    V, B = 6, 40
    ks = torch.randint(0, 5, (B,), generator=rng).tolist()
    logits = [torch.randint(0, 3, (k + 1, V), generator=rng).float() for k in ks]
    for lg in logits[::3]:
        lg[:, 0] = float("-inf")  # a token the model rules out
    greedy = SamplingParams()
    drafts = []
    for lg, k in zip(logits, ks):  # drafts that often agree with the argmax, and sometimes not
        best = lg.argmax(-1).tolist()
        drafts.append([best[i] if torch.rand(1, generator=rng).item() < 0.7 else int(torch.randint(0, V, (1,),
                       generator=rng)) for i in range(k)])
    qs = [None if b % 2 else (torch.nn.functional.one_hot(torch.tensor(d, dtype=torch.long), V).float() * 0.6 + 0.4 / V
                              if d else None) for b, d in enumerate(drafts)]
    full = accept_batch(drafts, qs, [warp(lg, greedy) for lg in logits], [None] * B)
    assert accept_greedy(drafts, logits) == full
    assert all(o is not None for o in full)


def test_the_greedy_shortcut_fails_a_row_with_nan_or_inf_logits_only():
    ok = torch.tensor([[0.0, 2.0, 1.0], [3.0, 0.0, float("-inf")]])
    nan, inf = ok.clone(), ok.clone()
    nan[1, 2], inf[0, 0] = float("nan"), float("inf")
    # draft 1 is the argmax at position 0 (kept), then the bonus is position 1's argmax, 0; the
    # draft 2 is not (the argmax 1 is written instead)
    assert accept_greedy([[1], [1], [1], [2]], [ok, nan, inf, ok]) == [(1, 0), None, None, (0, 1)]
    assert accept_greedy([[]], [ok[:1]]) == [(0, 1)]  # plain decoding: the argmax
    with pytest.raises(ValueError):
        accept_greedy([[1, 2]], [ok])


def test_a_seeded_row_draws_the_same_alone_and_beside_longer_drafts():
    """What a sampled request draws depends on its own drafts only: its outcome, and its generator's
    state after the round, are the same alone and in a batch with a longer draft (until stop 47 every
    row drew as many uniforms as the batch's longest draft, so a seeded request's text changed with
    the requests beside it)."""
    V, rng = 16, np.random.default_rng(5)

    def dist(rows):
        return torch.softmax(torch.tensor(rng.normal(size=(rows, V)), dtype=torch.float32), -1)

    for seed in range(40):
        q, p = dist(2), dist(3)
        drafts = [int(torch.multinomial(q[i], 1, generator=torch.Generator().manual_seed(seed + i))) for i in range(2)]
        other_q, other_p = dist(5), dist(6)
        other = [int(torch.multinomial(other_q[i], 1)) for i in range(5)]
        alone_g, batched_g = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed)
        alone = accept_batch([drafts], [q], [p], [alone_g])[0]
        batched = accept_batch([other, drafts], [other_q, q], [other_p, p],
                               [torch.Generator().manual_seed(10_000 + seed), batched_g])[1]
        assert batched == alone, seed
        assert torch.equal(alone_g.get_state(), batched_g.get_state()), seed
