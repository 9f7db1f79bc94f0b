"""Sampling settings and the ONE warping function that turns logits into a distribution.

The drafter uses `warp` to get q and the verifier uses it to get p. Speculative sampling is
exact only if both sides warp with the same (temperature, top_k, top_p), so this is the only
place where that transformation is written.
"""

from __future__ import annotations

import hashlib
import math
import operator
import random
from dataclasses import asdict, dataclass, field

import torch


# Below this temperature (other than 0, greedy) logits / T overflows or rounds every
# distribution to one token: such requests are refused with a clear error, not turned into NaN.
MIN_TEMPERATURE = 1e-3

# A user's seed, through the HTTP API or the CLI: any 64-bit integer, signed or not (OpenAI's are
# int64, -1 included), taken modulo 2**63, so the same seed gives the same text both ways.
SEED_LOW, SEED_HIGH, SEED_RANGE = -2 ** 63, 2 ** 64, 2 ** 63


def is_int_like(t) -> bool:
    """An int-like (an int, a numpy or 0-d torch integer: `operator.index` takes it), not a bool."""
    try:
        operator.index(t)
        return not isinstance(t, bool)
    except TypeError:
        return False


def is_token_id(t) -> bool:
    """An int-like that is >= 0."""
    return is_int_like(t) and operator.index(t) >= 0


def user_seed(seed: int) -> int:
    """The engine's seed for a user's (in [SEED_LOW, SEED_HIGH), checked by the caller)."""
    return seed % SEED_RANGE


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling settings. temperature == 0 means greedy."""

    temperature: float = 0.0
    top_k: int = 0  # 0: no top-k filter
    top_p: float = 1.0  # 1.0: no nucleus filter
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)

    def __post_init__(self):
        t = self.temperature
        if not isinstance(t, (int, float)) or isinstance(t, bool) or not (t == 0 or MIN_TEMPERATURE <= t < math.inf):
            raise ValueError(f"temperature must be 0 (greedy) or a finite number >= {MIN_TEMPERATURE}, got {t!r}")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 disables it), got {self.top_k!r}")
        if not isinstance(self.top_p, (int, float)) or isinstance(self.top_p, bool) or not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)
                                      or not SEED_LOW <= self.seed < SEED_HIGH):
            # (the wire's field is a uint64: a seed outside it made a remote drafter refuse the request,
            # which then ran without speculation, silently, until stop 51)
            raise ValueError(f"seed must be a 64-bit integer, in [-2**63, 2**64), got {self.seed!r}")
        if self.seed is not None:  # as the HTTP API and the CLI take it (until stop 65 a negative seed was refused
            object.__setattr__(self, "seed", user_seed(self.seed))  # here, and one >= 2**63 gave another text)
        if not all(is_token_id(t) for t in self.stop_token_ids):
            # (1.7 was taken as 1, and -5 kept, until stop 61)
            raise ValueError(f"stop_token_ids must be token ids (ints >= 0), got {list(self.stop_token_ids)!r}")
        object.__setattr__(self, "stop_token_ids", tuple(operator.index(t) for t in self.stop_token_ids))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def with_seed(self) -> "SamplingParams":
        """A copy whose seed is fixed (drawn now if the request gave none), so every party
        of a request derives the same random streams."""
        if self.seed is not None:
            return self
        return SamplingParams(**{**asdict(self), "seed": random.getrandbits(63)})

    def to_dict(self) -> dict:
        d = asdict(self)
        d["stop_token_ids"] = list(self.stop_token_ids)
        return d


def warp(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Logits [..., V] -> probabilities [..., V] (float32) under `params`.

    Greedy (temperature 0) gives the one-hot distribution of the argmax, so that the
    acceptance rule needs no special case and draws no random number for it.
    Otherwise: divide by temperature, keep the top_k largest, keep the smallest set whose
    mass reaches top_p (always at least the most likely token), renormalise.
    """
    logits = logits.float()
    if params.greedy:
        # (scatter, not F.one_hot: one_hot checks its indices on the host, a sync on a GPU)
        return torch.zeros_like(logits).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
    logits = logits / params.temperature
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_p, order = torch.sort(probs, dim=-1, descending=True)
        mass_before = torch.cumsum(sorted_p, dim=-1) - sorted_p
        drop_sorted = mass_before >= params.top_p
        drop_sorted[..., 0] = False  # the most likely token always survives (even a top_p that rounds to 0)
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def request_generator(seed: int, stream: str, position: int, device: torch.device | str = "cpu") -> torch.Generator:
    """A generator for one round of one request, derived from (seed, stream, position), on the
    device of the tensors it samples from (so drawing never moves data to the host).

    Deriving the stream from the committed length (instead of carrying one generator along)
    keeps sampled output reproducible whatever speculative work was done and thrown away,
    in one process or across the drafter and verifier actors. The numbers drawn depend on the
    device type (CPU and CUDA generators differ), so a seeded sampled request gives the same
    text run to run on the same kind of device; every device samples the target's distribution.
    """
    digest = hashlib.blake2b(f"{seed}:{stream}:{position}".encode(), digest_size=8).digest()
    g = torch.Generator(device=device)
    g.manual_seed(int.from_bytes(digest, "little") & 0x7FFF_FFFF_FFFF_FFFF)
    return g


def draw(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One token per row of probs [..., V] (weights, need not sum to 1), as a tensor on their
    device: an exponential race, argmax(w / E) with E ~ Exp(1) from `generator`, which picks i
    with probability w_i / sum(w). No device -> host transfer. generator None: the argmax (for a
    one-hot distribution, the same thing, with no draw)."""
    if generator is None:
        return probs.argmax(-1)
    race = torch.empty(probs.shape, dtype=torch.float32, device=probs.device).exponential_(generator=generator)
    return (probs.float() / no_zero(race)).argmax(-1)


def no_zero(race: torch.Tensor) -> torch.Tensor:
    """Exponential draws with an exact 0 (possible on some devices' generators) raised to the
    smallest float: p / 0 is NaN where p is 0, and argmax would take that token, one the warped
    distribution rules out. No draw on the CPU is 0, so nothing there changes."""
    return race.clamp_min_(torch.finfo(race.dtype).tiny)

