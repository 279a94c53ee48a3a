"""`testbed bench serve --racks R`: the serving benchmark on a fabric of switches (issue 43,
testbed.lab.fabric). R racks of H inference nodes behind rack switches whose uplinks (2:1
oversubscribed by default) reach a pool-side switch in front of P pool nodes; every node runs
bench serve's serving loop (testbed.bench.serve.serve_node) over its share of the burst and Zipf
workloads; then every node reads one block of the burst prefix's size at the same instant
(``incast``: the fetch alone, as bench incast does on one switch). Four modes, each on a
fabric built afresh:

  bridge     no kvswitch anywhere: every switch a plain Linux bridge;
  rack       switchd on the rack switches only;
  pool-side  switchd on the pool-side switch only;
  fabric     switchd on every switch (each deciding on the demand it sees: the pool side sees
             only what the racks missed; independent, inclusive layers).

Per row, over the measured phase (after a burst's warm-up): TTFT p50/p99, the bytes each rack's
uplink carried down into its rack and each pool node sent, the hit ratio per level (GETs a
level's switches answered from their caches over the GETs that reached that level),
byte-exactness. Writes JSON and a plot."""
from __future__ import annotations

import time

import numpy as np

from ...lab import TestbedError
from ...lab.fabric import AGG, FabricLab
from ...results import write_json
from ...sim.config import FRAME_OVERHEAD, MODELS
from ...sim.trace import DEFAULT_TRACE
from .serve import (CHUNK, _pct, _preload, block_bytes_for, check_choices, make_workloads,
                    serve_phases)

FABRIC_MODES = ("bridge", "rack", "pool-side", "fabric")
PLACEMENTS = ("independent", "split")
FABRIC_WORKLOADS = ("burst", "zipf", "incast")
INCAST_REPS = 3
LEVEL_KEYS = ("get_hit", "get_miss", "coalesced", "replicated", "replicas", "fill",
              "spec_fill", "expired", "reasked", "uncoalesced", "unsolicited")


def placement_args(placement: str, racks: int) -> dict[str, tuple[str, ...]]:
    """switchd's options per switch for a placement: ``independent`` (each caches on the
    demand it sees: inclusive layers), ``split`` (DistCache-style: the rack switches cache one
    half of the block keys, the pool-side switch the other)."""
    if placement == "independent":
        return {}
    return {**{f"r{k}": ("--cache-share", "0/2") for k in range(1, racks + 1)},
            AGG: ("--cache-share", "1/2")}


def fabric_lab(prefix: str, mode: str, racks: int, hosts_per_rack: int, pools: int,
               oversub: float, link_gbit: float, pool_link_gbit: float | None,
               placement: str = "independent", cache_entries: int = 65536) -> FabricLab:
    """The fabric of one mode as the benchmark (and the model's validation) builds it."""
    return FabricLab(prefix, racks, hosts_per_rack, pools, oversub,
                     switches=switches_for(mode, racks), chunk_size=CHUNK,
                     box_args=placement_args(placement, racks), cache_entries=cache_entries,
                     pool_capacity="1GiB", link_gbit=link_gbit,
                     pool_link_gbit=pool_link_gbit or link_gbit)


def switches_for(mode: str, racks: int) -> list[str]:
    rack = [f"r{k}" for k in range(1, racks + 1)]
    return {"bridge": [], "rack": rack, "pool-side": [AGG], "fabric": rack + [AGG]}[mode]


def check(racks: int, hosts_per_rack: int, oversub: float, workloads, modes,
          placement: str = "independent") -> None:
    """Bad options: one line, before any testbed is built (the fabric checks its shape)."""
    from ...lab.fabric import Fabric
    Fabric("fcheck", 0, 1, racks=racks, hosts_per_rack=hosts_per_rack, oversub=oversub)
    for kind, given, allowed in (("workload", workloads, FABRIC_WORKLOADS),
                                 ("mode", modes, FABRIC_MODES),
                                 ("placement", [placement], PLACEMENTS)):
        if not given:
            raise TestbedError(f"no {kind} given: choose from {', '.join(allowed)}")
        check_choices(kind, given, allowed)


