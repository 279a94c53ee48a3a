"""`testbed sim fabric`: the cluster model on a fabric of switches (issue 43): when does a second
level, a kvswitch in front of the pool nodes (the "agg" switch) on top of one per rack, pay?
Sweeps racks x hosts per rack x uplink oversubscription x sharing and compares the four modes
of `bench serve --racks` at each point: bridge (no kvswitch), rack (one per rack switch),
pool-side (the agg switch alone), fabric (both). JSON and a plot.

Assumptions (kept simple; docs/sim.md "A fabric of switches"):
- Requests, routing and the node tiers are the cluster model's (testbed.sim.workload and the
  node-tier pass of testbed.sim.model.simulate: HBM and DRAM by Che's approximation, pool
  nodes holding what was computed before), at a small request count (``requests_per_node``,
  16 by default) so a 1,024-node point runs in well under a minute; routing is random, so a
  rack's hosts share nothing a random pick of hosts would not. Hosts h are in rack h // H.
- Every switch is tiers.SwitchModel (switchd's admission loop over the data plane's model),
  run exactly (no time windows): a rack switch sees its hosts' fetches the node tiers missed;
  the agg switch sees every host's (pool-side) or only the rack switches' misses (fabric).
  Each has ``rack_gib`` / ``agg_gib`` of memory, switchd's default fill headroom and interval;
  concurrent misses of a block within its transfer time are held (coalescing at each level).
  With no rack switch, a second host of one rack is not held at the agg switch (one waiter a
  downlink port, as the data plane keeps): that fetch goes to the pool node too.
- Links: hosts at ``node_gbps``, pool nodes at ``pool_gbps``, a rack's uplink at
  H x node_gbps / oversub. A fetch takes its frames' bytes over the slowest link it crosses,
  stretched by 1/(1 - rho) of the busiest shared link it crosses in that second (the pool
  node's egress, the rack's uplink into the rack; rho capped at 0.98), as the cluster model
  queues on pool links; plus ``hop_us`` per kvswitch it passes. Writes go up the uplink and
  are not queued (as in the cluster model). Oversubscription changes only the timing.
- Bytes: pool egress (replies and write acks) per pool node, the uplinks' bytes into the racks
  (replies from above and write acks), both per second of the run. A hit at the agg switch
  still crosses the uplink: the second level takes nothing off the uplinks, only the racks do.
- Cost, per hour, as the cluster model prices a switch (config.SimConfig): each box running
  switchd its memory (``switch_gib_hour_usd``) and switchd's core, plus the data plane's mean
  cores (frames a second x ns per frame, measured: config.xdp_frame_cost); a hit is one run of
  the program, a miss, a held GET or a write passing it two. Boxes: R rack switches, 1 agg.
  The benefit is GPU time (prefill and waiting for KV) saved against the bridge, priced at
  ``gpu_hour_usd``; the second level's is the fabric's against rack's, and its cost the agg
  box's. TTFT has no queueing for the GPU, as in the cluster model.
"""
from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from ..results import write_json
from .config import FRAME_OVERHEAD, GIB, MODELS, SimConfig, xdp_frame_cost
from .fabric_serve_model import FABRIC_MODES, check_shape
from .model import _blocks, _percentiles, _request_times, _tiers
from .sweep import break_even
from .tiers import POOL, REPLICA, SWITCH, SwitchModel, che_ttl, dram_hits, gaps
from .trace import load_trace
from .workload import workload

RACK, AGG, FROM_POOL = 0, 1, 2                     # where a remote fetch is served
REQUESTS_PER_NODE, MAX_REQUESTS = 16, 16_384
RACKS, HOSTS, OVERSUB, SHARING = (4, 8, 16, 32), (8, 16, 32), (1.0, 2.0, 4.0), (0.0, 0.5, 0.9)


