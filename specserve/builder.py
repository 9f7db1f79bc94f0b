"""The one way to build a speculative pair from a `SpecServeConfig`. Every path goes through
here, so every path gets the same checks (model folders load, drafter and target share one
tokenizer, the drafter's vocabulary matches over the wire, its draft vocabulary is usable):

Every engine built here has the n-gram proposer too (the default without a drafter, the
fallback while the drafter is down) and the config's speculation policy.

- `build_engine(cfg)`: in process, the target and (if any) the drafter in this process
  (`specserve generate`, benchmarks, tests, and a colocated pair's verifier: `colocate`);
- `build_engine(cfg, drafter)`: the verifier's side of a distributed pair, drafting over gRPC
  (the Ray pair's verifier actor, each Serve replica); `drafter` is the drafter actor's
  `DrafterHandle` (found again after a failure, and restarted if it hangs), an address, or a
  callable that finds it;
- `start_drafter(cfg, scheduling_strategy)`: the drafter's side, a Ray actor running the gRPC
  server, restarted by Ray when its process dies and recreated when it was killed for good;
  returns its `DrafterHandle`.
"""

from __future__ import annotations

from typing import Callable

from specserve.config import SpecServeConfig
from specserve.core.draft_vocab import resolve as draft_vocab_ids
from specserve.core.runner import ModelRunner, check_weights, context_length, load_tokenizer, read_config, same_tokenizer


def check_pair(cfg: SpecServeConfig):
    """Raises ModelLoadError for a folder that does not load and ValueError for a drafter whose
    tokenizer differs from the target's. Returns the target's tokenizer."""
    for path in (cfg.target, cfg.drafter):
        if path is not None:
            check_weights(path)
    tokenizer = load_tokenizer(cfg.target)
    if cfg.drafter is not None and not same_tokenizer(tokenizer, load_tokenizer(cfg.drafter)):
        raise ValueError(f"the drafter's tokenizer ({cfg.drafter}) differs from the target's ({cfg.target}); "
                         "speculative decoding needs one shared vocabulary")
    if cfg.drafter is not None:  # its draft vocabulary (file and setting) before any actor starts
        draft_vocab_ids(cfg.drafter, cfg.draft_vocab, len(tokenizer))
    if cfg.max_model_len is not None:  # (until stop 62 cut to the context, said only in the replica's log)
        check_model_len(cfg)
    return tokenizer


def check_model_len(cfg: SpecServeConfig) -> None:
    """Refuses a `max_model_len` beyond the context of the models that will run (as vLLM does)."""
    models = {"target": cfg.target}
    if cfg.drafter is not None and cfg.k:
        models["drafter"] = cfg.drafter
    contexts = {name: context_length(read_config(path)) for name, path in models.items()}
    most = min(contexts.values())
    if cfg.max_model_len > most:
        told = ", ".join(f"the {name}'s {n}" for name, n in contexts.items())
        raise ValueError(f"max_model_len {cfg.max_model_len} is more than the models' context ({told} tokens): "
                         f"set it to at most {most}, or leave it unset")


def build_engine(cfg: SpecServeConfig, drafter: DrafterHandle | str | Callable[[], str] | None = None,
                 checked: bool = False):
    """The verifier side: target runner + proposer + engine (not started). drafter: where the
    remote drafter is (None: in this process, or none); a `DrafterHandle` is also restarted when
    it hangs (`cfg.drafter_hang_s`). checked: the caller ran `check_pair(cfg)` already (it is not
    run again)."""
    from specserve.verifier.engine import SpeculativeEngine

    if not checked:
        check_pair(cfg)
    target = ModelRunner.from_pretrained(cfg.target, name="target", slots=cfg.max_num_seqs, device=cfg.device,
                                         dtype=cfg.dtype, compile=cfg.compile)
    target.warmup(widths=(1, cfg.k + 1))  # compiles now (when compiled), not on the first request
    proposer = None
    if cfg.drafter is not None and drafter is not None:
        from specserve.verifier.client import RemoteProposer
        handle = drafter if isinstance(drafter, DrafterHandle) else None  # (the engine checks the vocabulary)
        proposer = RemoteProposer(handle.address if handle else drafter, drafter=handle, hang_s=cfg.drafter_hang_s)
    elif cfg.drafter is not None:
        from specserve.drafter.draft_model import DraftModelProposer
        drafter = ModelRunner.from_pretrained(cfg.drafter, name="drafter", role="drafter", slots=cfg.max_num_seqs,
                                              device=cfg.device, dtype=cfg.dtype, compile=cfg.compile,
                                              draft_vocab=cfg.draft_vocab)
        drafter.warmup(widths=(1,))
        proposer = DraftModelProposer(drafter)
    return SpeculativeEngine(target, proposer, max_num_seqs=cfg.max_num_seqs, max_waiting=cfg.max_waiting,
                             max_model_len=cfg.max_model_len, request_timeout_s=cfg.request_timeout_s,
                             ngram=True, speculation=cfg.speculation, max_k=max(cfg.k, 1), hang_s=cfg.engine_hang_s,
                             k_limit=cfg.k)


