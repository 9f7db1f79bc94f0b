"""The one way to build a speculative pair from a `SpecServeConfig`. Every path goes through
here, so every path gets the same checks (model folders load, drafter and target share one
tokenizer, the drafter's vocabulary matches over the wire):

- `build_engine(cfg)`: in process, the target and (if any) the drafter in this process
  (`specserve generate`, benchmarks, tests);
- `build_engine(cfg, drafter_address)`: the verifier's side of a distributed pair, drafting over
  gRPC (the Ray pair's verifier actor, each Serve replica);
- `start_drafter(cfg, scheduling_strategy)`: the drafter's side, a Ray actor running the gRPC
  server; returns the actor and its address.
"""

from __future__ import annotations

from specserve.config import SpecServeConfig
from specserve.core.runner import ModelRunner, load_tokenizer, same_tokenizer


def check_pair(cfg: SpecServeConfig):
    """Raises ModelLoadError for a folder that does not load and ValueError for a drafter whose
    tokenizer differs from the target's. Returns the target's tokenizer."""
    tokenizer = load_tokenizer(cfg.target)
    if cfg.drafter is not None and not same_tokenizer(tokenizer, load_tokenizer(cfg.drafter)):
        raise ValueError(f"the drafter's tokenizer ({cfg.drafter}) differs from the target's ({cfg.target}); "
                         "speculative decoding needs one shared vocabulary")
    return tokenizer


def build_engine(cfg: SpecServeConfig, drafter_address: str | None = None):
    """The verifier side: target runner + proposer + engine (not started)."""
    from specserve.verifier.engine import SpeculativeEngine

    check_pair(cfg)
    target = ModelRunner.from_pretrained(cfg.target, name="target", slots=cfg.max_num_seqs)
    proposer = None
    if cfg.drafter is not None and drafter_address is not None:
        from specserve.verifier.client import DrafterClient, RemoteProposer
        proposer = RemoteProposer(DrafterClient(drafter_address))
        if proposer.vocab_size != target.vocab_size:
            raise ValueError(f"the drafter's vocabulary ({proposer.vocab_size}) differs from the target's "
                             f"({target.vocab_size})")
    elif cfg.drafter is not None:
        from specserve.drafter.draft_model import DraftModelProposer
        proposer = DraftModelProposer(ModelRunner.from_pretrained(cfg.drafter, name="drafter", slots=cfg.max_num_seqs))
    return SpeculativeEngine(target, proposer, max_num_seqs=cfg.max_num_seqs, max_waiting=cfg.max_waiting,
                             max_model_len=cfg.max_model_len)


def start_drafter(cfg: SpecServeConfig, scheduling_strategy=None):
    """Starts the drafter actor (model + gRPC server) for cfg; returns (actor, address)."""
    import ray

    from specserve.drafter.actor import DrafterActor

    actor = DrafterActor.options(num_cpus=cfg.cpus_per_actor, num_gpus=1 if cfg.gpu() else 0,
                                 scheduling_strategy=scheduling_strategy).remote(
        cfg.drafter, cfg.pipeline, cfg.threads, max_sequences=cfg.max_num_seqs)
    try:
        return actor, ray.get(actor.get_address.remote())
    except Exception:
        ray.kill(actor)
        raise
