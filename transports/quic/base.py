"""QUIC transport (aioquic 1.7.2): what its server and client share (re-exported by `transports.quic`).

    client (client.QuicTransportClient)        server (server.QuicTransportServer)
    pool: node -> one connection                    per connection: stream id -> ServerSession
    pull(): one bidirectional stream per PULL
        HELLO + PULL + FIN ───────────────────────► ServerSession(hello=False, one_pull=True)
        ◄─────────────── BLOCK | MISS ... END + FIN  answers pumped round-robin over streams
    ClientSession verifies each digest               while unacked bytes < send_high_water

ALPN `kvfabric/1`; mutual TLS against the cluster CA (the server side is enforced by
`transports.quic.tls`, the client side by aioquic's own verification with the dialled node name
as server name).

Datagram size decides QUIC's speed here: aioquic builds every packet in Python, so throughput is
set by packets per second, not bytes. 1452-byte datagrams (what a 1500-byte-MTU network carries)
move about a sixth of what 8952-byte jumbo datagrams move; choose the size your network carries
(`max_datagram_size`), and TLS-TCP for bulk pulls where it is free to choose.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.connection import QuicConnection

from fabric import config as defaults
from fabric.config import TransportConfig
from transports.core.codec import Frame, encode_parts, payload_pieces
from transports.quic.backend import QuicBackend

ALPN = "kvfabric/1"
DATACENTER_INITIAL_RTT_S = 0.01
TRANSPORT = "quic"
# aioquic widens a stream's receive window as data arrives, not as the caller consumes it, so a
# stream's answers can pile up in the client. Asking at most 64 addresses per stream bounds that
# to 64 payloads per pull in flight (and keeps the PULL header far under the 64 KiB limit); the
# extra stream per 64 blocks costs one round trip.
MAX_ADDRESSES_PER_STREAM = 64
STREAM_PROTOCOL_ERROR = 0x1        # application error codes for STOP_SENDING / RESET_STREAM
STREAM_TIMEOUT = 0x2
STREAM_CANCELLED = 0x3


@dataclass(frozen=True, slots=True)
class QuicTuning:
    """Knobs that decide QUIC throughput. Defaults suit loopback and datacenter jumbo frames."""

    max_datagram_size: int = defaults.MAX_DATAGRAM_SIZE
    # Windows and the send high-water mark keep the bytes in flight below what the receiver's
    # socket buffer absorbs while its (single-threaded, pure-Python) QUIC stack catches up:
    # loss there halves the congestion window. They are far above loopback/datacenter BDPs.
    max_data: int = defaults.QUIC_MAX_DATA                # connection flow-control window
    max_stream_data: int = defaults.QUIC_MAX_STREAM_DATA  # per-stream flow-control window
    send_high_water: int = 2 * 1024 * 1024  # server: unacknowledged answer bytes per connection
    socket_buffer: int = 8 * 1024 * 1024    # SO_SNDBUF / SO_RCVBUF, capped by net.core.[rw]mem_max
    # The round trip assumed before the first sample: it sets the handshake's loss timer. The
    # libraries assume an internet path (aioquic 100 ms, qh3 333 ms), so one lost handshake packet
    # stalls a datacenter connection for a third of a second; None keeps the library's value.
    initial_rtt_s: float | None = DATACENTER_INITIAL_RTT_S
    # Hand a GRO / recvmmsg batch of datagrams to the library in one call (qh3: one pass of its
    # Rust core) and process the resulting events once, instead of once per datagram.
    receive_batches: bool = True

    @classmethod
    def from_config(cls, config: TransportConfig) -> QuicTuning:
        return cls(max_datagram_size=config.max_datagram_size, max_data=config.quic_max_data,
                   max_stream_data=config.quic_max_stream_data)

    @classmethod
    def library_defaults(cls, max_datagram_size: int, backend: QuicBackend) -> QuicTuning:
        """The library's own flow-control windows and initial round trip at `max_datagram_size`:
        what the tuned values are measured against."""
        d = backend.configuration()
        return cls(max_datagram_size, d.max_data, d.max_stream_data, initial_rtt_s=None, receive_batches=False)

    @classmethod
    def aioquic_defaults(cls) -> QuicTuning:
        """Stock aioquic settings (1200-byte datagrams, 1 MiB windows): the benchmark baseline."""
        d = QuicConfiguration()
        return cls(d.max_datagram_size, d.max_data, d.max_stream_data, 1024 * 1024, 0, initial_rtt_s=None,
                   receive_batches=False)


def base_configuration(is_client: bool, tuning: QuicTuning, idle_timeout_s: float,
                       backend: QuicBackend) -> QuicConfiguration:
    """The library's QuicConfiguration (typed as aioquic's: qh3's has the same fields)."""
    configuration = backend.configuration(
        is_client=is_client, alpn_protocols=[ALPN], idle_timeout=idle_timeout_s,
        max_datagram_size=tuning.max_datagram_size, max_data=tuning.max_data, max_stream_data=tuning.max_stream_data)
    if tuning.initial_rtt_s is not None:
        configuration.initial_rtt = tuning.initial_rtt_s
    return cast(QuicConfiguration, configuration)


def send_frame(quic: QuicConnection, stream_id: int, frame: Frame, max_payload: int,
               end_stream: bool = False) -> int:
    """Queue one whole frame on a stream (header and payload without joining them); bytes queued."""
    head, payload = encode_parts(frame, max_payload=max_payload)
    pieces = [v for v in (memoryview(p).cast("B") for p in payload_pieces(payload)) if v.nbytes]
    quic.send_stream_data(stream_id, head, end_stream=end_stream and not pieces)
    for i, view in enumerate(pieces):  # aioquic copies into its send buffer: hand it the payload's own memory
        quic.send_stream_data(stream_id, cast(bytes, view), end_stream=end_stream and i == len(pieces) - 1)
    return len(head) + sum(v.nbytes for v in pieces)