class DrafterHandle:
    """A pair's drafter actor. Ray restarts it when its process dies (max_restarts); `address()`
    finds it again (a restarted server listens on a new port) and recreates the actor if it was
    killed for good; `restart()` has Ray start a hung one again (the verifier's RemoteProposer
    decides, with `running()`). Picklable: the verifier actor resolves through its own copy."""

    # a start loads the model and, on a GPU, compiles it and records CUDA graphs: a large drafter on
    # a cold compile cache may take minutes (120 s until stop 50, which such a start could exceed)
    RESOLVE_TIMEOUT_S = 600.0
    RERESOLVE_TIMEOUT_S = 10.0  # later: the caller (the verifier's reconnect loop) asks again

    def __init__(self, cfg: SpecServeConfig, scheduling_strategy=None):
        self.cfg = cfg
        self.scheduling_strategy = scheduling_strategy
        # decided once, with its bundle: a drafter recreated hours later asked the cluster again
        # (use_gpu: null), and a GPU that joined since did not fit the CPU bundle it was placed in
        self.num_gpus = cfg.bundle().get("GPU", 0)
        self.actor = None
        self.resolved = False  # answered once: later resolves wait RERESOLVE_TIMEOUT_S, not the first start's
        self._start()

    def _start(self) -> None:
        from specserve.drafter.actor import DrafterActor

        cfg = self.cfg
        self.actor = DrafterActor.options(num_cpus=cfg.cpus_per_actor, num_gpus=self.num_gpus,
                                          max_restarts=-1, scheduling_strategy=self.scheduling_strategy).remote(
            cfg.drafter, cfg.pipeline, cfg.threads, max_sequences=cfg.max_num_seqs, seq_ttl_s=cfg.drafter_seq_ttl_s,
            device=cfg.device, dtype=cfg.dtype, q_dtype=cfg.q_dtype, compile=cfg.compile, fanout=cfg.fanout,
            draft_vocab=cfg.draft_vocab)

    def address(self) -> str:
        """Raises GetTimeoutError when the actor does not answer in time (restarting, hung)."""
        import ray

        try:
            address = ray.get(self.actor.get_address.remote(),
                              timeout=self.RERESOLVE_TIMEOUT_S if self.resolved else self.RESOLVE_TIMEOUT_S)
        except ray.exceptions.ActorDiedError as e:  # killed for good (no restart): a new one in its place,
            if e.actor_init_failed:  # unless its constructor raised: a second would too (it loaded twice)
                raise
            self._start()
            address = ray.get(self.actor.get_address.remote(), timeout=self.RESOLVE_TIMEOUT_S)
        self.resolved = True
        return address

    def started(self) -> str:
        """Waits for the drafter's first start (RESOLVE_TIMEOUT_S) and returns its address; a start
        that failed raises, and a drafter killed for good meanwhile is not recreated from here: a
        pair's verifier, started beside it with its own copy of this handle, does that (one
        copy only, so one new actor for the drafter's one bundle)."""
        import ray

        return ray.get(self.actor.get_address.remote(), timeout=self.RESOLVE_TIMEOUT_S)

    def running(self) -> int | None:
        """The process id of the actor's running process; None while it restarts (its model
        loading), once it is dead, and when Ray cannot say. (Ray's public state API needs the
        dashboard; this asks the GCS as `ray.util.state` would, through this worker's connection.)"""
        from ray._private import state

        try:
            actor = state.actors(self.actor._actor_id.hex())
            return int(actor["Pid"]) if actor["State"] == "ALIVE" else None
        except Exception:
            return None

    def restart(self) -> None:
        """Kills the actor's process; Ray starts it again (a new port: `address()` finds it)."""
        import ray

        ray.kill(self.actor, no_restart=False)

    def kill(self) -> None:
        import ray

        ray.kill(self.actor)


def start_drafter(cfg: SpecServeConfig, scheduling_strategy=None, checked: bool = False,
                  wait: bool = True) -> DrafterHandle:
    """Checks the pair (`check_pair`: a folder that does not load, another tokenizer or a bad draft
    vocabulary is a clear error here, before any actor starts; unless `checked`: the caller did),
    then starts the drafter actor (model + gRPC server) for cfg and, with `wait`, waits until it
    serves. Without it the caller loads the target meanwhile (`build_engine(cfg, handle)` finds
    the drafter once its target is loaded: a failed drafter start raises there), and kills the
    handle if its own start fails."""
    import ray

    if not checked:
        check_pair(cfg)
    handle = DrafterHandle(cfg, scheduling_strategy)
    if not wait:
        return handle
    try:
        handle.address()
    except Exception:
        ray.kill(handle.actor)
        raise
    return handle