def node_tiers(wl, cfg: SimConfig):
    """Every block request's facts and where the node tiers and pool nodes serve it from: the
    node-tier pass of testbed.sim.model.simulate, through the same functions."""
    b = _blocks(wl, cfg)
    end = float(wl.time[-1]) + 1e-9
    prev_g, next_g, ord_g, same_g = gaps(b.key, b.t, end)
    dense = np.empty(b.nb, np.int64)
    dense[ord_g] = np.concatenate([[0], np.cumsum(~same_g)])
    dense *= cfg.nodes
    dense += b.node
    prev_n, next_n, ord_n, same_n = gaps(dense, b.t, end)
    T_hbm = che_ttl(b.node, next_n, b.nbytes, cfg.hbm_gib * GIB, cfg.nodes, b.span)
    in_hbm = prev_n < T_hbm[b.node]
    if cfg.preload:
        pool_has = np.ones(b.nb, bool)
    elif cfg.pool_gib is None:
        pool_has = (prev_g > 0) & np.isfinite(prev_g)
    else:
        T = che_ttl(np.zeros(b.nb, np.int64), next_g, b.coded, cfg.pool_gib * GIB * cfg.pools,
                    1, b.span)[0]
        pool_has = (prev_g > 0) & (prev_g < T)
    in_dram = dram_hits(cfg, b.key, b.node, prev_n, next_n, b.nbytes, T_hbm, b.span,
                        cfg.demote, (ord_n, same_n, ord_g, same_g))
    return b, _tiers(b, cfg, in_hbm, in_dram, pool_has)


def _switch(cfg: SimConfig, b, idx: np.ndarray, gib: float) -> tuple[np.ndarray, int]:
    """SwitchModel outcomes of the fetches ``idx`` (in time order) at a switch of ``gib``."""
    cap = gib * GIB * b.ratio / cfg.block_bytes
    head = cap / 16 if cfg.headroom is None else cfg.headroom * cap
    sw = SwitchModel(cfg.switch_policy, cap, head, cfg.interval, cfg.coalesce)
    out = sw.run(b.key[idx], b.t[idx], b.nbytes[idx] / cfg.block_bytes,
                 b.wire[idx] / b.link_bps)
    return out, sw.steps


def unheld_at_agg(keys: np.ndarray, racks: np.ndarray, out: np.ndarray) -> np.ndarray:
    """Outcomes with a held fetch (REPLICA) whose leader (the block's last miss) came from the
    same rack made a miss (POOL): with no rack switch the agg switch holds one GET a port."""
    order = np.argsort(keys, kind="stable")
    o, rk = out[order], racks[order]
    # by block, in time order; a block's first fetch is a miss, so its leader is its own
    lead = np.maximum.accumulate(np.where(o == POOL, np.arange(len(o)), -1))
    same = (o == REPLICA) & (lead >= 0) & (rk == rk[np.maximum(lead, 0)])
    new = out.copy()
    new[order[same]] = POOL
    return new


def levels(cfg: SimConfig, b, tiers, H: int, rack_gib: float, agg_gib: float) -> dict:
    """Per mode, the switch outcomes of every remote fetch (tiers.ri) at each level it reaches
    (-1: not there) and where it is served; independent of the uplinks' rate."""
    ri = tiers.ri
    rack = b.node[ri] // H
    at_rack = np.full(len(ri), -1, np.int8)
    steps = 0
    for r in np.unique(rack):
        sel = np.flatnonzero(rack == r)
        at_rack[sel], s = _switch(cfg, b, ri[sel], rack_gib)
        steps += s
    agg_all, s1 = _switch(cfg, b, ri, agg_gib)
    agg_all = unheld_at_agg(b.key[ri], rack, agg_all)
    missed = np.flatnonzero(at_rack == POOL)
    agg_fab = np.full(len(ri), -1, np.int8)
    agg_fab[missed], s2 = _switch(cfg, b, ri[missed], agg_gib)
    none = np.full(len(ri), -1, np.int8)
    out = {}
    for mode, r_out, a_out in (("bridge", none, none), ("rack", at_rack, none),
                               ("pool-side", none, agg_all), ("fabric", at_rack, agg_fab)):
        served = np.full(len(ri), FROM_POOL, np.int8)
        served[(a_out == SWITCH) | (a_out == REPLICA)] = AGG
        served[(r_out == SWITCH) | (r_out == REPLICA)] = RACK
        out[mode] = (r_out, a_out, served)
    return {"modes": out, "rack": rack, "policy_steps": steps + s1 + s2}


