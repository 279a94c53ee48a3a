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

import time
from dataclasses import asdict

import numpy as np

from .config import FRAME_OVERHEAD, GIB, MODELS, SimConfig
from .evaluate import GAMMA
from .tiers import (DRAM, HBM, POOL, RECOMPUTE, REPLICA, SWITCH, TIERS, UNSAMPLED, SwitchModel,
                    che_ttl, dram_hits, gaps)
from .trace import BLOCK_TOKENS, Trace
from .workload import Workload, mix, route, workload

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
    prev_n, next_n, ord_n, same_n = gaps(nk, t, end)
    T_hbm = che_ttl(node, next_n, nbytes, cfg.hbm_gib * GIB, cfg.nodes, span)
    in_hbm = prev_n < T_hbm[node]
    # pool nodes (write-through of computed blocks; LRU over the cluster's lookups)
    prev_g, next_g, ord_g, same_g = gaps(key, t, end)
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
    pool_of = (mix(key, 5) % np.uint64(cfg.pools)).astype(np.int64)
    in_dram = dram_hits(cfg, key, node, prev_n, next_n, nbytes, T_hbm, span, cfg.demote, orders)

    # the switch tier runs on a spatial sample of prefix trees when its stream is too long
    avail = in_hbm | in_dram | pool_has
    remote_n = int(((depth < _first_false(avail, wl.offsets)[req]) & ~in_hbm & ~in_dram).sum())
    rate = min(1.0, cfg.switch_budget / max(1, remote_n))
    sampled = np.ones(wl.n, bool)
    if rate < 1:
        sampled = mix(wl.hash_ids[wl.offsets[:-1]], 11) < np.uint64(rate * 2.0**64)
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
        dropped = dram_hits(cfg, key, node, prev_n, next_n, nbytes, T_hbm, span, "none", orders)
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

