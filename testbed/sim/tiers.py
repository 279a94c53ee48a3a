"""The cache tiers of the cluster model. Node tiers (GPU HBM, node DRAM) are LRU caches computed
vectorised with Che's approximation, HBM evictions demoted to DRAM by value. The switch tier is a
model of the data plane (admit set, cache map, speculative-fill budget, coalescing) driven fetch
by fetch, with switchd's own admission loop (switchd.admission, the code the daemon runs)
stepping it every interval."""
from __future__ import annotations

import math
from collections import defaultdict

import numpy as np

from switchd.admission import AdmissionLoop, Observation
from switchd.policy import PrefixAware

from .config import GIB

HBM, DRAM, SWITCH, POOL, REPLICA, RECOMPUTE, UNSAMPLED = range(7)
TIERS = ("hbm", "dram", "switch", "pool", "switch_replica", "recompute")


def gaps(group: np.ndarray, t: np.ndarray, end: float):
    """For accesses in time order, the time since the previous and until the next access with
    the same ``group`` value (inf / time to ``end`` if none)."""
    order = np.argsort(group, kind="stable")
    g, ts = group[order], t[order]
    same = g[1:] == g[:-1]
    prev = np.full(len(t), np.inf)
    nxt = np.empty(len(t))
    d = ts[1:] - ts[:-1]
    prev[order[1:][same]] = d[same]
    nxt_sorted = np.where(np.append(same, False), np.append(d, 0.0), end - ts)
    nxt[order] = nxt_sorted
    return prev, nxt, order, same


def che_ttl(seg: np.ndarray, g: np.ndarray, size: np.ndarray, capacity: float, nseg: int,
            span: float) -> np.ndarray:
    """Per segment (node), the time T at which a TTL cache that keeps each access for
    min(g, T) (g = time to the next access of the block) holds ``capacity`` bytes on average."""
    T = np.full(nseg, np.inf)
    if capacity <= 0:
        return np.zeros(nseg)
    if len(g) == 0:
        return T
    target = capacity * span
    order = np.argsort(seg * (float(g.max()) * 2 + 1) + g)
    s, gg, w = seg[order], g[order], size[order]
    starts = np.searchsorted(s, np.arange(nseg))
    ends = np.searchsorted(s, np.arange(nseg), side="right")
    cw = np.cumsum(w * gg)
    cs = np.cumsum(w)
    seg_cw0 = np.where(starts > 0, cw[np.maximum(starts - 1, 0)], 0.0)[s]
    seg_cs1 = cs[np.maximum(ends - 1, 0)][s]
    before = cw - w * gg - seg_cw0                    # sum of w*g over earlier gaps of the segment
    rest = seg_cs1 - (cs - w) + 0.0                   # weight of gaps >= this one
    occ = before + gg * rest                          # occupancy x span at T = this gap
    over = occ > target[s] if np.ndim(target) else occ > target
    under = np.bincount(s, weights=~over, minlength=nseg).astype(np.int64)  # over is monotone
    first = np.where(starts + under < ends, starts + under, -1)
    for_seg = np.flatnonzero(first >= 0)
    k = first[for_seg]
    # on [g_{k-1}, g_k] occupancy is linear: before_k + T * rest_k
    T[for_seg] = (target - before[k]) / np.maximum(rest[k], 1e-300)
    return T




