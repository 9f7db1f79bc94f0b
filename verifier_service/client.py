"""The verifier's side of the gRPC contract: a Proposer whose drafts come from a remote drafter.

The engine's loop does not change: `SpeculativeEngine(target, RemoteProposer(resolve))` runs the
same draft -> verify -> accept rounds, with each draft fetched over gRPC.

Failures: every RPC has a deadline sized to its work (`deadline`). An RPC error or a missed
deadline raises `DrafterUnavailable` (the drafter's own refusals become CapacityError /
ValueError), and the engine then serves target-only and calls `mark_failed`. A background thread
then finds the drafter again through `resolve` (a restarted or recreated actor has a new
address) and connects; `recovered()` swaps the new connection in. Sequence ids on the wire carry
the connection's epoch, so a drafter that only missed a deadline (its old sequences still live,
reclaimed there after their TTL) never sees an id twice.
"""

from __future__ import annotations

import threading
import time
from typing import Callable

import grpc
import torch

from specserve.core.proposer import CapacityError, Draft, ProposeItem, Proposer
from specserve.core.sampling import SamplingParams
from specserve.proto import speculative_pb2 as pb
from specserve.proto import speculative_pb2_grpc as pb_grpc
from specserve.proto.codec import PROTOCOL_VERSION, q_from_proto, sampling_to_proto

CONNECT_TIMEOUT_S = 10.0
MAX_MESSAGE_BYTES = 64 << 20


def deadline(method: str, tokens: int = 0) -> float:
    """Seconds an RPC may take: a fixed allowance (scheduling, a GC pause, a loaded machine) plus
    the work it carries, counted in drafter token positions. A healthy drafter answers in
    milliseconds; these bound how long a hung one can stall a round."""
    base, per_token = {"Start": (5.0, 0.005), "Propose": (5.0, 0.02), "Release": (2.0, 0.0),
                       "Info": (CONNECT_TIMEOUT_S, 0.0)}[method]
    return base + per_token * tokens


class DrafterUnavailable(RuntimeError):
    """The drafter did not answer (connection lost, deadline missed, internal error)."""


