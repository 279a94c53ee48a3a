"""`testbed bench serve`: a live serving benchmark. N inference nodes and P pool nodes, every
link queueing at one rate (testbed.lab.links); each node runs a serving loop (serve_node) over its
share of a workload (serve_workloads) and records TTFT = queueing + fetch + modelled prefill (the
cluster model's preset, named in the JSON). Three modes, one after another on one testbed (each on
pool servers started afresh; with Mooncake on a testbed each), the workloads one after another in it
(each in a KV namespace of its own):

  bridge    a plain Linux bridge, no switch program: each block from its owner pool node;
  switch    kvswitch with switchd's default policy (nothing admitted by hand);
  replicas  no switch, every block on every pool node (written to all), reads spread at
            random: what a pool without the switch does for a hot object (the product's
            ``Placement`` with replicas = P and spread reads).

Pool egress per pool node is read from its interface counters; the switch's hit ratio is the
share of fetched chunks it answered from its cache (its replicas of a held miss are counted
apart); every fetched block is checked byte for byte against its content. Writes JSON and a
plot.
"""
from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path

import numpy as np

from ...lab import Lab, TestbedError
from ...lab.tasks import StartLine, gather
from ...lab.topology import plain_bridge_ports
from ...results import write_json
from ...sim.config import MODELS
from ...sim.trace import DEFAULT_TRACE
from .serve_workloads import (WORKLOADS, Workload, burst_workload, payload, trace_workload,
                              zipf_workload)

MODES = ("bridge", "switch", "replicas")
SW_KEYS = ("get_hit", "get_miss", "coalesced", "replicated", "replicas", "expired", "unheld",
           "reasked", "nack_closed", "fill", "spec_fill")
MAX_NODES = 24                 # inference nodes this 2-core box can run a serving loop for
NS_BASE = 40
CHUNK = 3072
CLUSTER_BLOCK_BYTES = 64 << 20   # a 512-token block of Llama-3-8B (128 KiB of KV a token)
CLUSTER_GBIT = 100.0             # the cluster's links


def block_bytes_for(link_gbit: float) -> int:
    """A block scaled with the links (whole chunks): fetching it takes about as long as a
    real block over a cluster's link, so modelled prefill can run in real time."""
    return max(1, round(CLUSTER_BLOCK_BYTES * link_gbit / CLUSTER_GBIT / CHUNK)) * CHUNK


def time_scale(link_gbit: float) -> float:
    """Seconds of the testbed per second of the cluster, for a block fetch."""
    return (block_bytes_for(link_gbit) / link_gbit) / (CLUSTER_BLOCK_BYTES / CLUSTER_GBIT)


def check(nodes: int, pools: int, link_gbit: float, workloads, modes) -> None:
    """One clear error for a configuration the benchmark cannot run."""
    if not 1 <= nodes <= MAX_NODES:
        raise TestbedError(f"--nodes must be 1..{MAX_NODES} on this box "
                           f"({os.cpu_count()} CPUs), got {nodes}")
    if not 1 <= pools <= 8:
        raise TestbedError(f"--pools must be 1..8, got {pools}")
    if not link_gbit > 0:
        raise TestbedError(f"--link-gbit must be > 0, got {link_gbit:g}")
    check_choices("workload", workloads, WORKLOADS)
    check_choices("mode", modes, MODES)


def check_choices(kind: str, given, allowed) -> None:
    """One clear error for the first of ``given`` that is not one of ``allowed``."""
    for v in given:
        if v not in allowed:
            raise TestbedError(f"unknown {kind} {v!r}: choose from {', '.join(allowed)}")


def _pct(x, q) -> float:
    return round(float(np.percentile(np.asarray(x), q)), 4) if len(x) else 0.0


def holding_of(mode: str, pools: int) -> dict:
    """The placement (serve_node.placement) of a mode: every pool node holds every block and
    reads spread in the replicas mode, one holder each otherwise."""
    return {"replicas": pools, "spread": True} if mode == "replicas" else {}


def _preload(lab: Lab, ns: int, keys: list[str], holding: dict | None,
             block_bytes: int) -> None:
    lab.task("h1", f"{__name__}:put_all", lab.pool_addrs, CHUNK, ns, block_bytes, keys,
             holding)


async def put_all(pools, chunk_size, ns, block_bytes, keys, holding) -> int:
    """In a node: put ``keys``' blocks on their holders (serve_node.placement)."""
    import asyncio
    from hostagent.inference.client import KVClient
    from .serve_node import placement
    sem = asyncio.Semaphore(8)

    async def one(c, k):
        async with sem:
            await c.put_block(ns, bytes.fromhex(k), payload(bytes.fromhex(k), block_bytes))

    async with KVClient(placement(pools, holding), chunk_size, 64, 60.0) as c:
        await asyncio.gather(*(one(c, k) for k in keys))
    return len(keys)


