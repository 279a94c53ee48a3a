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
  what the node tiers missed. Past ``switch_budget`` switch-bound fetches it runs on windows of
  the run at full size (testbed.sim.sample); what the switch serves is then estimated from the
  windows (x 1/R), everything else stays exact (``pool_on.switch.sample_rate`` says so).

KV codec (``--kv-codec``, testbed.sim.codec): blocks on the wire and in the switch and pool nodes
shrink by the codec's measured ratio; a fetched block is decoded on the node's CPU, overlapping the
fetch of later blocks. Costs and timing: see docs/sim.md. ``point`` computes one point for ``sim
run`` and ``sim sweep`` alike; result keys: see ``run`` and ``summary``.
"""
from __future__ import annotations

import time
from dataclasses import asdict
from types import SimpleNamespace

import numpy as np

from .codec import kv_codec, pipelined_load
from .config import FRAME_OVERHEAD, GIB, MODELS, SimConfig, default_requests, xdp_frame_cost
from .evaluate import GAMMA
from .sample import time_windows
from .tiers import (DRAM, HBM, POOL, RECOMPUTE, REPLICA, SWITCH, TIERS, UNSAMPLED, SwitchModel,
                    che_ttl, dram_hits, gaps, stable_order)
from .trace import BLOCK_TOKENS, Trace
from .workload import Workload, mix, route, workload


# ---- one run -----------------------------------------------------------------------------------
def _first_false(flags: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """Per request, the index (depth) of its first False flag, or its length."""
    false = np.flatnonzero(~flags)
    starts, lens = offsets[:-1], np.diff(offsets)
    i = np.searchsorted(false, starts)
    at = false[np.minimum(i, max(len(false) - 1, 0))] if len(false) else np.zeros(len(starts), int)
    found = (i < len(false)) & (at < offsets[1:])
    return np.where(found, at - starts, lens)


def _percentiles(x: np.ndarray) -> dict:
    if not len(x):
        return {"p50": None, "p99": None, "mean": None}
    p50, p99 = np.percentile(x, [50, 99])
    return {"p50": round(float(p50), 4), "p99": round(float(p99), 4),
            "mean": round(float(x.mean()), 4)}


def _incast(keys, times, windows) -> dict:
    """Concurrent fetches of one block at the pool nodes: fetches of a block that start within a
    block transfer time of the previous one form one incast event of that degree."""
    if not len(keys):
        return {"events": 0, "mean": 0.0, "p99": 0, "max": 0, "fetches_in_incast": 0.0}
    order = stable_order(keys)                  # fetches are in time order
    k, t, w = keys[order], times[order], windows[order]
    new = np.ones(len(k), bool)
    new[1:] = (k[1:] != k[:-1]) | (t[1:] - t[:-1] >= w[1:])
    ev = np.cumsum(new) - 1
    deg = np.bincount(ev)
    return {"events": int(len(deg)), "mean": round(float(deg.mean()), 4),
            "p99": int(np.percentile(deg, 99)), "max": int(deg.max()),
            "fetches_in_incast": round(float(deg[deg > 1].sum() / deg.sum()), 4)}


def _blocks(wl: Workload, cfg: SimConfig) -> SimpleNamespace:
    """Everything about every block request that does not depend on the tiers."""
    model = MODELS[cfg.model]
    nb, n, offsets = len(wl.hash_ids), wl.n, wl.offsets
    b = SimpleNamespace(nb=nb, n=n, offsets=offsets, key=wl.hash_ids)
    lens = np.diff(offsets)
    b.req = np.repeat(np.arange(n), lens)
    b.depth = np.arange(nb)
    b.depth -= np.repeat(offsets[:-1], lens)
    # every block holds BLOCK_TOKENS tokens but a prompt's partial last one (and any past its
    # end: one token)
    full = np.minimum(lens, wl.input_length // BLOCK_TOKENS)
    m = lens - full
    part = np.repeat(offsets[:-1] + full - (np.cumsum(m) - m), m) + np.arange(int(m.sum()))
    tokens = np.clip(wl.input_length[b.req[part]] - b.depth[part] * BLOCK_TOKENS, 1, BLOCK_TOKENS)
    b.nbytes = np.full(nb, float(cfg.block_bytes))
    b.nbytes[part] = np.ceil(tokens / cfg.block_tokens) * (cfg.block_tokens * cfg.kv_per_token)
    b.work = b.depth * GAMMA                               # prefill seconds: tokens x (1 +
    b.work += 1                                            # GAMMA x depth) / rate
    b.work *= BLOCK_TOKENS
    b.work[part] = tokens * (1 + GAMMA * b.depth[part])
    b.work /= model.prefill_tokens_per_s
    b.total_work = np.bincount(b.req, weights=b.work, minlength=n)
    b.t = np.repeat(wl.time, lens)
    b.span = max(float(wl.time[-1] - wl.time[0]), 1e-3)
    b.node = np.repeat(route(wl, cfg), lens)
    # on the wire, in the switch and the pool nodes: coded (16-bit bytes / the codec's ratio)
    b.codec = codec = kv_codec(cfg)
    b.ratio = codec["ratio"]
    b.coded = b.nbytes if b.ratio == 1 else b.nbytes / b.ratio
    b.chunks = np.full(nb, float(np.ceil(cfg.block_bytes / b.ratio / cfg.chunk_bytes)))
    b.chunks[part] = np.ceil(b.coded[part] / cfg.chunk_bytes)
    b.wire = b.chunks * FRAME_OVERHEAD                     # reply frames
    b.wire += b.coded
    # decoding a fetched block (16-bit bytes at the measured rate) and encoding a computed one
    b.decode_t = (b.nbytes / (codec["decode_gbytes_per_s"] * 1e9)
                  if codec["decode_gbytes_per_s"] else None)
    b.encode_t = (b.nbytes / (codec["encode_gbytes_per_s"] * 1e9)
                  if codec["encode_gbytes_per_s"] else None)
    b.get_per_chunk = cfg.chunk_bytes + FRAME_OVERHEAD     # GETs carry room for the reply
    b.link_bps = min(cfg.node_gbps, cfg.pool_gbps) * 1e9 / 8   # wire / link_bps: transfer time
    b.nsec = int(b.t.max()) + 1 if nb else 1
    cell = mix(b.key, 5)                                   # (pool node, second)
    cell %= np.uint64(cfg.pools)
    b.cell = cell.view(np.int64)
    b.cell *= b.nsec
    b.cell += b.t.astype(np.int64)
    return b


def _tiers(b, cfg: SimConfig, in_hbm, in_dram, pool_has) -> SimpleNamespace:
    """Where each block comes from apart from the switch (the same with the pool on and off)."""
    avail = in_hbm | in_dram | pool_has
    served = b.depth < np.repeat(_first_false(avail, b.offsets), np.diff(b.offsets))
    src = np.full(b.nb, RECOMPUTE, np.int8)
    src[served & in_dram] = DRAM
    src[served & in_hbm] = HBM
    remote = served & ~in_hbm & ~in_dram
    src[remote] = POOL
    ri = np.flatnonzero(remote)
    recomputed = np.flatnonzero(~served)
    decode_t = None
    if b.decode_t is not None:
        decode_t = np.zeros(b.nb)
        decode_t[ri] = b.decode_t[ri]
    return SimpleNamespace(
        src=src, ri=ri, recomputed=recomputed, decode_t=decode_t,
        saved_work=b.total_work - np.bincount(b.req[recomputed], weights=b.work[recomputed],
                                              minlength=b.n),
        pool_load=np.bincount(b.cell[ri], weights=b.wire[ri], minlength=cfg.pools * b.nsec),
        dram_t=np.where(src == DRAM, b.nbytes / (cfg.pcie_gbps * 1e9 / 8), 0.0))


def simulate(wl: Workload, cfg: SimConfig, log=None, xdp: dict | None = None) -> dict:
    """Run the model on a workload; returns the result dict (pool on and off). ``xdp``: the
    data plane's cost per frame as the caller resolved it (``xdp_frame_cost``), so that what a
    result records is what priced it; None: resolved here."""
    t_start = time.perf_counter()
    b = _blocks(wl, cfg)
    key, t, node, nbytes, span = b.key, b.t, b.node, b.nbytes, b.span
    end = float(wl.time[-1]) + 1e-9

    prev_g, next_g, ord_g, same_g = gaps(key, t, end)
    # node tiers (blocks numbered densely first, so that block x node packs into few bits)
    dense = np.empty(b.nb, np.int64)
    dense[ord_g] = np.concatenate([[0], np.cumsum(~same_g)])
    dense *= cfg.nodes
    dense += node
    prev_n, next_n, ord_n, same_n = gaps(dense, t, end)
    del dense
    T_hbm = che_ttl(node, next_n, nbytes, cfg.hbm_gib * GIB, cfg.nodes, span)
    in_hbm = prev_n < T_hbm[node]
    # pool nodes (write-through of computed blocks; LRU over the cluster's lookups)
    orders = (ord_n, same_n, ord_g, same_g)
    if cfg.preload:
        pool_has = np.ones(b.nb, bool)
    elif cfg.pool_gib is None:
        pool_has = (prev_g > 0) & np.isfinite(prev_g)
    else:
        zero = np.zeros(b.nb, np.int64)
        T_pool = che_ttl(zero, next_g, b.coded, cfg.pool_gib * GIB * cfg.pools, 1, span)[0]
        pool_has = (prev_g > 0) & (prev_g < T_pool)
    in_dram = dram_hits(cfg, key, node, prev_n, next_n, nbytes, T_hbm, span, cfg.demote, orders)
    dropped = dram_hits(cfg, key, node, prev_n, next_n, nbytes, T_hbm, span, "none", orders)
    distinct = int(b.nb - same_g.sum())
    del prev_n, next_n, ord_n, same_n, prev_g, next_g, ord_g, same_g, orders, node, b.node
    tiers = _tiers(b, cfg, in_hbm, in_dram, pool_has)

    # the switch tier runs on windows of the run when its stream is too long (sample.py)
    sampled = time_windows(wl.time, b.t[tiers.ri], b.nsec, cfg.switch_budget)
    res = {"config": asdict(cfg), "model": asdict(MODELS[cfg.model]),
           "kv_codec": b.codec, "requests": int(wl.n),
           "block_requests": int(b.nb), "distinct_blocks": distinct,
           "seconds_simulated": round(span, 3), "resampled": wl.resampled}
    base = _serve(cfg, b, tiers, sampled, switch=False)
    if log:
        log(f"node tiers and pool off: {time.perf_counter() - t_start:.1f}s; the switch pool "
            "on ...")
    on = _serve(cfg, b, tiers, sampled, switch=True)
    res["pool_off"], res["pool_on"] = base, on
    # value recovery: the same run with HBM evictions dropped
    if cfg.demote != "none":
        nodrop = _serve(cfg, b, _tiers(b, cfg, in_hbm, dropped, pool_has), sampled,
                        switch=False, light=True)
        res["demotion"] = {
            "mode": cfg.demote,
            "dram_hit_ratio": base["hit_ratio"]["dram"],
            "prefill_gpu_s_saved": round(base["prefill_gpu_s_saved"]
                                         - nodrop["prefill_gpu_s_saved"], 2),
            "remote_bytes_saved": int(nodrop["remote_bytes"] - base["remote_bytes"]),
            "ttft_p50_without": nodrop["ttft_s"]["p50"],
            "ttft_p50_with": base["ttft_s"]["p50"]}
    res["switch_benefit"] = _benefit(cfg, base, on, span, xdp or xdp_frame_cost(cfg))
    res["wall_seconds"] = round(time.perf_counter() - t_start, 2)
    return res


def _switch(cfg, b, tiers, smp) -> tuple:
    """Run the switch tier on the switch-bound fetches (all, or the sample's windows, each from
    the start of its warm-up): the counted fetches' indices, their outcomes and what to
    report."""
    ri = tiers.ri[smp.sim]
    cap = cfg.switch_gib * GIB * b.ratio / cfg.block_bytes    # coded blocks it holds
    headroom = cap / 16 if cfg.headroom is None else cfg.headroom * cap
    sw = SwitchModel(cfg.switch_policy, cap, headroom, cfg.interval, cfg.coalesce)
    out = np.empty(len(ri), np.int8)
    for j in np.unique(smp.window_of):
        at = np.flatnonzero(smp.window_of == j)
        x = ri[at]
        out[at] = sw.run(b.key[x], b.t[x] / cfg.clock_scale, b.nbytes[x] / cfg.block_bytes,
                         b.wire[x] / (b.link_bps * cfg.clock_scale))
    info = {"sample_rate": round(smp.rate, 6), "switch_bound_fetches": len(tiers.ri),
            "simulated_fetches": len(ri), "counted_fetches": int(smp.counted.sum()),
            "policy_steps": sw.steps, "capacity_blocks": round(cap, 2)}
    if smp.windows:
        info["windows"] = smp.windows
    return ri[smp.counted], out[smp.counted], smp.rate, info


def _request_times(b, fetch_t, saved_work, decode_t=None) -> tuple:
    """Per request: time loading its prefix and time computing, given each block's fetch time
    and, with a codec, its decode time (overlapping later blocks' fetches:
    ``codec.pipelined_load``); a node recomputes its prefix instead when loading it would take
    longer. With a codec, also the CPU seconds spent decoding (0 where it recomputes)."""
    if decode_t is None:
        fetch_req = np.bincount(b.req, weights=fetch_t, minlength=b.n)
    else:
        fetch_req = pipelined_load(b.offsets, fetch_t, decode_t)
    load_t = np.minimum(fetch_req, saved_work)
    compute_t = b.total_work - saved_work + np.where(fetch_req > saved_work, saved_work, 0.0)
    if decode_t is None:
        return load_t, compute_t
    decode_cpu = np.bincount(b.req, weights=decode_t, minlength=b.n)
    return load_t, compute_t, np.where(fetch_req > saved_work, 0.0, decode_cpu)


class _Estimate:
    """Sums and percentiles over every request of a figure known exactly for every request
    without its own switch hits (``base``: its blocks from the pool nodes, at the pool links'
    load with or without the switch) and, with them, only for the requests whose prefix trees
    the switch tier simulated (``own``, rate R of the requests). A sum is the exact sum of
    ``base`` plus the sampled requests' difference / R; the TTFT distribution is ``base``'s
    over all requests with the sampled requests' own-hit shift weighted 1/R. Unsampled (R = 1),
    both are exact. (Until #25 every figure came from the sampled requests alone, the pool-off
    ones too, so two sample rates of one point differed by 2x in GPU-seconds saved.)"""

    def __init__(self, smp, base, own):
        self.sampled, self.base, self.own = smp.sampled, base, own
        sampled = smp.sampled
        self.rate = float(sampled.mean())

    def total(self, f) -> float:
        b, o, s = f(self.base), f(self.own), self.sampled
        return float(b.sum() + (o[s] - b[s]).sum() / self.rate)

    def percentiles(self) -> dict:
        b = self.base[0] + self.base[1]
        if self.rate >= 1 or self.own is self.base:
            return _percentiles((self.own[0] + self.own[1]) if self.rate >= 1 else b)
        o, s = self.own[0] + self.own[1], self.sampled
        vals = np.concatenate([b, b[s], o[s]])
        w = np.concatenate([np.ones(len(b)), np.full(s.sum(), -1 / self.rate),
                            np.full(s.sum(), 1 / self.rate)])
        u, inv = np.unique(vals, return_inverse=True)
        cdf = np.maximum.accumulate(np.cumsum(np.bincount(inv, weights=w)) / len(b))
        pick = [float(u[min(len(u) - 1, np.searchsorted(cdf, q - 1e-12))]) for q in (0.5, 0.99)]
        return {"p50": round(pick[0], 4), "p99": round(pick[1], 4),
                "mean": round(self.total(lambda t: t[0] + t[1]) / len(b), 4)}


def _less(load: np.ndarray, cut: np.ndarray, smp, groups: int) -> np.ndarray:
    """Per (group, second) ``load`` less what the switch takes off it (``cut``, counted in the
    sample's windows): exactly in the seconds inside a window and elsewhere by the windows'
    fractional cut of the group's load."""
    if smp.exact:
        return np.maximum(load - cut, 0.0)
    load, cut = load.reshape(groups, -1), cut.reshape(groups, -1)
    inside = smp.window_secs[:load.shape[1]]
    frac = cut[:, inside].sum(1) / np.maximum(load[:, inside].sum(1), 1e-300)
    out = load * (1 - np.minimum(frac, 1.0))[:, None]
    out[:, inside] = np.maximum(load[:, inside] - cut[:, inside], 0.0)
    return out.reshape(-1)


def _serve(cfg, b, tiers, sampled, switch: bool, light: bool = False) -> dict:
    """Which tier serves every block, and what that costs, with the switch pool on or off.
    With the switch sampled at rate R, a sum over what it serves is the sampled sum / R, and a
    sum over what the pool nodes serve is the exact sum over all remote blocks minus that."""
    model = MODELS[cfg.model]
    node_bps, pool_bps = cfg.node_gbps * 1e9 / 8, cfg.pool_gbps * 1e9 / 8
    ri, src, pool_load = tiers.ri, tiers.src, tiers.pool_load
    si, hit_w, sw, rate = ri[:0], np.zeros(0), {}, 1.0
    if switch and len(ri):
        sri, out, rate, sw = _switch(cfg, b, tiers, sampled)
        src = src.copy()
        src[ri] = UNSAMPLED
        src[sri] = out
        si = sri[out != POOL]                               # served by the switch
        hit_w = np.full(len(si), 1 / rate)
        pool_load = _less(pool_load, np.bincount(b.cell[si], weights=b.wire[si],
                                                 minlength=len(pool_load)), sampled, cfg.pools)
    counts = np.bincount(src, minlength=len(TIERS) + 1).astype(float)
    counts[SWITCH] = hit_w[src[si] == SWITCH].sum()
    counts[REPLICA] = hit_w[src[si] == REPLICA].sum()
    counts[POOL] = len(ri) - counts[SWITCH] - counts[REPLICA]
    hit = {name: round(float(counts[code] / max(1, b.nb)), 6) for code, name in enumerate(TIERS)}
    comp = tiers.recomputed if cfg.write_through and not cfg.preload else ri[:0]
    hdr = b.chunks[comp] * FRAME_OVERHEAD
    remote_wire, remote_get = b.wire[ri].sum(), b.chunks[ri].sum() * b.get_per_chunk
    sw_wire = (b.wire[si] * hit_w).sum()
    sw_get = (b.chunks[si] * hit_w).sum() * b.get_per_chunk
    links = {
        "dram_to_hbm": float(b.nbytes[src == DRAM].sum()),
        "switch_to_nodes": remote_wire + hdr.sum(),
        "nodes_to_switch": remote_get + b.wire[comp].sum(),
        "pool_to_switch": remote_wire - sw_wire + hdr.sum(),
        "switch_to_pool": remote_get - sw_get + b.wire[comp].sum(),
    }
    links = {k: int(round(v)) for k, v in links.items()}
    # pool-link utilisation per pool node and second -> queueing on pool fetches
    rho = pool_load / pool_bps
    fetch_t = tiers.dram_t.copy()
    hop = cfg.hop_us * 1e-6 if switch else 0.0
    fetch_t[ri] = (b.wire[ri] / (min(node_bps, pool_bps) * (1 - np.minimum(rho[b.cell[ri]], 0.98)))
                   + hop)
    saved_work = tiers.saved_work
    base = _request_times(b, fetch_t, saved_work, tiers.decode_t)  # all from the pool nodes
    if len(si):
        fetch_t[si] = b.wire[si] / node_bps + cfg.hop_us * 1e-6
        own = _request_times(b, fetch_t, saved_work, tiers.decode_t)  # the sampled requests
    else:
        own = base
    est = _Estimate(sampled, base, own)
    out = {
        "hit_ratio": hit,
        "bytes": links,
        "remote_bytes": int(round(b.coded[ri].sum())),         # coded, with a codec
        "ttft_s": est.percentiles(),
        "prefill_gpu_s_saved": round(est.total(lambda t: b.total_work - t[1])
                                     * model.gpus_per_node, 2),
        "gpu_s_waiting_for_kv": round(est.total(lambda t: t[0]) * model.gpus_per_node, 2),
        "gpu_s_total": round(est.total(lambda t: t[0] + t[1]) * model.gpus_per_node, 2),
    }
    if tiers.decode_t is not None:          # node CPU: decoding fetched, encoding computed blocks
        out["kv_codec_cpu_s"] = {
            "decode": round(est.total(lambda t: t[2]), 2),
            "encode": round(float(b.encode_t[comp].sum()) if b.encode_t is not None else 0.0, 2)}
    if light:
        return out
    out["pool_link"] = {"peak_utilisation": round(float(rho.max()) if len(rho) else 0.0, 4),
                        "mean_utilisation": round(float(rho.mean()) if len(rho) else 0.0, 4),
                        "overloaded_share": round(float((rho >= 1).mean()) if len(rho) else 0.0,
                                                  4)}
    fetches = ri[src[ri] == POOL]
    out["incast"] = _incast(b.key[fetches], b.t[fetches], b.wire[fetches] / b.link_bps)
    if switch:
        # data-plane runs: a hit is one (the GET, answered in place); a fetch from a pool node,
        # a coalesced one and a write-through PUT are two (request in, reply or ack back)
        hits = si[src[si] == SWITCH]
        runs = (np.bincount(b.cell[ri] % b.nsec, weights=2 * b.chunks[ri], minlength=b.nsec)
                + np.bincount(b.cell[comp] % b.nsec, weights=2 * b.chunks[comp], minlength=b.nsec))
        runs = _less(runs, np.bincount(b.cell[hits] % b.nsec, weights=b.chunks[hits],
                                       minlength=b.nsec), sampled, 1)
        out["switch"] = {**sw, "frames_per_s": round(float(runs.sum()) / b.span, 1),
                         "frames_per_s_p99": round(float(np.percentile(runs, 99)), 1)}
    else:
        out["switch"] = {}
    return out


def _benefit(cfg: SimConfig, off: dict, on: dict, span: float, xdp: dict) -> dict:
    """What the switch pool saves and costs per hour of this workload, in dollars. The data
    plane's CPU (``xdp``: its cost per frame) is charged for the frames it handles on average;
    ``xdp_cores_p99`` is what a switch needs in its busiest 1% of seconds."""
    hours = span / 3600
    gpu_s = off["gpu_s_total"] - on["gpu_s_total"]
    benefit = gpu_s / 3600 * cfg.gpu_hour_usd / hours
    per_core = 1e9 / xdp["ns_per_frame"]
    xdp_cores = on["switch"].get("frames_per_s", 0.0) / per_core
    cost = (cfg.switch_gib * cfg.switch_gib_hour_usd
            + (cfg.switchd_cores + xdp_cores) * cfg.core_hour_usd)
    codec = {}
    if "kv_codec_cpu_s" in on:          # the nodes' decoding CPU the switch adds (or saves)
        cpu_on, cpu_off = on["kv_codec_cpu_s"], off["kv_codec_cpu_s"]
        cost += (cpu_on["decode"] - cpu_off["decode"]) / span * cfg.core_hour_usd
        codec = {"decode_cores_off": round(cpu_off["decode"] / span, 3),
                 "decode_cores_on": round(cpu_on["decode"] / span, 3),
                 "encode_cores": round(cpu_on["encode"] / span, 3)}
    return {"gpu_s_saved_per_hour": round(gpu_s / hours, 2),
            "benefit_usd_per_hour": round(benefit, 4),
            "cost_usd_per_hour": round(cost, 4),
            "xdp_cores": round(xdp_cores, 3),
            "xdp_cores_p99": round(on["switch"].get("frames_per_s_p99", 0.0) / per_core, 3),
            "xdp": xdp,
            "net_usd_per_hour": round(benefit - cost, 4),
            "pays": bool(benefit > cost),
            "pool_egress_saved": round(1 - on["bytes"]["pool_to_switch"]
                                       / max(1, off["bytes"]["pool_to_switch"]), 4),
            **({"kv_codec_cores": codec} if codec else {})}


def summary(res: dict) -> dict:
    """The figures of one point (a row of the sweep; ``sim run`` prints and writes the same)."""
    on, off, b = res["pool_on"], res["pool_off"], res["switch_benefit"]
    c = res["config"]
    return {"nodes": c["nodes"], "pools": c["pools"], "switch_gib": c["switch_gib"],
            "kv_codec": c.get("kv_codec", "none"),
            "sharing": res["sharing"], "skew": c["skew"], "requests": res["requests"],
            "switch_hit_ratio": round(on["hit_ratio"]["switch"]
                                      + on["hit_ratio"]["switch_replica"], 6),
            "node_tier_hit_ratio": round(off["hit_ratio"]["hbm"] + off["hit_ratio"]["dram"], 6),
            "pool_egress_saved": b["pool_egress_saved"],
            "peak_pool_link_off": off["pool_link"]["peak_utilisation"],
            "peak_pool_link_on": on["pool_link"]["peak_utilisation"],
            "incast_max_off": off["incast"]["max"],
            "ttft_p50_off": off["ttft_s"]["p50"], "ttft_p50_on": on["ttft_s"]["p50"],
            "ttft_p99_off": off["ttft_s"]["p99"], "ttft_p99_on": on["ttft_s"]["p99"],
            **{k: b[k] for k in ("gpu_s_saved_per_hour", "benefit_usd_per_hour",
                                 "cost_usd_per_hour", "net_usd_per_hour", "pays", "xdp_cores",
                                 "xdp_cores_p99")},
            "sample_rate": on["switch"].get("sample_rate", 1.0)}


def point(trace: Trace, cfg: SimConfig, requests: int | None = None, sharing: float = 0.0,
          log=None, xdp: dict | None = None) -> dict:
    """One point of the model, as ``sim run`` and every point of ``sim sweep`` compute it:
    ``requests`` resampled from the trace with ``sharing`` (None: ``default_requests``, 200 per
    node up to 200,000; 0: the trace's own requests, at the cluster's arrival rate), simulated
    with the switch pool off and on. Result: config, model, requests, block_requests,
    distinct_blocks, seconds_simulated, pool_off / pool_on (hit_ratio per tier, bytes per link,
    remote_bytes, ttft_s p50/p99/mean, prefill_gpu_s_saved, gpu_s_waiting_for_kv, gpu_s_total,
    pool_link utilisation, incast degree at pool nodes, switch sampling and frames), demotion
    (what value recovery saves), switch_benefit (break-even terms), sharing, point (``summary``),
    wall_seconds (including the workload). ``xdp``: the data plane's cost per frame a sweep
    resolved once for all its points (None: resolved here, before any work)."""
    t0 = time.perf_counter()
    xdp = xdp or xdp_frame_cost(cfg)        # fail before any work if it cannot be priced
    codec = kv_codec(cfg)
    if log:
        log(f"data plane: {xdp['ns_per_frame']} ns/frame from {xdp['source']}"
            + (f"; {xdp['fallback']}" if "fallback" in xdp else ""))
        log(f"KV codec {codec['name']}: {codec['source']}")
    if requests is None:
        requests = default_requests(cfg.nodes)
    if log:
        log(f"{cfg.nodes} nodes: the workload ...")
    wl = workload(trace, cfg, requests or None, sharing)
    if log:
        log(f"workload: {wl.n} requests, {len(wl.hash_ids)} block requests "
            f"({time.perf_counter() - t0:.1f}s)")
    res = simulate(wl, cfg, log, xdp)
    res["sharing"] = sharing
    res["wall_seconds"] = round(time.perf_counter() - t0, 2)
    res["point"] = {**summary(res), "wall_seconds": res["wall_seconds"]}
    return res
