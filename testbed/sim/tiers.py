"""The cache tiers of the cluster model. Node tiers (GPU HBM, node DRAM) are LRU caches computed
vectorised with Che's approximation, HBM evictions demoted to DRAM by value. The switch tier is a
model of the data plane (admit set, cache map, speculative-fill budget, coalescing) driven fetch
by fetch, with switchd's own admission loop (switchd.admission, the code the daemon runs)
stepping it every interval."""
from __future__ import annotations

import heapq
import math
from collections import defaultdict

import numpy as np

from switchd.admission import AdmissionLoop, Observation
from switchd.policy import PrefixAware

from .config import GIB

HBM, DRAM, SWITCH, POOL, REPLICA, RECOMPUTE, UNSAMPLED = range(7)
TIERS = ("hbm", "dram", "switch", "pool", "switch_replica", "recompute")


def _packed_order(high: np.ndarray, high_bits: int) -> np.ndarray | None:
    """Indices sorting ``high`` (ints in [0, 2**high_bits)), ties in index order, got by sorting
    high << b | index (one np.sort of integers, several times faster than a stable argsort);
    None if that does not fit 64 bits."""
    n = len(high)
    b = max(1, (n - 1).bit_length())
    if high_bits + b > 64:
        return None
    packed = (high.astype(np.uint64) << np.uint64(b)) | np.arange(n, dtype=np.uint64)
    packed.sort()
    packed &= np.uint64((1 << b) - 1)
    return packed.view(np.int64)


def stable_order(group: np.ndarray) -> np.ndarray:
    """np.argsort(group, kind="stable") for non-negative integers, faster."""
    if len(group) and int(group.min()) >= 0:
        order = _packed_order(group, int(group.max()).bit_length())
        if order is not None:
            return order
    return np.argsort(group, kind="stable")


def _seg_order(seg: np.ndarray, g: np.ndarray, nseg: int) -> np.ndarray:
    """Indices sorting by segment, then by g >= 0 (g quantised to what fits beside the segment
    and the index: at 30 M accesses over 1,024 nodes, 2**-28 of the largest g)."""
    n = len(seg)
    bits = 63 - max(1, (n - 1).bit_length()) - max(1, (nseg - 1).bit_length())
    gmax = float(g.max()) if n else 0.0
    if bits >= 20 and np.isfinite(gmax):
        q = (g * ((2.0 ** bits - 1) / max(gmax, 1e-300))).astype(np.uint64)
        high = (seg.astype(np.uint64) << np.uint64(bits)) | q
        order = _packed_order(high, bits + max(1, (nseg - 1).bit_length()))
        if order is not None:
            return order
    return np.argsort(seg * (gmax * 2 + 1) + g)


def gaps(group: np.ndarray, t: np.ndarray, end: float):
    """For accesses in time order, the time since the previous and until the next access with
    the same ``group`` value (inf / time to ``end`` if none); also the stable order by group and
    whether each access in that order has the group of the one before it."""
    order = stable_order(group)
    g = group[order]
    same = g[1:] == g[:-1]
    del g
    ts = t[order]
    d = np.diff(ts)
    prev_sorted = np.empty(len(t))
    prev_sorted[0] = np.inf
    np.copyto(prev_sorted[1:], np.where(same, d, np.inf))
    prev = np.empty(len(t))
    prev[order] = prev_sorted
    del prev_sorted
    nxt_sorted = ts
    nxt_sorted *= -1.0
    nxt_sorted += end                                   # time to the end ...
    np.copyto(nxt_sorted[:-1], d, where=same)           # ... or to the next access
    nxt = np.empty(len(t))
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
    order = _seg_order(seg, g, nseg)
    s, gg, w = seg[order], g[order], size[order]
    del order
    starts = np.searchsorted(s, np.arange(nseg))
    ends = np.searchsorted(s, np.arange(nseg), side="right")
    wg = w * gg
    before = np.cumsum(wg)                            # sum of w*g over earlier gaps of the
    seg_cw0 = np.where(starts > 0, before[np.maximum(starts - 1, 0)], 0.0)   # segment
    before -= wg
    del wg
    before -= seg_cw0[s]
    rest = np.cumsum(w)                               # weight of gaps >= this one
    seg_cs1 = rest[np.maximum(ends - 1, 0)]
    rest -= w
    del w
    np.subtract(seg_cs1[s], rest, out=rest)
    occ = gg * rest                                   # occupancy x span at T = this gap
    occ += before
    over = occ > target[s] if np.ndim(target) else occ > target
    del occ
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
    n = len(key)
    grp_start = np.arange(n)
    grp_start[1:][same_g] = 0
    np.maximum.accumulate(grp_start, out=grp_start)
    np.subtract(np.arange(n), grp_start, out=grp_start)      # earlier requests of the block
    valued = np.empty(n, bool)
    valued[order] = grp_start >= PrefixAware.MIN_COUNT - 1
    del grp_start
    resid = next_n - Th
    evicted = valued & (resid > 0)                       # this copy leaves HBM and is demoted
    T_d = che_ttl(node[evicted], resid[evicted], nbytes[evicted], cfg.dram_gib * GIB,
                  cfg.nodes, span)
    del resid, evicted
    # the copy found now was made at the previous access on this node: was it demoted?
    prev_valued = np.zeros(n, bool)
    prev_valued[ord_n[1:][same_n]] = valued[ord_n[:-1][same_n]]
    prev_valued &= prev_n >= Th
    Th += T_d[node]
    prev_valued &= prev_n < Th
    return prev_valued


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
        self.next_step: float | None = None     # kept across runs (TierSim runs fetch by fetch)

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
        next_step = (float(times[0]) + self.interval if self.next_step is None
                     else self.next_step)
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
        self.next_step = next_step
        return out


