"""The verifier as a Ray actor: the target runner and the engine's continuous-batching loop
(batched scoring, exact acceptance, per-slot KV rollback), drafting over gRPC from the pair's
drafter. Built by `specserve.builder.build_engine`, like every other verifier."""

from __future__ import annotations

import ray


@ray.remote
class VerifierActor:
    def __init__(self, config: dict, drafter=None):
        """drafter: the pair's `specserve.builder.DrafterHandle` (None: the drafter colocated in this
        process, or none, and then n-gram drafting, as the config says)."""
        import torch
        from transformers.utils import logging as hf_logging

        from specserve.builder import build_engine
        from specserve.config import SpecServeConfig

        cfg = SpecServeConfig.from_dict(config)
        torch.set_num_threads(cfg.threads)
        hf_logging.disable_progress_bar()
        self.drafter = drafter
        self.engine = build_engine(cfg, drafter)
        self.engine.start()

    def generate(self, request_id: str, prompt_ids: list[int], max_new_tokens: int, sampling: dict, k: int,
                 ignore_eos: bool = False, method: str | None = None) -> dict:
        """Returns {"token_ids", "finish_reason", "stats", "start", "chunks"} (chunks: (time, tokens)
        per round, on this actor's monotonic clock); raises ValueError for a bad request and
        Overloaded when the queue is full."""
        import time

        from specserve.core.sampling import SamplingParams

        start = time.monotonic()
        req = self.engine.submit(prompt_ids, max_new_tokens, SamplingParams(**sampling), k, request_id=request_id,
                                 ignore_eos=ignore_eos, method=method)
        req.done.wait()
        result = req.result()
        return {"token_ids": result.token_ids, "finish_reason": result.finish_reason, "stats": result.stats.to_dict(),
                "start": start, "chunks": req.chunks}

    def policy(self) -> dict:
        """The speculation policy's current costs and estimates."""
        return self.engine.policy.state()

    def times(self) -> dict:
        """Where the engine loop's time has gone so far: {"rounds", "seconds": {phase: s}}."""
        return self.engine.times.to_dict()

    def cancel(self, request_id: str) -> bool:
        """Ends the request before its next round; its KV state is released on both sides."""
        return self.engine.cancel(request_id)

    def load(self) -> dict:
        e = self.engine
        return {"running": e.num_running, "waiting": e.num_waiting,
                "free_slots": len(e.free_slots), "max_num_seqs": e.max_num_seqs}

    def health(self) -> dict:
        return self.engine.health()

    def cpu_seconds(self) -> float:
        """CPU seconds of this actor's whole process so far (every thread: for benchmarks)."""
        import time
        return time.process_time()

    def accelerator_ids(self) -> list[str]:
        return ray.get_runtime_context().get_accelerator_ids().get("GPU", [])
