"""A circuit breaker for calls to one directory shard, pure: the caller passes `now`.

    CLOSED ──(a call times out or fails)──► OPEN ──(probe_s passed)──► PROBING
      ▲                                      ▲                            │
      └───────────(the probe answers)────────┼────────────────────────────┘
                                             └──(the probe fails too)─────┘

While OPEN or PROBING, `allow()` is False: a lookup answers at once with what the node holds
itself (the directory is only a hint), instead of waiting for a shard that is not answering. One
probe at a time goes to the shard (`take_probe()`), off the request path, so no request pays the
timeout twice, and full answers come back as soon as the shard does.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from fabric import config as defaults


class BreakerState(enum.Enum):
    CLOSED = 0     # calls go through
    OPEN = 1       # calls answer local-only; waiting for the next probe
    PROBING = 2    # one probe in flight; calls still answer local-only


@dataclass(slots=True)
class CircuitBreaker:
    probe_s: float = defaults.DIRECTORY_PROBE_S   # how long after a failure the next probe may go
    state: BreakerState = BreakerState.CLOSED
    num_opened: int = 0                # times a failure opened the breaker
    _probe_at: float = 0.0

    def allow(self) -> bool:
        """True when a request may call the shard (the breaker is closed)."""
        return self.state is BreakerState.CLOSED

    def failure(self, now: float) -> None:
        """A call or a probe did not answer in time (or failed): open, and probe after `probe_s`."""
        if self.state is BreakerState.CLOSED:
            self.num_opened += 1
        self.state = BreakerState.OPEN
        self._probe_at = now + self.probe_s

    def success(self) -> None:
        self.state = BreakerState.CLOSED

    def take_probe(self, now: float) -> bool:
        """True (and PROBING) when the caller should send the one probe now."""
        if self.state is BreakerState.OPEN and now >= self._probe_at:
            self.state = BreakerState.PROBING
            return True
        return False
