"""LatencyRecorder: totals since start, percentiles over the most recent window."""

from __future__ import annotations

import pytest

from fabric.latency import LatencyRecorder


def test_totals_and_recent_percentiles() -> None:
    rec = LatencyRecorder(4)
    assert rec.stats().count == 0
    for v in (5, 1, 9, 3, 7):
        rec.record(v)
    lat = rec.stats()
    assert (lat.count, lat.max_ns, lat.mean_ns) == (5, 9, 5.0)
    assert lat.p50_ns == 3  # over the window of the 4 most recent: 1 3 7 9
    assert lat.p99_ns == 7


def test_window_must_be_a_power_of_two() -> None:
    with pytest.raises(ValueError):
        LatencyRecorder(3)
