"""`testbed soak --faults`: `bench faults`' testbed serving its traffic without a pause for a
long time (an hour by default), with the next fault of testbed.lab.fault_kinds injected every
``every_s`` seconds, in turn. Every inference node serves segments of the traffic back to back,
all nodes on one clock (so the bursts stay bursts), failing over from silent pool nodes and
checking every byte (testbed.bench.serve.serve_node).

Sampled every ``sample_s``: the resident memory of switchd and of each pool server (with its pid:
a fault may restart one) and the switch's counters. Judged at the end, with the traffic
stopped: memory growth per hour of each process over the later half of its life (a least-squares
slope, as a share of its mean), the counters consistent (every frame the program saw has exactly
one verdict counted; frames dropped as spoofed, from a foreign namespace or as a reply from a
non-pool port would be an attack this testbed does not make), every request answered, no wrong
byte, and nothing left behind once the testbed is down."""
from __future__ import annotations

import os
import time

import numpy as np

from ...results import write_json
from ...lab.tasks import gather
from ...lab.fault_kinds import FAULTS, SECONDS, Target, heal, inject, leftover_processes
from .faults import (CHUNK, DEADLINE_S, REQUEST_TIMEOUT_S, FaultBench, holding_for,
                     left_after_teardown)
from ..serve.serve import _preload
from .soak import _rss_kib as rss_kib
from ..serve.serve_workloads import mixed_workload

SEGMENT_S = 30.0
VERDICTS = ("xdp_aborted", "xdp_drop", "xdp_pass", "xdp_tx", "xdp_redirect")
ATTACKS = ("spoofed", "not_from_pool", "denied", "unchecked", "port_zero")


def soak_node(stop: str, index: int, nodes: int, pools: list[str], ns: int, block_bytes: int,
              prefill_tok_s: float, t0: float) -> dict:
    """Task: node ``index``'s share of the traffic, one segment after another on the common
    clock from ``t0``, until ``stop`` exists; the counts."""
    from ..serve.serve_node import serve
    tot = {"requests": 0, "failed": 0, "wrong_bytes": 0, "fetch_errors": 0, "segments": 0}
    wl = mixed_workload(nodes, pools, ns, seconds=SEGMENT_S)     # the same every segment
    while not os.path.exists(stop):
        k = int(np.ceil((time.time() - t0) / SEGMENT_S))
        out = serve(pools, CHUNK, ns, block_bytes, wl.requests[index], t0 + k * SEGMENT_S,
                    prefill_tok_s, holding_for("memory", len(pools)), True, DEADLINE_S)
        tot["requests"] += len(wl.requests[index])
        tot["failed"] += len(wl.requests[index]) - sum(t <= REQUEST_TIMEOUT_S
                                                       for t in out["ttft"])
        tot["wrong_bytes"] += out["wrong_bytes"]
        tot["fetch_errors"] += out["fetch_errors"]
        tot["segments"] += 1
    return tot


def _rss_kib(pid: int) -> int | None:
    """``soak``'s reading, or None for a process that ended (a fault may end one)."""
    try:
        return rss_kib(pid)
    except (OSError, StopIteration):
        return None


