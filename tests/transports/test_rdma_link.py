"""RdmaLink's set-up releases what it registered when a later step fails.

No RDMA device exists on the machines that run this suite, so a device refusal cannot be caused
for real: `fake_verbs` stands in for pyverbs (a stand-in for absent hardware only). It records
every memory region, completion queue and queue pair it hands out and refuses the step a test
names. The memory slabs themselves are real anonymous mmaps, and the test checks they are unmapped.
"""

from __future__ import annotations

import asyncio
import socket
import sys
import types
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, cast

import pytest

from transports.core.codec import FrameDecoder, MissReason
from transports.core.metrics import TransportMetrics
from transports.rdma.device import RdmaDeviceError, _Device, _RegisteredSlabs
from transports.rdma.link import RdmaLink

RECV_SLOTS = 4
SLOT_SIZE = 4096


@dataclass
class Verbs:
    """What the fake device handed out, and which step it refuses."""

    fail_at: str = ""
    live: list[Any] = field(default_factory=list)      # MRs, CQs, QPs not yet closed
    made: list[str] = field(default_factory=list)      # kinds, in creation order
    num_posted: int = 0


@pytest.fixture
def fake_verbs(monkeypatch: pytest.MonkeyPatch) -> Iterator[Verbs]:
    verbs = Verbs()

    class PyverbsError(Exception):
        pass

    class Resource:
        kind = ""

        def __init__(self, *args: Any, **kw: Any) -> None:
            if verbs.fail_at == self.kind:
                raise PyverbsError(f"device refused {self.kind}")
            verbs.made.append(self.kind)
            verbs.live.append(self)
            self.lkey = self.qp_num = len(verbs.made)

        def close(self) -> None:
            if self in verbs.live:
                verbs.live.remove(self)

    class MR(Resource):
        kind = "MR"

    class CQ(Resource):
        kind = "CQ"

    class QP(Resource):
        kind = "QP"

        def post_recv(self, wr: Any, bad: Any) -> None:
            if verbs.fail_at == f"post_recv {verbs.num_posted}":
                raise PyverbsError("receive queue full")
            verbs.num_posted += 1

    def record(*args: Any, **kw: Any) -> types.SimpleNamespace:
        return types.SimpleNamespace(*args, **kw)

    modules: dict[str, dict[str, Any]] = {
        "pyverbs": {},
        "pyverbs.enums": {"IBV_ACCESS_LOCAL_WRITE": 1, "IBV_QPT_RC": 2, "IBV_WR_SEND": 0,
                          "IBV_SEND_SIGNALED": 2, "IBV_WC_SUCCESS": 0},
        "pyverbs.pyverbs_error": {"PyverbsError": PyverbsError},
        "pyverbs.mr": {"MR": MR},
        "pyverbs.cq": {"CQ": CQ},
        "pyverbs.qp": {"QP": QP, "QPAttr": record, "QPCap": record, "QPInitAttr": record},
        "pyverbs.wr": {"SGE": lambda *a: a, "RecvWR": record, "SendWR": record},
    }
    for name, attrs in modules.items():
        module = types.ModuleType(name)
        module.__dict__.update(attrs)
        monkeypatch.setitem(sys.modules, name, module)
    yield verbs


@pytest.fixture
def slabs(monkeypatch: pytest.MonkeyPatch) -> list[list[Any]]:
    """The mmaps of every registered slab set, captured when the set is closed."""
    closed: list[list[Any]] = []

    class Recording(_RegisteredSlabs):
        def close(self) -> None:
            closed.append(list(self._maps))
            super().close()

    monkeypatch.setattr("transports.rdma.link._RegisteredSlabs", Recording)
    return closed


DEVICE = cast(_Device, types.SimpleNamespace(name="fake0", ctx=object(), pd=object(), port_num=1, gid_index=0,
                                             lid=1, mtu=4096, gid=bytes(16)))


def make_link(control: socket.socket, reasons: list[MissReason]) -> RdmaLink:
    return RdmaLink(DEVICE, control, FrameDecoder(), lambda frames: None, reasons.append,  # type: ignore[arg-type]
                    1.0, TransportMetrics(), recv_slots=RECV_SLOTS, slot_size=SLOT_SIZE)


@pytest.mark.parametrize("fail_at", ["MR", "CQ", "QP", "post_recv 0", f"post_recv {RECV_SLOTS - 1}"])
def test_a_failed_setup_frees_every_registered_region(fake_verbs: Verbs, slabs: list[list[Any]],
                                                      fail_at: str) -> None:
    fake_verbs.fail_at = fail_at

    async def main() -> None:
        a, b = socket.socketpair()
        try:
            with pytest.raises(RdmaDeviceError, match="fake0"):
                make_link(a, [])
        finally:
            a.close()
            b.close()

    asyncio.run(main())
    assert fake_verbs.live == [], f"left registered after a failed {fail_at}: {fake_verbs.made}"
    maps = [m for slab_set in slabs for m in slab_set]
    assert maps and all(m.closed for m in maps)   # the receive slab was mapped, and is unmapped


def test_a_closed_link_frees_everything_once(fake_verbs: Verbs, slabs: list[list[Any]]) -> None:
    reasons: list[MissReason] = []

    async def main() -> None:
        a, b = socket.socketpair()
        try:
            link = make_link(a, reasons)
            assert fake_verbs.made == ["MR", "CQ", "QP"] and fake_verbs.num_posted == RECV_SLOTS
            link.close(MissReason.PEER_GONE, "test")
            link.close(MissReason.PEER_GONE, "again")
        finally:
            b.close()

    asyncio.run(main())
    assert fake_verbs.live == [] and reasons == [MissReason.PEER_GONE]
    assert all(m.closed for slab_set in slabs for m in slab_set)
