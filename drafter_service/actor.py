"""The drafter as a Ray actor: loads the drafter model, starts the gRPC server, reports its address."""

from __future__ import annotations

import ray


@ray.remote
class DrafterActor:
    def __init__(self, model_path: str, pipeline: bool | str = True, threads: int = 1, port: int = 0,
                 max_sequences: int = 64):
        import torch
        from transformers.utils import logging as hf_logging

        from specserve.core.runner import ModelRunner
        from specserve.drafter.server import serve

        torch.set_num_threads(threads)
        hf_logging.disable_progress_bar()
        runner = ModelRunner.from_pretrained(model_path, name="drafter")
        self.server, self.port, self.servicer = serve(runner.model, port=port, pipeline=pipeline,
                                                      max_sequences=max_sequences)
        self.address = f"{ray.util.get_node_ip_address()}:{self.port}"

    def get_address(self) -> str:
        return self.address

    def accelerator_ids(self) -> list[str]:
        return ray.get_runtime_context().get_accelerator_ids().get("GPU", [])

    def live_sequences(self) -> int:
        return self.servicer.live_sequences

    def stop(self) -> None:
        self.server.stop(grace=1.0)
