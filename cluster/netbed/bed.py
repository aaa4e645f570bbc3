"""A bed of hosts on this machine: network namespaces on a private bridge, with shaped links and
partitions. The plan and the commands come from `cluster/netbed/plan.py`; this module runs them.

    bed = NetBed.create(3, profile="dc")      # hosts 0..2 at 10.x.y.1..3, bridge at 10.x.y.254
    bed.spawn(1, ["python", "server.py"])     # a process inside host 1, tracked by PID
    bed.partition(1, 2); bed.heal(1, 2)
    with bed.inside(2): ...                   # this thread's new sockets live in host 2
    bed.teardown()                            # or NetBed.load(state).teardown() from another process

What this kernel applies of a profile is in `bed.applied`: the rate (tbf, both ways) and random
loss (nftables, per sending host). A one-way delay needs `tc netem`; where the kernel lacks it the
delay is logged once as not applied, never pretended.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import os
import secrets
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from cluster.errors import ClusterError
from cluster.netbed.plan import (
    BedPlan,
    NetbedError,
    Profile,
    choose_subnet,
    create_commands,
    delete_commands,
    nft_ruleset,
    parse_profile,
    shape_commands,
)

logger = logging.getLogger(__name__)

CLONE_NEWNET = 0x40000000
STATE_NAME = "bed.json"
_libc = ctypes.CDLL(None, use_errno=True)


class NetbedUnavailable(ClusterError, RuntimeError):
    """This machine cannot host a bed; the message names the missing capability."""


def missing_capability() -> str | None:
    """The first thing a bed needs that this machine lacks, in a few words, or None."""
    if os.geteuid() != 0:
        return "root (network namespaces need CAP_NET_ADMIN)"
    for tool, package in (("ip", "iproute2"), ("tc", "iproute2"), ("nft", "nftables")):
        if shutil.which(tool) is None:
            return f"the `{tool}` command (OS package {package}; `make install` adds it)"
    if not Path("/proc/self/ns/net").exists():
        return "network namespaces (/proc/self/ns/net)"
    return None


def _run(cmd: Sequence[str], *, stdin: str | None = None, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(list(cmd), input=stdin, capture_output=True, text=True, timeout=60)
    if check and proc.returncode != 0:
        raise NetbedError(f"`{' '.join(cmd)}` failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc


def _setns(path: str | int) -> None:
    fd = os.open(path, os.O_RDONLY) if isinstance(path, str) else path
    try:
        if _libc.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns({path}): {os.strerror(err)}")
    finally:
        if isinstance(path, str):
            os.close(fd)


def _networks_in_use() -> list[str]:
    out = _run(["ip", "-4", "-o", "addr", "show"]).stdout
    return [line.split()[3] for line in out.splitlines() if len(line.split()) > 3]


@dataclass
class NetBed:
    """A running bed. `pids` are the processes it started; `profiles` the link of each host."""

    plan: BedPlan
    root: Path                                   # the bed's folder: state file, Ray temp dir
    profiles: dict[int, Profile] = field(default_factory=dict)
    partitions: set[tuple[int, int]] = field(default_factory=set)
    pids: list[int] = field(default_factory=list)

    @classmethod
    def create(cls, num_hosts: int, *, profile: str | Profile = "dc", root: str | os.PathLike[str] | None = None,
               ) -> NetBed:
        """Build `num_hosts` hosts with links shaped by `profile`. Raises NetbedUnavailable when the
        machine cannot; on any failure half-way, removes what it made."""
        missing = missing_capability()
        if missing:
            raise NetbedUnavailable(f"a network test bed needs {missing}")
        prefix = f"kvb{secrets.token_hex(2)}"
        plan = BedPlan(prefix, num_hosts, choose_subnet(secrets.token_bytes(16), _networks_in_use()))
        # Short: Ray's Unix sockets live under it, and their paths are limited to 107 bytes.
        folder = Path(root) if root is not None else Path(tempfile.mkdtemp(prefix=f"{prefix}-", dir="/tmp"))
        folder.mkdir(parents=True, exist_ok=True)
        bed = cls(plan, folder)
        bed.save()
        try:
            for cmd in create_commands(plan):
                _run(cmd)
            for i in range(num_hosts):
                bed.shape(i, profile)
        except BaseException:
            bed.teardown()
            raise
        logger.info("bed %s: %d hosts on %s (bridge %s)", prefix, num_hosts, plan.subnet, plan.bridge_address)
        return bed

    # ---- links -------------------------------------------------------------------------------------

    def shape(self, i: int, profile: str | Profile) -> None:
        """Give host i's link `profile` (rate both ways, loss on what it sends)."""
        prof = parse_profile(profile) if isinstance(profile, str) else profile
        for cmd in shape_commands(self.plan, i, prof):
            _run(cmd)
        if prof.delay_ms and not _delay_warned:
            _warn_delay_once(prof)
        self.profiles[i] = prof
        self._apply_rules(i)
        self.save()

    @property
    def applied(self) -> dict[str, bool]:
        """Which parts of a profile this bed applies on this kernel."""
        return {"rate": True, "loss": True, "delay": False, "partition": True}

    def partition(self, a: int, b: int) -> None:
        """Cut every packet between hosts a and b, both ways (established connections stall)."""
        if a == b:
            raise NetbedError(f"cannot partition host {a} from itself")
        self.partitions.add((min(a, b), max(a, b)))
        self._apply_rules(a)
        self._apply_rules(b)
        self.save()

    def heal(self, a: int, b: int) -> None:
        self.partitions.discard((min(a, b), max(a, b)))
        self._apply_rules(a)
        self._apply_rules(b)
        self.save()

    def _apply_rules(self, i: int) -> None:
        blocked = [self.plan.address(b if a == i else a) for a, b in self.partitions if i in (a, b)]
        loss = self.profiles[i].loss_per_mille if i in self.profiles else 0
        _run(["ip", "netns", "exec", self.plan.namespace(i), "nft", "-f", "-"], stdin=nft_ruleset(loss, blocked))

    # ---- processes ---------------------------------------------------------------------------------

    def command(self, i: int, argv: Sequence[str]) -> list[str]:
        """`argv` wrapped to run inside host i."""
        return ["ip", "netns", "exec", self.plan.namespace(i), *argv]

    def run(self, i: int, argv: Sequence[str], *, env: Mapping[str, str] | None = None,
            timeout_s: float = 120) -> subprocess.CompletedProcess[str]:
        """Run `argv` inside host i to completion; raises NetbedError when it fails."""
        proc = subprocess.run(self.command(i, argv), capture_output=True, text=True, timeout=timeout_s,
                              env={**os.environ, **(env or {})})
        if proc.returncode != 0:
            raise NetbedError(f"`{' '.join(argv)}` in host {i} failed ({proc.returncode}): "
                              f"{(proc.stderr or proc.stdout).strip()[-2000:]}")
        self._track(i)
        return proc

    def spawn(self, i: int, argv: Sequence[str], *, env: Mapping[str, str] | None = None,
              log: Path | None = None) -> subprocess.Popen[bytes]:
        """Start `argv` inside host i; its PID is tracked and stopped by `teardown`."""
        out = open(log, "ab") if log else subprocess.DEVNULL   # noqa: SIM115 - the child keeps it
        proc = subprocess.Popen(self.command(i, argv), stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, **(env or {})}, start_new_session=True)
        self.pids.append(proc.pid)
        self.save()
        return proc

    def host_pids(self, i: int) -> list[int]:
        """Every process living in host i's namespace (all of them were started by this bed)."""
        out = _run(["ip", "netns", "pids", self.plan.namespace(i)], check=False).stdout
        return [int(p) for p in out.split()]

    def _track(self, i: int) -> None:
        """Daemons (`ray start`) leave processes behind in the host: record their PIDs."""
        self.pids.extend(p for p in self.host_pids(i) if p not in self.pids)
        self.save()

    @contextlib.contextmanager
    def inside(self, i: int) -> Iterator[None]:
        """Run this thread inside host i: sockets it opens (and threads it starts) live there."""
        home = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
        try:
            _setns(f"/run/netns/{self.plan.namespace(i)}")
            try:
                yield
            finally:
                _setns(home)
        finally:
            os.close(home)

    # ---- state and teardown ------------------------------------------------------------------------

    @property
    def state_path(self) -> Path:
        return self.root / STATE_NAME

    def save(self) -> None:
        state = {"prefix": self.plan.prefix, "num_hosts": self.plan.num_hosts, "subnet": self.plan.subnet,
                 "root": str(self.root), "pids": self.pids,
                 "profiles": {str(i): p.name for i, p in self.profiles.items()},
                 "partitions": sorted(self.partitions)}
        tmp = self.state_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(state))
        tmp.replace(self.state_path)

    @classmethod
    def load(cls, state_path: str | os.PathLike[str]) -> NetBed:
        """The bed a state file describes (written by `save`), to tear it down from another process."""
        try:
            s = json.loads(Path(state_path).read_text())
            plan = BedPlan(s["prefix"], int(s["num_hosts"]), s["subnet"])
            return cls(plan, Path(s["root"]), pids=[int(p) for p in s["pids"]],
                       partitions={(int(a), int(b)) for a, b in s.get("partitions", [])})
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise NetbedError(f"unreadable bed state {state_path}: {e}") from None

    def teardown(self, *, grace_s: float = 5.0) -> None:
        """Stop the bed's processes (tracked PIDs and whatever runs in its namespaces), then delete
        its links and namespaces by name and its folder. Safe to call twice."""
        existing = set(_run(["ip", "netns", "list"], check=False).stdout.split())
        pids = set(self.pids)
        for i in range(self.plan.num_hosts):
            if self.plan.namespace(i) in existing:
                pids.update(self.host_pids(i))
        for sig in (signal.SIGTERM, signal.SIGKILL):
            alive = [p for p in pids if pid_alive(p)]
            for pid in alive:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)
            deadline = time.monotonic() + grace_s
            while any(pid_alive(p) for p in alive) and time.monotonic() < deadline:
                time.sleep(0.05)
        for cmd in delete_commands(self.plan):
            _run(cmd, check=False)
        shutil.rmtree(self.root, ignore_errors=True)
        logger.info("bed %s removed", self.plan.prefix)


_delay_warned = False


def _warn_delay_once(profile: Profile) -> None:
    global _delay_warned
    _delay_warned = True
    logger.warning("link profile %s: its %.2f ms delay is not applied (this kernel has no tc netem); "
                   "rate and loss are", profile.name, profile.delay_ms)


def pid_alive(pid: int) -> bool:
    """Whether process `pid` still runs (a zombie child of ours is reaped and counts as gone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:   # a zombie child of ours is dead for this purpose: reap it
        return os.waitpid(pid, os.WNOHANG) == (0, 0)
    except ChildProcessError:
        return True
