"""Reply arrays reused across loads: never handed out while anything still references them.

A NodeActor returns each load's array to Ray, which copies it into the object store; a mirror may
still be copying from a slice of it. Reusing an array that is still referenced would let the next
load overwrite KV that is being served, so the pool's one rule is asserted with the references a
NodeActor really keeps: views, slices, a pickled (protocol 5, out-of-band) reply.
"""

from __future__ import annotations

import pickle

import numpy as np

from cluster.node.reply_buffers import ReplyBuffers


def test_an_array_is_reused_only_once_nothing_references_it() -> None:
    pool = ReplyBuffers(max_bytes=1 << 20)
    first = pool.take((4, 3, 100))
    first[:] = 7
    reply = first[:2]                         # what a LoadReply carries: a leading slice
    del first
    second = pool.take((4, 3, 100))           # the reply is alive: a new array, not the same memory
    assert not np.shares_memory(reply, second) and pool.num_made == 2
    assert (reply == 7).all()
    del reply, second
    third = pool.take((2, 3, 100))            # smaller shapes fit in a free pooled array
    assert pool.num_reused == 1 and pool.num_made == 2 and third.shape == (2, 3, 100)


def test_an_out_of_band_pickle_holds_its_array_until_released() -> None:
    """Ray serializes a reply with pickle protocol 5: the buffer stays referenced until the copy is made."""
    pool = ReplyBuffers(max_bytes=1 << 20)
    out = pool.take((8, 1000))
    out[:] = 1
    buffers: list[pickle.PickleBuffer] = []
    data = pickle.dumps(out, protocol=5, buffer_callback=buffers.append)
    del out
    other = pool.take((8, 1000))
    other[:] = 2                              # must not land in the array being serialized
    restored = pickle.loads(data, buffers=[bytes(b.raw()) for b in buffers])
    assert (restored == 1).all() and pool.num_reused == 0
    del buffers, other
    pool.take((8, 1000))
    assert pool.num_reused == 1


def test_the_pool_keeps_at_most_max_bytes() -> None:
    pool = ReplyBuffers(max_bytes=1000)
    held = [pool.take((400,)), pool.take((400,))]
    big = pool.take((2000,))                  # over the cap: made, never kept
    assert big.nbytes == 2000 and pool.pooled_bytes == 800
    third = pool.take((400,))                 # both pooled arrays are in use and 1,200 > 1,000: not kept
    assert pool.pooled_bytes == 800 and pool.num_made == 4
    del held, third
    pool.take((900,))                         # room is made by dropping free arrays
    assert pool.pooled_bytes == 900
    assert ReplyBuffers(max_bytes=0).take((3,)).shape == (3,)
