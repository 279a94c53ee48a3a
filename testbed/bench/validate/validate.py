"""`testbed sim validate`: the cluster model against the veth testbed at the scale it reaches.

The first ``limit`` requests of a trace are replayed on a testbed with 4 inference nodes and one
pool node (namespaces ``simv<pid>-*``, always removed): every trace block is a 1024-byte KV block of
one chunk (keys and payloads as testbed.replay makes them), all put on the pool node first; requests
are routed to the 4 nodes as the model routes them, and each node's client fetches its requests'
blocks in chain order at ``speedup`` times the trace's pace, all four at once from a common start.
switchd runs its default policy every ``interval`` seconds over a cache of ``capacity`` blocks plus
fill headroom. Measured: the share of block fetches the switch answered (hits and coalesced
replicas, from the clients' reply flags) and the bytes every node's interface sent and received
during the replay. The model runs the same requests with the same routing, capacity, headroom,
interval and clock (trace time / speedup), the pool preloaded and no node tiers (the testbed's
clients cache nothing), and predicts both. Result: bench/results/sim-validate.json.
"""
from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path

import numpy as np

from ...lab import Lab
from ...lab.tasks import gather
from ...results import write_json
from ...sim.config import GIB, SimConfig
from ...sim.evaluate import capacity_blocks
from ...sim.model import simulate
from .replay import NS, block_key, block_payload, put_blocks
from ...sim.trace import Trace, load_trace
from ...sim.verdict import BY_CONSTRUCTION, FLOOR, RELATIVE, share_agrees, share_bound
from ...sim.workload import Workload, route

HOSTS = 4
BLOCK = 1024
LINKS = {"nodes_to_switch": ("host", "tx"), "switch_to_nodes": ("host", "rx"),
         "pool_to_switch": ("pool", "tx"), "switch_to_pool": ("pool", "rx")}
TARGET_BYTES = 0.10


def _slice(trace: Trace, n: int) -> Trace:
    end = int(trace.offsets[n])
    return Trace(trace.timestamp[:n], trace.input_length[:n], trace.output_length[:n],
                 trace.offsets[:n + 1].copy(), trace.hash_ids[:end], trace.path)


def _workload(trace: Trace) -> Workload:
    return Workload((trace.timestamp - trace.timestamp[0]) / 1000.0, trace.input_length,
                    trace.offsets, trace.hash_ids)


def model_config(cap: int, headroom: int, routing: str, speedup: float,
                 interval: float) -> SimConfig:
    """The model set up as the testbed is: 1024-byte blocks, one chunk each, no node tiers."""
    total = cap + headroom
    return SimConfig(nodes=HOSTS, pools=1, kv_bytes_per_token=BLOCK // 512, block_tokens=512,
                     hbm_gib=0, dram_gib=0, switch_gib=total * BLOCK / GIB,
                     headroom=headroom / total, chunk_bytes=BLOCK, routing=routing,
                     demote="none", interval=interval, clock_scale=speedup, preload=True,
                     switch_budget=1 << 62)


# ---- inside the namespaces (tasks) --------------------------------------------------------------
async def put(trace_path: str, limit: int, pool: str) -> dict:
    from hostagent.inference.client import KVClient
    tr = _slice(load_trace(trace_path), limit)
    ids = np.unique(tr.hash_ids).tolist()
    async with KVClient([pool], chunk_size=BLOCK, window=64) as c:
        await put_blocks(c, ids, BLOCK)
    return {"blocks": len(ids)}


async def drive(trace_path: str, limit: int, pool: str, routes_path: str, me: int,
                speedup: float, start_at: float) -> dict:
    from hostagent.inference.client import KVClient
    tr = _slice(load_trace(trace_path), limit)
    mine = [i for i, n in enumerate(json.loads(Path(routes_path).read_text())) if n == me]
    ts0 = int(tr.timestamp[0])
    hits = replicas = total = exact = 0
    async with KVClient([pool], chunk_size=BLOCK, window=64) as c:
        await asyncio.sleep(max(0.0, start_at - time.time()))
        t0 = time.monotonic() - max(0.0, time.time() - start_at)
        for i in mine:
            lag = (int(tr.timestamp[i]) - ts0) / 1000 / speedup - (time.monotonic() - t0)
            if lag > 0:
                await asyncio.sleep(lag)
            for h in tr.blocks(i).tolist():
                data, st = await c.get_block(NS, block_key(h), nchunks=1)
                total += 1
                hits += st.from_switch
                replicas += st.replicas
                exact += data == block_payload(h, BLOCK)
        seconds = time.monotonic() - t0
    return {"requests": len(mine), "block_requests": total, "switch_hits": hits,
            "replicas": replicas, "byte_exact": exact == total, "seconds": round(seconds, 2)}


# ---- orchestration ------------------------------------------------------------------------------
def _counters(lab: Lab) -> dict:
    return {n.name: {d: lab.link_bytes(n.name, d) for d in ("tx", "rx")} for n in lab.topo.nodes}


