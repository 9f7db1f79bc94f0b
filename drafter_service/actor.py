"""The drafter as a Ray actor: loads the drafter model, starts the gRPC server, reports its address.
Started (with restarts) by `specserve.builder.start_drafter`."""

from __future__ import annotations

import ray


@ray.remote
class DrafterActor:
    def __init__(self, model_path: str, pipeline: bool | str = True, threads: int = 1, port: int = 0,
                 max_sequences: int = 64, seq_ttl_s: float = 600.0, device: str = "auto",
                 dtype: str = "auto", q_dtype: str = "float32", compile: bool | str = "auto", fanout: int = 1,
                 draft_vocab: str | int = "auto"):
        import torch
        from transformers.utils import logging as hf_logging

        from specserve.core.runner import ModelRunner
        from specserve.drafter.server import serve

        torch.set_num_threads(threads)
        hf_logging.disable_progress_bar()
        runner = ModelRunner.from_pretrained(model_path, name="drafter", role="drafter", device=device, dtype=dtype,
                                             compile=compile, draft_vocab=draft_vocab)  # its GPU, if it holds one
        host = ray.util.get_node_ip_address()  # this node's address only, never every interface
        self.server, self.port, self.servicer = serve(runner.model, host=host, port=port, pipeline=pipeline,
                                                      max_sequences=max_sequences, seq_ttl_s=seq_ttl_s,
                                                      q_dtype=q_dtype, compile=runner.compiled, fanout=fanout,
                                                      bf16_head=runner.bf16_head, vocab=runner.vocab)
        self.address = f"{host}:{self.port}"

    def get_address(self) -> str:
        return self.address

    def cpu_seconds(self) -> float:
        """CPU seconds of this actor's whole process so far (every thread: for benchmarks)."""
        import time
        return time.process_time()

    def times(self) -> dict:
        """The server's DrafterTimes so far (counts and seconds: for benchmarks)."""
        return self.servicer.times.to_dict()

    def accelerator_ids(self) -> list[str]:
        return ray.get_runtime_context().get_accelerator_ids().get("GPU", [])

    def live_sequences(self) -> int:
        return self.servicer.live_sequences

    def draft_vocab_size(self) -> int | None:
        """Tokens in the server's draft vocabulary (greedy drafting), or None: every token."""
        vocab = self.servicer.inner.runner.vocab
        return None if vocab is None else len(vocab)

    def pid(self) -> int:
        import os
        return os.getpid()

    def stop(self) -> None:
        self.server.stop(grace=1.0)
