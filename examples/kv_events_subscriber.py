"""Follow every node's KV events and estimate, per node, how much of a prompt it holds.

    .venv/bin/python examples/kv_events_subscriber.py --address 127.0.0.1:6379 \
        --tokens 1,2,3,... [--block-size 16] [--seconds 10] [--curve-key router.key_secret]

It finds each NodeActor's event endpoints through Ray (`stats()["kv_events"]`; the fabric must run
with `[events] enabled = true` and a `replay_endpoint`), subscribes to all of them and keeps, per
node, the set of block hashes it holds. Like an outside router it matches a prompt by the events'
own `token_ids` and `parent_block_hash`, so it needs no kvfabric namespace: a node's hit estimate
is its longest leading run of the prompt's full blocks that it announced and still holds.

Each stream is followed by sequence number: a gap, or a number that went back (the node restarted:
a new publisher counts from 0) is repaired through the replay socket; a batch replayed twice is
recognised and skipped. With nothing received for `idle_check_s`, it asks for what follows the last
batch it applied, so a restart whose first batches it missed is still seen (the publisher no longer
has that batch as it was). A replay that stops at its bound (a `more` marker) or is rate limited is
asked again from where it stopped; batches older than the node's buffer are logged as gone.

Batches are vLLM 0.32's `KVEventBatch` (tagged maps, decoded here with plain msgpack). Where the
nodes' events use CURVE, `--curve-key` is this consumer's key pair (`kvfabric certs events-key`),
whose public key the operator put in the nodes' `[events] curve_allow_dir`.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import blake3
import msgpack
import zmq
import zmq.auth

logger = logging.getLogger("kv_events_subscriber")

END_SEQ = -1
GAP_SEQ = -2               # a replay marker: {"reason", "first", "last"} of batches it left out
DIGESTS_KEPT = 4096        # per node: sequence numbers whose batch can be recognised when seen again
ChainKey = tuple[int | None, tuple[int, ...]]   # (parent hash, the block's tokens)


@dataclass
class NodeView:
    """One node's announced blocks, rebuilt from its batches in sequence order."""

    held: set[int] = field(default_factory=set)
    expected: int = 0                     # the next sequence number to apply
    digests: dict[int, bytes] = field(default_factory=dict)
    num_resets: int = 0
    chain_of: dict[int, ChainKey] = field(default_factory=dict)   # held block -> (parent, tokens) announced
    first_events: list[str] = field(default_factory=list)   # tags of the first batch since a reset
    # held block -> (its extra hash keys, LoRA name) where an engine that hashes blocks its own way named them
    keys_of: dict[int, tuple[Any, str | None]] = field(default_factory=dict)

    def apply(self, seq: int, payload: bytes, chains: dict[ChainKey, set[int]]) -> None:
        _ts, events, _rank = msgpack.unpackb(payload, raw=False)
        self.first_events = [e["type"] for e in events] if seq == 0 else self.first_events
        for event in events:
            tag = event["type"]
            if tag == "AllBlocksCleared":
                self.held.clear()
                self.chain_of.clear()
                self.keys_of.clear()
            elif tag == "BlockStored":
                hashes, parent = event["block_hashes"], event["parent_block_hash"]
                tokens, block_size = event["token_ids"], event["block_size"]
                self.held.update(hashes)
                extra, lora = event.get("extra_keys"), event.get("lora_name")
                if extra or lora:
                    for i, h in enumerate(hashes):
                        self.keys_of[h] = (extra[i] if extra else None, lora)
                if tokens and len(tokens) == len(hashes) * block_size:   # learn how tokens chain into hashes
                    for i, h in enumerate(hashes):
                        key = (parent if i == 0 else hashes[i - 1], tuple(tokens[i * block_size:(i + 1) * block_size]))
                        chains.setdefault(key, set()).add(h)
                        self.chain_of[h] = key
            elif tag == "BlockRemoved":
                self.held.difference_update(event["block_hashes"])
                for h in event["block_hashes"]:
                    self.chain_of.pop(h, None)
                    self.keys_of.pop(h, None)
            else:
                logger.warning("unknown KV event %r ignored", tag)
        self.digests[seq] = blake3.blake3(payload).digest()
        self.digests.pop(seq - DIGESTS_KEPT, None)
        self.expected = seq + 1

    def reset(self) -> None:
        self.held.clear()
        self.chain_of.clear()
        self.keys_of.clear()
        self.digests.clear()
        self.expected = 0
        self.num_resets += 1


