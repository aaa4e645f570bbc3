"""A store's lifecycle, OPEN -> CLOSING -> CLOSED, and the calls it admits (no I/O).

    OPEN      every call is admitted; those that outlive the lock (file reads, puts, flushes,
              maintenance) count as in flight until they leave
    CLOSING   no call is admitted (StoreClosedError); `close()` waits up to its timeout for those
              in flight, then flushes and releases
    CLOSED    the CloseReport is kept: a second `close()` answers it, a concurrent one waits for it

`CallGate` is the one writer of the state, the count in flight and the report, under the store's
lock (shared, so a call is admitted and its state found in one critical section).
"""

from __future__ import annotations

import threading

from fabric.store_types import CloseReport, Lifecycle, StoreClosedError


class CallGate:
    """Admission of a store's calls and the close handshake (module docstring)."""

    def __init__(self, lock: threading.Lock, name: str) -> None:
        self._lock = lock
        self._name = name
        self._state = Lifecycle.OPEN
        self._num_inflight = 0
        self._idle = threading.Condition(lock)
        self._report: CloseReport | None = None

    @property
    def state(self) -> Lifecycle:
        return self._state

    def check_open_locked(self) -> None:
        if self._state is not Lifecycle.OPEN:
            raise StoreClosedError(f"store over {self._name} is {self._state.value}")

    def admit_locked(self) -> None:
        """Admit a call that will outlive the lock (raises StoreClosedError unless OPEN); `leave` ends it."""
        self.check_open_locked()
        self._num_inflight += 1

    def enter(self) -> None:
        with self._lock:
            self.admit_locked()

    def leave(self) -> None:
        with self._lock:
            self._num_inflight -= 1
            if not self._num_inflight:
                self._idle.notify_all()

    def begin_close(self, timeout_s: float) -> CloseReport | int:
        """The report of a close already begun (waiting for it to end); else CLOSING from now on,
        and how many calls were still in flight after `timeout_s`."""
        with self._lock:
            if self._state is not Lifecycle.OPEN:
                self._idle.wait_for(lambda: self._state is Lifecycle.CLOSED)
                assert self._report is not None, "a CLOSED store keeps its close report"
                return self._report
            self._state = Lifecycle.CLOSING
            self._idle.wait_for(lambda: not self._num_inflight, timeout_s)
            return self._num_inflight

    def finish_close(self, report: CloseReport) -> None:
        with self._lock:
            self._report = report
            self._state = Lifecycle.CLOSED
            self._idle.notify_all()