def phases(wl: Workload) -> list[list[list[dict]]]:
    """Each node's requests per phase: a workload's warm-up requests (the burst's node 1
    computing the prefix) run first, to the end of their write-through; then the rest, their
    arrival times counted from the second phase's start (its first request at 0). So a burst
    request never asks for the prefix before it is in the pool: in one phase, a write-through
    slower than the workload's margin under load had burst requests find part of the prefix
    missing and compute it (cached blocks 0.76 instead of 0.88 in one run)."""
    warm = [[r for r in reqs if r.get("warmup")] for reqs in wl.requests]
    if not any(warm):
        return [wl.requests]
    rest = [[r for r in reqs if not r.get("warmup")] for reqs in wl.requests]
    shift = min((r["at"] for reqs in rest for r in reqs), default=0.0)
    return [warm, [[{**r, "at": round(r["at"] - shift, 4)} for r in reqs] for reqs in rest]]


def _merge(into: dict, out: dict) -> None:
    """A node's results of one more phase: lists joined, counts added, flags and-ed."""
    for k, v in out.items():
        if k not in into:
            into[k] = v
        elif isinstance(v, bool):
            into[k] = into[k] and v
        elif k == "late_s":
            into[k] = max(into[k], v)
        else:
            into[k] = into[k] + v


def serve_phases(lab: Lab, wl: Workload, ns: int, prefill_tok_s: float, block_bytes: int,
                 holding: dict | None = None, at_start=None, deadline: float = 30.0,
                 failed: list | None = None) -> list[dict]:
    """Every node's serving loop (testbed.bench.serve.serve_node) over its share of ``wl``, phase by
    phase; each node's results. ``at_start(epoch)`` is called once the last phase's nodes have
    their common start (the run's time 0), while they serve (a fault's schedule, say);
    ``holding`` and ``deadline`` are the nodes' (testbed.bench.serve.serve_node.serve). A node whose
    loop fails raises, or with ``failed`` (a list) is noted there as (node, why) and gives {}."""
    nodes = lab.topo.host_nodes
    res: list[dict] = [{} for _ in nodes]
    steps = phases(wl)
    for phase in steps:
        on = [i for i, reqs in enumerate(phase) if reqs or phase is steps[-1]]
        start = StartLine(lab.tmp.name, len(on))      # once every node's engine is open
        tasks = [(i, lab.start_task(nodes[i].name, "testbed.bench.serve.serve_node:serve",
                                    lab.pool_addrs, CHUNK, ns, block_bytes, phase[i], start.path,
                                    prefill_tok_s, holding, True, deadline))
                 for i in on]
        at = start.go([t for _, t in tasks])
        if at_start is not None and phase is steps[-1]:
            at_start(at)
        if failed is None:
            for (i, _), r in zip(tasks, gather([t for _, t in tasks], timeout=1800)):
                _merge(res[i], r)
            continue
        for i, t in tasks:                            # failures are data: wait for every node
            try:
                _merge(res[i], t.result(timeout=1800))
            except TestbedError as exc:
                failed.append((i, str(exc)))
    return res


