"""The one timer scheme of every transport: a deadline-driven asyncio timer per connection.

Sessions say when they next have something to do (`next_deadline()`); a `DeadlineTimer` calls
its `expire(now)` then, and `expire` handles what is due (`handle_timer(now)`) and returns the
next deadline, at which the timer re-arms (None: disarmed until told of one).

    session event ──► timer.at_most(session.next_deadline())   (O(1); re-arms only if sooner)
    deadline      ──► expire(now) ──► session.handle_timer(now) … ──► the next deadline

Deadlines usually move later as frames arrive (each one pushes back the stall deadline): the
timer is then left where it is, fires early, and `expire` re-arms it at the later deadline, so
a busy connection costs one timer callback per timeout period, not one reschedule per frame.
A deadline that comes sooner (a frame started, output blocked, a first request) re-arms it at
once, which is why an adapter calls `at_most` after every call into its session.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable


class DeadlineTimer:
    """Calls `expire(now)` once the earliest deadline it was told of has passed; `expire`
    returns the next deadline (loop time) or None. Never fires after `cancel()`."""

    __slots__ = ("_expire", "_handle", "_loop", "_when", "cancelled")

    def __init__(self, expire: Callable[[float], float | None]) -> None:
        self._loop = asyncio.get_running_loop()
        self._expire = expire
        self._handle: asyncio.TimerHandle | None = None
        self._when = float("inf")
        self.cancelled = False

    @property
    def when(self) -> float | None:
        """The loop time it fires next, or None when disarmed."""
        return None if self._handle is None else self._when

    def at_most(self, deadline: float | None) -> None:
        """Fire no later than `deadline` (None: nothing new to wait for)."""
        if deadline is None or deadline >= self._when or self.cancelled:
            return
        if self._handle is not None:
            self._handle.cancel()
        self._when = deadline
        self._handle = self._loop.call_at(deadline, self._fire)

    def _fire(self) -> None:
        self._handle, self._when = None, float("inf")
        self.at_most(self._expire(self._loop.time()))

    def cancel(self) -> None:
        self.cancelled = True
        if self._handle is not None:
            self._handle.cancel()
            self._handle, self._when = None, float("inf")