def dram_hits(cfg, key, node, prev_n, next_n, nbytes, T_hbm, span, demote, orders) -> np.ndarray:
    """Which accesses find their block in the node's DRAM (demoted from HBM, still there)."""
    if demote == "none" or cfg.dram_gib <= 0:
        return np.zeros(len(key), bool)
    Th = T_hbm[node]
    if demote == "all":     # exclusive tiers: HBM + DRAM behave as one LRU of their sum
        T_both = che_ttl(node, next_n, nbytes, (cfg.hbm_gib + cfg.dram_gib) * GIB,
                         cfg.nodes, span)
        return (prev_n >= Th) & (prev_n < T_both[node])
    # value: demote a copy only if its block has been requested min_count times in the cluster
    ord_n, same_n, order, same_g = orders
    first = np.ones(len(key), bool)
    first[1:] = ~same_g
    grp_start = np.maximum.accumulate(np.where(first, np.arange(len(key)), 0))
    count = np.empty(len(key), np.int64)
    count[order] = np.arange(len(key)) - grp_start + 1     # requests of the block so far
    valued = count >= PrefixAware.MIN_COUNT
    evicted = valued & (next_n > Th)                     # this copy leaves HBM and is demoted
    resid = np.where(evicted, next_n - Th, 0.0)
    T_d = che_ttl(node[evicted], resid[evicted], nbytes[evicted], cfg.dram_gib * GIB,
                  cfg.nodes, span)
    # the copy found now was made at the previous access on this node: was it demoted?
    prev_valued = np.zeros(len(key), bool)
    prev_valued[ord_n[1:][same_n]] = valued[ord_n[:-1][same_n]]
    return prev_valued & (prev_n >= Th) & (prev_n < Th + T_d[node])




# ---- the switch tier ---------------------------------------------------------------------------
class SwitchModel:
    """The switch's data plane, modelled per fetch (a block is cached or not, learned from the
    reply of a miss if admitted or while the fill budget lasts, concurrent misses held), and
    switchd's admission loop stepping it every ``interval`` seconds."""

    def __init__(self, policy: str, capacity: float, headroom: float, interval: float,
                 coalesce: bool = True):
        self.total = capacity
        self.loop = AdmissionLoop(policy, capacity, headroom)
        self.interval, self.coalesce = interval, coalesce
        self.admitted: dict = {}        # the admit set (no pins in the model)
        self.filled: dict = {}          # the cache map: block -> (size, speculative)
        self.used = 0.0
        self.spec_budget = 0.0          # switchd starts with no fill budget until its first step
        self.hits: dict = defaultdict(int)
        self.misses: dict = defaultdict(int)
        self.sizes: dict = {}
        self.last_miss: dict = {}

    @property
    def steps(self) -> int:
        return self.loop.steps

    def step(self, now: float) -> None:
        d = self.loop.step(Observation(now, self.misses, self.hits, self.filled, self.admitted,
                                       self.sizes))
        for block, _size in d.evict:
            self.admitted.pop(block, None)
            gone = self.filled.pop(block, None)
            if gone is not None:
                self.used -= gone[0]
        for block in d.admit:
            self.admitted[block] = None
        self.spec_budget = d.spec_budget
        self.hits, self.misses, self.sizes = defaultdict(int), defaultdict(int), {}

    def run(self, keys, times, sizes, windows) -> np.ndarray:
        """Outcome per fetch: SWITCH (hit), POOL (fetched upstream), REPLICA (held, coalesced)."""
        out = np.empty(len(keys), np.int8)
        if not len(keys):
            return out
        next_step = float(times[0]) + self.interval
        filled, last_miss = self.filled, self.last_miss
        for i, (k, t, s, w) in enumerate(zip(keys.tolist(), times.tolist(), sizes.tolist(),
                                             windows.tolist())):
            while t >= next_step:
                self.step(next_step)
                next_step += self.interval
            if k in filled:
                out[i] = SWITCH
                self.hits[k] += 1
                continue
            self.misses[k] += 1
            self.sizes[k] = s
            if self.coalesce and t - last_miss.get(k, -math.inf) < w:
                out[i] = REPLICA
                continue
            out[i] = POOL
            last_miss[k] = t
            if self.used + s <= self.total + 1e-9:
                if k in self.admitted:
                    filled[k] = (s, False)
                    self.used += s
                elif s <= self.spec_budget:
                    filled[k] = (s, True)
                    self.used += s
                    self.spec_budget -= s
        return out