def run_validate(trace_path: str, limit: int = 2000, capacity: float = 0.05,
                 speedup: float = 20.0, routing: str = "random", json_path: str | None = None,
                 interval: float = 0.1, log=print) -> dict:
    trace = load_trace(trace_path)
    n = min(limit, trace.n_requests)
    tr = _slice(trace, n)
    cap = capacity_blocks(capacity, tr.distinct_blocks)
    headroom = max(16, cap // 4)
    cfg = model_config(cap, headroom, routing, speedup, interval)
    wl = _workload(tr)
    routes = route(wl, cfg)
    t0 = time.monotonic()
    trace_abs = str(Path(trace_path).resolve())
    log(f"validate: {n} requests of the trace on {HOSTS} nodes; building the testbed, putting "
        "the blocks ...")
    with Lab(f"simv{os.getpid() % 10000}", hosts=HOSTS, pools=1, chunk_size=BLOCK,
             cache_entries=cap + headroom,
             switchd_args=("--interval", str(interval), "--fill-headroom", str(headroom))) as lab:
        pool = lab.pool_addrs[0]
        lab.task("h1", f"{__name__}:put", trace_abs, n, pool, timeout=600)
        routes_path = os.path.join(lab.tmp.name, "routes.json")
        Path(routes_path).write_text(json.dumps(routes.tolist()))
        log(f"validate: {n} requests, {tr.n_block_requests} block fetches put; replaying on "
            f"{HOSTS} nodes ({time.monotonic() - t0:.0f}s)")
        before = _counters(lab)
        start_at = time.time() + 2.0
        tasks = [lab.start_task(f"h{i + 1}", f"{__name__}:drive", trace_abs, n, pool,
                                routes_path, i, speedup, start_at) for i in range(HOSTS)]
        live = gather(tasks, timeout=900)
        after = _counters(lab)
        counters = lab.stats()
    delta = {node: {d: after[node][d] - before[node][d] for d in ("tx", "rx")} for node in after}
    measured_bytes = {link: sum(v[d] for node, v in delta.items()
                                if (node.startswith("h") if role == "host"
                                    else node.startswith("p")))
                      for link, (role, d) in LINKS.items()}
    total = sum(r["block_requests"] for r in live)
    sw = sum(r["switch_hits"] + r["replicas"] for r in live)
    measured_hit = sw / total
    model = simulate(wl, cfg)
    on = model["pool_on"]
    model_hit = on["hit_ratio"]["switch"] + on["hit_ratio"]["switch_replica"]
    bytes_cmp = {link: {"measured": measured_bytes[link], "model": on["bytes"][link],
                        "error": round(on["bytes"][link] / max(1, measured_bytes[link]) - 1, 4)}
                 for link in LINKS}
    comparison = {
        "switch_hit_ratio": {"measured": round(measured_hit, 4), "model": round(model_hit, 4),
                             "difference_pp": round(100 * (model_hit - measured_hit), 2),
                             "bound_pp": round(100 * share_bound(measured_hit), 2),
                             "agrees": share_agrees(measured_hit, model_hit)},
        "pool_hit_ratio": {"measured": round(1 - measured_hit, 4),
                           "model": round(on["hit_ratio"]["pool"], 4),
                           "agrees": BY_CONSTRUCTION},        # 1 - the switch's, both sides
        "bytes_per_link": bytes_cmp,
    }
    ok = (comparison["switch_hit_ratio"]["agrees"]
          and all(abs(v["error"]) <= TARGET_BYTES for v in bytes_cmp.values()))
    out = {"trace": trace_path, "requests": n, "block_requests": int(tr.n_block_requests),
           "hosts": HOSTS, "routing": routing, "capacity_blocks": cap,
           "fill_headroom_blocks": headroom, "speedup": speedup, "interval_s": interval,
           "live": {"clients": live, "byte_exact": all(r["byte_exact"] for r in live),
                    "switch_fill": counters.get("fill"), "spec_fill": counters.get("spec_fill"),
                    "per_node_bytes": delta},
           "model": {"hit_ratio": on["hit_ratio"], "bytes": on["bytes"],
                     "policy_steps": on["switch"].get("policy_steps")},
           "comparison": comparison,
           "targets": {"hit_ratio_relative": RELATIVE, "hit_ratio_floor": FLOOR,
                       "bytes_relative": TARGET_BYTES},
           "within_targets": ok, "seconds": round(time.monotonic() - t0, 1)}
    log(f"validate: switch hit ratio measured {measured_hit:.4f} model {model_hit:.4f} "
        f"({comparison['switch_hit_ratio']['difference_pp']:+.2f} pp); bytes errors "
        + ", ".join(f"{k} {v['error']:+.1%}" for k, v in bytes_cmp.items()))
    write_json(json_path, out)
    return out