def _per_sec(group: np.ndarray, sec: np.ndarray, w: np.ndarray, groups: int, nsec: int):
    return np.bincount(group * nsec + sec, weights=w, minlength=groups * nsec).reshape(groups,
                                                                                       nsec)


def evaluate(cfg: SimConfig, b, tiers, lv: dict, mode: str, H: int, oversub: float,
             xdp_ns: float, rack_gib: float, agg_gib: float) -> dict:
    """One mode at one oversubscription: TTFT, GPU-seconds, hit ratio per level, bytes,
    data-plane cores and cost."""
    r_out, a_out, served = lv["modes"][mode]
    R = cfg.nodes // H
    ri, rack, nsec, span = tiers.ri, lv["rack"], b.nsec, b.span
    node_bps, pool_bps = cfg.node_gbps * 1e9 / 8, cfg.pool_gbps * 1e9 / 8
    up_bps = H * node_bps / oversub
    wire, chunks = b.wire[ri], b.chunks[ri]
    sec = (b.cell % nsec)
    pool_of = b.cell // nsec
    up = served != RACK
    from_pool = served == FROM_POOL
    comp = tiers.recomputed if cfg.write_through and not cfg.preload else ri[:0]
    acks = b.chunks[comp] * FRAME_OVERHEAD
    comp_rack = b.node[comp] // H
    up_load = _per_sec(rack[up], sec[ri][up], wire[up], R, nsec)
    pool_load = _per_sec(pool_of[ri][from_pool], sec[ri][from_pool], wire[from_pool],
                         cfg.pools, nsec)
    rho_up = np.minimum(up_load / up_bps, 0.98)
    rho_pool = np.minimum(pool_load / pool_bps, 0.98)
    rack_on, agg_on = mode in ("rack", "fabric"), mode in ("pool-side", "fabric")
    hop = cfg.hop_us * 1e-6
    fetch_t = tiers.dram_t.copy()
    s_ri, p_ri = sec[ri], pool_of[ri]
    t = np.where(served == RACK, wire / node_bps, 0.0)
    q_up = rho_up[rack, s_ri]
    t = np.where(served == AGG, wire / (min(node_bps, up_bps) * (1 - q_up)), t)
    q = np.maximum(q_up, rho_pool[p_ri, s_ri])
    t = np.where(from_pool, wire / (min(node_bps, up_bps, pool_bps) * (1 - q)), t)
    t += hop * (rack_on + (agg_on & up))
    fetch_t[ri] = t
    load_t, compute_t = _request_times(b, fetch_t, tiers.saved_work)
    gpus = MODELS[cfg.model].gpus_per_node
    # bytes: into each rack over its uplink, out of each pool node
    uplink = (np.bincount(rack[up], weights=wire[up], minlength=R)
              + np.bincount(comp_rack, weights=acks, minlength=R))
    egress = (np.bincount(p_ri[from_pool], weights=wire[from_pool], minlength=cfg.pools)
              + np.bincount(pool_of[comp], weights=acks, minlength=cfg.pools))
    # the data plane: runs of the program per box and second
    hits = {}
    cores, cores_p99, boxes, mem = 0.0, 0.0, 0, 0.0
    for name, out, seen, box, n_box, gib in (
            ("rack", r_out, np.ones(len(ri), bool), rack, R, rack_gib),
            ("pool-side", a_out, a_out >= 0, np.zeros(len(ri), np.int64), 1, agg_gib)):
        if not (rack_on if name == "rack" else agg_on):
            hits[name] = None
            continue
        c = chunks[seen]
        o = out[seen]
        hits[name] = round(float(c[o == SWITCH].sum() / max(1.0, c.sum())), 4)
        runs = np.where(o == SWITCH, 1.0, 2.0) * c
        wbox = comp_rack if name == "rack" else np.zeros(len(comp), np.int64)
        per = (_per_sec(box[seen], s_ri[seen], runs, n_box, nsec)
               + _per_sec(wbox, sec[comp], 2.0 * b.chunks[comp], n_box, nsec))
        cores += float(per.sum()) / span * xdp_ns / 1e9
        cores_p99 += float(np.percentile(per, 99, axis=1).sum()) * xdp_ns / 1e9
        boxes += n_box
        mem += n_box * gib
    cost = (mem * cfg.switch_gib_hour_usd + boxes * cfg.switchd_cores * cfg.core_hour_usd
            + cores * cfg.core_hour_usd)
    ttft = _percentiles(load_t + compute_t)
    return {"ttft_p50_s": ttft["p50"], "ttft_p99_s": ttft["p99"],
            "gpu_s_total": round(float((load_t + compute_t).sum()) * gpus, 2),
            "hit_ratio": hits,
            "served_share": {k: round(float((served == v).mean()) if len(ri) else 0.0, 4)
                             for k, v in (("rack", RACK), ("pool-side", AGG),
                                          ("pool", FROM_POOL))},
            "pool_egress_bytes_per_s": round(float(egress.sum()) / span, 1),
            "hottest_pool_egress_bytes_per_s": round(float(egress.max()) / span, 1),
            "uplink_bytes_per_s": round(float(uplink.sum()) / span, 1),
            "busiest_uplink_bytes_per_s": round(float(uplink.max()) / span, 1),
            "peak_uplink_utilisation": round(float((up_load / up_bps).max()), 4),
            "peak_pool_link_utilisation": round(float((pool_load / pool_bps).max()), 4),
            "boxes": boxes, "xdp_cores": round(cores, 3), "xdp_cores_p99": round(cores_p99, 3),
            "cost_usd_per_hour": round(cost, 4)}