def _level(counters: list[dict]) -> dict:
    """One level's switches' counters added up."""
    return {k: sum(c.get(k, 0) for c in counters) for k in LEVEL_KEYS}


def hit_ratio(level: dict | None) -> float | None:
    """GETs answered from the level's caches over the GETs that reached it."""
    if level is None:
        return None
    seen = level["get_hit"] + level["get_miss"] + level["coalesced"]
    return round(level["get_hit"] / seen, 4) if seen else 0.0


def _run(lab: FabricLab, wl, mode: str, preset, block_bytes: int, log) -> dict:
    ns = wl.params["ns"]
    if wl.preload:
        _preload(lab, ns, wl.preload, None, block_bytes)
    pools, racks = lab.topo.pool_nodes, [b.name for b in lab.topo.rack_boxes]
    running = {level: [b for b in names if b in lab.boxes]
               for level, names in (("rack", racks), ("pool-side", [AGG]))}
    before = {}

    def snapshot(_at=None):
        """Links and counters as the measured phase starts (after a burst's warm-up, whose
        write-through and misses are not the hot block's)."""
        before.update(pools=[lab.link_bytes(p.name, "tx") for p in pools],
                      replies=[lab.pool_counters(i).get("tx_bytes", 0)
                               for i in range(len(pools))],
                      uplinks=[lab.uplink_bytes(r) for r in racks],
                      counters={b: lab.box_counters(b) for bs in running.values() for b in bs})
    t0 = time.monotonic()
    res = serve_phases(lab, wl, ns, preset.prefill_tokens_per_s, block_bytes,
                       at_start=snapshot)
    egress = [lab.link_bytes(p.name, "tx") - b for p, b in zip(pools, before["pools"])]
    uplinks = [lab.uplink_bytes(r) - b for r, b in zip(racks, before["uplinks"])]
    replies = [lab.pool_counters(i).get("tx_bytes", 0) - b
               for i, b in enumerate(before["replies"])]
    moved = {b: {k: v - before["counters"][b].get(k, 0)
                 for k, v in lab.box_counters(b).items()}
             for bs in running.values() for b in bs}
    levels = {level: _level([moved[b] for b in bs]) if bs else None
              for level, bs in running.items()}
    ttft = [x for r in res for x, w in zip(r["ttft"], r["warmup"]) if not w]
    fetch = [x for r in res for x, w in zip(r["fetch"], r["warmup"]) if not w]
    chunks = sum(r["chunks"] for r in res) or 1
    row = {
        "workload": wl.name, "mode": mode,
        "ttft_p50_s": _pct(ttft, 50), "ttft_p99_s": _pct(ttft, 99),
        "uplink_bytes": uplinks, "pool_egress_bytes": egress, "pool_payload_bytes": replies,
        "hit_ratio": {level: hit_ratio(c) for level, c in levels.items()},
        "byte_exact": all(r["byte_exact"] for r in res),
        "wrong_bytes": sum(r["wrong_bytes"] for r in res),
        "requests": len(ttft), "ttft_mean_s": round(float(np.mean(ttft)), 4) if ttft else 0,
        "fetch_p50_s": _pct(fetch, 50), "fetch_p99_s": _pct(fetch, 99),
        "switch_answered_ratio": round(sum(r["from_switch"] for r in res) / chunks, 4),
        "replica_ratio": round(sum(r["replicas"] for r in res) / chunks, 4),
        "retransmit_ratio": round(sum(r["retransmits"] for r in res) / chunks, 5),
        "fetch_errors": sum(r["fetch_errors"] for r in res),
        "hottest_pool_egress_x_mean": round(max(egress) / (sum(egress) / len(egress)), 3)
        if sum(egress) else None,
        "level_counters": levels, "seconds": round(time.monotonic() - t0, 1),
    }
    log(f"{wl.name:5} {mode:9} ttft p50 {row['ttft_p50_s']:.3f}s p99 {row['ttft_p99_s']:.3f}s "
        f"uplinks {[round(u / 2**20, 1) for u in uplinks]} MiB pool "
        f"{[round(e / 2**20, 1) for e in egress]} MiB hit {row['hit_ratio']} "
        f"exact {row['byte_exact']} ({row['seconds']} s)")
    return row