def _run_workload(lab: Lab, wl: Workload, mode: str, ns: int, preset, block_bytes: int,
                  log) -> dict:
    if wl.preload:
        _preload(lab, ns, wl.preload, holding_of(mode, len(lab.pool_addrs)), block_bytes)
    pools = lab.topo.pool_nodes
    before = [lab.link_bytes(p.name, "tx") for p in pools]
    sw0 = lab.counters() if mode == "switch" else {}   # the switch's rounds: its time
    t0 = time.monotonic()
    res = serve_phases(lab, wl, ns, preset.prefill_tokens_per_s, block_bytes,
                       holding_of(mode, len(lab.pool_addrs)))
    egress = [lab.link_bytes(p.name, "tx") - b for p, b in zip(pools, before)]
    # warm-up requests (the burst's first computation of its prefix) are reported apart
    pick = [(r, [i for i, w in enumerate(r["warmup"]) if not w]) for r in res]
    ttft = [r["ttft"][i] for r, idx in pick for i in idx]
    warm = [x for r in res for x, w in zip(r["ttft"], r["warmup"]) if w]
    chunks = sum(r["chunks"] for r in res) or 1
    row = {
        "workload": wl.name, "mode": mode,
        "ttft_p50_s": _pct(ttft, 50), "ttft_p99_s": _pct(ttft, 99),
        "pool_egress_bytes": egress,
        "switch_hit_ratio": round(sum(r["from_switch"] for r in res) / chunks, 4),
        "retransmit_ratio": round(sum(r["retransmits"] for r in res) / chunks, 5),
        "byte_exact": all(r["byte_exact"] for r in res),
        "wrong_bytes": sum(r["wrong_bytes"] for r in res),
        # what the figures are made of
        "requests": len(ttft), "ttft_mean_s": round(float(np.mean(ttft)), 4) if ttft else 0,
        "warmup_ttft_s": [round(x, 4) for x in warm],
        "queue_p50_s": _pct([r["queue"][i] for r, idx in pick for i in idx], 50),
        "queue_p99_s": _pct([r["queue"][i] for r, idx in pick for i in idx], 99),
        "fetch_p50_s": _pct([r["fetch"][i] for r, idx in pick for i in idx], 50),
        "fetch_p99_s": _pct([r["fetch"][i] for r, idx in pick for i in idx], 99),
        "prefill_p50_s": _pct([r["prefill"][i] for r, idx in pick for i in idx], 50),
        "prefill_p99_s": _pct([r["prefill"][i] for r, idx in pick for i in idx], 99),
        "cached_block_ratio": round(sum(r["cached_blocks"] for r in res) /
                                    max(1, sum(r["blocks"] for r in res)), 4),
        "replica_ratio": round(sum(r["replicas"] for r in res) / chunks, 4),
        "chunks_fetched": sum(r["chunks"] for r in res),
        "fetch_errors": sum(r["fetch_errors"] for r in res),
        "blocks_written": sum(r.get("written", 0) for r in res),
        "write_errors": sum(r.get("write_errors", 0) for r in res),
        "hottest_pool_egress_x_mean": round(max(egress) / (sum(egress) / len(egress)), 3)
        if sum(egress) else None,
        "seconds": round(time.monotonic() - t0, 1),
        "start_late_max_s": max(r.get("late_s", 0.0) for r in res),
        "switch_counters": {k: v - sw0.get(k, 0) for k, v in lab.counters().items()
                            if k in SW_KEYS}
        if sw0 else None,
    }
    log(f"{wl.name:5} {mode:8} ttft p50 {row['ttft_p50_s']:.3f}s p99 {row['ttft_p99_s']:.3f}s "
        f"fetch p50 {row['fetch_p50_s']:.3f}s hit {row['switch_hit_ratio']:.3f} "
        f"cached {row['cached_block_ratio']:.3f} retx {row['retransmit_ratio']:.4f} "
        f"egress {[round(e / 2**20, 1) for e in egress]} MiB exact {row['byte_exact']} "
        f"({row['seconds']} s)")
    return row


def fresh_mode(lab: Lab, mode: str) -> None:
    """The testbed as a new one for ``mode`` finds it: pool servers started afresh (empty), then
    switchd on fresh maps (switch) or a plain bridge (the others)."""
    if lab.switch is not None and mode != "switch":
        lab.stop_switch()
        lab.switchd("reset")
        plain_bridge_ports(lab.topo, True)
    for i in range(len(lab.pools)):
        lab.stop_pool(i)
    lab.start_pools()
    if mode == "switch" and lab.switch is None:
        lab.start_switch()


def make_workloads(names, nodes: int, pools_addrs, preset, trace_path: str,
                   trace_requests: int, scale: float = 1.0) -> dict[str, Workload]:
    """The workloads by name (``scale`` < 1 shrinks them for a quick run)."""
    from kvproto.wire import PORT
    pools = [(a, PORT) for a in pools_addrs]
    out = {}
    for i, name in enumerate(names):
        ns = NS_BASE + i
        if name == "trace":
            out[name] = trace_workload(trace_path, nodes, preset.prefill_tokens_per_s,
                                       max(nodes, int(trace_requests * scale)))
        elif name == "burst":
            out[name] = burst_workload(nodes, preset.prefill_tokens_per_s,
                                       prefix_blocks=max(2, int(32 * scale)),
                                       tail_s=6.0 * scale)
        else:
            out[name] = zipf_workload(nodes, pools, ns, objects=max(4, int(64 * scale)),
                                      hot=max(1, int(8 * scale)), seconds=15.0 * scale)
        out[name].params["ns"] = ns
    return out