def _gain(cfg: SimConfig, base: dict, more: dict, span: float) -> dict:
    """What ``more`` (a mode) adds over ``base``: bytes saved, GPU time saved and its price,
    the boxes and cores it adds, net dollars an hour."""
    gpu_s = base["gpu_s_total"] - more["gpu_s_total"]
    benefit = gpu_s / span * cfg.gpu_hour_usd        # GPU-s per s = GPU-h per h
    cost = more["cost_usd_per_hour"] - base["cost_usd_per_hour"]
    saved = (lambda k: round(1 - more[k] / base[k], 4) if base[k] else 0.0)
    return {"pool_egress_saved": saved("pool_egress_bytes_per_s"),
            "pool_egress_saved_bytes_per_s": round(base["pool_egress_bytes_per_s"]
                                                   - more["pool_egress_bytes_per_s"], 1),
            "uplink_saved": saved("uplink_bytes_per_s"),
            "uplink_saved_bytes_per_s": round(base["uplink_bytes_per_s"]
                                              - more["uplink_bytes_per_s"], 1),
            "ttft_p50_s": [base["ttft_p50_s"], more["ttft_p50_s"]],
            "gpu_s_saved_per_hour": round(gpu_s / span * 3600, 2),
            "benefit_usd_per_hour": round(benefit, 4),
            "boxes": more["boxes"] - base["boxes"],
            "xdp_cores": round(more["xdp_cores"] - base["xdp_cores"], 3),
            "cost_usd_per_hour": round(cost, 4),
            "net_usd_per_hour": round(benefit - cost, 4), "pays": bool(benefit > cost)}


