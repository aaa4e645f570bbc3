"""RDMA device access (pyverbs, imported lazily: this module loads without it): why RDMA cannot
run here, an opened device (context, protection domain, port, GID) shared per (device, port,
GID index), and registered memory slabs.

    _RegisteredSlabs:  slab 0 = mmap ─ MR     slab 1 = mmap ─ MR     …  (one MR per slab)
                       extents sub-allocated by `slabs.SlabAllocator` (pure bookkeeping)

`close()` deregisters every MR and unmaps every slab it created, including a slab whose MR
registration failed half way.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import sys
from pathlib import Path
from typing import Any, ClassVar

from transports.core.errors import TransportError
from transports.core.slabs import Extent, SlabAllocator
from transports.rdma.control import MTU_CODES, gid_bytes

logger = logging.getLogger(__name__)


class RdmaDeviceError(TransportError, OSError):
    """The RDMA device refused an operation (pyverbs error), or a work request failed."""


# ---------------------------------------------------------------------------------------------
# Device access (pyverbs imported lazily: this module loads without it)


def rdma_unavailable_reason() -> str | None:
    """Why RDMA cannot run here, or None when pyverbs and at least one device are present."""
    sysfs = Path("/sys/class/infiniband")
    if sys.platform == "linux" and not (sysfs.is_dir() and any(sysfs.iterdir())):
        # The hardware check comes first: without a device, installing pyverbs would not help.
        return (f"no RDMA device: {sysfs} lists none (no InfiniBand/RoCE NIC, or the rdma kernel "
                f"modules are not loaded)")
    try:
        import pyverbs.device as d
        from pyverbs.pyverbs_error import PyverbsError
    except ImportError as e:
        return f"pyverbs not installed ({e}); install the `rdma` extra on a host with rdma-core"
    try:
        devices = d.get_device_list()
    except PyverbsError as e:
        return f"cannot list RDMA devices: {e}"
    if not devices:
        return "no RDMA device: ibv_get_device_list() returned none"
    return None


class _Device:
    """An opened device: context, protection domain, port attributes, our GID."""

    _opened: ClassVar[dict[tuple[str | None, int, int], _Device]] = {}

    def __init__(self, name: str | None, port_num: int, gid_index: int) -> None:
        import pyverbs.device as d
        from pyverbs.pd import PD

        devices = d.get_device_list()
        if not devices:
            raise RdmaDeviceError("no RDMA device: ibv_get_device_list() returned none")
        self.name = name or devices[0].name.decode()
        self.ctx = d.Context(name=self.name)
        self.pd = PD(self.ctx)
        self.port_num = port_num
        self.gid_index = gid_index
        port = self.ctx.query_port(port_num)
        self.lid = int(port.lid)
        self.mtu = {code: size for size, code in MTU_CODES.items()}.get(int(port.active_mtu), 1024)
        self.gid = gid_bytes(self.ctx.query_gid(port_num, gid_index).gid)

    @classmethod
    def get(cls, name: str | None, port_num: int, gid_index: int) -> _Device:
        from pyverbs.pyverbs_error import PyverbsError

        key = (name, port_num, gid_index)
        if key not in cls._opened:
            try:
                cls._opened[key] = cls(name, port_num, gid_index)
            except PyverbsError as err:
                raise RdmaDeviceError(f"cannot open RDMA device {name or '(first)'} port {port_num}: {err}") from err
        return cls._opened[key]


class _RegisteredSlabs:
    """A SlabAllocator whose slabs are anonymous mmaps, each registered as one memory region."""

    def __init__(self, device: _Device, slab_size: int, max_slabs: int) -> None:
        import pyverbs.enums as e

        self._device = device
        self._access = e.IBV_ACCESS_LOCAL_WRITE
        self.alloc = SlabAllocator(slab_size, max_slabs)
        self._maps: list[mmap.mmap] = []
        self._mrs: list[Any] = []
        self._addrs: list[int] = []

    def allocate(self, nbytes: int) -> Extent | None:
        extent = self.alloc.allocate(nbytes)
        if extent is None and self.alloc.can_add_slab:
            self._register(self.alloc.add_slab())
            extent = self.alloc.allocate(nbytes)
        return extent

    def _register(self, slab: int) -> None:
        from pyverbs.mr import MR

        mem = mmap.mmap(-1, self.alloc.slab_size)
        anchor = ctypes.c_char.from_buffer(mem)
        address = ctypes.addressof(anchor)
        del anchor  # the mapping stays put; only the buffer export is released
        self._maps.append(mem)
        self._addrs.append(address)
        self._mrs.append(MR(self._device.pd, self.alloc.slab_size, self._access, address=address))
        assert len(self._maps) == slab + 1, "slabs must be registered in order"

    def view(self, extent: Extent) -> memoryview:
        return memoryview(self._maps[extent.slab])[extent.offset:extent.offset + extent.length]

    def sge(self, extent: Extent, length: int) -> Any:
        from pyverbs.wr import SGE

        return SGE(self._addrs[extent.slab] + extent.offset, length, self._mrs[extent.slab].lkey)

    def free(self, extent: Extent) -> None:
        self.alloc.free(extent)

    def close(self) -> None:
        for mr in self._mrs:
            mr.close()
        for mem in self._maps:
            try:
                mem.close()
            except BufferError:  # a view is still referenced somewhere: the GC unmaps it later
                logger.debug("slab still referenced at close; left to the garbage collector")
        self._mrs.clear()
        self._maps.clear()
