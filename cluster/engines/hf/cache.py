"""Layer-wise loading: a `DynamicCache` whose layer i waits for layer i of the cached prefix.

    fabric.load_layers ──► feeder thread: decode layer 0, 1, 2, ... ──► LayerFeed slots
                                                                          │ wait(i)
    model.forward:  embed ─► layer 0 attention: cache.update(k, v, 0) ────┘ ─► layer 1 ...

The prefix length is known before the first layer arrives (a `LayerStream` plans first), so the
model computes positions and masks for the suffix at once; each attention layer blocks only in its
own `update` until that layer's K/V is there. Compute of layer i overlaps the transfer of layers
i+1.. (torch releases the GIL inside its kernels, the feeder thread mostly waits on I/O).

If the stream fails (`IncompleteLoadError`: a peer died or a block failed its digest after some
layers had come), the waiting `update` raises it out of the forward pass: no token was computed on
wrong KV, and the caller falls back to a verified load or a recompute.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np
import torch
from transformers import DynamicCache, PretrainedConfig
from transformers.cache_utils import Cache, DynamicLayer

from cluster.api import IncompleteLoadError, LayerStream
from cluster.engines.hf.kv import decode_layer
from fabric.keys import Namespace


class LayerFeed:
    """Per-layer K/V slots filled by a background thread from a `LayerStream`. Thread-safe."""

    def __init__(self, stream: LayerStream, ns: Namespace, device: torch.device | str = "cpu") -> None:
        self.num_layers = ns.layout.num_layers
        self.num_tokens = stream.num_blocks * ns.block_size
        self.arrived_s: list[float | None] = [None] * self.num_layers   # perf_counter when decoded
        self._slots: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * self.num_layers
        self._error: BaseException | None = None
        self._done = False
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, args=(stream, ns, device),
                                        name="kvfabric-layer-feed", daemon=True)
        self._thread.start()

    def _run(self, stream: LayerStream, ns: Namespace, device: torch.device | str) -> None:
        try:
            for layer, payload in stream:
                if payload.shape[0] != stream.num_blocks:
                    raise IncompleteLoadError(f"layer {layer} came with {payload.shape[0]} blocks, "
                                              f"the stream planned {stream.num_blocks}")
                kv = decode_layer(payload, ns, device)
                with self._cond:
                    self._slots[layer] = kv
                    self.arrived_s[layer] = time.perf_counter()
                    self._cond.notify_all()
        except BaseException as exc:  # handed to the forward pass, which raises it in the engine's thread
            with self._cond:
                self._error = exc
        finally:
            with self._cond:
                self._done = True
                self._cond.notify_all()

    def wait(self, layer: int, timeout_s: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of `layer`'s prefix once it has arrived; raises what stopped the stream, or
        IncompleteLoadError if the stream ended without this layer."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._cond:
            while (kv := self._slots[layer]) is None:
                if self._error is not None:
                    raise IncompleteLoadError(f"layer {layer} never arrived: {self._error}") from self._error
                if self._done:
                    raise IncompleteLoadError(f"the layer stream ended without layer {layer}")
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise IncompleteLoadError(f"layer {layer} did not arrive within {timeout_s} s")
                self._cond.wait(remaining)
            self._slots[layer] = None   # the cache layer owns it now; the feed keeps no second reference
            return kv

    def join(self) -> None:
        self._thread.join()


class StreamedLayer(DynamicLayer):  # type: ignore[no-untyped-call]  # transformers' __init_subclass__
    """A `DynamicLayer` that starts as `num_prefix` tokens long and fetches them on its first update."""

    def __init__(self, feed: LayerFeed, layer: int) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.feed = feed
        self.layer = layer
        self.consumed_s: float | None = None   # perf_counter when the forward pass reached this layer
        self.waited_s = 0.0                    # of the forward pass, blocked until this layer had arrived

    def get_seq_length(self) -> int:
        if not self.is_initialized:
            return self.feed.num_tokens
        return super().get_seq_length()

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any,
               ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.consumed_s = time.perf_counter()
            keys, values = self.feed.wait(self.layer)
            self.waited_s = time.perf_counter() - self.consumed_s
            self.lazy_initialization(key_states, value_states)
            self.keys, self.values = keys.to(key_states.dtype), values.to(value_states.dtype)
        return super().update(key_states, value_states, *args, **kwargs)


class LayerwiseCache(DynamicCache):
    """A DynamicCache over a `LayerFeed`: pass it as `past_key_values` with only the suffix tokens."""

    def __init__(self, feed: LayerFeed) -> None:
        self.feed = feed
        self.streamed = [StreamedLayer(feed, i) for i in range(feed.num_layers)]
        Cache.__init__(self, layers=list(self.streamed))

    def overlap_s(self, forward_start: float) -> float:
        """Seconds the forward pass (started at perf_counter `forward_start`) computed while layers
        were still arriving: from its start to the last layer's arrival, less the time it sat
        waiting for a layer. 0 when every layer was there before it started."""
        arrived = [t for t in self.feed.arrived_s if t is not None]
        if not arrived:
            return 0.0
        waited = sum(layer.waited_s for layer in self.streamed)
        return max(0.0, max(arrived) - forward_start - waited)


def cache_from_payloads(payloads: np.ndarray, ns: Namespace, config: PretrainedConfig,
                        device: torch.device | str = "cpu") -> DynamicCache:
    """A DynamicCache holding a loaded prefix (uint8 [blocks, layers, bytes]), every layer at once."""
    cache = DynamicCache(config=config)
    for layer in range(ns.layout.num_layers):
        keys, values = decode_layer(payloads[:, layer], ns, device)
        cache.update(keys, values, layer)
    return cache