def fabric_point(trace, racks: int, hosts_per_rack: int, oversubs, sharing: float,
                 requests_per_node: int = REQUESTS_PER_NODE, max_requests: int = MAX_REQUESTS,
                 rack_gib: float = 64.0, agg_gib: float = 64.0, xdp: dict | None = None,
                 **cfg_kw) -> list[dict]:
    """The four modes at R racks x H hosts and ``sharing``, one row per oversubscription: each
    mode's figures, and what the agg switch adds on top of the racks (``second_level``), the
    racks add over the bridge (``rack_level``) and the agg switch alone adds
    (``pool_side_alone``)."""
    check_shape(racks, hosts_per_rack, min(oversubs))
    t0 = time.perf_counter()
    cfg = SimConfig(nodes=racks * hosts_per_rack, switch_gib=rack_gib, **cfg_kw)
    xdp = xdp or xdp_frame_cost(cfg)
    n = min(max_requests, requests_per_node * cfg.nodes)
    wl = workload(trace, cfg, n, sharing)
    b, tiers = node_tiers(wl, cfg)
    lv = levels(cfg, b, tiers, hosts_per_rack, rack_gib, agg_gib)
    rows = []
    for o in oversubs:
        modes = {m: evaluate(cfg, b, tiers, lv, m, hosts_per_rack, o, xdp["ns_per_frame"],
                             rack_gib, agg_gib) for m in FABRIC_MODES}
        rows.append({"racks": racks, "hosts_per_rack": hosts_per_rack, "nodes": cfg.nodes,
                     "oversub": o, "sharing": sharing, "requests": int(wl.n),
                     "remote_fetches": int(len(tiers.ri)),
                     "seconds_simulated": round(b.span, 2), "modes": modes,
                     "second_level": _gain(cfg, modes["rack"], modes["fabric"], b.span),
                     "rack_level": _gain(cfg, modes["bridge"], modes["rack"], b.span),
                     "pool_side_alone": _gain(cfg, modes["bridge"], modes["pool-side"],
                                              b.span)})
    wall = round(time.perf_counter() - t0, 2)
    for r in rows:
        r["wall_seconds"] = wall
    return rows


def run_fabric_sweep(trace_path: str, racks=RACKS, hosts_per_rack=HOSTS, oversub=OVERSUB,
                     sharing=SHARING, requests_per_node: int = REQUESTS_PER_NODE,
                     max_requests: int = MAX_REQUESTS, rack_gib: float = 64.0,
                     agg_gib: float = 64.0, json_path: str | None = None,
                     plot_path: str | None = None, log=print, **cfg_kw) -> dict:
    """Every (racks, hosts per rack, sharing) point at every oversubscription; per (hosts per
    rack, oversubscription, sharing) the rack count from which the second level pays
    (interpolated as sweep.break_even does nodes); the 32 x 32 answer (or the largest
    point's). ``cfg_kw``: SimConfig fields shared by every point (pools, model, links...)."""
    for r in racks:
        for h in hosts_per_rack:
            for o in oversub:
                check_shape(r, h, o)
    trace = load_trace(trace_path)
    base = SimConfig(**cfg_kw)
    xdp = xdp_frame_cost(base)
    log(f"data plane: {xdp['ns_per_frame']} ns/frame from {xdp['source']}")
    log(f"sim fabric: {len(sharing) * len(hosts_per_rack) * len(racks)} points (sharing x hosts "
        f"per rack x racks, each at {len(oversub)} oversubscriptions), a line each ...")
    t0, points = time.perf_counter(), []
    for s in sharing:
        for h in hosts_per_rack:
            for r in racks:
                rows = fabric_point(trace, r, h, oversub, s, requests_per_node, max_requests,
                                    rack_gib, agg_gib, xdp, **cfg_kw)
                points += rows
                g = rows[0]["second_level"]
                log(f"sharing {s} {r} racks x {h} hosts: second level saves "
                    f"{g['pool_egress_saved']:.1%} of pool egress, nets "
                    f"${g['net_usd_per_hour']:.2f}/h at {rows[0]['oversub']:g}:1 "
                    f"({rows[0]['wall_seconds']}s)")
    curves = []
    for s in sharing:
        for h in hosts_per_rack:
            for o in oversub:
                pts = sorted((p for p in points if (p["sharing"], p["hosts_per_rack"],
                                                    p["oversub"]) == (s, h, o)),
                             key=lambda p: p["racks"])
                net = [p["second_level"]["net_usd_per_hour"] for p in pts]
                curves.append({"sharing": s, "hosts_per_rack": h, "oversub": o,
                               "second_level_pays_from_racks":
                                   break_even([p["racks"] for p in pts], net),
                               "pays_at_racks": [p["racks"] for p, v in zip(pts, net) if v > 0]})
    big = max((p["racks"] * p["hosts_per_rack"], p["racks"]) for p in points)
    at = [p for p in points if (p["nodes"], p["racks"]) == big]
    out = {"trace": str(trace_path), "racks": list(racks), "hosts_per_rack": list(hosts_per_rack),
           "oversub": list(oversub), "sharing": list(sharing),
           "requests_per_node": requests_per_node, "max_requests": max_requests,
           "rack_gib": rack_gib, "agg_gib": agg_gib,
           "defaults": {k: v for k, v in vars(base).items() if k not in ("nodes", "switch_gib")},
           "xdp": xdp, "break_even": curves,
           "answer": {"racks": at[0]["racks"], "hosts_per_rack": at[0]["hosts_per_rack"],
                      "second_level": [{"sharing": p["sharing"], "oversub": p["oversub"],
                                        **p["second_level"],
                                        "agg_hit_ratio": p["modes"]["fabric"]["hit_ratio"][
                                            "pool-side"],
                                        "rack_hit_ratio": p["modes"]["fabric"]["hit_ratio"][
                                            "rack"]} for p in at]},
           "points": points, "wall_seconds": round(time.perf_counter() - t0, 1)}
    write_json(json_path, out)
    if plot_path:
        plot(out, plot_path)
    return out


