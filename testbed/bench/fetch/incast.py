"""`testbed bench incast`: N readers in separate namespaces ask for the same KV block at the same
instant from one pool node, in two modes measured in one run:

  baseline  plain Linux bridge, no switch program: the pool node sends the block N times;
  switch    kvswitch with coalescing and caching on, cache cold at the start of each repetition.

Readers fetch with `hostagent get` (the XDP fetch engine); the pool node is `hostagent serve`
(its GETs answered from XDP) on the in-memory store or, with ``store="mooncake"``, on Mooncake
Store (a master in the topology's m1; the pool node stages the block from it at its first GET,
then serves it from the staging arena).

Pool egress is read from the pool node's interface counters (not computed); completion time is
each reader's own clock from the common start instant to its last byte; every block is checked
byte for byte. Writes JSON and a plot.

On one box every reader shares the same two cores, which real inference nodes do not. By default
links are unshaped veths; with ``link_gbit`` (every node's link) or ``pool_link_gbit`` (the pool
node's) each link queues at that rate both ways whatever sent the frame (testbed.lab.links), so
that, as in a cluster, links and not the readers' CPU are the bottleneck. A shaped run also
measures the box's unshaped aggregate (the most readers through the switch, unshaped links), so
a reader of the result can see which bound held.
"""
from __future__ import annotations

import os
import statistics
import time
from pathlib import Path

import numpy as np

from kvproto import DEFAULT_CHUNK

from ...lab import Lab
from ...results import write_json

NS = 7


def _percentile(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q))


def _measure(lab: Lab, readers: int, key: bytes, block: bytes, reps: int,
             cold: callable) -> dict:
    egress, times, retransmits, exact = [], [], 0, True
    nodes = [f"h{i}" for i in range(1, readers + 1)]
    for _ in range(reps):
        cold()
        before = lab.link_bytes("p1", "tx")
        results = lab.get_many(nodes, NS, key, start_delay=1.0 + 0.25 * readers)
        egress.append(lab.link_bytes("p1", "tx") - before)
        for stats, data in results:
            exact &= data == block
            times.append(stats["seconds"])
            retransmits += stats["retransmits"]
    return {"readers": readers, "pool_egress_bytes": int(statistics.median(egress)),
            "pool_egress_bytes_all": egress,
            "completion_s_p50": round(_percentile(times, 50), 4),
            "completion_s_p99": round(_percentile(times, 99), 4),
            "retransmits": retransmits, "byte_exact": exact, "repetitions": reps}


