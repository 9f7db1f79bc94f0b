"""The gRPC contract: committed stubs are fresh, and bad requests get statuses, not a dead server."""

import filecmp
import os

import grpc
import numpy as np
import pytest
import torch
from scipy import stats

from specserve.training.tiny import tiny_model
from specserve.drafter.server import serve
from specserve.proto.codec import q_from_proto, q_to_proto
from specserve.core.runner import ModelRunner
from specserve.core.sampling import SamplingParams, warp
from specserve.proto import build
from specserve.proto import speculative_pb2 as pb
from specserve.proto import speculative_pb2_grpc as pb_grpc

V = 64


def test_committed_stubs_are_fresh(tmp_path):
    for fresh in build.generate(str(tmp_path)):
        committed = os.path.join(build.PROTO_DIR, os.path.basename(fresh))
        assert filecmp.cmp(fresh, committed, shallow=False), f"{committed} is stale: run `python -m specserve.proto.build`"


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.7), SamplingParams(temperature=1.0, top_k=5),
                                    SamplingParams(temperature=0.5, top_p=0.3)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_q_travels_exactly(params, dtype):
    q = warp(torch.randn(V) * 3, params).to(dtype)
    msg = pb.Distribution.FromString(q_to_proto(q).SerializeToString())
    assert torch.equal(q_from_proto(msg, V), q)


@pytest.fixture(scope="module")
def stub():
    server, port, servicer = serve(tiny_model("llama", V, seed=0), host="127.0.0.1", pipeline=True)
    servicer.address = f"127.0.0.1:{port}"
    channel = grpc.insecure_channel(servicer.address)
    yield pb_grpc.DrafterStub(channel), channel, servicer
    channel.close()
    server.stop(0)


def start(stub, seq_id, prompt=(1, 2, 3), temperature=0.0):
    return stub.Start(pb.StartRequest(items=[pb.StartItem(seq_id=seq_id, prompt_ids=list(prompt),
                                                          sampling=pb.Sampling(temperature=temperature, seed=1))]),
                      timeout=10)


def propose(stub, seq_id, new_tokens=(), k=3, round_=1, skip_preparation=False):
    return stub.Propose(pb.ProposeRequest(items=[pb.ProposeItem(seq_id=seq_id, round=round_, new_tokens=list(new_tokens),
                                                                k=k, skip_preparation=skip_preparation)]), timeout=10)


def code_of(fn):
    with pytest.raises(grpc.RpcError) as e:
        fn()
    assert e.value.details(), "an error status without a message"
    return e.value.code()


def test_bad_requests_get_statuses_and_the_server_keeps_serving(stub):
    s, channel, servicer = stub
    assert code_of(lambda: propose(s, "nope")) == grpc.StatusCode.NOT_FOUND
    assert code_of(lambda: start(s, "")) == grpc.StatusCode.INVALID_ARGUMENT
    assert code_of(lambda: start(s, "a", prompt=())) == grpc.StatusCode.INVALID_ARGUMENT
    assert code_of(lambda: start(s, "a", prompt=(1, V + 5))) == grpc.StatusCode.INVALID_ARGUMENT
    assert code_of(lambda: start(s, "a", prompt=[1] * 5000)) == grpc.StatusCode.OUT_OF_RANGE
    start(s, "ok")
    assert code_of(lambda: start(s, "ok")) == grpc.StatusCode.ALREADY_EXISTS
    assert code_of(lambda: propose(s, "ok", k=17)) == grpc.StatusCode.INVALID_ARGUMENT  # MAX_K = 16
    twice = pb.ProposeRequest(items=[pb.ProposeItem(seq_id="ok", round=1, k=2)] * 2)
    assert code_of(lambda: s.Propose(twice, timeout=10)) == grpc.StatusCode.INVALID_ARGUMENT
    bad_confidence = pb.ProposeRequest(items=[pb.ProposeItem(seq_id="ok", round=1, k=2, min_confidence=1.5)])
    assert code_of(lambda: s.Propose(bad_confidence, timeout=10)) == grpc.StatusCode.INVALID_ARGUMENT
    caught_up = s.Propose(pb.ProposeRequest(items=[pb.ProposeItem(seq_id="ok", round=1, new_tokens=[3, 4], k=0)]),
                          timeout=10)  # k = 0: takes in committed tokens, drafts nothing
    assert list(caught_up.drafts[0].tokens) == []
    assert code_of(lambda: propose(s, "ok", new_tokens=[-1])) == grpc.StatusCode.INVALID_ARGUMENT
    bad_sampling = pb.StartRequest(items=[pb.StartItem(seq_id="t", prompt_ids=[1],
                                                       sampling=pb.Sampling(temperature=-1.0))])
    assert code_of(lambda: s.Start(bad_sampling, timeout=10)) == grpc.StatusCode.INVALID_ARGUMENT
    # bytes that are no ProposeRequest at all
    raw = channel.unary_unary("/specserve.v2.Drafter/Propose", request_serializer=lambda b: b,
                              response_deserializer=lambda b: b)
    with pytest.raises(grpc.RpcError) as e:
        raw(b"\xff\xff\xff\xff garbage", timeout=10)
    assert e.value.code() != grpc.StatusCode.OK
    # and the server still serves
    reply = propose(s, "ok", k=4)
    assert len(reply.drafts[0].tokens) == 4 and not reply.drafts[0].q  # greedy: no q travels
    assert s.Release(pb.ReleaseRequest(seq_ids=["ok", "unknown"]), timeout=10).live_sequences == 0


def test_batched_messages_and_sampled_q(stub):
    s, _, _ = stub
    req = pb.StartRequest(items=[pb.StartItem(seq_id=f"b{i}", prompt_ids=[1 + i, 2], sampling=pb.Sampling(
        temperature=0.9, top_k=8, seed=i)) for i in range(3)])
    assert s.Start(req, timeout=10).live_sequences == 3
    reply = s.Propose(pb.ProposeRequest(items=[pb.ProposeItem(seq_id=f"b{i}", round=7, k=2) for i in range(3)]),
                      timeout=10)
    assert [d.seq_id for d in reply.drafts] == ["b0", "b1", "b2"] and all(d.round == 7 for d in reply.drafts)
    for d in reply.drafts:
        assert len(d.q) == 2
        for tok, q in zip(d.tokens, d.q):
            assert len(q.token_ids) == 8 and tok in q.token_ids  # sparse after top-k, and the draft is in it
    assert s.Release(pb.ReleaseRequest(seq_ids=["b0", "b1", "b2"]), timeout=10).live_sequences == 0


