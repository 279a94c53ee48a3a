"""Cluster-scale model of the KV-cache tiers (``testbed sim run``): a Mooncake-format trace replayed
over N inference nodes behind the switch pool and M pool nodes, with the switch pool on and off.

Tiers a block of a request's prefix chain is served from, first that holds it:
GPU HBM -> node DRAM (both per node) -> switch pool -> pool-node DRAM -> recompute.

- Prefix semantics: a request uses the longest prefix of its chain that some tier holds and
  recomputes the rest; every block of the request is then in the node's HBM.
- Node tiers are LRU (as vLLM's prefix cache and LMCache's CPU tier are), computed vectorised with
  Che's approximation: an LRU of capacity C holds a block iff it was touched within its
  characteristic time T(C), where T is solved per node so that the mean occupancy is C.
  HBM evictions are demoted to DRAM (``demote``): ``none`` drops them, ``all`` keeps them, ``value``
  keeps those whose remaining value is proven (requested at least ``min_count`` times in the
  cluster, the admission bar of switchd's prefix policy). The run also reports what demotion saves.
- Pool nodes: every computed block is written through to the pool node that owns it (hash
  placement, as Mooncake does); their capacity (default unlimited) is an LRU over the cluster's
  lookups. ``preload``: the pool holds every block from the start (as the testbed replay does).
- Switch pool: driven through a policy object of switchd.policy the way switchd drives it: the
  cache is fixed between steps every ``interval`` seconds, a miss's reply is learned if its block is
  admitted or the speculative-fill budget lasts, concurrent misses of a block are held and answered
  by one upstream fetch (coalescing), and each step feeds the interval's hits and misses to the
  policy, offers missed and speculatively filled blocks, and applies its evictions. It sees only
  what the node tiers missed. At large scale it runs on a spatial sample of prefix trees (SHARDS:
  rate R, capacity scaled by R) when the switch-bound stream exceeds ``switch_budget`` accesses;
  metrics that depend on it are then estimated from the sample (``switch_sample`` says so).

Costs and timing: see docs/sim.md. Result keys: see ``run``.
"""
from __future__ import annotations

import heapq
import math
import time
from collections import defaultdict
from dataclasses import asdict, dataclass

import numpy as np

from switchd.policy import POLICIES, PrefixAware, make_policy

from .policy_eval import GAMMA
from .trace import BLOCK_TOKENS, Trace

GIB = 1 << 30
FRAME_OVERHEAD = 14 + 20 + 8 + 48        # Ethernet + IPv4 + UDP + KV header per chunk frame
ROUTINGS = ("random", "least-loaded", "affinity")
DEMOTES = ("none", "all", "value")
HBM, DRAM, SWITCH, POOL, REPLICA, RECOMPUTE, UNSAMPLED = range(7)
TIERS = ("hbm", "dram", "switch", "pool", "switch_replica", "recompute")


@dataclass(frozen=True)
class Model:
    name: str
    kv_bytes_per_token: int      # K and V of every layer, bf16
    prefill_tokens_per_s: float  # one inference node, long prompts
    gpus_per_node: int


MODELS = {
    # 32 layers x 8 KV heads x 128 x 2 (K, V) x 2 bytes; one H100 per node
    "llama3-8b": Model("Llama-3-8B", 32 * 8 * 128 * 2 * 2, 10_000, 1),
    # 80 layers x 8 KV heads x 128 x 2 x 2; one 8-GPU node (TP8)
    "llama3-70b": Model("Llama-3-70B", 80 * 8 * 128 * 2 * 2, 8_000, 8),
    # MLA: 61 layers x (512 latent + 64 rope) x 2 bytes; one 8-GPU node
    "deepseek-v3": Model("DeepSeek-V3", 61 * (512 + 64) * 2, 6_000, 8),
}