def _incast(lab: FabricLab, mode: str, nbytes: int, log) -> dict:
    """Every host reads one block of ``nbytes`` at the same instant (``INCAST_REPS`` blocks, one
    after another): the fetch alone, without a serving loop's arrivals spread over a window."""
    import os
    pools, racks = lab.topo.pool_nodes, [b.name for b in lab.topo.rack_boxes]
    hosts = [n.name for n in lab.topo.host_nodes]
    secs, egress, uplinks, exact = [], [0] * len(pools), [0] * len(racks), True
    for rep in range(INCAST_REPS):
        key, block = os.urandom(16), os.urandom(nbytes)
        lab.put(hosts[rep % len(hosts)], 1, key, block)
        e0, u0 = [lab.link_bytes(p.name, "tx") for p in pools], [lab.uplink_bytes(r)
                                                                 for r in racks]
        got = lab.get_many(hosts, 1, key)
        egress = [a + lab.link_bytes(p.name, "tx") - b for a, p, b in zip(egress, pools, e0)]
        uplinks = [a + lab.uplink_bytes(r) - b for a, r, b in zip(uplinks, racks, u0)]
        secs += [r["seconds"] for r, _ in got]
        exact &= all(d == block for _, d in got)
    row = {"workload": "incast", "mode": mode, "completion_p50_s": _pct(secs, 50),
           "completion_p99_s": _pct(secs, 99), "block_bytes": nbytes,
           "uplink_x_block": [round(u / INCAST_REPS / nbytes, 3) for u in uplinks],
           "pool_x_block": round(sum(egress) / INCAST_REPS / nbytes, 3),
           "uplink_bytes": uplinks, "pool_egress_bytes": egress, "byte_exact": exact}
    log(f"incast {mode:9} completion p50 {row['completion_p50_s']:.3f}s p99 "
        f"{row['completion_p99_s']:.3f}s uplinks x {row['uplink_x_block']} pool x "
        f"{row['pool_x_block']} exact {exact}")
    return row


def unshaped_capacity(racks: int, hosts_per_rack: int, pools: int, prefix: str,
                      block_mib: float = 4.0) -> dict:
    """The box's own bound (links not shaped, kvswitch on every switch): every host reads one
    block at once; the aggregate rate of the slowest reader's time, so a shaped run whose links
    are far below it is bound by its links, not this machine's CPU."""
    import os
    block, key = os.urandom(int(block_mib * (1 << 20))), os.urandom(16)
    with FabricLab(prefix, racks, hosts_per_rack, pools, chunk_size=CHUNK) as lab:
        lab.put("h1", 1, key, block)
        hosts = [n.name for n in lab.topo.host_nodes]
        got = lab.get_many(hosts, 1, key)
    slowest = max(r["seconds"] for r, _ in got)
    return {"readers": len(hosts), "block_bytes": len(block), "slowest_s": round(slowest, 3),
            "aggregate_gbit": round(8 * len(hosts) * len(block) / slowest / 1e9, 3),
            "byte_exact": all(d == block for _, d in got)}