def plot(out: dict, path) -> None:
    """The second level (agg switch on top of the rack switches) against inference nodes, at the
    middle oversubscription: pool egress it saves, net dollars an hour, its data-plane cores."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    o = out["oversub"][len(out["oversub"]) // 2]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.4))
    marks = "osD^v"
    for i, s in enumerate(out["sharing"]):
        for j, h in enumerate(out["hosts_per_rack"]):
            pts = sorted((p for p in out["points"] if (p["sharing"], p["hosts_per_rack"],
                                                       p["oversub"]) == (s, h, o)),
                         key=lambda p: p["nodes"])
            x = [p["nodes"] for p in pts]
            g = [p["second_level"] for p in pts]
            kw = dict(color=f"C{i}", marker=marks[j % len(marks)],
                      label=f"sharing {s:g}, {h} hosts/rack")
            axes[0].plot(x, [100 * v["pool_egress_saved"] for v in g], **kw)
            axes[1].plot(x, [v["net_usd_per_hour"] for v in g], **kw)
            axes[2].plot(x, [v["xdp_cores"] for v in g], **kw)
    axes[0].set_ylabel("pool egress the agg switch saves over the racks' (%)")
    axes[1].set_ylabel("second level: net $/h (GPU time saved - cost)")
    axes[1].set_yscale("symlog", linthresh=1.0)
    axes[1].axhline(0, color="k", lw=1)
    axes[2].set_ylabel("agg switch XDP cores (mean)")
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xlabel("inference nodes (racks x hosts per rack)")
        ax.grid(alpha=0.3, which="both")
    axes[0].legend(fontsize=7)
    fig.suptitle(f"When a pool-side kvswitch pays on top of rack switches ({o:g}:1 uplinks, "
                 f"{out['defaults']['pools']} pool nodes, {out['rack_gib']:g}/{out['agg_gib']:g}"
                 f" GiB rack/agg, XDP {out['xdp']['ns_per_frame']} ns/frame)", fontsize=10)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