def run_incast(readers: list[int], block_mib: float, reps: int, json_path: str | None,
               plot_path: str | None, chunk_size: int = DEFAULT_CHUNK,
               link_gbit: float | None = None,
               pool_link_gbit: float | None = None, store: str = "memory",
               link_delay_us: float = 0.0, log=print) -> dict:
    block = os.urandom(int(block_mib * (1 << 20)))
    key = os.urandom(16)
    shaped = link_gbit is not None or pool_link_gbit is not None
    log(f"bench incast: {', '.join(map(str, readers))} readers of a {block_mib:g} MiB block, "
        f"{reps} repetitions each, bridge then switch")
    results = _run_modes(readers, block, key, reps, chunk_size, (link_gbit, pool_link_gbit,
                         link_delay_us), store, ("baseline", "switch"), log)
    unshaped = None
    if shaped:          # the box's own bound: the same fetch through the switch, no shaping
        log("bench incast: the switch on unshaped links ...")
        row = _run_modes([max(readers)], block, key, 1, chunk_size, (None, None, 0.0), store,
                         ("switch",), log)[0]
        unshaped = {"readers": row["readers"], "completion_s_p50": row["completion_s_p50"],
                    "aggregate_gbit": round(8 * row["readers"] * len(block) /
                                            row["completion_s_p99"] / 1e9, 3)}
    nchunks = -(-len(block) // chunk_size)
    for r in results:
        r["retransmit_ratio"] = round(r["retransmits"] / (r["readers"] * nchunks *
                                                          r["repetitions"]), 5)
    out = {"block_bytes": len(block), "chunk_bytes": chunk_size, "link_gbit": link_gbit,
           "pool_link_gbit": pool_link_gbit, "link_delay_us": link_delay_us, "store": store,
           "cpus": os.cpu_count(),
           "results": results, "unshaped_switch": unshaped,
           "summary": _summary(results, len(block))}
    write_json(json_path, out)
    if plot_path:
        plot_incast(out, plot_path)
    return out


def _run_modes(readers, block, key, reps, chunk_size, links, store, modes, log) -> list[dict]:
    results = []
    link_gbit, pool_link_gbit, link_delay_us = links
    log(f"bench incast: building the testbed ({max(readers)} readers) ...")
    with Lab("inc", hosts=max(readers), pools=1, chunk_size=chunk_size, switch=False,
             pool_capacity="1GiB", store=store, link_gbit=link_gbit,
             pool_link_gbit=pool_link_gbit, link_delay_us=link_delay_us,
             cache_entries=max(65536, 2 * len(block) // chunk_size)) as lab:
        lab.put("h1", NS, key, block)
        for mode in modes:
            log(f"bench incast: mode {mode} ...")
            if mode == "switch":
                lab.start_switch()
                lab.switchd("cache", "admit", "--ns", str(NS), "--key", key.hex())

            def cold():
                if mode == "switch":
                    lab.switchd("cache", "evict", "--ns", str(NS), "--key", key.hex())
                    lab.switchd("cache", "admit", "--ns", str(NS), "--key", key.hex())

            for n in readers:
                t0 = time.monotonic()
                row = {"mode": mode, "shaped": link_gbit is not None or
                       pool_link_gbit is not None, **_measure(lab, n, key, block, reps, cold)}
                results.append(row)
                log(f"{mode:8} readers={n:2} pool egress "
                    f"{row['pool_egress_bytes'] / len(block):5.2f} x block, "
                    f"completion p50 {row['completion_s_p50']:.3f}s "
                    f"p99 {row['completion_s_p99']:.3f}s, retransmits {row['retransmits']}, "
                    f"byte-exact {row['byte_exact']} ({time.monotonic() - t0:.0f}s)")
    return results


def _summary(results: list[dict], block: int) -> dict:
    by = {(r["mode"], r["readers"]): r for r in results}
    ns = sorted({r["readers"] for r in results})
    lo, hi = ns[0], ns[-1]
    s = {}
    for mode in ("baseline", "switch"):
        s[mode] = {
            "max_pool_egress_x_block": round(max(by[(mode, n)]["pool_egress_bytes"] / block
                                                 for n in ns), 3),
            f"completion_p50_ratio_{hi}_vs_{lo}": round(
                by[(mode, hi)]["completion_s_p50"] / by[(mode, lo)]["completion_s_p50"], 3),
            "all_byte_exact": all(by[(mode, n)]["byte_exact"] for n in ns),
            "max_retransmit_ratio": max(by[(mode, n)]["retransmit_ratio"] for n in ns),
        }
    return s


def plot_incast(out: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    block = out["block_bytes"]
    for mode, style in (("baseline", "o--"), ("switch", "s-")):
        rows = [r for r in out["results"] if r["mode"] == mode]
        n = [r["readers"] for r in rows]
        ax1.plot(n, [r["pool_egress_bytes"] / block for r in rows], style, label=mode)
        ax2.plot(n, [r["completion_s_p50"] for r in rows], style, label=f"{mode} p50")
        ax2.plot(n, [r["completion_s_p99"] for r in rows], style, alpha=0.4,
                 label=f"{mode} p99")
    ax1.set(xlabel="readers asking at once", ylabel="pool node egress / block size",
            title="Bytes the pool node sends", xscale="log", xticks=n, xticklabels=n)
    link = (f", links {out['link_gbit'] * 1000:g} Mbit/s" if out.get("link_gbit") else
            f", pool link {out['pool_link_gbit'] * 1000:g} Mbit/s"
            if out.get("pool_link_gbit") else "")
    link += f", {out.get('store', 'memory')} store"
    ax2.set(xlabel="readers asking at once", ylabel="seconds", xscale="log", xticks=n,
            xticklabels=n, title=f"Completion, {block / (1 << 20):g} MiB block{link}")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