def run_fabric(racks: int = 2, hosts_per_rack: int = 4, pools: int = 2, oversub: float = 2.0,
               link_gbit: float = 0.025, pool_link_gbit: float | None = None,
               workloads=FABRIC_WORKLOADS, modes=FABRIC_MODES,
               model: str = "llama3-8b", scale: float = 1.0, json_path: str | None = None,
               plot_path: str | None = None, prefix: str = "sf", log=print,
               placement: str = "independent", cache_entries: int = 65536) -> dict:
    check(racks, hosts_per_rack, oversub, workloads, modes, placement)
    preset, block_bytes = MODELS[model], block_bytes_for(link_gbit)
    nodes, results, wls, shape = racks * hosts_per_rack, [], {}, {}
    log(f"bench serve --racks: modes {', '.join(modes)} x workloads {', '.join(workloads)} on "
        f"{racks} racks x {hosts_per_rack} nodes, {pools} pool nodes, {oversub:g}:1 uplinks")
    for mode in modes:
        log(f"bench serve --racks: mode {mode}: building the fabric testbed ...")
        with fabric_lab(prefix, mode, racks, hosts_per_rack, pools, oversub, link_gbit,
                        pool_link_gbit, placement, cache_entries) as lab:
            shape = lab.topo.as_dict()
            serving = [w for w in workloads if w != "incast"]
            wls = make_workloads(serving, nodes, lab.pool_addrs, preset, DEFAULT_TRACE, 0,
                                 scale)
            for name in serving:
                log(f"bench serve --racks: mode {mode}, workload {name} ...")
                results.append(_run(lab, wls[name], mode, preset, block_bytes, log))
            if "incast" in workloads:       # the burst's prefix as one block
                log(f"bench serve --racks: mode {mode}, workload incast ...")
                results.append(_incast(lab, mode, max(2, int(32 * scale)) * block_bytes, log))
    log("bench serve --racks: the fabric's unshaped capacity ...")
    unshaped = unshaped_capacity(racks, hosts_per_rack, pools, prefix)
    log(f"unshaped: {unshaped}")
    burst = wls.get("burst")
    config = {**shape, "nodes": nodes, "chunk_bytes": CHUNK, "block_bytes": block_bytes,
              "burst_prefix_bytes": burst.params["prefix_blocks"] * block_bytes if burst else 0,
              "placement": placement, "cache_entries": cache_entries,
              "policy": "switchd's default on every switch",
              "preset": model, "prefill_tokens_per_s": preset.prefill_tokens_per_s,
              "scale": scale, "workloads": {n: w.params for n, w in wls.items()},
              "uplink_bytes": "bytes each rack's uplink delivered into its rack",
              "unshaped_fabric": unshaped}
    out = {"config": config, "results": results,
           "summary": summary(results, config["burst_prefix_bytes"])}
    write_json(json_path, out)
    if plot_path:
        plot(out, plot_path)
    return out


def summary(results: list[dict], prefix_bytes: int = 0) -> dict:
    """p99 ratios to the bridge; for the burst, how many times its hot prefix crossed each
    uplink (frames as sent: the prefix's chunks with their headers) and left the pool nodes
    (reply payloads)."""
    by = {(r["workload"], r["mode"]): r for r in results}
    out = {"all_byte_exact": all(r["byte_exact"] for r in results)}
    wire = prefix_bytes / CHUNK * (CHUNK + FRAME_OVERHEAD)
    for (w, m), r in by.items():
        if w == "burst" and prefix_bytes:
            out[f"burst_{m}_uplink_x_prefix"] = [round(u / wire, 3) for u in r["uplink_bytes"]]
            out[f"burst_{m}_pool_x_prefix"] = round(sum(r["pool_payload_bytes"]) /
                                                    prefix_bytes, 3)
    for (w, m), r in by.items():
        base = by.get((w, "bridge"))
        key = "completion_p99_s" if w == "incast" else "ttft_p99_s"
        if base and m != "bridge" and r[key]:
            out[f"{w}_p99_bridge_over_{m}"] = round(base[key] / r[key], 2)
    return out


def plot(out: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = out["results"]
    names = sorted({r["workload"] for r in rows})
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    width = 0.8 / len(names)
    for ax, label in ((axes[0], "TTFT p99 (s; incast: completion p99)"),
                      (axes[1], "pool egress (MiB)")):
        for i, w in enumerate(names):
            rs = [r for r in rows if r["workload"] == w]
            vals = [sum(r["pool_egress_bytes"]) / 2**20 if ax is axes[1] else
                    r.get("ttft_p99_s", r.get("completion_p99_s")) for r in rs]
            ax.bar([j + width * i for j in range(len(rs))], vals, width, label=w)
            ax.set_xticks([j + 0.4 - width / 2 for j in range(len(rs))],
                          [r["mode"] for r in rs])
        ax.set_ylabel(label)
        ax.legend()
    fig.suptitle(f"{out['config']['racks']} racks x {out['config']['hosts_per_rack']} hosts, "
                 f"{out['config']['oversub']:g}:1 uplinks")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