class Subscriber:
    """SUB + replay sockets for each node; `poll` applies what arrived."""

    def __init__(self, endpoints: dict[str, tuple[str, str]], *, topic: str = "", idle_check_s: float = 1.0,
                 context: zmq.Context[zmq.Socket[bytes]] | None = None,
                 curve_keys: tuple[bytes, bytes] | None = None, server_keys: dict[str, bytes] | None = None) -> None:
        """`curve_keys` (public, secret): this consumer's key pair, for nodes whose events use CURVE
        (`server_keys`: each such node's public key, from its stats)."""
        self.ctx = context or zmq.Context.instance()
        self.curve_keys = curve_keys
        self._server_keys = server_keys or {}
        self.views = {name: NodeView() for name in endpoints}
        self.chains: dict[ChainKey, set[int]] = {}
        self.idle_check_s = idle_check_s
        self._replay_at = dict(endpoints)
        self._subs: dict[zmq.Socket[bytes], str] = {}
        self._poller = zmq.Poller()
        self._last_seen = {name: 0.0 for name in endpoints}
        for name, (endpoint, _) in endpoints.items():
            sub = self.ctx.socket(zmq.SUB)
            self._secure(sub, name)
            sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
            sub.connect(endpoint)
            self._subs[sub] = name
            self._poller.register(sub, zmq.POLLIN)

    def poll(self, timeout_s: float) -> None:
        """Apply every batch that arrives within `timeout_s`, and check idle streams."""
        deadline = time.monotonic() + timeout_s
        while True:
            ready = dict(self._poller.poll(max(0, int((deadline - time.monotonic()) * 1000))))
            for sock in ready:
                _topic, seq, payload = sock.recv_multipart()
                self._on_batch(self._subs[sock], int.from_bytes(seq, "big"), payload, live=True)
            now = time.monotonic()
            for name, seen in self._last_seen.items():
                if now - seen >= self.idle_check_s:
                    self.resync(name)
            if now >= deadline:
                return

    def resync(self, name: str) -> None:
        """Apply what `name`'s replay socket kept after the last applied batch. If that batch is not
        there as it was applied, the node's publisher is a new one: start over from its batch 0."""
        self._last_seen[name] = time.monotonic()
        view = self.views[name]
        last = view.expected - 1
        batches = self._replay(name, max(0, last))
        if last >= 0 and (not batches or batches[0][0] != last
                          or view.digests.get(last) != blake3.blake3(batches[0][1]).digest()):
            logger.info("node %s: its publisher restarted; rebuilding its view", name)
            view.reset()
            batches = self._replay(name, 0)
        for seq, payload in batches:
            self._on_batch(name, seq, payload, live=False)

    def close(self) -> None:
        for sock in self._subs:
            sock.close(linger=0)

    def hit_estimates(self, tokens: Sequence[int], block_size: int) -> dict[str, int]:
        """Per node: the longest leading run of `tokens`' full blocks it holds, in blocks."""
        per_block: list[set[int]] = []
        parents: Iterable[int | None] = [None]
        for i in range(len(tokens) // block_size):
            chunk = tuple(tokens[i * block_size:(i + 1) * block_size])
            found = set().union(*(self.chains.get((p, chunk), set()) for p in parents))
            if not found:
                break
            per_block.append(found)
            parents = found
        out = {}
        for name, view in self.views.items():
            n = 0
            while n < len(per_block) and per_block[n] & view.held:
                n += 1
            out[name] = n
        return out

    def _on_batch(self, name: str, seq: int, payload: bytes, *, live: bool) -> None:
        view = self.views[name]
        self._last_seen[name] = time.monotonic()
        if seq == view.expected:
            view.apply(seq, payload, self.chains)
        elif seq < view.expected:
            if view.digests.get(seq) == blake3.blake3(payload).digest():
                return                                  # seen already (live and replayed)
            logger.info("node %s: sequence went back to %d: a new publisher; rebuilding", name, seq)
            view.reset()
            if live:
                self.resync(name)
            elif seq == 0:
                view.apply(seq, payload, self.chains)
            else:
                logger.warning("node %s: the new publisher's batches 0..%d are gone; view may be partial",
                               name, seq - 1)
                view.apply(seq, payload, self.chains)
        elif live:
            self.resync(name)                           # a gap: fill it from the replay socket
            if seq >= view.expected:
                view.apply(seq, payload, self.chains)
        else:
            logger.warning("node %s: batches %d..%d are gone from the replay buffer; view may be partial",
                           name, view.expected, seq - 1)
            view.apply(seq, payload, self.chains)

    def _replay(self, name: str, start: int, timeout_s: float = 5.0) -> list[tuple[int, bytes]]:
        """The kept batches from `start` on, following `more` markers; `expired` ones are logged
        (the view may then be partial), `rate_limited` waits and asks again."""
        out: list[tuple[int, bytes]] = []
        deadline = time.monotonic() + timeout_s
        dealer = self.ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        self._secure(dealer, name)
        dealer.connect(self._replay_at[name][1])
        try:
            while time.monotonic() < deadline:
                dealer.send_multipart([b"", start.to_bytes(8, "big")])
                again: int | None = None
                while dealer.poll(max(1, int((deadline - time.monotonic()) * 1000))):
                    _empty, _topic, seq_bytes, payload = dealer.recv_multipart()
                    seq = int.from_bytes(seq_bytes, "big", signed=True)
                    if seq == END_SEQ:
                        break
                    if seq == GAP_SEQ:
                        gap = msgpack.unpackb(payload, raw=False)
                        if gap["reason"] in ("more", "rate_limited"):
                            again = gap["first"]
                        else:
                            logger.warning("node %s: batches %d..%d are gone (%s); view may be partial", name,
                                           gap["first"], gap["last"], gap["reason"])
                        continue
                    out.append((seq, payload))
                else:
                    logger.warning("node %s: replay request unanswered after %.0f s", name, timeout_s)
                    return out
                if again is None:
                    return out
                if not out or out[-1][0] < again - 1:
                    time.sleep(0.05)          # rate limited: ask again shortly
                start = again
            return out
        finally:
            dealer.close(linger=0)

    def _secure(self, sock: zmq.Socket[bytes], name: str) -> None:
        """CURVE client keys when the node's events are CURVE endpoints."""
        server_key = self._server_keys.get(name)
        if server_key and self.curve_keys is not None:
            sock.curve_publickey, sock.curve_secretkey = self.curve_keys
            sock.curve_serverkey = server_key


def endpoints_from_ray(address: str, namespace: str) -> tuple[dict[str, tuple[str, str]], dict[str, bytes]]:
    """Each node's (PUB, replay) endpoints, and the CURVE public key of those that use CURVE, from
    its NodeActor's stats."""
    import ray

    from cluster.client import FabricClient
    from cluster.supervisor import alive_node_ids

    if not ray.is_initialized():
        ray.init(address=address, namespace=namespace, logging_level=logging.WARNING)
    out: dict[str, tuple[str, str]] = {}
    keys: dict[str, bytes] = {}
    for node_id in alive_node_ids():
        stats: dict[str, Any] = FabricClient.connect(node_id=node_id, namespace=namespace).stats()
        events = stats.get("kv_events")
        if not events or not events["replay_endpoint"]:
            raise SystemExit(f"node {node_id} publishes no KV events with replay: set [events] enabled = true "
                             "and replay_endpoint in the fabric's config")
        out[stats["node_name"]] = (events["endpoint"], events["replay_endpoint"])
        if events.get("curve_public_key"):
            keys[stats["node_name"]] = events["curve_public_key"].encode()
    return out, keys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--address", default="auto", help="the Ray cluster the fabric runs on")
    parser.add_argument("--namespace", default="kvfabric", help="the fabric's Ray namespace")
    parser.add_argument("--tokens", default="", help="comma-separated token ids of a prompt to estimate")
    parser.add_argument("--block-size", type=int, default=16, help="[kv] block_size of the fabric")
    parser.add_argument("--seconds", type=float, default=10.0, help="how long to follow the events")
    parser.add_argument("--curve-key", default="", help="this consumer's key pair (NAME.key_secret from "
                        "`kvfabric certs events-key`) for nodes whose events use CURVE")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    tokens = [int(t) for t in args.tokens.split(",") if t.strip()]
    endpoints, server_keys = endpoints_from_ray(args.address, args.namespace)
    curve_keys = None
    if args.curve_key:
        public, secret = zmq.auth.load_certificate(args.curve_key)
        if secret is None:
            raise SystemExit(f"{args.curve_key} holds no secret key (want the .key_secret file)")
        curve_keys = (public, secret)
    sub = Subscriber(endpoints, curve_keys=curve_keys, server_keys=server_keys)
    for name in sub.views:
        sub.resync(name)
    end = time.monotonic() + args.seconds
    try:
        while time.monotonic() < end:
            sub.poll(1.0)
            held = ", ".join(f"{name}: {len(v.held)} blocks" for name, v in sub.views.items())
            line = f"held {held}"
            if tokens:
                hits = sub.hit_estimates(tokens, args.block_size)
                line += " | prompt hit " + ", ".join(f"{n}: {b * args.block_size} of {len(tokens)} tokens"
                                                     for n, b in hits.items())
            print(line, flush=True)
    finally:
        sub.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
