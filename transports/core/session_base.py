"""What the server and the client session share: the close state, the decoder and the total frame
deadline (a frame must arrive whole within `frame_timeout_s` of its first byte)."""

from __future__ import annotations

import enum

from transports.core.codec import FrameDecoder, MissReason, ProtocolError

__all__ = ["SessionBase", "State"]


class State(enum.Enum):
    OPEN = "open"
    CLOSING = "closing"   # the adapter sends what the last call returned, then closes


class SessionBase:
    """What both sides share: the decoder, the total frame deadline and the close state."""

    frame_timeout_s: float
    idle_timeout_s: float

    def _init_session(self, decoder: FrameDecoder, now: float) -> None:
        self.decoder = decoder
        self.state = State.OPEN
        self.close_reason = MissReason.PEER_GONE
        self.error: ProtocolError | None = None   # what the peer did wrong, when it did
        self.frame_started: float | None = None    # first byte of the partly received frame
        self.idle_since = now

    @property
    def closing(self) -> bool:
        return self.state is State.CLOSING

    def _close(self, reason: MissReason) -> None:
        if self.state is State.OPEN:
            self.state = State.CLOSING
            self.close_reason = reason

    def _track_frame(self, num_frames: int, now: float) -> None:
        """Keep `frame_started`: a frame that is still partial after frames completed in this call
        began in this call."""
        if not self.decoder.mid_frame:
            self.frame_started = None
        elif num_frames or self.frame_started is None:
            self.frame_started = now

    def _frame_deadline(self) -> float | None:
        return None if self.frame_started is None else self.frame_started + self.frame_timeout_s


# =============================================================================================
# Server
