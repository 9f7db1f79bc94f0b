"""The verifier's side of the gRPC contract: a Proposer whose drafts come from a remote drafter.

The engine's loop does not change: `SpeculativeEngine(target, RemoteProposer(resolve))` runs the
same draft -> verify -> accept rounds, with each draft fetched over gRPC.

Proposes travel on one long-lived bidirectional stream per connection (`ProposeStream`): no call
is set up per round, and a call can be sent now and collected later (`send`, then `receive`), so
the engine sends a round's outcome as soon as acceptance is decided and does its bookkeeping
while the drafter drafts. Start, Release and Info stay unary calls; before an Info every Propose
in flight is collected, before a Release those carrying a released sequence (a Release never
overtakes a Propose of the same sequence). A Release is sent and not waited for: the drafter
answers it at once, but the round trip cost the engine's loop 2-3 ms per Release at two
sequences, the drafter's process busy with the other's work (benchmarks/diagnostics/k0_costs.py);
its answer is read by the next Start (so a Start never overtakes a Release, and the drafter has
the released slots back before it counts its free ones) or Release. A Start waits for no Propose
(its new sequences have none in flight) and touches only its own sequences, so the engine may
send it from a helper thread while its loop proposes on the stream.

Failures: every RPC has a deadline sized to its work (`deadline`). An RPC error or a missed
deadline raises `DrafterUnavailable` (the drafter's own refusals become CapacityError /
ValueError), and the engine then serves target-only and calls `mark_failed`. A background thread
then finds the drafter again through `resolve` (a restarted or recreated actor has a new
address) and connects; `recovered()` swaps the new connection in. Given the drafter actor's
handle (`specserve.builder.DrafterHandle`), it also restarts a hung one: a drafter that Ray
reports running but that cannot be reached for `hang_s` (its actor does not answer, or its gRPC
server does not answer Info, which does not wait for the model lock, so a drafter busy with a
long job still answers it: a stopped process, a wedged GPU call) would otherwise leave the pair
on the fallback for good. Sequence ids on the wire carry
the connection's epoch, so a drafter that only missed a deadline (its old sequences still live,
reclaimed there after their TTL) never sees an id twice.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from typing import Callable

import grpc
import torch

from specserve.core.proposer import CapacityError, Draft, ProposeItem, Proposer
from specserve.core.sampling import SamplingParams
from specserve.proto import speculative_pb2 as pb
from specserve.proto import speculative_pb2_grpc as pb_grpc
from specserve.proto.codec import PROTOCOL_VERSION, q_from_proto, sampling_to_proto
from specserve.proto.transport import channel_options

log = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 10.0


def deadline(method: str, tokens: int = 0) -> float:
    """Seconds an RPC may take: a fixed allowance (scheduling, a GC pause, a loaded machine) plus
    the work it carries, counted in drafter token positions. A healthy drafter answers in
    milliseconds; these bound how long a hung one can stall a round."""
    base, per_token = {"Start": (5.0, 0.005), "Propose": (5.0, 0.02), "Release": (2.0, 0.0),
                       "Info": (CONNECT_TIMEOUT_S, 0.0)}[method]
    return base + per_token * tokens


class DrafterUnavailable(RuntimeError):
    """The drafter did not answer (connection lost, deadline missed, internal error)."""


class IncompatibleDrafter(RuntimeError):
    """The drafter answers but cannot serve this verifier (another protocol, another vocabulary)."""


class DrafterClient:
    """One channel to one drafter server."""

    def __init__(self, address: str, connect_timeout_s: float = CONNECT_TIMEOUT_S):
        self.address = address
        self.channel = grpc.insecure_channel(address, options=channel_options())
        self.stub = pb_grpc.DrafterStub(self.channel)
        try:
            grpc.channel_ready_future(self.channel).result(timeout=connect_timeout_s)
            self.info = self.stub.Info(pb.InfoRequest(), timeout=connect_timeout_s)
        except Exception:
            self.channel.close()
            raise
        if self.info.protocol_version != PROTOCOL_VERSION:
            self.channel.close()
            raise IncompatibleDrafter(f"the drafter at {address} speaks protocol {self.info.protocol_version}, "
                                      f"this verifier {PROTOCOL_VERSION}")

        self.stream: ProposeStream | None = None

    def call(self, method: str, request, tokens: int = 0):
        return getattr(self.stub, method)(request, timeout=deadline(method, tokens))

    def call_later(self, method: str, request, tokens: int = 0) -> grpc.Future:
        """Sends the call and returns at once; its future holds the answer."""
        return getattr(self.stub, method).future(request, timeout=deadline(method, tokens))

    def send(self, request, tokens: int = 0) -> None:
        """Writes a ProposeRequest on the stream (opened now if there is none)."""
        if self.stream is None:
            self.stream = ProposeStream(self.stub)
        self.stream.send(request, deadline("Propose", tokens))

    def receive(self):
        """The reply to the oldest request on the stream not yet answered. An error ends the
        stream (the next send opens another)."""
        try:
            reply = self.stream.receive()
        except grpc.RpcError:
            self.stream.close()
            self.stream = None
            raise
        if self.stream.expired is not None and not self.stream.pending:  # the watchdog cancelled the stream
            self.stream.close()  # as this reply came: the next send opens another (it went on the dead one,
            self.stream = None   # and its receive took the drafter for failed)
        return reply

    def close(self) -> None:
        if self.stream is not None:
            self.stream.close()
        self.channel.close()


class DeadlineExceeded(grpc.RpcError):
    """A request on the stream was not answered within its deadline (the stream was cancelled)."""

    def __init__(self, seconds: float):
        self.seconds = seconds

    def code(self):
        return grpc.StatusCode.DEADLINE_EXCEEDED

    def details(self):
        return f"no answer on the Propose stream within {self.seconds:.1f} s"


class ProposeStream:
    """One ProposeStream call: requests are written from a queue, replies read in order. Each
    request has a deadline (`deadline`), counted from its send, or from when the verifier asks for
    its reply if that is later: a watchdog thread, waking every WATCH_S, cancels the stream once a
    `receive` has waited on the oldest unanswered one past it. A reply nobody waits for costs no
    round (gRPC reads a message only when asked for it, so an unread one looks unanswered): until
    stop 47 one left unread past its deadline (the policy turned speculation off after an early
    send) cancelled the stream, and the next drafting round took the drafter for failed. The stream
    itself has no deadline: it lives as long as the connection."""

    WATCH_S = 0.05

    def __init__(self, stub):
        self.requests: queue.SimpleQueue = queue.SimpleQueue()
        self.replies = stub.ProposeStream(iter(self.requests.get, None))
        self.pending: deque[tuple[float, float]] = deque()  # (send time, allowed seconds), oldest first
        self.expired: float | None = None  # the allowance that was missed, once the watchdog cancelled
        # the `receive` now waiting: when it began, and the request it waits for (None: none waits)
        self.receiving: tuple[float, tuple[float, float]] | None = None
        self.closed = threading.Event()
        threading.Thread(target=self._watch, name="propose-stream-watchdog", daemon=True).start()

    def send(self, request, seconds: float) -> None:
        self.pending.append((time.monotonic(), seconds))
        self.requests.put(request)

    def receive(self):
        self.receiving = (time.monotonic(), self.pending[0]) if self.pending else None
        try:
            reply = next(self.replies)
        except StopIteration:
            raise DeadlineExceeded(0.0) if self.expired is not None else _Ended() from None
        except grpc.RpcError:
            if self.expired is not None:
                raise DeadlineExceeded(self.expired) from None
            raise
        finally:
            self.receiving = None
        self.pending.popleft()
        return reply

    def _watch(self) -> None:
        while not self.closed.wait(self.WATCH_S):
            waiting = self.receiving  # (read once: the start and the request of one wait, never of two)
            if waiting is None:
                continue
            began, (sent, seconds) = waiting
            if time.monotonic() - max(sent, began) > seconds:
                self.expired = seconds
                self.replies.cancel()
                return

    def close(self) -> None:
        self.closed.set()
        self.requests.put(None)
        self.replies.cancel()


class _Ended(grpc.RpcError):
    """The drafter ended the stream without a status (it shut down)."""

    def code(self):
        return grpc.StatusCode.UNAVAILABLE

    def details(self):
        return "the drafter ended the Propose stream"


class RemoteProposer(Proposer):
    """Proposes through a DrafterClient: one Propose call per round for every active sequence.
    `resolve`: the drafter's address, or a callable that finds it (again, after a failure).
    `drafter`: its actor's handle (`running()`, `restart()`), to restart it after `hang_s` of
    silence while it runs (None: never restarted from here)."""

    def __init__(self, resolve: str | Callable[[], str], drafter=None, hang_s: float = 60.0):
        self.resolve = resolve if callable(resolve) else (lambda: resolve)
        self.drafter, self.hang_s = drafter, hang_s
        self.restarts = 0  # hung drafters restarted
        self.client = DrafterClient(self.resolve())
        self.vocab_size = self.client.info.vocab_size
        self.max_length = self.client.info.max_length
        self.rounds: dict[str, int] = {}
        self.sent_at: dict[str, float] = {}  # sequence -> time.monotonic() of its last call
        self.epoch = 0  # connections so far; part of every sequence id on the wire
        self.reconnects = 0
        self._fresh: DrafterClient | None = None  # a new connection, ready to swap in
        self._reconnecting: threading.Thread | None = None
        self._backoff = 0.25
        self._unanswered: deque[tuple[list[ProposeItem], list[int], bool]] = deque()  # (items, rounds, kept)
        self._kept: list[Draft] | None = None  # the drafts of the last `send`, once read
        self._lost: Exception | None = None  # a Propose's error read by a Start or Release, not yet raised
        self._releases: list[tuple[grpc.Future, list[str]]] = []  # Releases sent, answers not read (future, wire ids)
        self._releases_lock = threading.Lock()  # (a Start may come from a helper thread)
        self._orphans: list[str] = []  # wire ids of the sequences of connections given up, to release

    def _wire_id(self, seq_id: str) -> str:
        return f"{seq_id}.{self.epoch}"

    def _call(self, method: str, request, tokens: int = 0, settle: bool = True):
        if settle:
            self._settle()
        try:
            return self.client.call(method, request, tokens)
        except grpc.RpcError as e:
            self._raise(method, e)

    def _settle(self) -> None:
        """Reads the answers to every Propose in flight before an Info or a Release (calls stay in
        order: a Release never overtakes a Propose of its sequence). An error among them is kept
        for the next Propose (`send`, `receive`) to raise: it belongs to the proposing, not to
        this call."""
        try:
            while self._unanswered:
                self._read_one()
        except (CapacityError, ValueError, DrafterUnavailable) as e:
            self._lost = e

    def _read_one(self) -> None:
        items, rounds, kept = self._unanswered[0]
        try:
            reply = self.client.receive()
            self._unanswered.popleft()
            drafts = self._check(items, rounds, reply)
        except (grpc.RpcError, DrafterUnavailable) as e:
            self._unanswered.clear()
            raise (self._error("Propose", e) if isinstance(e, grpc.RpcError) else e) from None
        if kept:
            self._kept = drafts

    def _raise(self, method: str, e: grpc.RpcError):
        raise self._error(method, e) from None

    def _error(self, method: str, e: grpc.RpcError) -> Exception:
        code, details = e.code(), e.details()
        if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
            return CapacityError(details)
        if code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OUT_OF_RANGE, grpc.StatusCode.ALREADY_EXISTS):
            return ValueError(details)  # (the request's fault, not the drafter's: it runs without it)
        return DrafterUnavailable(f"{method} to {self.client.address}: {code.name}: {details}")

    def start(self, seq_id: str, prompt_ids: list[int], params: SamplingParams) -> None:
        self.start_many([(seq_id, prompt_ids, params)])

    def start_many(self, items: list[tuple[str, list[int], SamplingParams]]) -> None:
        """One Start call for all (the drafter starts all or none), after the answers to the
        Releases sent before it; safe beside the loop's Proposes on another thread (see the
        module's docstring)."""
        self._read_releases(wait=True)
        wire = [self._wire_id(seq_id) for seq_id, _, _ in items]
        try:
            self._call("Start", pb.StartRequest(items=[
                pb.StartItem(seq_id=w, prompt_ids=prompt_ids, sampling=sampling_to_proto(params))
                for w, (_, prompt_ids, params) in zip(wire, items)]), sum(len(p) for _, p, _ in items), settle=False)
        except DrafterUnavailable:  # a missed deadline: the drafter may start them all the same, later. Released
            with self._releases_lock:  # once it is back (until stop 50 they held its slots for its TTL)
                self._orphans.extend(wire)
            raise
        now = time.monotonic()
        for seq_id, _, _ in items:
            self.rounds[seq_id] = 0
            self.sent_at[seq_id] = now

    def due(self, seq_id: str) -> bool:
        """Called last a quarter of the drafter's TTL ago (InfoReply.seq_ttl_s): the drafter
        reclaims a sequence after its TTL, and a Propose for it is then refused (NOT_FOUND),
        which fails the drafter for every sequence. A long rest (speculation off, for instance a veto of the adaptive policy's
        guard under load) sends a sequence nothing for longer than that."""
        sent, ttl = self.sent_at.get(seq_id), self.client.info.seq_ttl_s
        return sent is not None and ttl > 0 and time.monotonic() - sent > ttl / 4

    answers_later = True  # `send` now, `receive` later: the engine sends a round's outcome early

    @property
    def prepares(self) -> bool:
        """Whether the drafter pipelines (it says so in Info)."""
        return bool(self.client.info.pipeline)

    def propose(self, items: list[ProposeItem]) -> list[Draft]:
        """One Propose. A call that only catches the drafter up (every k = 0) is sent and not
        waited for: its answer (nothing to draft) is read before the next call's, so the drafter
        takes the tokens in while the target works."""
        if not any(item.k for item in items):
            self._send(items, kept=False)
            return [Draft([], None) for _ in items]
        self.send(items)
        return self.receive()

    def send(self, items: list[ProposeItem]) -> None:
        """Sends a Propose without waiting for its drafts; `receive` returns them. The drafts of an
        earlier `send` not received yet are dropped (read, and their errors raised, in order)."""
        self._kept = None
        self._unanswered = deque((items, rounds, False) for items, rounds, _ in self._unanswered)
        self._send(items, kept=True)

    def receive(self) -> list[Draft]:
        """The drafts of the last `send` (waiting for them if they are not in yet)."""
        while self._kept is None and self._unanswered:
            self._read_one()
        drafts, self._kept = self._kept, None
        if drafts is None:  # its answer was read, and failed, before: by a Start or Release
            lost, self._lost = self._lost, None
            raise lost or RuntimeError("receive() without a send()")
        self._backoff = 0.25  # healthy again
        return drafts

    def _send(self, items: list[ProposeItem], kept: bool) -> None:
        lost, self._lost = self._lost, None
        if lost is not None:  # an earlier Propose failed (read by a Start or Release)
            raise lost
        now = time.monotonic()
        for item in items:
            self.rounds[item.seq_id] += 1
            self.sent_at[item.seq_id] = now
        request = pb.ProposeRequest(items=[pb.ProposeItem(
            seq_id=self._wire_id(item.seq_id), round=self.rounds[item.seq_id], new_tokens=item.new_tokens, k=item.k,
            min_confidence=item.min_confidence, skip_preparation=not item.prepare)
            for item in items])
        try:
            self.client.send(request, sum(len(item.new_tokens) + item.k for item in items))
        except grpc.RpcError as e:
            self._raise("Propose", e)
        self._unanswered.append((list(items), [self.rounds[item.seq_id] for item in items], kept))

    def _check(self, items: list[ProposeItem], rounds: list[int], reply) -> list[Draft]:
        """The drafts of a reply, checked against what was asked."""
        drafts = []
        if len(reply.drafts) != len(items):
            raise DrafterUnavailable(f"drafter at {self.client.address} answered {len(reply.drafts)} drafts to "
                                     f"{len(items)} sequences")
        for item, r, d in zip(items, rounds, reply.drafts):
            if d.seq_id != self._wire_id(item.seq_id) or d.round != r or len(d.tokens) > item.k:
                raise DrafterUnavailable(f"drafter answered ({d.seq_id}, round {d.round}, {len(d.tokens)} tokens) "
                                         f"to ({item.seq_id}, round {r}, k={item.k})")
            try:
                probs = torch.stack([q_from_proto(q, self.vocab_size) for q in d.q]) if d.q else None
            except (ValueError, RuntimeError) as e:  # (the drafter's fault: a ValueError means the request's)
                raise DrafterUnavailable(f"drafter at {self.client.address} sent a q that does not decode: {e}") from None
            drafts.append(Draft(list(d.tokens), probs, pipeline_hit=d.pipeline_hit, prepared=d.prepared))
        return drafts

    def release(self, seq_id: str) -> None:
        self.release_many([seq_id])

    def release_many(self, seq_ids: list[str]) -> None:
        """One Release call, sent and not waited for (its answer is read later, see the module's
        docstring). It first reads the answers to the Proposes in flight if one of them carries
        a released sequence (a Release never overtakes a Propose of its sequence)."""
        known = [s for s in seq_ids if self.rounds.pop(s, None) is not None]
        for s in known:
            self.sent_at.pop(s, None)
        if not known:
            return
        self._read_releases(wait=False)
        in_flight = {item.seq_id for items, _, _ in self._unanswered for item in items}
        if not in_flight.isdisjoint(known):
            self._settle()
        with self._releases_lock:  # (with those whose Release failed before: sent again)
            wire, self._orphans = [self._wire_id(s) for s in known] + self._orphans, []
        future = self.client.call_later("Release", pb.ReleaseRequest(seq_ids=wire))
        with self._releases_lock:
            self._releases.append((future, wire))

    def _read_releases(self, wait: bool) -> None:
        """Reads the answers to the Releases sent (wait=False: those already in). A Release that
        failed is logged, and its sequences go out again with the next Release (or, once a lost
        drafter is back, with the orphans); until stop 53 they held the drafter's slots for its
        TTL, and a drafter that is gone fails the next Propose."""
        with self._releases_lock:
            sent, self._releases = self._releases, []
            if not wait:
                self._releases = [(f, ids) for f, ids in sent if not f.done()]
                sent = [(f, ids) for f, ids in sent if f.done()]
        for future, ids in sent:
            try:
                future.result()
            except grpc.RpcError as e:
                log.warning("release of %d sequences failed (sent again later): %s", len(ids), self._error("Release", e))
                with self._releases_lock:
                    self._orphans.extend(ids)

    # ---------------------------------------------------------------- failure and recovery
    def abandon(self, seq_ids: list[str]) -> None:
        for s in seq_ids:
            if self.rounds.pop(s, None) is not None:
                self.sent_at.pop(s, None)
                with self._releases_lock:  # (_orphans: a Start's helper thread adds to it too)
                    self._orphans.append(self._wire_id(s))

    def mark_failed(self, error: Exception) -> None:
        self.abandon(list(self.rounds))  # (a copy: a Start's helper thread may add to it)
        with self._releases_lock:  # Releases not answered yet are sent again once the drafter is back (the
            # connection given up cancels them; until stop 52 their sequences held the drafter's slots for its TTL)
            unanswered, self._releases = self._releases, []
            for future, ids in unanswered:
                if not future.done() or future.exception() is not None:
                    self._orphans.extend(ids)
        self._unanswered.clear()
        self._kept = self._lost = None
        if self._reconnecting is None or not self._reconnecting.is_alive():
            delay, self._backoff = self._backoff, min(2 * self._backoff, 10.0)  # a flapping drafter waits longer
            self._reconnecting = threading.Thread(target=self._reconnect, args=(delay,), name="drafter-reconnect",
                                                  daemon=True)
            self._reconnecting.start()

    def _reconnect(self, delay: float) -> None:
        """Background: find the drafter again and connect (retrying), without touching engine state.
        A drafter that runs (per Ray) but stays silent for hang_s is restarted; a restarting one
        (loading its model, however long) is waited for."""
        # the drafter's process (by pid) silent since the failure, and the one restarted last
        watched = self.drafter.running() if self.drafter is not None else None
        silent_since, restarted, refused = time.monotonic(), None, None
        while True:
            time.sleep(delay)
            try:
                client = DrafterClient(self.resolve())
                if client.info.vocab_size != self.vocab_size:
                    client.close()
                    raise IncompatibleDrafter(f"the drafter at {client.address} has a vocabulary of "
                                              f"{client.info.vocab_size}, the target {self.vocab_size}")
            except IncompatibleDrafter as e:  # it answers: no hang to restart it for (until stop 53 it was
                if str(e) != refused:  # restarted every hang_s, as if silent); said once, then retried
                    log.error("%s; speculating resumes once a drafter that fits is back", e)
                    refused = str(e)
                silent_since = time.monotonic()
                delay = min(2 * delay, 5.0)
                continue
            except Exception as e:
                if self.drafter is not None:
                    pid = self.drafter.running()
                    if pid != watched:  # another process (or none, restarting): its own hang_s from now
                        watched, silent_since = pid, time.monotonic()
                    elif pid is not None and pid != restarted and time.monotonic() - silent_since >= self.hang_s:
                        log.warning("the drafter (pid %d) runs but has not answered for %.0f s (%s); restarting it",
                                    pid, time.monotonic() - silent_since, type(e).__name__)
                        try:
                            self.drafter.restart()  # (Ray still reports it running for seconds: restarted once)
                        except Exception as err:  # (Ray's own trouble: this loop goes on, and tries again)
                            log.warning("restarting the drafter failed: %r", err)
                            continue
                        self.restarts += 1
                        restarted = pid
                delay = min(2 * delay, 5.0)
                continue
            self._fresh = client
            return

    def recoverable(self) -> bool:
        return self._fresh is not None

    def recovered(self) -> bool:
        fresh, self._fresh = self._fresh, None
        if fresh is None:
            return False
        old, self.client = self.client, fresh
        old.close()
        self._unanswered.clear()
        self._kept = self._lost = None
        self.epoch += 1
        self.reconnects += 1
        self.max_length = fresh.info.max_length
        self.rounds.clear()
        self.sent_at.clear()
        with self._releases_lock:  # the last connection's sequences: a drafter still up (the connection was
            orphans, self._orphans = self._orphans, []  # given up for a missed deadline) frees them now, not after its TTL
            if orphans:
                self._releases.append((self.client.call_later("Release", pb.ReleaseRequest(seq_ids=orphans)), orphans))
        return True