def run_serve(nodes: int = 8, pools: int = 2, store: str = "memory", link_gbit: float = 0.025,
              workloads=WORKLOADS, modes=MODES, model: str = "llama3-8b",
              trace_path: str = DEFAULT_TRACE,
              trace_requests: int = 96, scale: float = 1.0, json_path: str | None = None,
              plot_path: str | None = None, prefix: str = "sv", log=print) -> dict:
    check(nodes, pools, link_gbit, workloads, modes)
    if "trace" in workloads and not Path(trace_path).is_file():
        raise TestbedError(f"no trace at {trace_path} (give --trace)")
    preset = MODELS[model]
    block_bytes = block_bytes_for(link_gbit)
    results = []
    kw = dict(hosts=nodes, pools=pools, chunk_size=CHUNK, store=store, pool_capacity="1GiB",
              link_gbit=link_gbit, pool_link_gbit=link_gbit)
    log(f"bench serve: modes {', '.join(modes)} x workloads {', '.join(workloads)} on {nodes} "
        f"nodes and {pools} pool nodes ({store}), links at {link_gbit:g} Gbit/s")
    with contextlib.ExitStack() as labs:
        lab = None
        for mode in modes:
            # with the memory store one testbed serves every mode (each on empty pool nodes);
            # Mooncake's master outlives a pool server, so there each mode has a testbed
            if lab is None or store != "memory":
                labs.close()
                log(f"bench serve: mode {mode}: building the testbed ...")
                lab = labs.enter_context(Lab(prefix, switch=mode == "switch", **kw))
            else:
                log(f"bench serve: mode {mode}: pool servers afresh ...")
                fresh_mode(lab, mode)
            wls = make_workloads(workloads, nodes, lab.pool_addrs, preset, trace_path,
                                 trace_requests, scale)
            for name in workloads:
                log(f"bench serve: mode {mode}, workload {name} ...")
                results.append(_run_workload(lab, wls[name], mode, wls[name].params["ns"],
                                             preset, block_bytes, log))
    config = {
        "nodes": nodes, "pools": pools, "store": store, "link_gbit": link_gbit,
        "chunk_bytes": CHUNK, "block_bytes": block_bytes, "block_tokens": 512,
        "cluster_block_bytes": CLUSTER_BLOCK_BYTES, "cluster_link_gbit": CLUSTER_GBIT,
        "fetch_time_scale": round(time_scale(link_gbit), 3),
        "preset": model, "prefill_tokens_per_s": preset.prefill_tokens_per_s,
        "switch_policy": "switchd default", "scale": scale, "cpus": os.cpu_count(),
        "workloads": {n: w.params for n, w in wls.items()},
        "requests": {n: w.n_requests for n, w in wls.items()},
    }
    out = {"config": config, "results": results, "summary": summary(results)}
    write_json(json_path, out)
    if plot_path:
        plot(out, plot_path)
    return out


def summary(results: list[dict]) -> dict:
    by = {(r["workload"], r["mode"]): r for r in results}
    s = {}

    def ratio(w, a, b, key):
        if (w, a) in by and (w, b) in by and by[(w, b)][key]:
            return round(by[(w, a)][key] / by[(w, b)][key], 3)
        return None

    if ("burst", "switch") in by:
        s["burst_p99_bridge_over_switch"] = ratio("burst", "bridge", "switch", "ttft_p99_s")
        s["burst_p99_replicas_over_switch"] = ratio("burst", "replicas", "switch", "ttft_p99_s")
    for m in MODES:
        if ("zipf", m) in by:
            s[f"zipf_hottest_pool_egress_x_mean_{m}"] = by[("zipf", m)][
                "hottest_pool_egress_x_mean"]
    if ("trace", "switch") in by and ("trace", "bridge") in by:
        s["trace_p50_switch_over_bridge"] = ratio("trace", "switch", "bridge", "ttft_p50_s")
        s["trace_p99_switch_over_bridge"] = ratio("trace", "switch", "bridge", "ttft_p99_s")
    s["all_byte_exact"] = all(r["byte_exact"] for r in results)
    s["max_retransmit_ratio"] = max(r["retransmit_ratio"] for r in results)
    return s


def plot(out: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    res = out["results"]
    wls = list(dict.fromkeys(r["workload"] for r in res))
    modes = list(dict.fromkeys(r["mode"] for r in res))
    by = {(r["workload"], r["mode"]): r for r in res}
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    x = np.arange(len(wls))
    w = 0.8 / len(modes)
    for i, m in enumerate(modes):
        p50 = [by.get((wl, m), {}).get("ttft_p50_s", 0) for wl in wls]
        p99 = [by.get((wl, m), {}).get("ttft_p99_s", 0) for wl in wls]
        axes[0].bar(x + i * w, p99, w, alpha=0.35, color=f"C{i}")
        axes[0].bar(x + i * w, p50, w, label=f"{m} (p50; light: p99)", color=f"C{i}")
        eg = [by.get((wl, m), {}).get("hottest_pool_egress_x_mean") or 0 for wl in wls]
        axes[1].bar(x + i * w, eg, w, label=m, color=f"C{i}")
    c = out["config"]
    axes[0].set(xticks=x + w * (len(modes) - 1) / 2, xticklabels=wls, ylabel="TTFT, s",
                title=f"TTFT: {c['nodes']} nodes, {c['pools']} pool nodes, links "
                      f"{c['link_gbit'] * 1000:g} Mbit/s, {c['preset']}")
    axes[1].set(xticks=x + w * (len(modes) - 1) / 2, xticklabels=wls,
                ylabel="hottest pool node egress / mean", title="Pool egress balance")
    axes[1].axhline(1.0, color="k", lw=0.5)
    for ax in axes:
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
