"""The pure half of the network test bed: link profiles, the address plan, and the exact commands
(`ip`, `tc`, `nft`, `ray start`) that build, shape, cut and remove a bed of hosts. No I/O here:
`cluster/netbed/bed.py` runs what these functions return.

A bed is N hosts, each a network namespace with one veth into a private bridge. Every name starts
with the bed's prefix (`kvb` + 4 hex digits), so concurrent beds never collide and teardown can
remove exactly what one bed made.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass

from cluster.errors import ClusterError

PREFIX_RE = re.compile(r"^kvb[0-9a-f]{4}$")
HOST_IF = "eth0"               # the host's end of its veth, inside its namespace
MAX_HOSTS = 200
NFT_TABLE = "kvfabric_bed"


class NetbedError(ClusterError, ValueError):
    """A bed request that cannot be planned: unknown profile, bad prefix, too many hosts."""


@dataclass(frozen=True, slots=True)
class Profile:
    """A link: rate in bit/s both ways, one-way delay and random loss per direction."""

    name: str
    rate_bps: int
    delay_ms: float
    loss_percent: float

    @property
    def loss_per_mille(self) -> int:
        """The nftables `numgen random mod 1000` threshold: loss is applied in steps of 0.1 %."""
        return round(self.loss_percent * 10)


PROFILES: dict[str, Profile] = {
    "lan": Profile("lan", 10_000_000_000, 0.05, 0.0),
    "dc": Profile("dc", 1_000_000_000, 0.5, 0.0),
    "wan": Profile("wan", 200_000_000, 20.0, 0.1),
    "lossy": Profile("lossy", 1_000_000_000, 1.0, 1.0),
}

_RATE_RE = re.compile(r"^(\d+(?:\.\d+)?)(k|m|g)?bit$")
_UNITS = {None: 1, "k": 1_000, "m": 1_000_000, "g": 1_000_000_000}


def parse_rate(text: str) -> int:
    """`200mbit` → 200_000_000 bit/s."""
    m = _RATE_RE.match(text.strip().lower())
    if not m:
        raise NetbedError(f"bad rate {text!r}: expected a number and kbit, mbit or gbit, e.g. 200mbit")
    return int(float(m.group(1)) * _UNITS[m.group(2)])


def parse_profile(text: str) -> Profile:
    """A named profile (`lan`, `dc`, `wan`, `lossy`) or `rate=200mbit,delay=20ms,loss=0.1%`."""
    text = text.strip()
    if text in PROFILES:
        return PROFILES[text]
    if "=" not in text:
        raise NetbedError(f"unknown link profile {text!r}; choose one of {', '.join(PROFILES)} "
                          "or give rate=...,delay=...ms,loss=...%")
    fields: dict[str, str] = {}
    for part in text.split(","):
        key, sep, value = part.partition("=")
        if not sep or key.strip() not in ("rate", "delay", "loss"):
            raise NetbedError(f"bad link field {part!r} in {text!r}: use rate=, delay=, loss=")
        fields[key.strip()] = value.strip()
    if "rate" not in fields:
        raise NetbedError(f"link profile {text!r} needs a rate")
    try:
        delay = float(fields.get("delay", "0ms").removesuffix("ms"))
        loss = float(fields.get("loss", "0%").removesuffix("%"))
    except ValueError:
        raise NetbedError(f"bad delay or loss in {text!r}: e.g. delay=0.5ms,loss=1%") from None
    if delay < 0 or not 0 <= loss <= 100:
        raise NetbedError(f"delay must be >= 0 and loss within 0..100 % in {text!r}")
    return Profile(text, parse_rate(fields["rate"]), delay, loss)


@dataclass(frozen=True, slots=True)
class BedPlan:
    """Names and addresses of one bed: host i is namespace `<prefix>h<i>` at `<subnet>.<i+1>`,
    its veth's bridge end is `<prefix>v<i>`, and the bridge `<prefix>br` holds `<subnet>.254`
    (so a process in the root namespace can reach every host)."""

    prefix: str
    num_hosts: int
    subnet: str                  # e.g. "10.213.7.0/24"

    def __post_init__(self) -> None:
        if not PREFIX_RE.match(self.prefix):
            raise NetbedError(f"bad bed prefix {self.prefix!r}: expected kvb + 4 hex digits")
        if not 1 <= self.num_hosts <= MAX_HOSTS:
            raise NetbedError(f"a bed has 1..{MAX_HOSTS} hosts, got {self.num_hosts}")
        net = ipaddress.ip_network(self.subnet)
        if net.prefixlen != 24 or not net.is_private:
            raise NetbedError(f"bed subnet must be a private /24, got {self.subnet}")

    @property
    def bridge(self) -> str:
        return f"{self.prefix}br"

    @property
    def bridge_address(self) -> str:
        return self._ip(254)

    def namespace(self, i: int) -> str:
        return f"{self.prefix}h{self._check(i)}"

    def veth(self, i: int) -> str:
        return f"{self.prefix}v{self._check(i)}"

    def address(self, i: int) -> str:
        return self._ip(self._check(i) + 1)

    def namespaces(self) -> list[str]:
        return [self.namespace(i) for i in range(self.num_hosts)]

    def _check(self, i: int) -> int:
        if not 0 <= i < self.num_hosts:
            raise NetbedError(f"no host {i} in a bed of {self.num_hosts}")
        return i

    def _ip(self, last: int) -> str:
        return str(ipaddress.ip_network(self.subnet)[last])


def choose_subnet(seed: bytes, in_use: list[str]) -> str:
    """A 10.x.y.0/24 picked from `seed` that overlaps none of `in_use` (networks on this machine)."""
    used = [ipaddress.ip_network(n, strict=False) for n in in_use]
    for k in range(0, len(seed) - 1, 2):
        net = ipaddress.ip_network(f"10.{200 + seed[k] % 50}.{seed[k + 1]}.0/24")
        if not any(net.overlaps(u) for u in used):
            return str(net)
    raise NetbedError("no free 10.200-249.x.0/24 subnet for the bed")


def create_commands(plan: BedPlan) -> list[list[str]]:
    """`ip` commands that build the bridge, the namespaces and their links (root namespace)."""
    cmds = [["ip", "link", "add", plan.bridge, "type", "bridge"],
            ["ip", "addr", "add", f"{plan.bridge_address}/24", "dev", plan.bridge],
            ["ip", "link", "set", plan.bridge, "up"]]
    for i in range(plan.num_hosts):
        ns, veth = plan.namespace(i), plan.veth(i)
        cmds += [["ip", "netns", "add", ns],
                 ["ip", "link", "add", veth, "type", "veth", "peer", "name", HOST_IF, "netns", ns],
                 ["ip", "link", "set", veth, "master", plan.bridge, "up"],
                 ["ip", "-n", ns, "addr", "add", f"{plan.address(i)}/24", "dev", HOST_IF],
                 ["ip", "-n", ns, "link", "set", HOST_IF, "up"],
                 ["ip", "-n", ns, "link", "set", "lo", "up"]]
    return cmds


def delete_commands(plan: BedPlan) -> list[list[str]]:
    """Remove the bed's links and namespaces by name (each may already be gone)."""
    return ([["ip", "link", "del", plan.veth(i)] for i in range(plan.num_hosts)]
            + [["ip", "netns", "del", ns] for ns in plan.namespaces()]
            + [["ip", "link", "del", plan.bridge]])


