"""`testbed sim validate --serve`: the cluster model against `testbed bench serve` at its own
point. For each mode (switch, bridge; replicas on request) one testbed of bench serve's
configuration (testbed.bench.serve.serve: N inference nodes, P pool nodes, every link queueing
at one rate, chunk and block sizes scaled with the links, switchd's default policy) runs bench
serve's workloads one after another with bench serve's own code (make_workloads, _run_workload);
before them, the testbed's timing constants are measured with every node probing at once
(``calibrate``): the fetch engine's round trip (one node's fetch of one block from the pool on idle
links) and the box's wake-up latency; the link rate is the configured one, which the links hold (the
probe's is kept as a check). The model (testbed.sim.serve_model) then replays the same request lists
with those constants and switchd's default policy at the same cache size, interval and fill
headroom. Compared per (workload, mode): TTFT p50 and p99 (warm-up requests apart), the share of
fetched blocks per tier (switch: hits and held replicas; pool) and of looked-up blocks found in a
remote tier (the rest is recomputed), and each pool node's egress bytes. Verdict
(testbed.sim.verdict): TTFT p50 within 10 %, and the split the model could get wrong, switch hits
and held replicas, each within 20 % of the measured share (1 pp at least); the pool's share, the
cached and the recomputed blocks agree by construction and are shown as such. Result:
bench/results/sim-validate-serve.json."""
from __future__ import annotations

import statistics
import time

from ..serve import serve as bench_serve
from ..serve.serve_workloads import block_key
from ...lab import Lab
from ...lab.tasks import gather
from ...results import write_json
from ...sim.config import FRAME_OVERHEAD, MODELS
from ...sim.trace import DEFAULT_TRACE
from ...sim.serve_model import Calibration, simulate_serve, summarise
from ...sim.verdict import (BY_CONSTRUCTION, FLOOR, RELATIVE, relative_agrees, share_agrees,
                            share_bound)

TARGET_P50 = 0.10
# the shares the verdict checks (hits and held replicas: what timing decides) and those that
# agree by construction (the pool's is fetched - hits - replicas; the cached and recomputed
# blocks are the workload's own; the switch's is the sum of the two checked)
CHECKED = ("switch_hit", "switch_replica")
DERIVED = ("switch", "pool", "cached_blocks", "recompute")
PROBE_NS, PROBE_REPS, PROBE_SET = 99, 15, 8
INTERVAL = 1.0                                   # switchd's default policy step


# ---- in a node (a testbed.lab task) -------------------------------------------------------------
def probe(pools: list[str], chunk: int, ns: int, block_bytes: int, reps: int, n: int,
          links: bool, tag: str, start_at: float) -> dict:
    """Run in every node at once (the box as busy with engines as in a run). Times of: a lookup
    of a block no pool holds (NOT_FOUND), a sleep's overshoot (when a node wakes for an arrival
    or at the end of a modelled prefill) and, with ``links`` (one node, so that the links are
    idle), a fetch of one block and a fetch of ``n`` blocks at once, each on blocks not fetched
    before."""
    from hostagent.inference.fetch.engine import FetchEngine
    out = {"not_found": [], "wake": [], "one": [], "many": []}
    with FetchEngine(pools, chunk) as eng:
        def timed(keys):
            t0 = time.monotonic()
            got = eng.get_blocks([(ns, k, None) for k in keys], return_exceptions=True)
            dt = time.monotonic() - t0
            for b in got:
                if not isinstance(b, BaseException):
                    b.release()
            return dt
        time.sleep(max(0.0, start_at - time.time()))
        for r in range(reps):
            for i in range(4):
                out["not_found"].append(timed([block_key(f"probe-missing-{tag}", 4 * r + i)]))
                t0 = time.monotonic()
                time.sleep(0.01)
                out["wake"].append(time.monotonic() - t0 - 0.01)
            if links:
                out["one"].append(timed([block_key("probe", r)]))
                out["many"].append(timed([block_key("probe", 1000 + r * n + i)
                                          for i in range(n)]))
            time.sleep(0.1)
    return out


def probe_keys(reps: int, n: int) -> list[str]:
    return ([block_key("probe", r).hex() for r in range(reps)]
            + [block_key("probe", 1000 + r * n + i).hex() for r in range(reps) for i in range(n)])


