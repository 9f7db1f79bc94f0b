"""The verifier as a Ray actor: owns the target runner, is a gRPC client of the drafter, and runs
the engine's continuous-batching loop (batched scoring, exact acceptance, per-slot KV rollback)."""

from __future__ import annotations

import ray


@ray.remote
class VerifierActor:
    def __init__(self, target_path: str, drafter_address: str | None, threads: int = 1, max_num_seqs: int = 8,
                 max_waiting: int = 64, max_model_len: int | None = None):
        import torch
        from transformers.utils import logging as hf_logging

        from drafter_service.runner import ModelRunner
        from verifier_service.client import DrafterClient, RemoteProposer
        from verifier_service.engine import SpeculativeEngine

        torch.set_num_threads(threads)
        hf_logging.disable_progress_bar()
        target = ModelRunner.from_pretrained(target_path, name="target", slots=max_num_seqs)
        proposer = RemoteProposer(DrafterClient(drafter_address)) if drafter_address else None
        if proposer is not None and proposer.vocab_size != target.vocab_size:
            raise ValueError(f"drafter vocabulary ({proposer.vocab_size}) differs from the target's "
                             f"({target.vocab_size})")
        self.engine = SpeculativeEngine(target, proposer, max_num_seqs=max_num_seqs, max_waiting=max_waiting,
                                        max_model_len=max_model_len)
        self.engine.start()

    def generate(self, request_id: str, prompt_ids: list[int], max_new_tokens: int, sampling: dict, k: int,
                 ignore_eos: bool = False) -> dict:
        """Returns {"token_ids", "finish_reason", "stats", "start", "chunks"} (chunks: (time, tokens)
        per round, on this actor's monotonic clock); raises ValueError for a bad request and
        Overloaded when the queue is full."""
        import time

        from drafter_service.sampling import SamplingParams

        start = time.monotonic()
        req = self.engine.submit(prompt_ids, max_new_tokens, SamplingParams(**sampling), k, request_id=request_id,
                                 ignore_eos=ignore_eos)
        req.done.wait()
        result = req.result()
        return {"token_ids": result.token_ids, "finish_reason": result.finish_reason, "stats": result.stats.to_dict(),
                "start": start, "chunks": req.chunks}

    def cancel(self, request_id: str) -> bool:
        """Ends the request before its next round; its KV state is released on both sides."""
        return self.engine.cancel(request_id)

    def load(self) -> dict:
        e = self.engine
        return {"running": e.num_running, "waiting": e.num_waiting,
                "free_slots": len(e.free_slots), "max_num_seqs": e.max_num_seqs}

    def accelerator_ids(self) -> list[str]:
        return ray.get_runtime_context().get_accelerator_ids().get("GPU", [])
