"""One speculative pair on Ray: a drafter actor and a verifier actor, placed in a placement group
with one bundle each (one GPU each on GPU clusters), talking gRPC.

    pair = SpeculativePair(target_path, drafter_path, pipeline=True)
    result = pair.generate(prompt_ids, max_new_tokens=64, sampling=SamplingParams(), k=4)
    pair.shutdown()

`generate` has the same signature and returns the same GenerationResult as the in-process engine.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from drafter_service.sampling import SamplingParams
from verifier_service.engine import GenerationResult, Overloaded, SpecStats

TARGET_BUNDLE, DRAFTER_BUNDLE = 0, 1


@dataclass
class PairConfig:
    target: str
    drafter: str | None
    pipeline: bool | str = True  # False, True (default policy) or a policy name: drafter_service.pipeline.POLICIES
    use_gpu: bool | None = None  # None: one GPU per actor when the cluster has GPUs
    strategy: str = "PACK"  # placement strategy for the pair's two bundles
    cpus_per_actor: float = 1.0  # also each actor's torch thread count (at least 1)
    max_num_seqs: int = 8  # sequences batched together in each round
    max_waiting: int = 64  # queued requests beyond which new ones are refused (Overloaded)
    max_model_len: int | None = None  # prompt + generated tokens (default: the models' context)

    def bundles(self) -> list[dict]:
        use_gpu = self.use_gpu if self.use_gpu is not None else ray.cluster_resources().get("GPU", 0) >= 2
        bundle = {"CPU": self.cpus_per_actor, **({"GPU": 1} if use_gpu else {})}
        return [dict(bundle), dict(bundle)]


def ensure_ray() -> None:
    """Connects to the Ray cluster this process is configured for, or starts a local one."""
    if not ray.is_initialized():
        ray.init(logging_level="ERROR", log_to_driver=False)


class SpeculativePair:
    def __init__(self, target: str, drafter: str | None, pipeline: bool = True, **config):
        ensure_ray()
        from drafter_service.actor import DrafterActor
        from verifier_service.actor import VerifierActor

        self.config = PairConfig(target, drafter, pipeline, **config)
        bundles = self.config.bundles()
        self.pg = placement_group(bundles, strategy=self.config.strategy)
        ray.get(self.pg.ready(), timeout=120)
        threads = max(1, int(self.config.cpus_per_actor))

        def opts(index):
            return dict(num_cpus=bundles[index]["CPU"], num_gpus=bundles[index].get("GPU", 0),
                        scheduling_strategy=PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=index))

        self.drafter = None
        try:
            if drafter is not None:
                self.drafter = DrafterActor.options(**opts(DRAFTER_BUNDLE)).remote(
                    drafter, pipeline, threads, max_sequences=self.config.max_num_seqs)
                address = ray.get(self.drafter.get_address.remote())
            else:
                address = None
            c = self.config
            self.verifier = VerifierActor.options(max_concurrency=c.max_num_seqs + c.max_waiting + 8,
                                                  **opts(TARGET_BUNDLE)).remote(
                target, address, threads, c.max_num_seqs, c.max_waiting, c.max_model_len)
            ray.get(self.verifier.accelerator_ids.remote())  # surfaces a load error here
        except Exception:
            self.shutdown()
            raise

    def generate(self, prompt_ids: list[int], max_new_tokens: int, sampling: SamplingParams = SamplingParams(),
                 k: int = 4, request_id: str | None = None) -> GenerationResult:
        ref = self.submit(prompt_ids, max_new_tokens, sampling, k, request_id)
        return self.result(ref)

    def submit(self, prompt_ids, max_new_tokens, sampling=SamplingParams(), k=4, request_id=None, ignore_eos=False):
        """Starts a request; returns a Ray ObjectRef for `result` (or ray.get: the raw dict with
        per-round timings). Cancel it with `cancel(request_id)`."""
        k = k if self.drafter is not None else 0
        return self.verifier.generate.remote(request_id or uuid.uuid4().hex, list(prompt_ids), max_new_tokens,
                                             sampling.to_dict(), k, ignore_eos)

    @staticmethod
    def result(ref) -> GenerationResult:
        try:
            out = ray.get(ref)
        except ray.exceptions.RayTaskError as e:
            if isinstance(e.cause, (ValueError, Overloaded)):
                raise type(e.cause)(str(e.cause)) from None
            raise
        stats = SpecStats(**{k: v for k, v in out["stats"].items() if k in SpecStats.__dataclass_fields__})
        return GenerationResult(out["token_ids"], out["finish_reason"], stats)

    def cancel(self, request_id: str) -> bool:
        return ray.get(self.verifier.cancel.remote(request_id))

    def load(self) -> dict:
        """Running / waiting sequences and free target slots of the verifier."""
        return ray.get(self.verifier.load.remote())

    def shutdown(self) -> None:
        for actor in (getattr(self, "verifier", None), self.drafter):
            if actor is not None:
                ray.kill(actor)
        remove_placement_group(self.pg)


def generate_distributed(target: str, drafter: str | None, prompt: str, max_tokens: int, sampling: SamplingParams,
                         k: int, pipeline: bool = True):
    """For the CLI: start a pair, generate once, shut down. Returns (GenerationResult, tokenizer)."""
    from drafter_service.runner import load_tokenizer

    tokenizer = load_tokenizer(target)
    pair = SpeculativePair(target, drafter, pipeline=pipeline)
    try:
        return pair.generate(tokenizer(prompt)["input_ids"], max_tokens, sampling, k), tokenizer
    finally:
        pair.shutdown()