class DrafterClient:
    """One channel to one drafter server."""

    def __init__(self, address: str, connect_timeout_s: float = CONNECT_TIMEOUT_S):
        self.address = address
        self.channel = grpc.insecure_channel(address, options=[("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                                                               ("grpc.max_send_message_length", MAX_MESSAGE_BYTES)])
        self.stub = pb_grpc.DrafterStub(self.channel)
        try:
            grpc.channel_ready_future(self.channel).result(timeout=connect_timeout_s)
            self.info = self.stub.Info(pb.InfoRequest(), timeout=connect_timeout_s)
        except Exception:
            self.channel.close()
            raise
        if self.info.protocol_version != PROTOCOL_VERSION:
            self.channel.close()
            raise RuntimeError(f"the drafter at {address} speaks protocol {self.info.protocol_version}, "
                               f"this verifier {PROTOCOL_VERSION}")

    def call(self, method: str, request, tokens: int = 0):
        return getattr(self.stub, method)(request, timeout=deadline(method, tokens))

    def call_async(self, method: str, request, tokens: int = 0) -> grpc.Future:
        return getattr(self.stub, method).future(request, timeout=deadline(method, tokens))

    def close(self) -> None:
        self.channel.close()


class RemoteProposer(Proposer):
    """Proposes through a DrafterClient: one Propose call per round for every active sequence.
    `resolve`: the drafter's address, or a callable that finds it (again, after a failure)."""

    def __init__(self, resolve: str | Callable[[], str]):
        self.resolve = resolve if callable(resolve) else (lambda: resolve)
        self.client = DrafterClient(self.resolve())
        self.vocab_size = self.client.info.vocab_size
        self.max_length = self.client.info.max_length
        self.rounds: dict[str, int] = {}
        self.epoch = 0  # connections so far; part of every sequence id on the wire
        self.reconnects = 0
        self._fresh: DrafterClient | None = None  # a new connection, ready to swap in
        self._reconnecting: threading.Thread | None = None
        self._backoff = 0.25
        self._in_flight: tuple[grpc.Future, list[ProposeItem], list[int]] | None = None  # a catch-up call, unanswered

    def _wire_id(self, seq_id: str) -> str:
        return f"{seq_id}.{self.epoch}"

    def _call(self, method: str, request, tokens: int = 0):
        self._settle()
        try:
            return self.client.call(method, request, tokens)
        except grpc.RpcError as e:
            self._raise(method, e)

    def _settle(self) -> None:
        """Collects the answer to the catch-up call in flight, if any, before the next call (calls
        stay in order); its error, if any, is raised here."""
        if self._in_flight is None:
            return
        future, items, rounds = self._in_flight
        self._in_flight = None
        try:
            self._check(items, rounds, future.result())
        except grpc.RpcError as e:
            self._raise("Propose", e)

    def _raise(self, method: str, e: grpc.RpcError):
        code, details = e.code(), e.details()
        if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
            raise CapacityError(details) from None
        if code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OUT_OF_RANGE):
            raise ValueError(details) from None
        raise DrafterUnavailable(f"{method} to {self.client.address}: {code.name}: {details}") from None

    def start(self, seq_id: str, prompt_ids: list[int], params: SamplingParams) -> None:
        self.start_many([(seq_id, prompt_ids, params)])

    def start_many(self, items: list[tuple[str, list[int], SamplingParams]]) -> None:
        """One Start call for all (the drafter starts all or none)."""
        self._call("Start", pb.StartRequest(items=[
            pb.StartItem(seq_id=self._wire_id(seq_id), prompt_ids=prompt_ids, sampling=sampling_to_proto(params))
            for seq_id, prompt_ids, params in items]), sum(len(p) for _, p, _ in items))
        for seq_id, _, _ in items:
            self.rounds[seq_id] = 0

    def propose(self, items: list[ProposeItem]) -> list[Draft]:
        """One Propose call. A call that only catches the drafter up (every k = 0) is sent and
        not waited for: its answer (nothing to draft) is collected before the next call, so the
        drafter takes the tokens in while the target works."""
        self._settle()
        for item in items:
            self.rounds[item.seq_id] += 1
        request = pb.ProposeRequest(items=[pb.ProposeItem(
            seq_id=self._wire_id(item.seq_id), round=self.rounds[item.seq_id], new_tokens=item.new_tokens, k=item.k,
            min_confidence=item.min_confidence)
            for item in items])
        tokens = sum(len(item.new_tokens) + item.k for item in items)
        rounds = [self.rounds[item.seq_id] for item in items]
        if not any(item.k for item in items):
            self._in_flight = (self.client.call_async("Propose", request, tokens), list(items), rounds)
            return [Draft([], None) for _ in items]
        drafts = self._check(items, rounds, self._call("Propose", request, tokens))
        self._backoff = 0.25  # healthy again
        return drafts

    def _check(self, items: list[ProposeItem], rounds: list[int], reply) -> list[Draft]:
        """The drafts of a reply, checked against what was asked."""
        drafts = []
        for item, r, d in zip(items, rounds, reply.drafts, strict=True):
            if d.seq_id != self._wire_id(item.seq_id) or d.round != r or len(d.tokens) > item.k:
                raise DrafterUnavailable(f"drafter answered ({d.seq_id}, round {d.round}, {len(d.tokens)} tokens) "
                                         f"to ({item.seq_id}, round {r}, k={item.k})")
            probs = torch.stack([q_from_proto(q, self.vocab_size) for q in d.q]) if d.q else None
            drafts.append(Draft(list(d.tokens), probs, pipeline_hit=d.pipeline_hit, prepared=d.prepared))
        return drafts

    def release(self, seq_id: str) -> None:
        self.release_many([seq_id])

    def release_many(self, seq_ids: list[str]) -> None:
        known = [s for s in seq_ids if self.rounds.pop(s, None) is not None]
        if known:
            self._call("Release", pb.ReleaseRequest(seq_ids=[self._wire_id(s) for s in known]))

    # ---------------------------------------------------------------- failure and recovery
    def mark_failed(self, error: Exception) -> None:
        self.rounds.clear()
        self._in_flight = None
        if self._reconnecting is None or not self._reconnecting.is_alive():
            delay, self._backoff = self._backoff, min(2 * self._backoff, 10.0)  # a flapping drafter waits longer
            self._reconnecting = threading.Thread(target=self._reconnect, args=(delay,), name="drafter-reconnect",
                                                  daemon=True)
            self._reconnecting.start()

    def _reconnect(self, delay: float) -> None:
        """Background: find the drafter again and connect (retrying), without touching engine state."""
        while True:
            time.sleep(delay)
            try:
                client = DrafterClient(self.resolve())
            except Exception:
                delay = min(2 * delay, 5.0)
                continue
            if client.info.vocab_size != self.vocab_size:
                client.close()
                continue
            self._fresh = client
            return

    def recovered(self) -> bool:
        fresh, self._fresh = self._fresh, None
        if fresh is None:
            return False
        old, self.client = self.client, fresh
        old.close()
        self._in_flight = None
        self.epoch += 1
        self.reconnects += 1
        self.max_length = fresh.info.max_length
        self.rounds.clear()
        return True
