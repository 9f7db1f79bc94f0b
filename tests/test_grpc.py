"""The gRPC contract: committed stubs are fresh, and bad requests get statuses, not a dead server."""

import filecmp
import os

import grpc
import pytest
import torch

from specserve.training.tiny import tiny_model
from specserve.drafter.server import serve
from specserve.proto.codec import q_from_proto, q_to_proto
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


def propose(stub, seq_id, new_tokens=(), k=3, round_=1):
    return stub.Propose(pb.ProposeRequest(items=[pb.ProposeItem(seq_id=seq_id, round=round_,
                                                                new_tokens=list(new_tokens), k=k)]), timeout=10)


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
    assert code_of(lambda: propose(s, "ok", k=65)) == grpc.StatusCode.INVALID_ARGUMENT
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
    from specserve.drafter.server import MAX_MESSAGE_BYTES
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
    assert [d.tokens for d in drafts] == [[]] and remote._in_flight is not None
    d = remote.propose([ProposeItem("cu", [7], 2)])[0]  # collects the catch-up's answer first
    assert remote._in_flight is None and len(d.tokens) == 2
    assert servicer.inner.seqs["cu.0"].tokens[:7] == [1, 2, 3, 4, 5, 6, 7]  # (+ a pipelined guess)
    remote.release("cu")
    remote.rounds["gone"] = 0  # a sequence the drafter does not know: the catch-up fails there
    remote.propose([ProposeItem("gone", [1], 0)])
    with pytest.raises(DrafterUnavailable, match="NOT_FOUND"):
        remote.propose([ProposeItem("gone", [], 1)])
    remote.client.close()