# ---- the four live tiers, exact, request by request --------------------------------------------
class TierSim:
    """Node DRAM (per inference node), the switch (SwitchModel), pool DRAM and pool disk (per
    pool node), replayed request by request with hostagent.common.tier_policy deciding, the same
    code the live inference nodes and pool nodes run: what each node writes down and when, what it
    promotes, what leaves a full tier first and whether an evicted block moves down or is
    dropped. Each inference node and each pool node has a policy of its own, fed with what it
    sees (a node: its requests; a pool node: the PUTs and the GETs that reach it). A request
    uses the longest run of blocks some tier holds from its first block and computes the rest;
    ``pool_bytes`` None is an unbounded pool."""

    def __init__(self, cfg, nodes: int, pools: int, block_bytes: int, node_bytes: float,
                 pool_bytes: float | None, disk_bytes: float, owner, nchunks: int = 1,
                 switch_entries: int = 0, switch_policy: str = "prefix",
                 switch_headroom: int | None = None, interval: float = 1.0,
                 fetch_window: float = 0.0, prefill_tok_s: float | None = None,
                 block_tokens: int = 512):
        from hostagent.common.tier_policy import OrderedTier, TierPolicy
        self.cfg, self.size, self.owner, self.nchunks = cfg, block_bytes, owner, nchunks
        by_value = cfg.demote == "value"
        self.node_pol = [TierPolicy(cfg) for _ in range(nodes)]
        self.pool_pol = [TierPolicy(cfg) for _ in range(pools)]
        self.node = [OrderedTier(node_bytes, p, by_value) for p in self.node_pol]
        big = math.inf if pool_bytes is None else pool_bytes
        self.pool = [OrderedTier(big, p, by_value) for p in self.pool_pol]
        self.disk = [OrderedTier(disk_bytes) for _ in self.pool_pol]   # LRU, as DiskTier
        self.written = [set() for _ in range(nodes)]   # what a node knows is in the pool
        self.switch = None
        if switch_entries:
            head = switch_entries // 16 if switch_headroom is None else switch_headroom
            self.switch = SwitchModel(switch_policy, switch_entries, head, interval)
        self.window, self.prefill, self.block_tokens = fetch_window, prefill_tok_s, block_tokens
        self.busy = [0.0] * nodes          # with prefill_tok_s: a node serves one at a time
        self.pending: list = []            # writes in flight: (lands at, seq, node, block)
        self._lands = None
        self.hits = dict.fromkeys(("node", "switch", "pool", "disk"), 0)
        self.requests = self.blocks = self.computed = 0
        self.write_bytes = self.writes = self.demoted = self.dropped = 0

    # pool side
    def _pool_put(self, p: int, block, now: float) -> None:
        pol = self.pool_pol[p]
        if block not in self.pool[p] and block not in self.disk[p]:
            pol.access(block, now, size=self.size)           # a PUT: the compute that made it
        for gone, size in self.pool[p].put(block, self.size):
            if gone in self.disk[p]:
                continue
            if pol.demote(gone, "pool", now, size, self.disk[p].free) == "disk":
                self.demoted += 1
                self.disk[p].put(gone, size)
            else:
                self.dropped += 1

    def _pool_get(self, p: int, block, now: float) -> str | None:
        if self.pool[p].get(block):
            self.pool_pol[p].access(block, now, size=self.size)
            return "pool"
        if self.disk[p].get(block):
            self.pool_pol[p].access(block, now, size=self.size)
            self._pool_put(p, block, now)                    # staged back into DRAM
            return "disk"
        return None

    # node side
    def _write(self, n: int, block, now: float) -> None:
        self.written[n].add(block)
        self.writes += 1
        self.write_bytes += self.size
        if self._lands is not None:         # after the request's prefill, as live
            heapq.heappush(self.pending, (self._lands, self.writes, n, block))
        else:
            self._pool_put(self.owner(block), block, now)

    def _land(self, now: float) -> None:
        while self.pending and self.pending[0][0] <= now:
            t, _, _n, block = heapq.heappop(self.pending)
            self._pool_put(self.owner(block), block, t)

    def _node_put(self, n: int, block, now: float) -> None:
        for gone, _size in self.node[n].put(block, self.size):
            if gone not in self.written[n] and \
                    self.node_pol[n].demote(gone, "node", now, self.size) == "pool":
                self._write(n, gone, now)

    def _switch(self, block, now: float) -> bool:
        """The switch answers (a hit or a coalesced reply) for a block the pool holds."""
        if self.switch is None:
            return False
        k = np.array([hash(block)], np.int64)
        out = self.switch.run(k, np.array([now]), np.array([self.nchunks], float),
                              np.array([self.window]))
        return int(out[0]) in (SWITCH, REPLICA)

    def _switch_has(self, block) -> bool:
        return self.switch is not None and hash(block) in self.switch.filled

    def request(self, n: int, now: float, keys: list, tokens: int | None = None) -> list:
        """One request of node ``n`` arriving at ``now``: the tier each block came from (None:
        computed). With ``prefill_tok_s`` and ``tokens`` the node serves its requests one at
        a time and what it writes lands after the request's prefill."""
        timed = self.prefill is not None and tokens is not None
        if timed:
            now = max(now, self.busy[n])
        self._land(now)
        pol, tier = self.node_pol[n], self.node[n]
        got: list = []
        for d, b in enumerate(keys):
            pol.access(b, now, d, self.size)
        for b in keys:
            if tier.get(b):
                got.append("node")
                continue
            p = self.owner(b)
            if self._switch_has(b) or b in self.pool[p] or b in self.disk[p]:
                if self._switch(b, now):
                    got.append("switch")
                    continue
                got.append(self._pool_get(p, b, now))
            else:
                got.append(None)
        run = next((i for i, g in enumerate(got) if g is None), len(got))
        if timed:
            fetch = self.window * (len(keys) - got.count("node"))
            self.busy[n] = now + fetch + max(0, tokens - run * self.block_tokens) / self.prefill
            self._lands = self.busy[n] + self.window
        self.requests += 1
        self.blocks += len(keys)
        for i, (b, g) in enumerate(zip(keys, got)):
            if i < run:
                self.hits[g] += 1
            if g == "node":
                continue
            if g is not None and i < run:
                self.written[n].add(b)                       # it is in the pool
                if pol.promote(b, now, None, self.size):     # as the live node does
                    self._node_put(n, b, now)
            elif i >= run:
                self.computed += 1
                self._node_put(n, b, now)
        for i, b in enumerate(keys):      # write down what is due now (computed or held)
            if b not in self.written[n] and (i >= run or got[i] == "node") and \
                    pol.write_down(b, now, self.size) == "now":
                self._write(n, b, now)
        self._lands = None
        return got[:run] + [None] * (len(keys) - run)

    def summary(self) -> dict:
        n = max(1, self.blocks)
        shares = {k: round(v / n, 4) for k, v in self.hits.items()}
        return {"tier_hits": shares, "hit_ratio": round(sum(self.hits.values()) / n, 4),
                "pool_write_bytes": self.write_bytes, "writes": self.writes,
                "block_requests": self.blocks, "requests": self.requests,
                "computed_blocks": self.computed, "demoted_to_disk": self.demoted,
                "dropped_from_pool": self.dropped}