def calibrate(lab: Lab, block_bytes: int, chunk: int, link_gbit: float) -> Calibration:
    """The fetch engine's round trip and the box's wake-up latency, measured on this testbed
    with every node's engine open and probing at once (t(1 block) less one block's frames at
    the link's rate is the round trip; a 10 ms sleep's overshoot is the wake-up latency), and
    the links' rate: the configured one, which the links hold (tests/test_links.py); the rate
    the probe's t(n blocks) - t(1 block) implies is kept beside it."""
    bench_serve._preload(lab, PROBE_NS, probe_keys(PROBE_REPS, PROBE_SET), None, block_bytes)
    start_at = time.time() + 2.0 + 0.3 * len(lab.topo.host_nodes)
    tasks = [lab.start_task(h.name, f"{__name__}:probe", lab.pool_addrs, chunk, PROBE_NS,
                            block_bytes, PROBE_REPS, PROBE_SET, i == 0, h.name, start_at)
             for i, h in enumerate(lab.topo.host_nodes)]
    res = gather(tasks, timeout=600)
    m = {k: [x for r in res for x in r[k]] for k in res[0]}
    med = {k: statistics.median(v) for k, v in m.items()}
    chunks = -(-block_bytes // chunk)
    wire = chunks * (chunk + FRAME_OVERHEAD)
    rate = link_gbit * 1e9 / 8
    probed = ((PROBE_SET - 1) * wire / (med["many"] - med["one"])
              if med["many"] > med["one"] else None)
    rtt = max(0.0, med["one"] - wire / rate)
    return Calibration(rate, rtt, chunk, block_bytes, wake_s=max(0.0, med["wake"]), source={
        "measured_s": {k: [round(x, 5) for x in v] for k, v in m.items()},
        "medians_s": {k: round(v, 5) for k, v in med.items()},
        "probed_rate_vs_configured": round(probed / rate, 3) if probed else None,
        "how": f"link rate: the configured one (the link test holds frames to it, XDP-answered "
               f"and stack alike; the probe's {PROBE_SET - 1} blocks' frames / (t({PROBE_SET} "
               f"blocks) - t(1 block)) is kept as a check: a busy CPU stretches it); "
               f"rtt = t(1 block) - one block's frames / rate, from h1 ({PROBE_REPS} probes, "
               f"median) while every node probes; wake = a 10 ms sleep's overshoot (median "
               f"over every node)"})


# ---- comparison ---------------------------------------------------------------------------------
def _measured_tiers(row: dict) -> dict:
    hit, rep = row["switch_hit_ratio"], row.get("replica_ratio", 0.0)
    fetched = 1.0 if row["chunks_fetched"] else 0.0        # shares of the fetched chunks
    return {"switch": round(hit + rep, 4), "switch_hit": hit, "switch_replica": rep,
            "pool": round(fetched - hit - rep, 4), "cached_blocks": row["cached_block_ratio"],
            "recompute": round(1 - row["cached_block_ratio"], 4)}


def _model_tiers(m: dict) -> dict:
    s = m["tier_share"]
    return {"switch": round(s["switch"] + s["switch_replica"], 4), "switch_hit": s["switch"],
            "switch_replica": s["switch_replica"], "pool": s["pool"],
            "cached_blocks": m["cached_block_ratio"],
            "recompute": round(1 - m["cached_block_ratio"], 4)}


def compare(row: dict, model: dict) -> dict:
    mt, tt = _measured_tiers(row), _model_tiers(model)
    ms = summarise(model["requests"])
    rel = (lambda a, b: round(b / a - 1, 4) if a else None)
    ttft = {q: {"measured": row[f"ttft_{q}_s"], "model": ms[f"ttft_{q}_s"],
                "error": rel(row[f"ttft_{q}_s"], ms[f"ttft_{q}_s"])} for q in ("p50", "p99")}
    tiers = {k: {"measured": mt[k], "model": tt[k],
                 "difference_pp": round(100 * (tt[k] - mt[k]), 2)} for k in mt}
    for k in CHECKED:                       # what the model could get wrong: the split
        tiers[k]["bound_pp"] = round(100 * share_bound(mt[k]), 2)
        tiers[k]["agrees"] = share_agrees(mt[k], tt[k])
    for k in DERIVED:                       # what it cannot: computed from those, or given
        tiers[k]["agrees"] = BY_CONSTRUCTION
    egress = [{"measured": a, "model": b, "error": rel(a, b)}
              for a, b in zip(row["pool_egress_bytes"], model["pool_egress_bytes"])]
    ok_p50 = relative_agrees(row["ttft_p50_s"], ms["ttft_p50_s"], TARGET_P50)
    ok_tiers = all(tiers[k]["agrees"] for k in CHECKED)
    return {"workload": row["workload"], "mode": row["mode"], "ttft": ttft, "tiers": tiers,
            "pool_egress_bytes": egress, "chunks_fetched": {"measured": row["chunks_fetched"],
                                                            "model": model["chunks_fetched"]},
            "ttft_p50_within_target": ok_p50, "tiers_within_target": ok_tiers}


# ---- orchestration ------------------------------------------------------------------------------
def run_validate_serve(nodes: int = 8, pools: int = 2, link_gbit: float = 0.025,
                       workloads=("trace", "burst", "zipf"), modes=("switch", "bridge"),
                       scale: float = 1.0,
                       trace_path: str = DEFAULT_TRACE,
                       trace_requests: int = 96, json_path: str | None = None,
                       prefix: str | None = None, model: str = "llama3-8b", log=print) -> dict:
    bench_serve.check(nodes, pools, link_gbit, workloads, modes)
    preset = MODELS[model]
    block_bytes = bench_serve.block_bytes_for(link_gbit)
    chunk = bench_serve.CHUNK
    prefix = prefix or f"svv{__import__('os').getpid() % 10000}"
    t0 = time.monotonic()
    rows, comparisons, cals = [], [], {}
    log(f"validate --serve: modes {', '.join(modes)} x workloads {', '.join(workloads)} on "
        f"{nodes} nodes and {pools} pool nodes")
    for mode in modes:
        log(f"validate --serve: mode {mode}: building the testbed, probing its timing ...")
        with Lab(prefix, hosts=nodes, pools=pools, chunk_size=chunk, switch=mode == "switch",
                 store="memory", pool_capacity="1GiB", link_gbit=link_gbit,
                 pool_link_gbit=link_gbit) as lab:
            cal = calibrate(lab, block_bytes, chunk, link_gbit)
            cals[mode] = {"link_bytes_per_s": round(cal.link_bytes_per_s, 1),
                          "rtt_s": round(cal.rtt_s, 5), "wake_s": round(cal.wake_s, 5),
                          **cal.source}
            log(f"{mode}: link {cal.link_bytes_per_s * 8 / 1e6:.2f} Mbit/s (probed x "
                f"{cal.source['probed_rate_vs_configured']}), round trip "
                f"{cal.rtt_s * 1e3:.1f} ms, wake-up {cal.wake_s * 1e3:.1f} ms")
            wls = bench_serve.make_workloads(workloads, nodes, lab.pool_addrs, preset,
                                             trace_path, trace_requests, scale)
            cache_blocks = lab.cache_entries // cal.chunks
            for name in workloads:
                wl = wls[name]
                log(f"validate --serve: mode {mode}, workload {name} ...")
                row = bench_serve._run_workload(lab, wl, mode, wl.params["ns"], preset,
                                                block_bytes, log)
                m = simulate_serve(wl.requests, wl.preload, mode, lab.pool_addrs,
                                   wl.params["ns"], cal, preset.prefill_tokens_per_s,
                                   cache_blocks=cache_blocks, interval=INTERVAL)
                c = compare(row, m)
                log(f"  model {name} {mode}: ttft p50 {c['ttft']['p50']['model']} "
                    f"({c['ttft']['p50']['error']:+.1%}) p99 {c['ttft']['p99']['model']}; "
                    f"switch {c['tiers']['switch']['model']} vs {c['tiers']['switch']['measured']}"
                    f", cached {c['tiers']['cached_blocks']['model']} vs "
                    f"{c['tiers']['cached_blocks']['measured']}")
                rows.append(row)
                comparisons.append(c)
    out = {"config": {"nodes": nodes, "pools": pools, "link_gbit": link_gbit,
                      "chunk_bytes": chunk, "block_bytes": block_bytes, "scale": scale,
                      "workloads": list(workloads), "modes": list(modes), "preset": model,
                      "trace": trace_path, "trace_requests": trace_requests,
                      "switch": {"policy": "switchd default", "interval_s": INTERVAL,
                                 "cache_entries": Lab.__init__.__defaults__[2],
                                 "fill_headroom": "1/16 of the cache"}},
           "calibration": cals,
           "live": rows,          # what the testbed measured ("measured": the stamp)
           "comparison": comparisons,
           "targets": {"ttft_p50_relative": TARGET_P50, "share_relative": RELATIVE,
                       "share_floor": FLOOR, "shares_checked": list(CHECKED),
                       "shares_by_construction": list(DERIVED)},
           "within_targets": {f"{c['workload']}/{c['mode']}": c["ttft_p50_within_target"]
                              and c["tiers_within_target"] for c in comparisons},
           "completed": all(r["byte_exact"] for r in rows),
           "seconds": round(time.monotonic() - t0, 1)}
    write_json(json_path, out)
    return out