def test_client_calls_carry_deadlines():
    """A drafter that does not answer fails the call within its deadline instead of hanging."""
    import socket
    import time

    from specserve.verifier.client import DrafterClient
    with socket.socket() as silent:  # accepts TCP connections, never speaks HTTP/2
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        t0 = time.monotonic()
        with pytest.raises(Exception):
            DrafterClient(f"127.0.0.1:{silent.getsockname()[1]}", connect_timeout_s=1.0)
        assert time.monotonic() - t0 < 10


def test_a_large_vocabulary_batch_fits_one_propose_with_a_16_bit_q():
    """V = 128,256, k = 4, 64 sampled sequences in one Propose through a real drafter server: with
    q in bfloat16 the reply fits the message limit (in float32 it would be twice the size, over
    it), and q arrives exactly as the drafter sampled from it."""
    from specserve.proto.transport import MAX_MESSAGE_BYTES
    vocab, k, seqs = 128_256, 4, 64
    server, port, _ = serve(tiny_model("llama", vocab, seed=0, hidden=16, layers=1), host="127.0.0.1",
                            pipeline=False, max_sequences=seqs, q_dtype="bfloat16")
    channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=[("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)])
    try:
        s = pb_grpc.DrafterStub(channel)
        s.Start(pb.StartRequest(items=[pb.StartItem(seq_id=f"s{i}", prompt_ids=[i + 1, 2], sampling=pb.Sampling(
            temperature=1.0, seed=i)) for i in range(seqs)]), timeout=60)
        reply = s.Propose(pb.ProposeRequest(items=[pb.ProposeItem(seq_id=f"s{i}", round=1, k=k) for i in range(seqs)]),
                          timeout=120)
        size = reply.ByteSize()
        assert size <= MAX_MESSAGE_BYTES < 2 * size - 4 * seqs * k * 16  # float32 would not fit
        for d in reply.drafts[:3]:
            assert len(d.q) == k and all(q.dtype == pb.PROB_BFLOAT16 for q in d.q)
            for tok, q in zip(d.tokens, d.q):
                dense = q_from_proto(q, vocab)
                assert dense.dtype == torch.bfloat16 and dense[tok] > 0
    finally:
        channel.close()
        server.stop(0)


def test_a_catch_up_call_is_not_waited_for_and_its_error_surfaces_on_the_next_call(stub):
    """RemoteProposer sends a call with every k = 0 (only catching the drafter up) without
    waiting: it returns empty drafts at once, the drafter still takes the tokens in before the
    next call, and a failure of the catch-up is raised by the next call."""
    from specserve.core.proposer import ProposeItem
    from specserve.verifier.client import DrafterUnavailable, RemoteProposer
    servicer = stub[2]
    remote = RemoteProposer(servicer.address)
    remote.start("cu", [1, 2, 3], SamplingParams())
    drafts = remote.propose([ProposeItem("cu", [4, 5, 6], 0)])
    assert [d.tokens for d in drafts] == [[]] and len(remote._unanswered) == 1
    d = remote.propose([ProposeItem("cu", [7], 2)])[0]  # reads the catch-up's answer first
    assert not remote._unanswered and len(d.tokens) == 2
    assert servicer.inner.seqs["cu.0"].tokens[:7] == [1, 2, 3, 4, 5, 6, 7]  # (+ a pipelined guess)
    remote.release("cu")
    remote.rounds["gone"] = 0  # a sequence the drafter does not know: the catch-up fails there
    remote.propose([ProposeItem("gone", [1], 0)])
    with pytest.raises(DrafterUnavailable, match="NOT_FOUND"):
        remote.propose([ProposeItem("gone", [], 1)])
    remote.client.close()


def test_the_propose_stream_sends_now_answers_later_and_a_refusal_ends_only_that_stream(stub):
    """RemoteProposer proposes on one long-lived stream: `send` returns at once, `receive` gives
    the drafts (the same as a unary Propose's, the drafter being greedy and deterministic); a
    Release of a sequence in flight reads the answer first, a Start (of new sequences) does not
    wait for it; a refused request raises and the next call opens a new stream on the same
    connection."""
    from specserve.core.proposer import ProposeItem
    from specserve.verifier.client import RemoteProposer
    s, _, servicer = stub
    remote = RemoteProposer(servicer.address)
    remote.start("st", [1, 2, 3], SamplingParams())
    start(s, "st-unary", (1, 2, 3))
    streams = set()
    for new in ([4], [5, 6], []):
        remote.send([ProposeItem("st", new, 3)])
        got = remote.receive()[0].tokens
        want = list(propose(s, "st-unary", new, 3).drafts[0].tokens)
        assert got == want and len(got) == 3
        streams.add(id(remote.client.stream))
    assert len(streams) == 1  # one stream for every round
    remote.send([ProposeItem("st", [9], 2)])
    remote.start("st2", [4, 5], SamplingParams())  # does not wait for the Propose in flight
    assert len(remote._unanswered) == 1 and len(remote.receive()[0].tokens) == 2
    with pytest.raises(ValueError, match="outside the vocabulary"):
        remote.propose([ProposeItem("st", [V + 5], 2)])
    assert remote.client.stream is None  # that stream ended with the refusal's status
    assert len(remote.propose([ProposeItem("st", [7], 2)])[0].tokens) == 2  # a new one serves
    remote.send([ProposeItem("st", [V + 6], 2)])
    remote.start("st3", [1], SamplingParams())  # beside the refused Propose: the Start succeeds
    remote.release_many(["st"])  # reads the refusal first; the Release itself succeeds
    with pytest.raises(ValueError, match="outside the vocabulary"):
        remote.receive()  # the failure stays with the Propose
    assert len(remote.propose([ProposeItem("st3", [2], 2)])[0].tokens) == 2
    remote.release_many(["st2", "st3"])
    s.Release(pb.ReleaseRequest(seq_ids=["st-unary"]), timeout=10)
    remote.client.close()


def test_a_hung_drafter_fails_the_stream_within_its_deadline(stub, monkeypatch):
    """A request on the stream that the drafter does not answer in time (here: its model lock is
    held) fails with DEADLINE_EXCEEDED, within the deadline plus the watchdog's period."""
    import time

    from specserve.core.proposer import ProposeItem
    from specserve.verifier import client as client_module
    from specserve.verifier.client import DrafterUnavailable, RemoteProposer
    s, _, servicer = stub
    remote = RemoteProposer(servicer.address)
    remote.start("hung", [1, 2, 3], SamplingParams())
    monkeypatch.setattr(client_module, "deadline", lambda method, tokens=0: 0.5)
    with servicer.lock:  # the drafter is busy for good
        t0 = time.monotonic()
        with pytest.raises(DrafterUnavailable, match="DEADLINE_EXCEEDED") as e:
            remote.propose([ProposeItem("hung", [4], 2)])
        assert 0.5 <= time.monotonic() - t0 < 4.0  # (unpatched, the deadline is about 5 s)
    monkeypatch.undo()
    # the engine gives the connection up and reconnects: the drafter, up all along, frees the old
    # connection's sequences at once (until stop 48 they held its slots until their TTL, 600 s)
    remote.mark_failed(e.value)
    deadline = time.monotonic() + 10
    while not remote.recovered():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert remote.epoch == 1
    while "hung.0" in servicer.inner.seqs:
        assert time.monotonic() < deadline, "the old connection's sequence was not released"
        time.sleep(0.05)
    remote.client.close()


def test_outcomes_sent_early_keep_greedy_and_sampled_output_exact():
    """The engine sends each round's outcome to a remote drafter as soon as acceptance is decided
    and takes those drafts in the next round. Greedy output equals plain decoding; a seeded sampled
    request writes the same tokens as with the drafter in process (drafts are reproducible); and the
    second token, often drafted early, follows the target's distribution (chi-square)."""
    from specserve.drafter.draft_model import DraftModelProposer
    from specserve.verifier.client import RemoteProposer
    from specserve.verifier.engine import SpeculativeEngine

    target, drafter = tiny_model("llama", 8, seed=5, initializer_range=0.5), tiny_model("llama", 8, seed=6,
                                                                                          initializer_range=0.5)
    server, port, _ = serve(drafter, host="127.0.0.1", pipeline=True, max_sequences=16)
    try:
        remote = SpeculativeEngine(ModelRunner(target, slots=8), RemoteProposer(f"127.0.0.1:{port}"), eos_ids=set(),
                                   max_waiting=2000)
        local = SpeculativeEngine(ModelRunner(target, slots=8), DraftModelProposer(ModelRunner(drafter, slots=8)),
                                  eos_ids=set())
        plain = SpeculativeEngine(ModelRunner(target), None, eos_ids=set())
        for prompt, k in (([1, 2], 3), ([3], 1), ([4, 5, 6], 5)):
            assert remote.generate(prompt, 30, SamplingParams(), k).token_ids == \
                plain.generate(prompt, 30, SamplingParams(), 0).token_ids
        assert remote.early_drafts > 0
        for seed in range(4):
            params = SamplingParams(temperature=1.1, seed=seed)
            full = remote.generate([1, 2], 30, params, 3).token_ids
            assert full == local.generate([1, 2], 30, params, 3).token_ids
            # and a shorter max_tokens cuts the same text (stop 59: the last round drafted fewer, and drew other numbers)
            assert [remote.generate([1, 2], n, params, 3).token_ids for n in (1, 2, 4, 7, 11)] == \
                [full[:n] for n in (1, 2, 4, 7, 11)]
        early = remote.early_drafts
        n = 1500
        reqs = [remote.submit([1, 2], 3, SamplingParams(temperature=1.0, seed=s), k=1) for s in range(n)]
        while not all(r.done.is_set() for r in reqs):
            remote.step()
        seconds = [r.result().token_ids[1] for r in reqs]
        assert remote.early_drafts > early + n // 10
        with torch.no_grad():  # P(x2) = sum over x1 of P(x1) P(x2 | x1)
            p1 = torch.softmax(target(torch.tensor([[1, 2]])).logits[0, -1].double(), -1)
            p2 = sum(p1[x] * torch.softmax(target(torch.tensor([[1, 2, x]])).logits[0, -1].double(), -1)
                     for x in range(8)).numpy()
        counts = np.bincount(seconds, minlength=8)
        assert stats.chisquare(counts, n * p2 / p2.sum()).pvalue > 1e-3
    finally:
        server.stop(0)


def hold_model_lock(servicer, until, seconds: float) -> None:
    """Returns once a background thread holds the drafter's model lock (the drafter is busy, as
    while it prepares drafts); the thread lets go when `until` is set or after `seconds`."""
    import threading
    held = threading.Event()

    def hold():
        with servicer.lock:
            held.set()
            until.wait(seconds)
    threading.Thread(target=hold, daemon=True).start()
    held.wait()


def test_a_release_does_not_wait_for_early_drafts_and_their_wait_counts_as_drafting(stub):
    """A finished sequence is released right after the round, while the early send of the others
    is in flight: the release waits for neither those drafts nor the drafter's lock, and the wait
    for the drafts (in the next round) is that round's drafting, for the policy and in the
    engine's round times. Here the drafter is held busy 0.6 s from the early send on."""
    import threading

    from specserve.verifier.client import RemoteProposer
    from specserve.verifier.engine import SpeculativeEngine
    _, _, servicer = stub
    engine = SpeculativeEngine(ModelRunner(tiny_model("llama", V, seed=0), slots=4), RemoteProposer(servicer.address),
                               eos_ids=set(), speculation="fixed")
    short = engine.submit([1, 2, 3], 8, SamplingParams(), k=3)
    long = engine.submit([4, 5, 6], 40, SamplingParams(), k=3)
    send_early = engine._send_early

    def busy_drafter_then_send(*args):
        hold_model_lock(servicer, threading.Event(), 0.6)
        return send_early(*args)
    engine._send_early = busy_drafter_then_send
    while not short.done.is_set():
        engine.step()
    engine._send_early = send_early
    assert engine.times.rounds >= 2
    waited = engine.times.seconds["early_wait"]
    assert waited >= 0.45 and engine.times.seconds["release"] < 0.3, engine.times.to_dict()
    engine.step()  # the round that uses those drafts: its drafting cost includes the wait
    observed = [h for (p, b), h in engine.policy.hit_costs.items() if b == 1] + \
        [d(3) for (p, b), d in engine.policy.draft_costs.items() if b == 1]
    assert observed and max(observed) >= 0.45
    while not long.done.is_set():
        engine.step()
    assert engine.times.rounds > 0


def test_a_release_never_waits_for_the_drafters_lock(stub):
    """Release is answered at once even while the model lock is held (a preparation running):
    the sequence counts as released now, and its slot is freed by the lock's next holder."""
    import threading
    import time

    s, _, servicer = stub
    start(s, "to-go")
    assert "to-go" in servicer.inner.seqs
    done = threading.Event()
    hold_model_lock(servicer, done, 5.0)
    live = servicer.live_sequences
    t0 = time.monotonic()
    reply = s.Release(pb.ReleaseRequest(seq_ids=["to-go"]), timeout=10)
    assert time.monotonic() - t0 < 3.0  # (the lock is held 5 s)
    assert reply.live_sequences == live - 1 == servicer.live_sequences
    assert "to-go" in servicer.inner.seqs  # not applied yet: the lock is held
    done.set()
    s.Info(pb.InfoRequest(), timeout=10)  # the lock's next holder applies it
    assert "to-go" not in servicer.inner.seqs and not servicer.to_release


def test_a_release_is_not_waited_for_and_a_start_after_it_finds_it_applied(stub, monkeypatch, caplog):
    """RemoteProposer sends a Release and goes on (the engine's loop does not wait for the
    round trip); the next Start first reads its answer, so the drafter has the released
    sequences gone before it starts new ones; a Release that fails is logged, not raised."""
    import time

    from specserve.verifier.client import RemoteProposer
    servicer = stub[2]
    remote = RemoteProposer(servicer.address)
    remote.start_many([("r1", [1, 2, 3], SamplingParams()), ("r2", [4, 5], SamplingParams())])
    real = servicer._drain_releases  # (what the Release handler calls before it answers)

    def slow():
        time.sleep(1.0)
        real()

    monkeypatch.setattr(servicer, "_drain_releases", slow)
    t0 = time.monotonic()
    remote.release_many(["r1", "r2"])
    assert time.monotonic() - t0 < 0.5 and "r1.0" in servicer.inner.seqs  # sent, not applied yet
    remote.start("r3", [6, 7], SamplingParams())
    assert time.monotonic() - t0 >= 1.0  # the Start waited for the Release's answer
    assert "r1.0" not in servicer.inner.seqs and "r2.0" not in servicer.inner.seqs and "r3.0" in servicer.inner.seqs
    remote.release_many(["r3"])

    def broken():
        raise RuntimeError("the drafter broke")

    remote.start("r4", [8], SamplingParams())  # (reads r3's answer first)
    monkeypatch.setattr(servicer, "_drain_releases", broken)
    with caplog.at_level("WARNING", logger="specserve.verifier.client"):
        remote.release_many(["r4"])
        remote._read_releases(wait=True)
    assert "release of 1 sequences failed" in caplog.text
    monkeypatch.setattr(servicer, "_drain_releases", real)
    stub[0].Info(pb.InfoRequest(), timeout=10)  # (the lock's next holder applies what the handler took note of)
    assert not {"r1.0", "r2.0", "r3.0", "r4.0"} & servicer.inner.seqs.keys()

    class Lost:  # a Release that fails before the drafter takes note of its ids (as if lost on the way)
        def __enter__(self):
            raise RuntimeError("lost")

        def __exit__(self, *exc):
            return False
    remote.start("r5", [8], SamplingParams())
    lock = servicer.release_lock
    monkeypatch.setattr(servicer, "release_lock", Lost())
    remote.release_many(["r5"])
    remote._read_releases(wait=True)
    monkeypatch.setattr(servicer, "release_lock", lock)
    assert "r5.0" in servicer.inner.seqs  # not released: until stop 53 it stayed until the drafter's TTL
    remote.start("r6", [9], SamplingParams())
    remote.release_many(["r6"])  # r5 goes out again with it
    remote._read_releases(wait=True)
    stub[0].Info(pb.InfoRequest(), timeout=10)
    assert not {"r5.0", "r6.0"} & servicer.inner.seqs.keys()
    remote.client.close()


def test_a_drafter_that_answers_in_another_protocol_is_said_once_and_not_restarted(monkeypatch, caplog):
    """After a failure the client reconnects. A drafter that answers in another protocol (a rolling
    upgrade) is an error said once and retried, not a silent drafter restarted every hang_s (until
    stop 53 its reconnect counted it as silence and restarted it, and said so as a hang); once
    the protocol fits again, the client reconnects."""
    import time

    import specserve.drafter.server as drafter_server
    from conftest import eventually
    from specserve.proto.codec import PROTOCOL_VERSION
    from specserve.verifier.client import RemoteProposer
    server, port, _ = serve(tiny_model("llama", V, seed=0), host="127.0.0.1", pipeline=True)
    restarts = []

    class Handle:  # what the client asks of the drafter's actor handle: its process, and a restart
        def running(self):
            return os.getpid()

        def restart(self):
            restarts.append(time.monotonic())
    try:
        remote = RemoteProposer(f"127.0.0.1:{port}", drafter=Handle(), hang_s=0.2)
        monkeypatch.setattr(drafter_server, "PROTOCOL_VERSION", PROTOCOL_VERSION - 1)
        with caplog.at_level("WARNING", logger="specserve.verifier.client"):
            remote.mark_failed(RuntimeError("lost"))
            time.sleep(2.0)  # three tries (0.25, 0.5, 1 s apart)
        assert not restarts and caplog.text.count(f"speaks protocol {PROTOCOL_VERSION - 1}") == 1, caplog.text
        monkeypatch.setattr(drafter_server, "PROTOCOL_VERSION", PROTOCOL_VERSION)
        assert eventually(lambda: remote._fresh is not None, within_s=8.0)
        remote._fresh.close()
        remote.client.close()
    finally:
        server.stop(0)


def test_a_reply_that_does_not_decode_is_the_drafters_fault(stub):
    """A Propose reply with a q that does not decode, or too few drafts, fails the drafter
    (DrafterUnavailable, naming it), not the request (a ValueError is the request's fault)."""
    from specserve.core.proposer import ProposeItem
    from specserve.verifier.client import DrafterUnavailable, RemoteProposer
    remote = RemoteProposer(stub[2].address)
    item = ProposeItem("x", [], 2)
    bad_q = pb.Distribution(packed=b"\0" * 12)  # three float32 values for a vocabulary of 64
    good = pb.Draft(seq_id=remote._wire_id("x"), round=1, tokens=[1, 2], q=[bad_q, bad_q])
    with pytest.raises(DrafterUnavailable, match="does not decode"):
        remote._check([item], [1], pb.ProposeReply(drafts=[good]))
    with pytest.raises(DrafterUnavailable, match="answered 0 drafts to 1"):
        remote._check([item], [1], pb.ProposeReply(drafts=[]))
    remote.client.close()


def test_a_send_not_received_is_dropped_by_the_next_one(stub):
    """The engine does not wait for early drafts nobody takes (k went to 0 or up): the client then
    reads and drops them before the next call's answer, so `receive` returns that call's drafts."""
    from specserve.core.proposer import ProposeItem
    from specserve.drafter.draft_model import DraftModelProposer
    from specserve.verifier.client import RemoteProposer
    _, _, servicer = stub
    remote = RemoteProposer(servicer.address)
    local = DraftModelProposer(ModelRunner(tiny_model("llama", V, seed=0)))
    for p in (remote, local):
        p.start("drop", [1, 2, 3], SamplingParams().with_seed())
    remote.send([ProposeItem("drop", [4], 2)])  # never received
    local.propose([ProposeItem("drop", [4], 2)])
    remote.send([ProposeItem("drop", [5, 6], 3)])
    assert remote.receive()[0].tokens == local.propose([ProposeItem("drop", [5, 6], 3)])[0].tokens
    assert not remote._unanswered
    remote.release("drop")
    remote.client.close()


def test_a_remote_drafter_rests_while_speculation_is_off_and_is_caught_up_before_it_drafts():
    """With the adaptive policy's speculation off (no veto), a remote drafter rests, as one in
    process does: joining sequences are not started on it and nothing is sent to it, so none of
    its work runs beside the plain passes (until stop 67 it was started and fed meanwhile). When
    speculation comes on, the sequences start on it with everything committed and draft; greedy
    output stays plain decoding's. With room for one sequence on the drafter, the Starts it
    refuses fall back one by one, the engine not degraded."""
    from specserve.verifier.client import RemoteProposer
    from specserve.verifier.engine import SpeculativeEngine
    from specserve.verifier.policy import PassCosts

    target, drafter = tiny_model("llama", V, seed=11), tiny_model("llama", V, seed=12, hidden=16, layers=1)
    plain = SpeculativeEngine(ModelRunner(target), None, eos_ids=set())
    for capacity in (8, 1):
        # (not pipelined: a pipelining drafter counts the outcomes it assumes as committed)
        server, port, servicer = serve(drafter, host="127.0.0.1", pipeline=False, max_sequences=capacity)
        try:
            engine = SpeculativeEngine(ModelRunner(target, slots=4), RemoteProposer(f"127.0.0.1:{port}"),
                                       eos_ids=set(), speculation="adaptive", max_k=4)
            engine.policy.costs = PassCosts({(b, w): 1e-3 * w for b in (1, 4) for w in (1, 5)})
            for b in range(1, 5):
                engine.policy.observe_draft("draft_model", b, 1, 10.0)  # drafting looks hopeless
            engine.policy.on = False
            prompts = [[1 + i, 2, 3] for i in range(3)]
            reqs = [engine.submit(p, 60, SamplingParams(), k=4) for p in prompts]
            for _ in range(5):
                engine.step()
                assert engine._resting() and all(r.resting and not r.drafting for r in reqs)
            assert not servicer.proposer.seqs and engine.deferred_starts == 0  # nothing sent to it
            assert all(len(r.out) == 5 for r in reqs)
            engine.policy.mode = "fixed"  # speculation on: every sequence drafts its k from now on
            engine.step()
            assert not any(r.resting for r in reqs) and sum(r.drafting for r in reqs) == min(3, capacity)
            for r in reqs:
                if r.drafting:  # started with every committed token, then this round's
                    assert servicer.proposer.committed_length(f"{r.id}.0") >= len(r.prompt_ids) + 5
                    assert r.stats.num_drafts == 1
            while not all(r.done.is_set() for r in reqs):
                engine.step()
            for p, r in zip(prompts, reqs):
                assert r.result().token_ids == plain.generate(p, 60, SamplingParams(), 0).token_ids
            assert engine.degraded is None and engine.proposer_failures == 0
        finally:
            server.stop(0)


def test_joining_sequences_start_on_a_remote_drafter_beside_the_target_prefill():
    """The Start of joining sequences goes to a remote drafter from a helper thread before the
    target prefills their prompts, so the drafter's prefill runs beside the target's; with
    speculation on they still draft from their first round (the Start is waited for after the
    prefill). Here the target's prefill waits (up to 5 s) for the drafter to hold the sequences: a
    Start sent after the prefill (as until stop 54) never arrives in time. Greedy output stays
    plain decoding's, for the first batch and for one joining mid-flight."""
    import time

    from specserve.verifier.client import RemoteProposer
    from specserve.verifier.engine import SpeculativeEngine

    target, drafter = tiny_model("llama", V, seed=11), tiny_model("llama", V, seed=12, hidden=16, layers=1)
    plain = SpeculativeEngine(ModelRunner(target), None, eos_ids=set())
    server, port, servicer = serve(drafter, host="127.0.0.1", pipeline=False)
    try:
        engine = SpeculativeEngine(ModelRunner(target, slots=4), RemoteProposer(f"127.0.0.1:{port}"), eos_ids=set())
        seen = []
        prefill_batch = engine.target.prefill_batch

        def prefill_once_the_drafter_has_them(items):
            slots = {slot for slot, _ in items}
            wire = [f"{r.id}.0" for r in engine.running if r.slot in slots]
            until = time.monotonic() + 5.0
            while not all(w in servicer.proposer.seqs for w in wire) and time.monotonic() < until:
                time.sleep(0.002)
            seen.append(all(w in servicer.proposer.seqs for w in wire))
            return prefill_batch(items)

        engine.target.prefill_batch = prefill_once_the_drafter_has_them
        prompts = [[1 + i, 2, 3] for i in range(3)]
        reqs = [engine.submit(p, 30, SamplingParams(), k=4) for p in prompts]
        engine.step()
        assert seen == [True] and not engine._starting
        assert all(r.drafting and r.stats.rounds_by_k[0] == 0 for r in reqs)  # drafted in their first round
        engine.step()
        late = engine.submit([9, 8, 7], 20, SamplingParams(), k=4)
        engine.step()
        assert seen == [True, True] and late.drafting and late.stats.rounds_by_k[0] == 0
        assert engine.deferred_starts == 4  # (all four from the helper thread)
        while not all(r.done.is_set() for r in [*reqs, late]):
            engine.step()
        for p, r in zip(prompts, reqs):
            assert r.result().token_ids == plain.generate(p, 30, SamplingParams(), 0).token_ids
        assert late.result().token_ids == plain.generate([9, 8, 7], 20, SamplingParams(), 0).token_ids
        assert engine.degraded is None and engine.proposer_failures == 0
    finally:
        server.stop(0)


def test_a_start_sent_beside_a_prefill_that_fails_is_released_in_the_same_step():
    """A joining request's Start goes to the drafter before the target prefills it; when that
    prefill fails, the request fails alone (a clear error) and the drafter's sequence is released
    in the same step, though nothing else runs (until this was fixed, the Release waited for the
    next request)."""
    import time

    from specserve.verifier.client import RemoteProposer
    from specserve.verifier.engine import SpeculativeEngine

    target, drafter = tiny_model("llama", V, seed=11), tiny_model("llama", V, seed=12, hidden=16, layers=1)
    server, port, servicer = serve(drafter, host="127.0.0.1", pipeline=False)
    try:
        engine = SpeculativeEngine(ModelRunner(target, slots=4), RemoteProposer(f"127.0.0.1:{port}"), eos_ids=set())

        def fails(*_args, **_kwargs):
            raise RuntimeError("the prefill failed")

        engine.target.prefill_batch = engine.target.prefill = fails
        req = engine.submit([1, 2, 3], 10, SamplingParams(), k=4)
        engine.step()
        assert req.done.is_set() and isinstance(req.error, RuntimeError) and not engine.running
        until = time.monotonic() + 5.0
        while servicer.live_sequences and time.monotonic() < until:  # (a Release is not waited for)
            time.sleep(0.01)
        assert servicer.live_sequences == 0 and engine.degraded is None
    finally:
        server.stop(0)


def test_a_start_under_way_when_the_drafter_fails_goes_to_the_fallback():
    """The drafter fails (here: the stream breaks under a running sequence's drafts, during the
    target's prefill of a joining sequence) while that sequence's Start, sent beside the prefill
    (`_start_ahead`), is still under way on the old connection. The Start itself succeeds, but
    once it is taken up its sequence goes to the fallback with the others (it is not counted as
    started on the drafter), and every output stays plain decoding's."""
    import threading

    from specserve.verifier.client import RemoteProposer
    from specserve.verifier.engine import SpeculativeEngine

    target, drafter = tiny_model("llama", V, seed=11), tiny_model("llama", V, seed=12, hidden=16, layers=1)
    plain = SpeculativeEngine(ModelRunner(target), None, eos_ids=set())
    server, port, servicer = serve(drafter, host="127.0.0.1", pipeline=False)
    try:
        remote = RemoteProposer(f"127.0.0.1:{port}")
        engine = SpeculativeEngine(ModelRunner(target, slots=4), remote, eos_ids=set(), speculation="adaptive",
                                   max_k=4, ngram=True)
        engine.policy.choose = lambda limits, *_: list(limits)  # speculation on
        first = engine.submit([1, 2, 3], 60, SamplingParams(), k=4)
        engine.step()
        engine.step()  # (its drafts on the stream, and the next ones asked for early)
        assert first.drafting and engine._early
        go = threading.Event()
        start_many = remote.start_many
        remote.start_many = lambda items: (go.wait(10), start_many(items))
        prefill_batch = engine.target.prefill_batch

        def prefill_as_the_stream_breaks(items):
            remote.client.stream.replies.cancel()
            return prefill_batch(items)

        engine.target.prefill_batch = prefill_as_the_stream_breaks
        joined = engine.submit([4, 5, 6], 40, SamplingParams(), k=4)
        engine.step()  # the Start sent beside the prefill; the early drafts' answer: the stream is gone
        engine.target.prefill_batch = prefill_batch
        assert engine.degraded is not None and engine._starting and not joined.drafting
        go.set()
        engine._starting[0][0].join(10)
        engine.step()
        assert not engine._starting and joined.drafting and joined.via == "ngram"
        while not (first.done.is_set() and joined.done.is_set()):
            engine.step()
        assert first.result().token_ids == plain.generate([1, 2, 3], 60, SamplingParams(), 0).token_ids
        assert joined.result().token_ids == plain.generate([4, 5, 6], 40, SamplingParams(), 0).token_ids
    finally:
        server.stop(0)


def test_no_drafts_are_asked_for_early_after_a_probe_while_speculation_is_off():
    """With the adaptive policy's speculation off, a round that drafts is a probe: the next round
    drafts nothing, so its drafts are not asked for early (they would keep the drafter busy beside
    the plain passes). A seeded sampled request drafts every round whatever the policy, and is
    still asked for early. Output stays plain decoding's."""
    from specserve.verifier.client import RemoteProposer
    from specserve.verifier.engine import SpeculativeEngine
    from specserve.verifier.policy import PROBE_EVERY, PassCosts

    target, drafter = tiny_model("llama", V, seed=13), tiny_model("llama", V, seed=14, hidden=16, layers=1)
    plain = SpeculativeEngine(ModelRunner(target), None, eos_ids=set())
    server, port, _ = serve(drafter, host="127.0.0.1", pipeline=False, max_sequences=4)
    try:
        proposer = RemoteProposer(f"127.0.0.1:{port}")
        engine = SpeculativeEngine(ModelRunner(target, slots=4), proposer, eos_ids=set(), speculation="adaptive",
                                   max_k=4)
        engine.policy.costs = PassCosts({(b, w): 1e-3 * w for b in (1, 2) for w in (1, 5)})
        for b in (1, 2):
            engine.policy.observe_draft("draft_model", b, 1, 10.0)  # drafting looks hopeless: off
        sent = []  # {sequence id: k} of every round's early send
        send_early = engine._send_early
        engine._send_early = lambda *a: (lambda asked: (sent.append(asked) if asked else None, asked)[1])(send_early(*a))
        greedy = engine.submit([1, 2, 3], 3 * PROBE_EVERY, SamplingParams(), k=4)
        while not greedy.done.is_set():
            engine.step()
        assert sum(greedy.stats.rounds_by_k[1:]) >= 1 and not engine.policy.on  # a probe, and still off
        assert sent == []
        assert greedy.result().token_ids == plain.generate([1, 2, 3], 3 * PROBE_EVERY, SamplingParams(), 0).token_ids
        seeded = engine.submit([4, 5], 12, SamplingParams(temperature=0.9, seed=1), k=4)
        while not seeded.done.is_set():
            engine.step()
        assert seeded.stats.rounds_by_k[0] == 0 and sent and all(list(asked) == [seeded.id] for asked in sent)
    finally:
        server.stop(0)


def test_a_prepared_round_near_the_context_end_is_not_refused(stub):
    """A Propose whose new tokens are the outcome a preparation assumed is checked against the
    context once: until stop 47 the server counted those tokens twice (they were already in the
    sequence), refused the call within about 2k + 1 tokens of the end with OUT_OF_RANGE, and the
    verifier took that for a failed drafter."""
    stub_, _, servicer = stub
    L = servicer.max_length
    start(stub_, "edge", prompt=[1 + i % 50 for i in range(L - 10)])
    first = propose(stub_, "edge", k=4)
    servicer.background.submit(lambda: None).result()  # the preparation after it has run
    assert servicer.proposer.ready.get("edge")
    reply = propose(stub_, "edge", new_tokens=list(first.drafts[0].tokens) + [7], k=4, round_=2)  # L - 1 in all
    assert len(reply.drafts[0].tokens) == 4
    stub_.Release(pb.ReleaseRequest(seq_ids=["edge"]), timeout=10)


def test_a_propose_that_skips_preparation_leaves_nothing_prepared_and_drafts_alike(stub):
    """skip_preparation (the adaptive policy's ask where a preparation would rarely serve a whole
    call): the drafter prepares nothing for that sequence, so the all-accepted outcome is drafted
    on demand, to the same tokens; the same call without it is served from the preparation."""
    stub_, _, servicer = stub
    replies = {}
    for skip in (False, True):
        seq = f"skip{skip}"
        start(stub_, seq)
        first = propose(stub_, seq, k=3, skip_preparation=skip)
        servicer.background.submit(lambda: None).result()  # a preparation after it, if any, has run
        assert bool(servicer.proposer.ready.get(seq)) is not skip
        guess = servicer.proposer.ready[seq][0].assumed if not skip else None
        replies[skip] = first, guess
    first, guess = replies[False]
    assert list(replies[True][0].drafts[0].tokens) == list(first.drafts[0].tokens)
    outcome = guess  # the outcome the drafter bet on, all drafts accepted: the same for both sequences
    hits = {skip: propose(stub_, f"skip{skip}", new_tokens=outcome, k=3, round_=2).drafts[0] for skip in (False, True)}
    assert hits[False].pipeline_hit and not hits[True].pipeline_hit
    assert list(hits[False].tokens) == list(hits[True].tokens)
    stub_.Release(pb.ReleaseRequest(seq_ids=["skipFalse", "skipTrue"]), timeout=10)


def test_a_reply_left_unread_past_its_deadline_does_not_end_the_stream(stub, monkeypatch):
    """The engine may leave a Propose's reply unread for a while (it sent a round's outcome early,
    then the policy stopped drafting): the stream stays up and the reply is read when asked for.
    Until stop 47 the watchdog counted from the send whether anyone waited or not, cancelled the
    stream, and the next drafting round raised DrafterUnavailable from a drafter that had answered
    in milliseconds."""
    import time

    from specserve.core.proposer import ProposeItem
    from specserve.verifier import client as client_module
    from specserve.verifier.client import RemoteProposer
    servicer = stub[2]
    remote = RemoteProposer(servicer.address)
    remote.start("unread", [1, 2, 3], SamplingParams())
    monkeypatch.setattr(client_module, "deadline", lambda method, tokens=0: 0.3)
    remote.send([ProposeItem("unread", [4], 2)])
    stream = remote.client.stream
    time.sleep(1.0)  # over three deadlines, the reply unread
    assert len(remote.receive()[0].tokens) == 2 and remote.client.stream is stream
    monkeypatch.undo()  # (the next reply is no test of the short deadline: a loaded machine may be slow)
    assert len(remote.propose([ProposeItem("unread", [5], 2)])[0].tokens) == 2
    remote.release("unread")
    remote.client.close()


def test_a_long_rest_keeps_the_drafters_sequences_alive():
    """A remote drafter reclaims a sequence it has not heard of for its TTL (InfoReply.seq_ttl_s),
    and a Propose for a reclaimed one fails the drafter for every sequence. Under a veto of the
    adaptive policy's guard the engine sends the drafter nothing, and until stop 48 a veto longer
    than the TTL ended that way. Now a sequence with no call for a quarter of the TTL gets one
    (its committed tokens, k = 0): after a veto of 4 TTLs drafting resumes with no failure, the
    drafter reclaimed nothing, and greedy output equals plain decoding."""
    import time

    from specserve.verifier.client import RemoteProposer
    from specserve.verifier.engine import SpeculativeEngine
    from specserve.verifier.policy import PassCosts

    target, drafter = tiny_model("llama", V, seed=11), tiny_model("llama", V, seed=12, hidden=16, layers=1)
    want = SpeculativeEngine(ModelRunner(target), None, eos_ids=set()).generate([1, 2, 3], 120, SamplingParams(), 0)
    ttl = 1.0  # (0.4 until stop 57: a stall of ~0.3 s on a loaded machine would let the drafter reclaim)
    server, port, servicer = serve(drafter, host="127.0.0.1", pipeline=False, seq_ttl_s=ttl)
    try:
        proposer = RemoteProposer(f"127.0.0.1:{port}")
        assert proposer.client.info.seq_ttl_s == pytest.approx(ttl)
        engine = SpeculativeEngine(ModelRunner(target, slots=2), proposer, eos_ids=set(), speculation="adaptive",
                                   max_k=4)
        engine.policy.costs = PassCosts({(b, w): 0.05 for b in (1, 2) for w in (1, 2, 3, 4, 5)})  # wide passes no dearer
        engine.policy.draft_costs.clear()
        engine.policy.observe_draft("draft_model", 1, 1, 0.0)  # and drafting free: the model speculates
        req = engine.submit([1, 2, 3], 120, SamplingParams(), k=4)
        for _ in range(3):
            engine.step()
        drafted = sum(req.stats.rounds_by_k[1:])
        assert drafted == 3
        guard, policy = engine.policy.guard, engine.policy
        guard.until[guard.bucket(1)] = policy.rounds + 1000  # a veto
        joined = engine.submit([4, 5, 6], 60, SamplingParams(), k=4)  # rests: started on the drafter after the veto,
        t0 = time.monotonic()  # and a Start is when the drafter reclaims what went unheard of for its TTL
        for _ in range(30):  # 4 TTLs
            engine.step()
            time.sleep(4 * ttl / 30)
        assert time.monotonic() - t0 > 4 * ttl and sum(req.stats.rounds_by_k[1:]) == drafted  # rested
        assert joined.resting
        # speculation resumes at once, in the round after the veto's last (this test is about the drafter,
        # not the policy's judgement): the joined sequence starts, then both draft
        policy.mode = "fixed"
        while not (req.done.is_set() and joined.done.is_set()):
            engine.step()
        assert sum(req.stats.rounds_by_k[1:]) > drafted and sum(joined.stats.rounds_by_k[1:]) > 0  # drafting again
        assert engine.proposer_failures == 0 and engine.degraded is None and servicer.reclaimed == 0
        assert req.result().token_ids == want.token_ids
        assert joined.result().token_ids == SpeculativeEngine(ModelRunner(target), None, eos_ids=set()).generate(
            [4, 5, 6], 60, SamplingParams(), 0).token_ids
    finally:
        server.stop(0)


def test_a_start_after_a_release_of_the_same_id_waits_for_it_and_a_duplicate_is_the_request_s_fault(stub):
    """A Release the drafter answered but left pending (its model lock was busy) is applied before
    a Start of the same id: until stop 48 that Start was refused ALREADY_EXISTS, which the client
    took for a failed drafter (every sequence failed over). A Start of an id that is live is the
    request's fault: the client raises ValueError (that sequence runs without the drafter), and
    the engine refuses a request id already in use."""
    import threading

    from specserve.verifier.client import RemoteProposer
    from specserve.verifier.engine import SpeculativeEngine
    s, _, servicer = stub
    start(s, "again")
    busy = threading.Event()
    hold_model_lock(servicer, busy, 10.0)
    s.Release(pb.ReleaseRequest(seq_ids=["again"]), timeout=10)  # answered at once, applied later
    assert "again" in servicer.inner.seqs
    threading.Timer(0.3, busy.set).start()
    start(s, "again")  # waits for the lock, then the release goes first
    remote = RemoteProposer(servicer.address)
    remote.start("dup", [1, 2], SamplingParams())
    remote.rounds.pop("dup")  # (as if the client had lost track of it)
    with pytest.raises(ValueError, match="already started"):
        remote.start("dup", [1, 2], SamplingParams())
    s.Release(pb.ReleaseRequest(seq_ids=["again", "dup.0"]), timeout=10)
    remote.client.close()
    engine = SpeculativeEngine(ModelRunner(tiny_model("llama", V, seed=0)), None, eos_ids=set())
    engine.submit([1, 2], 4, SamplingParams(), 0, request_id="same")
    with pytest.raises(ValueError, match="in use"):
        engine.submit([1, 2], 4, SamplingParams(), 0, request_id="same")


def test_a_failed_preparation_is_undone_and_the_next_propose_drafts_on_demand():
    """An error while preparing drafts (out of memory on a fan-out pass, say) leaves the sequence
    as it was: the next Propose's drafts equal on-demand drafting's. Until stop 48 the guessed
    tokens stayed committed, and the drafter drafted from the wrong context from then on."""
    from specserve.drafter.draft_model import DraftModelProposer
    from specserve.drafter.pipeline import PipelinedProposer
    from specserve.core.proposer import ProposeItem
    drafter = tiny_model("llama", V, seed=3)
    plain = DraftModelProposer(ModelRunner(drafter, slots=2))
    piped = PipelinedProposer(DraftModelProposer(ModelRunner(drafter, slots=2)))
    params = SamplingParams().with_seed()
    for p in (plain, piped):
        p.start("s", [1, 2, 3], params)
    assert plain.propose([ProposeItem("s", [], 3)])[0].tokens == piped.propose([ProposeItem("s", [], 3)])[0].tokens
    base = piped.base_length("s")
    fail = piped.inner.propose_seqs

    def boom(*a, **kw):
        raise RuntimeError("out of memory")
    piped.inner.propose_seqs = boom
    with pytest.raises(RuntimeError, match="out of memory"):
        piped.speculate(["s"])
    piped.inner.propose_seqs = fail
    assert piped.base_length("s") == base and "s" not in piped.guessed
    outcome = [7, 9]
    want, got = plain.propose([ProposeItem("s", outcome, 3)])[0], piped.propose([ProposeItem("s", outcome, 3)])[0]
    assert got.tokens == want.tokens and not got.pipeline_hit


def test_a_drafter_with_another_vocabulary_is_refused_in_process_and_remote():
    """Tokenizers alike (check_pair) do not make output layers alike: a drafter whose q has another
    size fails acceptance on every round with a sampled request. The engine refuses such a drafter
    when it is built, remote or in process (until stop 49, only the builder checked, remote ones)."""
    from specserve.drafter.draft_model import DraftModelProposer
    from specserve.verifier.client import RemoteProposer
    from specserve.verifier.engine import SpeculativeEngine

    target, drafter = tiny_model("llama", V, seed=0), tiny_model("llama", V + 8, seed=1, hidden=16, layers=1)
    with pytest.raises(ValueError, match=rf"drafter's vocabulary \({V + 8}\) differs from the target's \({V}\)"):
        SpeculativeEngine(ModelRunner(target), DraftModelProposer(ModelRunner(drafter)))
    server, port, _ = serve(drafter, host="127.0.0.1", pipeline=False)
    try:
        remote = RemoteProposer(f"127.0.0.1:{port}")
        with pytest.raises(ValueError, match="differs from the target's"):
            SpeculativeEngine(ModelRunner(target), remote)
        remote.client.close()
    finally:
        server.stop(0)
