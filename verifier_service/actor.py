"""The verifier as a Ray actor: owns the target runner, is a gRPC client of the drafter, and runs
the engine's decode loop (single-pass scoring, exact acceptance, KV rollback)."""

from __future__ import annotations

import threading

import ray


@ray.remote
class VerifierActor:
    def __init__(self, target_path: str, drafter_address: str | None, threads: int = 1):
        import torch
        from transformers.utils import logging as hf_logging

        from drafter_service.runner import ModelRunner
        from verifier_service.client import DrafterClient, RemoteProposer
        from verifier_service.engine import SpeculativeEngine

        torch.set_num_threads(threads)
        hf_logging.disable_progress_bar()
        target = ModelRunner.from_pretrained(target_path, name="target")
        proposer = RemoteProposer(DrafterClient(drafter_address)) if drafter_address else None
        if proposer is not None and proposer.vocab_size != target.vocab_size:
            raise ValueError(f"drafter vocabulary ({proposer.vocab_size}) differs from the target's "
                             f"({target.vocab_size})")
        self.engine = SpeculativeEngine(target, proposer)
        self.lock = threading.Lock()  # one sequence at a time through this engine
        self.active: set[str] = set()  # requests waiting for or holding the engine
        self.cancelled: set[str] = set()

    def generate(self, request_id: str, prompt_ids: list[int], max_new_tokens: int, sampling: dict, k: int) -> dict:
        """Returns {"token_ids", "finish_reason", "stats"}; raises ValueError for a bad request."""
        from drafter_service.sampling import SamplingParams

        params = SamplingParams(**sampling)
        self.active.add(request_id)
        try:
            with self.lock:
                result = self.engine.generate(prompt_ids, max_new_tokens, params, k,
                                              on_tokens=lambda _: request_id not in self.cancelled)
        finally:
            self.active.discard(request_id)
            self.cancelled.discard(request_id)
        return {"token_ids": result.token_ids, "finish_reason": result.finish_reason, "stats": result.stats.to_dict()}

    def cancel(self, request_id: str) -> None:
        """Ends the request after its current round; its KV state is released on both sides."""
        if request_id in self.active:
            self.cancelled.add(request_id)

    def accelerator_ids(self) -> list[str]:
        return ray.get_runtime_context().get_accelerator_ids().get("GPU", [])

    def target_length(self) -> int:
        return self.engine.target.length
