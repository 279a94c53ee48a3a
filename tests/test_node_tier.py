"""The node DRAM tier (hostagent.inference.node_tier, issue #29) on its own: bounded in bytes,
the same zero-copy buffer handed back, value order and leases, shared by threads within its
bound. Pure Python; its hit without a network fetch and the pool's tiers: test_tiers_store.py."""
import threading

import numpy as np
import pytest

from hostagent.common.transfer import TransferStats
from hostagent.common.block import Block
from hostagent.inference.node_tier import NodeTier, view_of
from test_tiers_store import NS, key, payload


def engine_block(i: int, n: int = 1000, released: list | None = None) -> Block:
    """A Block as the fetch engine hands one over: a view of an arena, released once."""
    arena = np.frombuffer(bytearray(payload(n, i)), np.uint8)
    return Block(NS, key(i), 1, arena, TransferStats(),
                 (lambda: released.append(i)) if released is not None else None)


def test_node_tier_hands_back_the_same_buffer_and_stays_within_its_bytes():
    released, told = [], []

    def on_evict(ns, k, obj, nbytes):         # the block is still whole while it is decided
        told.append((k[0], obj.tobytes() == payload(1000, k[0]), nbytes))

    tier = NodeTier(3000, on_evict=on_evict)
    blocks = [engine_block(i, released=released) for i in range(5)]
    addr0 = blocks[0].numpy().__array_interface__["data"][0]
    assert tier.put(NS, key(0), blocks[0])
    got = tier.get(NS, key(0))
    assert got is blocks[0]                                    # the same object: no copy
    assert got.numpy().__array_interface__["data"][0] == addr0
    assert np.shares_memory(view_of(got), blocks[0].numpy())
    for b in blocks[1:]:
        assert tier.put(NS, b.key, b)
        assert tier.used <= tier.capacity
    # three blocks fit: 0 (touched before 1 and 2 came) leaves first, then 1
    assert [t[0] for t in told] == [0, 1] and all(ok for _, ok, _ in told)
    assert released == [0, 1]                                  # released after the decision
    assert tier.get(NS, key(0)) is None and tier.get(NS, key(4)) is blocks[4]
    s = tier.stats()
    assert (s["bytes"], s["blocks"], s["evictions"], s["hits"], s["misses"]) == (3000, 3, 2, 2, 1)
    assert not tier.put(NS, key(9), engine_block(9, 3001))    # larger than the tier
    assert tier.stats()["rejected"] == 1


def test_node_tier_value_order_leases_and_names_already_held():
    values = {0: 5.0, 1: 1.0, 2: 3.0, 3: 0.1, 4: 0.5, 5: 10.0}
    released = []
    tier = NodeTier(3000, evict="value", value_fn=lambda ns, k, n: values[k[0]])
    for i in range(3):
        assert tier.put(NS, key(i), engine_block(i, released=released))
    assert tier.put(NS, key(3), engine_block(3, released=released))
    assert released == [1]                                     # the lowest value left first
    values[3] = 9.0                                            # 3 was used since
    lease = tier.lease(NS, key(2))                             # 2 is the lowest now, but leased
    assert tier.put(NS, key(4), engine_block(4, released=released)) and released == [1, 0]
    with lease:
        assert tier.put(NS, key(5), engine_block(5, released=released))   # 4 goes, not 2
        assert released == [1, 0, 4]
        assert tier.remove(NS, key(2)) and released == [1, 0, 4]   # freed when the lease ends
    assert released == [1, 0, 4, 2]
    held = tier.get(NS, key(3))
    dup = engine_block(3, released=released)
    assert not tier.put(NS, key(3), dup) and tier.get(NS, key(3)) is held   # first copy stays
    with pytest.raises(ValueError):
        NodeTier(100, evict="value")
    with pytest.raises(ValueError):
        NodeTier(0)


def test_value_eviction_takes_the_lowest_value_of_the_moment():
    """The value order is kept up incrementally (hostagent.common.eviction.ValueHeap), not ranked
    anew per eviction: with values that rise as blocks are used, each eviction still takes the
    lowest-valued block held at that moment (ties: least recently pushed)."""
    rng = np.random.default_rng(5)
    values, evicted, new = {}, [], [None]

    def on_evict(ns, k, obj, n):                 # the block being put was no candidate
        rest = [values[h] for _, h in tier._entries if h != new[0]]
        evicted.append((values[k], min(rest)))

    tier = NodeTier(50 * 1000, evict="value", value_fn=lambda ns, k, n: values[k],
                    on_evict=on_evict)
    for i in range(2000):
        k = new[0] = int(rng.integers(0, 400)).to_bytes(16, "big")
        if tier.get(NS, k) is not None:
            values[k] += float(rng.integers(1, 5))               # used: worth more
        else:
            values.setdefault(k, float(rng.integers(0, 20)))
            assert tier.put(NS, k, bytes(1000))
    assert len(evicted) > 500
    # what left was no more valuable than anything it left behind
    assert all(v <= rest for v, rest in evicted)


def test_node_tier_is_shared_by_threads_within_its_bound():
    tier = NodeTier(64 * 1000)
    errors = []

    def engine(seed):
        rng = np.random.default_rng(seed)
        try:
            for _ in range(2000):
                i = int(rng.integers(0, 200))
                got = tier.get(NS, key(i))
                if got is None:
                    tier.put(NS, key(i), bytes([i]) * 1000)
                elif bytes(view_of(got)[:1]) != bytes([i]):
                    errors.append(i)
        except Exception as exc:                   # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=engine, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    s = tier.stats()
    assert not errors and s["bytes"] == 1000 * s["blocks"] <= tier.capacity
    assert s["hits"] > 0 and s["evictions"] > 0 and s["hits"] + s["misses"] == 8000