def tbf_args(rate_bps: int) -> list[str]:
    """A token bucket at `rate_bps`: the burst holds 4 ms of traffic (at least 64 KiB), enough for
    a software link at 10 Gbit/s without capping below the rate."""
    burst = max(rate_bps // 8 // 250, 64 << 10)
    return ["tbf", "rate", f"{rate_bps}bit", "burst", str(burst), "latency", "50ms"]


def shape_commands(plan: BedPlan, i: int, profile: Profile) -> list[list[str]]:
    """Rate-limit host i both ways: its namespace's egress and the bridge end's egress (its ingress)."""
    ns = plan.namespace(i)
    return [["ip", "netns", "exec", ns, "tc", "qdisc", "replace", "dev", HOST_IF, "root", *tbf_args(profile.rate_bps)],
            ["tc", "qdisc", "replace", "dev", plan.veth(i), "root", *tbf_args(profile.rate_bps)]]


def nft_ruleset(loss_per_mille: int, blocked: list[str]) -> str:
    """The whole nftables table of one host, replaced atomically: random loss of what it sends
    (so each direction of a path loses what its sender's profile says) and a drop both ways for
    every host it is partitioned from."""
    out = [f'oifname "{HOST_IF}" numgen random mod 1000 < {loss_per_mille} drop'] if loss_per_mille else []
    inp = []
    for addr in sorted(blocked):
        ipaddress.ip_address(addr)
        out.append(f"ip daddr {addr} drop")
        inp.append(f"ip saddr {addr} drop")
    lines = [f"add table inet {NFT_TABLE}", f"delete table inet {NFT_TABLE}", f"table inet {NFT_TABLE} {{",
             "  chain out {", "    type filter hook output priority 0; policy accept;",
             *(f"    {r}" for r in out), "  }",
             "  chain in {", "    type filter hook input priority 0; policy accept;",
             *(f"    {r}" for r in inp), "  }", "}"]
    return "\n".join(lines) + "\n"


def ray_start_command(ray_bin: str, plan: BedPlan, i: int, temp_dir: str, *, port: int, num_cpus: int,
                      object_store_bytes: int, system_config: str) -> list[str]:
    """`ray start` for host i on its own address: the head on host 0, workers joining it."""
    common = ["--node-ip-address", plan.address(i), "--temp-dir", temp_dir, "--num-cpus", str(num_cpus),
              "--object-store-memory", str(object_store_bytes), "--disable-usage-stats"]
    if i == 0:
        return [ray_bin, "start", "--head", "--port", str(port), "--include-dashboard=false",
                "--system-config", system_config, *common]
    return [ray_bin, "start", "--address", f"{plan.address(0)}:{port}", *common]