def growth_per_hour(samples: list[tuple[float, int, int]]) -> dict:
    """Per process (name, pid): the least-squares slope of RSS over the later half of its
    samples, as a share of its mean per hour (the first half is its warm-up)."""
    by: dict = {}
    for t, key, rss in samples:
        by.setdefault(key, []).append((t, rss))
    out = {}
    for (name, pid), pts in by.items():
        later = pts[len(pts) // 2:]
        if len(later) < 3 or later[-1][0] - later[0][0] < 60:
            continue                                  # too short-lived to judge
        t, r = np.array(later, float).T
        slope = np.polyfit(t, r, 1)[0]                # KiB per second
        out[f"{name}/{pid}"] = {"minutes": round((t[-1] - t[0]) / 60, 1),
                                "mean_kib": int(r.mean()),
                                "growth_pct_per_hour": round(slope * 3600 / r.mean() * 100, 3)}
    return out


def settled_counters(lab, tries: int = 10) -> dict:
    """The switch's counters once two reads half a second apart agree (per-CPU counters read
    while a stray frame passes can disagree by one)."""
    last = lab.counters()
    for _ in range(tries):
        time.sleep(0.5)
        now = lab.counters()
        if now == last:
            break
        last = now
    return last


def run_fault_soak(minutes: float = 60.0, every_s: float = 180.0, sample_s: float = 10.0,
                   faults=FAULTS, nodes: int = 4, pools: int = 2, link_gbit: float = 0.025,
                   json_path: str | None = None, prefix: str = "fs", log=print) -> dict:
    bench = FaultBench(nodes, pools, link_gbit, prefix=prefix, log=log)
    stop = f"/tmp/kvsoak-{prefix}-{os.getpid()}.stop"
    samples, rss, injected = [], [], []
    log("soak --faults: building the testbed ...")
    with bench.lab("memory") as lab:
        ns = bench.ns
        pre = mixed_workload(nodes, lab.pool_addrs, ns, seconds=SEGMENT_S)
        _preload(lab, ns, pre.preload, bench.holding, bench.block_bytes)
        t0 = time.time() + 5.0
        tasks = [lab.start_task(n.name, f"{__name__}:soak_node", stop, i, nodes, lab.pool_addrs,
                                ns, bench.block_bytes, bench.preset.prefill_tokens_per_s, t0)
                 for i, n in enumerate(lab.topo.host_nodes)]
        end, next_fault, turn = t0 + minutes * 60, t0 + every_s, 0
        log(f"soak --faults: {minutes:g} minutes of serving, a fault every {every_s:g} s ...")
        while time.time() < end:
            now = time.time()
            if now >= next_fault:
                fault = faults[turn % len(faults)]
                turn += 1
                did = inject(lab, fault, Target())
                time.sleep(SECONDS[fault])
                healed = heal(lab, fault, Target())
                injected.append({"fault": fault, "at_s": round(now - t0, 1),
                                 "did": did, "healing": healed})
                log(f"{now - t0:7.1f} s: {fault}")
                next_fault += every_s
            t = time.time() - t0
            for name, proc in [("switchd", lab.switch)] + [
                    (f"pool-{n.name}", p) for n, p in zip(lab.topo.pool_nodes, lab.pools)]:
                if proc is not None and (kib := _rss_kib(proc.pid)) is not None:
                    rss.append((t, (name, proc.pid), kib))
            samples.append({"t_s": round(t, 1), **{k: v for k, v in lab.counters().items()
                                                   if k in ("packets", "get_hit", "get_miss",
                                                            "coalesced")}})
            time.sleep(max(0.0, min(sample_s, next_fault - time.time())))
        open(stop, "w").close()
        counts = gather(tasks, timeout=SEGMENT_S + 300)   # a writer's backlog too
        os.unlink(stop)
        final = settled_counters(lab)
        expected = {p.pid for p in lab.pools if p} | {lab.switch.pid}
        inside = leftover_processes(lab, expected)
    verdicts = sum(final[v] for v in VERDICTS)
    out = {"config": {"minutes": minutes, "every_s": every_s, "faults": list(faults),
                      "nodes": nodes, "pools": pools, "link_gbit": link_gbit,
                      "segment_s": SEGMENT_S, "sample_s": sample_s},
           "requests": sum(c["requests"] for c in counts),
           "failed_requests": sum(c["failed"] for c in counts),
           "wrong_bytes": sum(c["wrong_bytes"] for c in counts),
           "fetch_errors": sum(c["fetch_errors"] for c in counts),
           "faults_injected": injected,
           "memory": growth_per_hour(rss),
           "counters": {"packets": final["packets"], "verdicts": verdicts,
                        "attacks": {a: final.get(a, 0) for a in ATTACKS},
                        "consistent": verdicts == final["packets"] and
                        not any(final.get(a, 0) for a in ATTACKS)},
           "left_behind": inside + left_after_teardown(prefix), "samples": samples}
    write_json(json_path, out)
    return out
