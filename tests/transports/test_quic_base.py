"""QUIC tuning (transports/quic/base.py) on a real library connection, driven with `now` by hand:
what a lost first packet costs a datacenter handshake."""

from __future__ import annotations

from transports.quic.backend import resolve
from transports.quic.base import QuicTuning, base_configuration


def _first_resend_s(backend_name: str, tuning: QuicTuning) -> float:
    """Seconds after a client's first flight is sent (and lost) until it sends it again."""
    backend = resolve(backend_name)
    config = base_configuration(True, tuning, 30.0, backend)
    config.server_name = "node-a"
    quic = backend.connection(configuration=config)
    quic.connect(("10.0.0.1", 4433), now=0.0)
    assert quic.datagrams_to_send(now=0.0), "the client sent no Initial"   # lost on the way
    timer = quic.get_timer()
    assert timer is not None, "a client with an unanswered Initial must arm a loss timer"
    quic.handle_timer(now=timer)
    assert quic.datagrams_to_send(now=timer), "the loss timer fired without resending the Initial"
    return float(timer)


def test_a_lost_first_packet_is_resent_within_a_datacenter_timescale(quic_backend: str) -> None:
    # The libraries assume an internet round trip before the first sample (aioquic 100 ms, qh3
    # 333 ms): a lost Initial stalls the connect by 0.2-1 s. Tuned, the resend comes in tens of ms.
    assert _first_resend_s(quic_backend, QuicTuning(1452)) <= 0.1


def test_library_defaults_keep_the_library_initial_round_trip(quic_backend: str) -> None:
    stock = QuicTuning.library_defaults(1452, resolve(quic_backend))
    assert stock.initial_rtt_s is None
    assert _first_resend_s(quic_backend, stock) > 0.1
