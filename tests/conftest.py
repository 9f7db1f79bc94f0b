import os
import socket

import pytest
import torch

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
    """One Ray instance for the whole session, with logical GPUs for placement tests."""
    import ray

    from specserve.cluster.pair import start_ray
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
