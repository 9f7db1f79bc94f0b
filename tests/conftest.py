import copy
import itertools
import os
import socket

import numpy as np
import pytest
import torch
from scipy import stats

from specserve.core.sampling import warp

# One thread per process: the suite runs on 2 cores next to other processes (Ray actors, and
# possibly a training run); oversubscribed intra-op threads make torch many times slower.
torch.set_num_threads(1)
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session")
def tiny_pair_dir(tmp_path_factory):
    """A saved tiny target/drafter pair sharing one tokenizer (what `specserve make-tiny-pair` writes)."""
    from specserve.training.tiny import make_tiny_pair
    out = tmp_path_factory.mktemp("tiny_pair")
    target, drafter = make_tiny_pair(str(out), seed=0)
    return {"target": target, "drafter": drafter, "root": str(out)}


@pytest.fixture(scope="session")
def ray_session():
    """One Ray instance for the whole session, with logical GPUs for placement tests. Under
    pytest-xdist (the README's command) each worker process has a session, and so a local Ray, of
    its own."""
    import ray

    from specserve.cluster.pair import start_ray
    try:
        start_ray(num_cpus=8, num_gpus=4, include_dashboard=False)
    except Exception as e:  # Ray waits 30 s (hard-coded) for its raylet; two workers starting theirs at once on
        if "timed out during startup" not in str(e):  # 2 busy cores missed it once in stop 62's CI, and every
            raise                                      # test of that worker that needs Ray errored: once more
        ray.shutdown()
        start_ray(num_cpus=8, num_gpus=4, include_dashboard=False)
    yield ray
    ray.shutdown()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def eventually(check, within_s: float = 5.0) -> bool:
    """Whether check() comes true within the time (polled): for what a drafter applies a moment
    after the call that asked for it returned (a Release is sent and not waited for)."""
    import time
    deadline = time.monotonic() + within_s
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def top2_gap(model, tokens) -> tuple[float, float]:
    """(the gap between a model's two largest logits after `tokens`, the largest), in float32 from
    its dtype: where speculative and plain greedy decoding part, the tests allow only a near-tie.
    model: a Hugging Face causal LM or a ModelRunner (its model)."""
    model = model if isinstance(model, torch.nn.Module) else model.model
    with torch.no_grad():
        top = torch.topk(model(torch.tensor([tokens])).logits[0, -1].float(), 2).values
    return float(top[0] - top[1]), float(top[0])


# exact distributions and their tests, for the sampling checks of several paths


def sequence_probs(target, prompt, params, n):
    """p(t1, ..., tn) of the target under the warped distribution, exactly: an array of shape (v,) * n."""
    with torch.no_grad():
        v = target.config.vocab_size
        joint = np.ones(1)
        for length in range(n):
            prefixes = torch.tensor(list(itertools.product(range(v), repeat=length)), dtype=torch.long).reshape(v ** length, length)
            ids = torch.cat([torch.tensor(prompt).expand(len(prefixes), -1), prefixes], dim=1)
            rows = warp(target(ids).logits[:, -1], params).double().numpy()  # warp takes [..., V]
            joint = (joint[:, None] * rows).reshape(-1)
    return joint.reshape((v,) * n)


def chi_square(counts, want):
    """Pearson's test of counts against probabilities, cells expecting fewer than 5 pooled."""
    counts, expected = counts.reshape(-1), counts.sum() * want.reshape(-1) / want.sum()
    big = expected >= 5
    if big.all():  # nothing to pool (an empty pooled cell, 0 of 0 expected, made the statistic NaN)
        return stats.chisquare(counts, expected).pvalue
    return stats.chisquare(np.append(counts[big], counts[~big].sum()),
                           np.append(expected[big], expected[~big].sum())).pvalue


SIX_TOKEN_CHECKS = ((0, 1), (2, 3), (4, 5), (2,), (3,), (4,), (5,))  # joints of pairs, and each later token


def assert_follows(sequences, want, keeps=SIX_TOKEN_CHECKS, context=None) -> None:
    """The sampled token sequences against the target's exact distribution `want` (from
    `sequence_probs`): none has a token outside its support, and chi_square on the marginal of each
    tuple of token positions in keeps is above 1e-4 (seven checks: 7e-4 of false alarms)."""
    counts = np.zeros(want.shape)
    for tokens in sequences:
        counts[tuple(tokens)] += 1
    assert counts[want == 0].sum() == 0, "a token outside the target's support"
    p_values = {}
    for keep in keeps:
        axes = tuple(a for a in range(counts.ndim) if a not in keep)
        p_values[keep] = chi_square(counts.sum(axis=axes), want.sum(axis=axes))
    assert min(p_values.values()) > 1e-4, (p_values, context)


def near(model, noise, seed):
    """A copy of `model` with Gaussian noise of `noise` times each weight's spread: a drafter that
    agrees with it often but not always."""
    out = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for w in out.parameters():
            w.add_(noise * w.std() * torch.randn(w.shape, generator=g))
    return out
