"""Eviction orders shared by the pool's staging (``hostagent.pool.staging``) and the inference
node's DRAM tier (``hostagent.inference.node_tier``): the order names, their check, and
``ValueHeap``, the lowest-value-first order kept up incrementally.
"""
from __future__ import annotations

import heapq


EVICT_ORDERS = ("lru", "value")


def check_eviction(evict: str, value_fn) -> None:
    if evict not in EVICT_ORDERS:
        raise ValueError(f"eviction order {evict!r} is not one of {', '.join(EVICT_ORDERS)}")
    if evict == "value" and value_fn is None:
        raise ValueError("evict='value' needs a value_fn(ns, key, nbytes)")


class ValueHeap:
    """Held blocks lowest value first, kept up as they come (``push``) rather than ranked anew
    at every eviction: a popped entry whose value has risen since is pushed back with it, one
    whose block has gone (or been replaced) is dropped, and the heap is rebuilt after as many
    evictions as there are blocks (values that fell are seen then). Exact when values only
    rise between rebuilds (the tier policy's time-free order keys), amortised O(log n) value
    calls per eviction. Ties: the least recently pushed first."""

    def __init__(self, value_fn):
        self.vf, self.heap, self.seq, self.pops = value_fn, [], 0, 0

    def push(self, name, obj, nbytes: int) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (self.vf(name[0], name[1], nbytes), self.seq, name, obj))

    def rebuild(self, held) -> None:
        """From ``held``: (name, obj, nbytes) of every held block, least recent first."""
        self.heap, self.pops = [], 0
        for name, obj, nbytes in held:
            self.seq += 1
            self.heap.append((self.vf(name[0], name[1], nbytes), self.seq, name, obj))
        heapq.heapify(self.heap)

    def victims(self, current: dict, pinned, nbytes, held):
        """Names of ``current``'s unpinned blocks, lowest value first (lazily; pinned ones
        are put back when the caller stops asking)."""
        if self.pops > len(current) or len(self.heap) > 2 * len(current) + 64:
            self.rebuild(held())
        later = []
        try:
            while self.heap:
                entry = heapq.heappop(self.heap)
                value, _, name, obj = entry
                if current.get(name) is not obj:
                    continue                        # gone or replaced
                if pinned(obj):
                    later.append(entry)
                    continue
                now = self.vf(name[0], name[1], nbytes(obj))
                if now > value:                     # used since: back in at its value now
                    self.seq += 1
                    heapq.heappush(self.heap, (now, self.seq, name, obj))
                    continue
                self.pops += 1
                yield name
        finally:
            for entry in later:
                heapq.heappush(self.heap, entry)