@dataclass
class SimConfig:
    nodes: int = 4
    pools: int | None = None          # pool nodes; default max(1, nodes // 8)
    model: str = "llama3-8b"
    kv_bytes_per_token: int | None = None   # overrides the model's
    block_tokens: int = 512           # allocation/transfer granularity (divides 512)
    hbm_gib: float = 40.0             # per node, for KV
    dram_gib: float = 256.0           # per node
    switch_gib: float = 64.0          # the switch pool
    pool_gib: float | None = None     # per pool node; None: unlimited
    node_gbps: float = 100.0          # inference node <-> switch
    pool_gbps: float = 100.0          # pool node <-> switch
    pcie_gbps: float = 200.0          # node DRAM -> HBM
    chunk_bytes: int = 3072           # payload per KV frame
    hop_us: float = 5.0               # extra latency of a fetch through the switch pool
    routing: str = "affinity"
    demote: str = "value"
    switch_policy: str = "prefix"
    interval: float = 1.0             # switchd policy step, seconds (of the policy clock)
    headroom: float | None = None     # speculative-fill share of the switch; None: 1/16
    coalesce: bool = True
    load: float = 0.7                 # per-node prefill utilisation without any cache
    rate_per_node: float | None = None  # requests/s per node; default from load
    preload: bool = False             # pool nodes hold every block from the start
    write_through: bool = True        # computed blocks are put to the pool nodes
    switch_budget: int = 1_000_000    # switch-bound accesses simulated exactly; more: sampled
    clock_scale: float = 1.0          # policy clock = trace time / clock_scale (testbed speedup)
    xdp_ns_per_frame: float = 310.0   # data-plane CPU per KV frame (bench throughput)
    seed: int = 1
    # cost model (break-even), see docs/sim.md
    gpu_hour_usd: float = 2.0
    switch_gib_hour_usd: float = 0.004
    core_hour_usd: float = 0.04
    switchd_cores: float = 1.0

    def __post_init__(self):
        if self.nodes < 1:
            raise ValueError(f"nodes must be >= 1, got {self.nodes}")
        if self.pools is None:
            self.pools = max(1, self.nodes // 8)
        if self.model not in MODELS:
            raise ValueError(f"unknown model {self.model!r} (choose from {', '.join(MODELS)})")
        if self.routing not in ROUTINGS:
            raise ValueError(f"unknown routing {self.routing!r} (choose from {', '.join(ROUTINGS)})")
        if self.demote not in DEMOTES:
            raise ValueError(f"unknown demotion {self.demote!r} (choose from {', '.join(DEMOTES)})")
        if self.switch_policy not in POLICIES:
            raise ValueError(f"unknown policy {self.switch_policy!r} "
                             f"(choose from {', '.join(POLICIES)})")
        if not (1 <= self.block_tokens <= BLOCK_TOKENS and BLOCK_TOKENS % self.block_tokens == 0):
            raise ValueError(f"block tokens must divide {BLOCK_TOKENS}, got {self.block_tokens}")
        for name in ("hbm_gib", "dram_gib", "switch_gib"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0")
        for name in ("node_gbps", "pool_gbps", "pcie_gbps", "interval", "load"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0")

    @property
    def kv_per_token(self) -> int:
        return self.kv_bytes_per_token or MODELS[self.model].kv_bytes_per_token

    @property
    def block_bytes(self) -> int:
        return BLOCK_TOKENS * self.kv_per_token


# ---- workload ---------------------------------------------------------------------------------
def _mix(x: np.ndarray, salt: int = 0) -> np.ndarray:
    """A 64-bit mixing hash of integer ids (splitmix64), vectorised."""
    z = (np.asarray(x).astype(np.uint64) + np.uint64(0x9E3779B97F4A7C15 * (salt + 1) & (2**64 - 1)))
    with np.errstate(over="ignore"):
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


@dataclass
class Workload:
    """Requests (time-sorted, times in seconds) as flat block arrays, like Trace."""
    time: np.ndarray
    input_length: np.ndarray
    offsets: np.ndarray
    hash_ids: np.ndarray
    resampled: bool = False

    @property
    def n(self) -> int:
        return len(self.time)


def _partial_tail_fresh(offsets, ids, input_length, start_id):
    """Give the partial last block of every prompt an id of its own (its text is the request's)."""
    lens = np.diff(offsets)
    partial = (input_length % BLOCK_TOKENS != 0) & (lens > input_length // BLOCK_TOKENS) & (lens > 0)
    last = offsets[1:][partial] - 1
    ids = ids.copy()
    ids[last] = start_id + np.arange(len(last))
    return ids


def workload(trace: Trace, cfg: SimConfig, requests: int | None = None,
             sharing: float = 0.0) -> Workload:
    """The requests the cluster serves. With ``requests`` unset and no sharing, the trace itself,
    its timestamps scaled to the cluster's arrival rate. Otherwise a resampled trace: prefix trees
    (requests sharing a first block, i.e. a session or a shared document) are drawn uniformly with
    replacement; each drawn copy keeps the tree's requests and their offsets from its first request
    and starts at a uniform time in the run, and gets fresh block ids (a new session), except that
    with probability ``sharing`` it keeps the tree's original ids (the same content asked again,
    e.g. a popular document). Partial last blocks always get fresh ids. The run lasts
    requests / (nodes x rate) seconds."""
    rate = cfg.rate_per_node or cfg.load * MODELS[cfg.model].prefill_tokens_per_s / max(
        1.0, float(trace.input_length.mean()))
    total_rate = rate * cfg.nodes
    max_id = int(trace.hash_ids.max()) + 1 if trace.n_block_requests else 1
    if requests is None and sharing == 0:
        t = (trace.timestamp - trace.timestamp[0]) / 1000.0
        span = max(1e-9, float(t[-1]))
        scale = trace.n_requests / total_rate / span
        return Workload(t * scale, trace.input_length.copy(), trace.offsets.copy(),
                        trace.hash_ids.copy())
    n = int(requests or trace.n_requests)
    rng = np.random.default_rng(cfg.seed)
    heads = trace.hash_ids[trace.offsets[:-1]]
    _, group = np.unique(heads, return_inverse=True)
    order = np.argsort(group, kind="stable")                  # requests by tree, in time order
    g_sizes = np.bincount(group)
    g_start = np.zeros(len(g_sizes) + 1, np.int64)
    np.cumsum(g_sizes, out=g_start[1:])
    t_ms = trace.timestamp.astype(np.float64)
    first_t = t_ms[order[g_start[:-1]]]
    draws = rng.integers(0, len(g_sizes), int(1.2 * n / g_sizes.mean()) + 16)
    while g_sizes[draws].sum() < n:
        draws = np.concatenate([draws, rng.integers(0, len(g_sizes), len(draws))])
    keep = np.searchsorted(np.cumsum(g_sizes[draws]), n) + 1
    draws = draws[:keep]
    span = n / total_rate
    copy_of = np.repeat(np.arange(len(draws)), g_sizes[draws])
    within = np.arange(len(copy_of)) - np.repeat(np.cumsum(g_sizes[draws]) - g_sizes[draws],
                                                 g_sizes[draws])
    req = order[g_start[draws][copy_of] + within]              # original request index
    shared = rng.random(len(draws)) < sharing
    id_off = np.where(shared, 0, (np.arange(len(draws)) + 1) * max_id)[copy_of]
    starts = rng.uniform(0, span, len(draws))[copy_of]
    when = starts + (t_ms[req] - first_t[draws][copy_of]) / 1000.0
    srt = np.argsort(when, kind="stable")[:n]
    srt = srt[np.argsort(when[srt], kind="stable")]
    req, id_off, when = req[srt], id_off[srt], when[srt]
    lens = np.diff(trace.offsets)[req]
    offsets = np.zeros(n + 1, np.int64)
    np.cumsum(lens, out=offsets[1:])
    src = np.repeat(trace.offsets[:-1][req] - offsets[:-1], lens) + np.arange(offsets[-1])
    ids = trace.hash_ids[src] + np.repeat(id_off, lens)
    il = trace.input_length[req]
    ids = _partial_tail_fresh(offsets, ids, il, (len(draws) + 2) * max_id)
    return Workload(when - when[0], il, offsets, ids, resampled=True)


# ---- routing -----------------------------------------------------------------------------------
def route(wl: Workload, cfg: SimConfig) -> np.ndarray:
    """The inference node of every request."""
    n = cfg.nodes
    if cfg.routing == "random":
        return np.random.default_rng(cfg.seed + 7).integers(0, n, wl.n)
    if cfg.routing == "affinity":       # prefix/session affinity: the first block picks the node
        return (_mix(wl.hash_ids[wl.offsets[:-1]], 3) % np.uint64(n)).astype(np.int64)
    # least-loaded: the node whose queue of prefill work empties first
    work = wl.input_length / MODELS[cfg.model].prefill_tokens_per_s
    busy = [(0.0, i) for i in range(n)]
    out = np.empty(wl.n, np.int64)
    for r, (t, w) in enumerate(zip(wl.time.tolist(), work.tolist())):
        free, node = busy[0]
        out[r] = node
        heapq.heapreplace(busy, (max(free, t) + w, node))
    return out


# ---- node tiers (Che's approximation) ----------------------------------------------------------
def _gaps(group: np.ndarray, t: np.ndarray, end: float):
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
    seg_cs0 = np.where(starts > 0, cs[np.maximum(starts - 1, 0)], 0.0)[s]
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


# ---- the switch tier ---------------------------------------------------------------------------
class SwitchModel:
    """switchd's loop over one policy object, fed the switch-bound fetches in time order."""

    def __init__(self, policy: str, capacity: float, headroom: float, interval: float,
                 coalesce: bool = True):
        self.total = capacity
        self.pol = make_policy(policy, max(1e-9, capacity - headroom))
        self.interval, self.coalesce = interval, coalesce
        self.filled: dict = {}          # key -> size: in the data plane's cache map
        self.used = 0.0
        self.spec_budget = 0.0          # switchd starts with no fill budget until its first step
        self.hits: dict = defaultdict(int)
        self.misses: dict = defaultdict(int)
        self.last_miss: dict = {}
        self.steps = 0
        self.policy_calls = 0

    def _remove(self, key) -> None:
        size = self.filled.pop(key, None)
        if size is not None:
            self.used -= size

    def _offer(self, key, now, size) -> None:
        adm = self.pol.admit(key, now, size=size)
        self.policy_calls += 1
        for k in adm.evicted:
            self._remove(k)
        if not adm and key in self.filled:
            self._remove(key)

    def step(self, now: float) -> None:
        pol, offered = self.pol, set()
        for k, c in self.hits.items():
            if k in pol:
                pol.access(k, now, count=c)
        for k, c in sorted(self.misses.items(), key=lambda kv: -kv[1]):
            pol.access(k, now, count=c)
            if k in pol:
                continue
            offered.add(k)
            self._offer(k, now, self._sizes.get(k, 1.0))
        for k in [k for k in self.filled if k not in pol and k not in offered]:
            self._offer(k, now, self.filled[k])
        self.policy_calls += len(self.hits) + len(self.misses)
        self.hits.clear()
        self.misses.clear()
        self.spec_budget = max(0.0, self.total - pol.used)
        self.steps += 1

    def run(self, keys, times, sizes, windows) -> np.ndarray:
        """Outcome per fetch: SWITCH (hit), POOL (fetched upstream), REPLICA (held, coalesced)."""
        out = np.empty(len(keys), np.int8)
        if not len(keys):
            return out
        self._sizes = {}
        next_step = float(times[0]) + self.interval
        filled, hits, misses, last_miss, pol = (self.filled, self.hits, self.misses,
                                                self.last_miss, self.pol)
        sizes_d = self._sizes
        for i, (k, t, s, w) in enumerate(zip(keys.tolist(), times.tolist(), sizes.tolist(),
                                             windows.tolist())):
            if t >= next_step:
                while t >= next_step:
                    self.step(next_step)
                    next_step += self.interval
            if k in filled:
                out[i] = SWITCH
                hits[k] += 1
                continue
            misses[k] += 1
            sizes_d[k] = s
            if self.coalesce and t - last_miss.get(k, -math.inf) < w:
                out[i] = REPLICA
                continue
            out[i] = POOL
            last_miss[k] = t
            if self.used + s <= self.total + 1e-9:
                if k in pol:
                    filled[k] = s
                    self.used += s
                elif s <= self.spec_budget:
                    filled[k] = s
                    self.used += s
                    self.spec_budget -= s
        return out


# ---- one run -----------------------------------------------------------------------------------
def _first_false(flags: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """Per request, the index (depth) of its first False flag, or its length."""
    lens = np.diff(offsets)
    pos = np.arange(len(flags)) - np.repeat(offsets[:-1], lens)
    vals = np.where(flags, np.iinfo(np.int64).max, pos)
    first = lens.astype(np.int64).copy()
    ne = lens > 0
    if ne.any():
        first[ne] = np.minimum(np.minimum.reduceat(vals, offsets[:-1][ne]), lens[ne])
    return first


def _percentiles(x: np.ndarray) -> dict:
    if not len(x):
        return {"p50": None, "p99": None, "mean": None}
    p50, p99 = np.percentile(x, [50, 99])
    return {"p50": round(float(p50), 4), "p99": round(float(p99), 4), "mean": round(float(x.mean()), 4)}


def _incast(keys, times, windows) -> dict:
    """Concurrent fetches of one block at the pool nodes: fetches of a block that start within a
    block transfer time of the previous one form one incast event of that degree."""
    if not len(keys):
        return {"events": 0, "mean": 0.0, "p99": 0, "max": 0, "fetches_in_incast": 0.0}
    order = np.argsort(keys, kind="stable")     # fetches are in time order
    k, t, w = keys[order], times[order], windows[order]
    new = np.ones(len(k), bool)
    new[1:] = (k[1:] != k[:-1]) | (t[1:] - t[:-1] >= w[1:])
    ev = np.cumsum(new) - 1
    deg = np.bincount(ev)
    return {"events": int(len(deg)), "mean": round(float(deg.mean()), 4),
            "p99": int(np.percentile(deg, 99)), "max": int(deg.max()),
            "fetches_in_incast": round(float(deg[deg > 1].sum() / deg.sum()), 4)}


def simulate(wl: Workload, cfg: SimConfig, log=None) -> dict:
    """Run the model on a workload; returns the result dict (pool on and off)."""
    t_start = time.perf_counter()
    model = MODELS[cfg.model]
    kvt = cfg.kv_per_token
    nb = len(wl.hash_ids)
    lens = np.diff(wl.offsets)
    req = np.repeat(np.arange(wl.n), lens)
    depth = np.arange(nb) - wl.offsets[:-1][req]
    tokens = np.clip(wl.input_length[req] - depth * BLOCK_TOKENS, 1, BLOCK_TOKENS)
    alloc = np.ceil(tokens / cfg.block_tokens) * cfg.block_tokens
    nbytes = alloc * kvt                                   # bytes a block occupies and moves
    size = nbytes / cfg.block_bytes                        # in full blocks (policy unit)
    work = tokens * (1 + GAMMA * depth) / model.prefill_tokens_per_s   # prefill seconds
    t = wl.time[req]
    span = max(float(wl.time[-1] - wl.time[0]), 1e-3)
    end = float(wl.time[-1]) + 1e-9
    node_of = route(wl, cfg)
    node = node_of[req]
    key = wl.hash_ids

    # node tiers
    nk = key * cfg.nodes + node
    prev_n, next_n, ord_n, same_n = _gaps(nk, t, end)
    T_hbm = che_ttl(node, next_n, nbytes, cfg.hbm_gib * GIB, cfg.nodes, span)
    in_hbm = prev_n < T_hbm[node]
    # pool nodes (write-through of computed blocks; LRU over the cluster's lookups)
    prev_g, next_g, ord_g, same_g = _gaps(key, t, end)
    orders = (ord_n, same_n, ord_g, same_g)
    if cfg.preload:
        pool_has = np.ones(nb, bool)
    elif cfg.pool_gib is None:
        pool_has = prev_g > 0
        pool_has &= np.isfinite(prev_g)
    else:
        zero = np.zeros(nb, np.int64)
        T_pool = che_ttl(zero, next_g, nbytes, cfg.pool_gib * GIB * cfg.pools, 1, span)[0]
        pool_has = (prev_g > 0) & (prev_g < T_pool)
    pool_of = (_mix(key, 5) % np.uint64(cfg.pools)).astype(np.int64)
    in_dram = _dram(cfg, key, node, prev_n, next_n, nbytes, T_hbm, span, cfg.demote, orders)

    # the switch tier runs on a spatial sample of prefix trees when its stream is too long
    avail = in_hbm | in_dram | pool_has
    remote_n = int(((depth < _first_false(avail, wl.offsets)[req]) & ~in_hbm & ~in_dram).sum())
    rate = min(1.0, cfg.switch_budget / max(1, remote_n))
    sampled = np.ones(wl.n, bool)
    if rate < 1:
        sampled = _mix(wl.hash_ids[wl.offsets[:-1]], 11) < np.uint64(rate * 2.0**64)
    res = {"config": asdict(cfg), "model": asdict(model), "requests": int(wl.n),
           "block_requests": int(nb), "distinct_blocks": int(nb - same_g.sum()),
           "seconds_simulated": round(span, 3), "resampled": wl.resampled}
    base = _serve(cfg, wl, req, depth, key, t, node, nbytes, size, work, pool_of, in_hbm,
                  in_dram, pool_has, span, sampled, switch=False)
    if log:
        log(f"node tiers and pool off: {time.perf_counter() - t_start:.1f}s")
    on = _serve(cfg, wl, req, depth, key, t, node, nbytes, size, work, pool_of, in_hbm,
                in_dram, pool_has, span, sampled, switch=True)
    res["pool_off"], res["pool_on"] = base, on
    # value recovery: the same run with HBM evictions dropped
    if cfg.demote != "none":
        dropped = _dram(cfg, key, node, prev_n, next_n, nbytes, T_hbm, span, "none", orders)
        nodrop = _serve(cfg, wl, req, depth, key, t, node, nbytes, size, work, pool_of, in_hbm,
                        dropped, pool_has, span, sampled, switch=False, light=True)
        res["demotion"] = {
            "mode": cfg.demote,
            "dram_hit_ratio": base["hit_ratio"]["dram"],
            "prefill_gpu_s_saved": round(base["prefill_gpu_s_saved"]
                                         - nodrop["prefill_gpu_s_saved"], 2),
            "remote_bytes_saved": int(nodrop["remote_bytes"] - base["remote_bytes"]),
            "ttft_p50_without": nodrop["ttft_s"]["p50"],
            "ttft_p50_with": base["ttft_s"]["p50"]}
    res["switch_benefit"] = _benefit(cfg, base, on, span)
    res["wall_seconds"] = round(time.perf_counter() - t_start, 2)
    return res


def _dram(cfg, key, node, prev_n, next_n, nbytes, T_hbm, span, demote, orders) -> np.ndarray:
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


def _serve(cfg, wl, req, depth, key, t, node, nbytes, size, work, pool_of, in_hbm, in_dram,
           pool_has, span, sampled, switch: bool, light: bool = False) -> dict:
    """Which tier serves every block, and what that costs, with the switch pool on or off."""
    model = MODELS[cfg.model]
    nb = len(key)
    avail = in_hbm | in_dram | pool_has
    prefix = _first_false(avail, wl.offsets)
    served = depth < prefix[req]
    src = np.full(nb, RECOMPUTE, np.int8)
    src[served & in_dram] = DRAM
    src[served & in_hbm] = HBM
    remote = served & ~in_hbm & ~in_dram
    src[remote] = POOL
    node_bps, pool_bps = cfg.node_gbps * 1e9 / 8, cfg.pool_gbps * 1e9 / 8
    chunks = np.ceil(nbytes / cfg.chunk_bytes)
    wire = nbytes + chunks * FRAME_OVERHEAD                # reply frames
    window = wire / min(node_bps, pool_bps)                # a block's transfer time
    weight = np.ones(nb)
    sample_rate = 1.0
    sw = {}
    if switch and remote.any():
        ri = np.flatnonzero(remote)
        cap = cfg.switch_gib * GIB / cfg.block_bytes
        keep = sampled[req[ri]]
        if not keep.all():
            sample_rate = max(float(keep.mean()), 1e-12)
            src[ri[~keep]] = UNSAMPLED
            weight[ri[keep]] = 1 / sample_rate
            weight[ri[~keep]] = 0
            ri = ri[keep]
        headroom = cap / 16 if cfg.headroom is None else cfg.headroom * cap
        model_sw = SwitchModel(cfg.switch_policy, cap * sample_rate, headroom * sample_rate,
                               cfg.interval, cfg.coalesce)
        src[ri] = model_sw.run(key[ri], t[ri] / cfg.clock_scale, size[ri],
                               window[ri] / cfg.clock_scale)
        sw = {"sample_rate": round(sample_rate, 6), "switch_bound_fetches": int(remote.sum()),
              "simulated_fetches": int(len(ri)), "policy_steps": model_sw.steps,
              "capacity_blocks": round(cap * sample_rate, 2)}
    w = weight
    counted = w.sum()
    hit = {name: round(float(w[src == code].sum() / counted), 6)
           for code, name in enumerate(TIERS)}
    is_pool = src == POOL
    is_sw = (src == SWITCH) | (src == REPLICA)
    is_remote = is_pool | is_sw
    hdr = chunks * FRAME_OVERHEAD
    get_frames = chunks * (cfg.chunk_bytes + FRAME_OVERHEAD)   # GETs carry room for the reply
    computed = (src == RECOMPUTE) & cfg.write_through & (not cfg.preload)
    links = {
        "dram_to_hbm": float((w * nbytes)[src == DRAM].sum()),
        "switch_to_nodes": float((w * wire)[is_remote].sum() + (hdr * computed).sum()),
        "nodes_to_switch": float((w * get_frames)[is_remote].sum() + (wire * computed).sum()),
        "pool_to_switch": float((w * wire)[is_pool].sum() + (hdr * computed).sum()),
        "switch_to_pool": float((w * get_frames)[is_pool].sum() + (wire * computed).sum()),
    }
    links = {k: int(v) for k, v in links.items()}
    # pool-link utilisation per pool node and second -> queueing on pool fetches
    sec = np.floor(t).astype(np.int64)
    nsec = int(sec.max()) + 1 if nb else 1
    pool_load = np.bincount(pool_of[is_pool] * nsec + sec[is_pool],
                            weights=(w * wire)[is_pool], minlength=cfg.pools * nsec)
    rho = pool_load / pool_bps
    rho_blk = np.minimum(rho[pool_of * nsec + sec], 0.98)
    fetch_t = np.zeros(nb)
    fetch_t[src == DRAM] = nbytes[src == DRAM] / (cfg.pcie_gbps * 1e9 / 8)
    fetch_t[is_sw] = wire[is_sw] / node_bps + cfg.hop_us * 1e-6
    fetch_t[is_pool] = wire[is_pool] / (min(node_bps, pool_bps) * (1 - rho_blk[is_pool])) \
        + (cfg.hop_us * 1e-6 if switch else 0.0)
    n = wl.n
    fetch_req = np.bincount(req, weights=fetch_t, minlength=n)
    saved_work = np.bincount(req, weights=np.where(src == RECOMPUTE, 0.0, work), minlength=n)
    total_work = np.bincount(req, weights=work, minlength=n)
    # a node recomputes its prefix instead when fetching it would take longer
    load_t = np.minimum(fetch_req, saved_work)
    compute_t = total_work - saved_work + np.where(fetch_req > saved_work, saved_work, 0.0)
    ttft = load_t + compute_t
    req_w = sampled
    gpus = model.gpus_per_node
    out = {
        "hit_ratio": hit,
        "bytes": links,
        "remote_bytes": int((w * nbytes)[is_remote].sum()),
        "ttft_s": _percentiles(ttft[req_w]),
        "prefill_gpu_s_saved": round(float((total_work - compute_t)[req_w].sum()
                                           / req_w.mean()) * gpus, 2),
        "gpu_s_waiting_for_kv": round(float(load_t[req_w].sum() / req_w.mean()) * gpus, 2),
        "gpu_s_total": round(float(ttft[req_w].sum() / req_w.mean()) * gpus, 2),
    }
    if light:
        return out
    out["pool_link"] = {"peak_utilisation": round(float(rho.max()) if len(rho) else 0.0, 4),
                        "mean_utilisation": round(float(rho.mean()) if len(rho) else 0.0, 4),
                        "overloaded_share": round(float((rho >= 1).mean()) if len(rho) else 0.0,
                                                  4)}
    fetches = np.flatnonzero(is_pool) if switch else np.flatnonzero(is_remote)
    out["incast"] = _incast(key[fetches], t[fetches], window[fetches])
    frames = float((w * chunks)[is_remote | computed].sum()) * 2
    out["switch"] = {**sw, "frames_per_s": round(frames / span, 1)} if switch else {}
    return out


def _benefit(cfg: SimConfig, off: dict, on: dict, span: float) -> dict:
    """What the switch pool saves and costs per hour of this workload, in dollars."""
    hours = span / 3600
    gpu_s = off["gpu_s_total"] - on["gpu_s_total"]
    benefit = gpu_s / 3600 * cfg.gpu_hour_usd / hours
    xdp_cores = on["switch"].get("frames_per_s", 0.0) * cfg.xdp_ns_per_frame * 1e-9
    cost = (cfg.switch_gib * cfg.switch_gib_hour_usd
            + (cfg.switchd_cores + xdp_cores) * cfg.core_hour_usd)
    return {"gpu_s_saved_per_hour": round(gpu_s / hours, 2),
            "benefit_usd_per_hour": round(benefit, 4),
            "cost_usd_per_hour": round(cost, 4),
            "xdp_cores": round(xdp_cores, 3),
            "net_usd_per_hour": round(benefit - cost, 4),
            "pays": bool(benefit > cost),
            "pool_egress_saved": round(1 - on["bytes"]["pool_to_switch"]
                                       / max(1, off["bytes"]["pool_to_switch"]), 4)}


def run(trace: Trace, cfg: SimConfig, requests: int | None = None, sharing: float = 0.0,
        log=None) -> dict:
    """Build the workload and simulate it. Result: config, model, requests, block_requests,
    distinct_blocks, seconds_simulated, pool_off / pool_on (hit_ratio per tier, bytes per link,
    remote_bytes, ttft_s p50/p99/mean, prefill_gpu_s_saved, gpu_s_waiting_for_kv, gpu_s_total,
    pool_link utilisation, incast degree at pool nodes, switch sampling), demotion (what value
    recovery saves), switch_benefit (break-even terms), wall_seconds (including the workload)."""
    t0 = time.perf_counter()
    wl = workload(trace, cfg, requests, sharing)
    if log:
        log(f"workload: {wl.n} requests, {len(wl.hash_ids)} block requests "
            f"({time.perf_counter() - t0:.1f}s)")
    res = simulate(wl, cfg, log)
    res["sharing"] = sharing
    res["wall_seconds"] = round(time.perf_counter() - t0, 2)
    return res

