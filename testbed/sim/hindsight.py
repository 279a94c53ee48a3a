"""The offline references a cache policy is measured against, both with hindsight (they read the
whole request sequence, so they exist only in the evaluator): Belady's MIN, which knows when every
block comes back, and the best fixed set, which knows how often each block comes but not when.

Our Belady may bypass a miss (cache it or not); libCacheSim's admits every miss, a different cache
with a lower optimum. testbed.sim.baselines.belady_bypass runs libCacheSim's in our model, and the
tests check both against brute force in their own model and against each other in ours."""
from __future__ import annotations

import heapq

import numpy as np


def next_use(keys: np.ndarray) -> np.ndarray:
    """For each position i, the next position holding the same key (len(keys) if none)."""
    keys = np.asarray(keys)
    n = len(keys)
    order = np.argsort(keys, kind="stable")        # equal keys stay in time order
    nxt = np.full(n, n, np.int64)
    same = keys[order[1:]] == keys[order[:-1]]
    nxt[order[:-1][same]] = order[1:][same]
    return nxt


def belady_hits(keys: np.ndarray, capacity: int) -> np.ndarray:
    """Hit mask of Belady's MIN over a request sequence of unit-size keys (the optimum for
    unit sizes): on a miss, keep the key only if it is needed again before some cached key, and
    then evict the cached key needed furthest in the future. O(n log capacity)."""
    keys = np.asarray(keys)
    n, capacity = len(keys), int(capacity)
    nxt = next_use(keys).tolist()
    hits = np.zeros(n, bool)
    cached: dict = {}               # key -> its next use
    heap: list = []                 # (-next use, key), stale items skipped
    for i, key in enumerate(keys.tolist()):
        nu = nxt[i]
        if key in cached:
            hits[i] = True
        elif nu == n:
            continue                # never needed again: do not cache
        elif len(cached) >= capacity:
            while cached.get(heap[0][1]) != -heap[0][0]:
                heapq.heappop(heap)
            if -heap[0][0] < nu:    # every cached key is needed sooner: bypass
                continue
            del cached[heapq.heappop(heap)[1]]
        cached[key] = nu
        heapq.heappush(heap, (-nu, key))
    return hits


def static_hits(keys: np.ndarray, capacity: int) -> np.ndarray:
    """Hit mask of the best fixed set in hindsight: the ``capacity`` most requested keys (ties:
    the earlier first request), each cached at its first request and never evicted. The most a
    policy that knew every block's total demand in advance, but not when it comes, gets without
    exploiting recency; at most Belady's (it is one of the schedules Belady's optimum covers)."""
    keys = np.asarray(keys)
    uniq, first, inverse, counts = np.unique(keys, return_index=True, return_inverse=True,
                                             return_counts=True)
    chosen = np.zeros(len(uniq), bool)
    chosen[np.lexsort((first, -counts))[:int(capacity)]] = True
    hits = chosen[inverse.reshape(-1)]
    hits[first] = False
    return hits
