"""`tune_allocator`: received payload buffers are reused from the heap instead of being page-faulted
in (and zeroed by the kernel) for every block. Each case runs in a fresh interpreter, since the
tuning is process-wide and permanent."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# Receive a 48 MiB pull of 24 KiB payloads the way the TLS link does (a fresh uninitialised buffer
# each, filled; results wait for their reader, then are dropped together), four times, and print the
# minor page faults of the last three pulls.
PROBE = """
import resource, sys
sys.path.insert(0, {root!r})
from transports.core.buffers import tune_allocator, uninitialised_bytearray
if {tune}:
    assert tune_allocator()
def pull():
    held = []
    for _ in range(2048):
        buf = uninitialised_bytearray(24 << 10)
        buf[::4096] = b"x" * 6        # touch every page, as decryption into it does
        held.append(buf)
pull()                                # the first pull grows the heap
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(3):
    pull()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def faults(tune: bool) -> int:
    out = subprocess.run([sys.executable, "-c", PROBE.format(root=str(ROOT), tune=tune)],
                         capture_output=True, text=True, timeout=60, check=True)
    return int(out.stdout.strip())


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mallopt thresholds are glibc (Linux) only")
def test_tuned_allocator_reuses_payload_buffers_instead_of_faulting_them_in() -> None:
    untuned, tuned = faults(False), faults(True)
    assert untuned >= 20_000             # the freed heap was trimmed: each pull faults up to 12k pages back in
    assert tuned < 1_000, f"{tuned} page faults for three pulls into reused heap memory"
