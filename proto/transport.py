"""The transport settings both ends of the contract share: the largest message, and the drafter's
keepalive.

Keepalive: the drafter's server pings each verifier connection after KEEPALIVE_S without a ping,
calls or none, and closes a connection whose ping goes unanswered for KEEPALIVE_TIMEOUT_S. A
verifier whose host died or whose network was cut sends no FIN or RST, so without the pings its
ProposeStream would hold one of the server's RPC threads for good (TCP's own keepalive starts after
two hours); closing the connection ends the stream and frees the thread. The verifier's side needs
no pings of its own: every call it makes has a deadline (`specserve.verifier.client.deadline`).
The sequences of a closed connection stay until the drafter's TTL reclaims them (a verifier that
comes back connects anew under a new epoch, and releases the old connection's ids then).
"""

from __future__ import annotations

MAX_MESSAGE_BYTES = 64 << 20
KEEPALIVE_S = 20.0
KEEPALIVE_TIMEOUT_S = 10.0


def channel_options() -> list[tuple[str, int]]:
    """The verifier's channel to a drafter."""
    return [("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES)]


def server_options(keepalive_s: float = KEEPALIVE_S, keepalive_timeout_s: float = KEEPALIVE_TIMEOUT_S
                   ) -> list[tuple[str, int]]:
    """The drafter's server: the message limits, and pings that find a verifier gone silent."""
    return channel_options() + [
        ("grpc.keepalive_time_ms", int(keepalive_s * 1000)),
        ("grpc.keepalive_timeout_ms", int(keepalive_timeout_s * 1000)),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),  # an idle stream sends no data: keep pinging it
        ("grpc.http2.ping_timeout_ms", int(keepalive_timeout_s * 1000)),  # gRPC 1.85 times a ping out by this, not the above
    ]
