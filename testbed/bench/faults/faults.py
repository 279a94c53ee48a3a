"""`testbed bench faults`: one fault at a time (testbed.lab.fault_kinds) injected into a serving
testbed while requests are in flight, side by side with the same traffic over the plain bridge
and through the switch with no fault.

`bench serve`'s testbed and serving loops (testbed.bench.serve: serve, serve_node): N inference
nodes, P pool nodes, links at one rate, switchd's default policy. The traffic (serve_workloads'
``mixed``) is the zipf workload throughout with a burst every few seconds (a new prefix asked
by every node at once); the fault strikes at a random moment within the second burst's first
``0.3`` s, while GETs for it are held in the switch, and ends ``seconds`` later. The nodes'
loops fail over as the product does (``hostagent.common.pools``: a transfer silent for 1 s asks
the block's next holder, and the silent node is left out for a while): with the memory and disk
stores every block is written to ``FAILOVER_REPLICAS`` pool nodes, with Mooncake every node
reads every block from the shared store (``holding_for``). Every fetched byte is checked.

Per run: requests completed and failed (no first token within REQUEST_TIMEOUT_S, or a node's
loop that died: a block that cannot be fetched is recomputed, so a request fails only when even
that runs past the bound), fetch errors (blocks whose fetch failed: not found is not an error)
and blocks recomputed (every block a request did not get from the pool or the switch), wrong
bytes handed to a node, blocks lost from the pool (every block the pool held before the run,
read afterwards past the switch's cache), TTFT p50/p99 before, during (from the fault to
``AFTER_S`` past its end) and after, the bridge's p99 over the same requests, seconds from the
fault's end until a sliding window's TTFT p50, and its p99, is within 10 % of the fault-free
run's, and what was left behind (processes, namespaces, pins, cgroups). With the memory store
every run shares one testbed (each on empty pool nodes and a fresh switch); Mooncake's master
outlives a pool server, so there each run has a testbed of its own."""
from __future__ import annotations

import contextlib
import random
import subprocess
import time
from pathlib import Path

import numpy as np

from ...lab import Lab, TestbedError
from ...lab.topology import plain_bridge_ports
from ...lab.fault_kinds import (FAULTS, SECONDS, SWITCH_FAULTS, MemoryLimit, Target, heal,
                                inject, leftover_processes)
from ...results import write_json
from ...sim.config import MODELS
from ..serve.serve import (CHUNK, NS_BASE, _pct as serve_pct, _preload, block_bytes_for,
                           check_choices, serve_phases)
from ..serve.serve_workloads import mixed_workload

STORES = ("memory", "mooncake", "disk")
REQUEST_TIMEOUT_S = 30.0      # a request without its first token by then has failed
READ_BACK_DEADLINE_S = 10.0   # reading a block back after a run, from each pool node in turn
# a block fetch's deadline in the nodes (silence: 1 s; then the next pool node is asked)
DEADLINE_S = 5.0
AFTER_S = 2.0                 # "during" reaches this far past the fault's end
WINDOW_S = 1.0                # the sliding window of recovery_s (its error: half of it)
DISK_POOL_DRAM = "2MiB"       # with the disk tier: most blocks live on disk
FAILOVER_REPLICAS = 2         # pool nodes holding each block where a store keeps one copy


def holding_for(store: str, pools: int) -> dict:
    """The placement of a run's blocks (serve_node.placement): Mooncake's nodes share one
    store (any node reads any block); the memory and disk stores keep one copy per node, so
    each block goes to ``FAILOVER_REPLICAS`` of them."""
    return {"shared": True} if store == "mooncake" else {
        "replicas": min(FAILOVER_REPLICAS, pools)}


def check(faults, stores, nodes: int, pools: int, link_gbit: float, seconds: float | None,
          run_s: float, target: Target) -> None:
    """One clear error for a configuration the benchmark cannot run (before any testbed)."""
    check_choices("fault", faults, FAULTS)
    check_choices("store", stores, STORES)
    if not 1 <= nodes <= 24:
        raise TestbedError(f"--nodes must be 1..24 on this box, got {nodes}")
    if not (2 if "mooncake" in stores else 1) <= pools <= 8:
        raise TestbedError(f"--pools must be 1..8 (2 or more with mooncake), got {pools}")
    if not link_gbit > 0:
        raise TestbedError(f"--link-gbit must be > 0, got {link_gbit:g}")
    if seconds is not None and not seconds > 0:
        raise TestbedError(f"--fault-seconds must be > 0, got {seconds:g}")
    if not run_s >= 12:
        raise TestbedError(f"--run-seconds must be >= 12 (two bursts and a recovery), "
                           f"got {run_s:g}")
    for what, name, kind, n in (("--host-node", target.host, "h", nodes),
                                ("--pool-node", target.pool, "p", pools)):
        if name not in {f"{kind}{i}" for i in range(1, n + 1)}:
            raise TestbedError(f"{what} {name}: no such node (this testbed has {kind}1.."
                               f"{kind}{n})")


def runs_for(faults, stores) -> list[tuple[str, str]]:
    """(fault, store) pairs: every fault with the memory store; pool-kill with each store."""
    out = [(f, "memory") for f in faults if "memory" in stores]
    if "pool-kill" in faults:
        out += [("pool-kill", s) for s in stores if s != "memory"]
    return out


def _pct(x, q) -> float | None:
    """serve's percentile, None where a window has no request (not 0)."""
    return serve_pct(x, q) if len(x) else None


class Timeline:
    """A run's requests: arrival (s from the start), TTFT (None: no answer)."""

    def __init__(self, wl, res: list[dict]):
        self.at, self.ttft = [], []
        for reqs, r in zip(wl.requests, res):
            got = r.get("ttft", [])
            for i, q in enumerate(reqs):
                self.at.append(q["at"])
                self.ttft.append(got[i] if i < len(got) else None)
        self.at = np.asarray(self.at)

    def failed(self) -> int:
        return sum(t is None or t > REQUEST_TIMEOUT_S for t in self.ttft)

    def window(self, lo: float, hi: float) -> list[float]:
        return [t if t is not None else REQUEST_TIMEOUT_S
                for a, t in zip(self.at, self.ttft) if lo <= a < hi]


def recovery_s(run: Timeline, calm: Timeline, healed: float, end: float,
               pct: float = 50) -> float | None:
    """Seconds from ``healed`` until the TTFT ``pct``-th percentile of a sliding window is
    within 10 % of the fault-free run's over the same requests (None: not within the run).
    The p50 barely sees a fault that slows a few requests; the p99 sees the slowest."""
    t = healed
    while t + WINDOW_S <= end:
        got, want = run.window(t, t + WINDOW_S), calm.window(t, t + WINDOW_S)
        if got and want and np.percentile(got, pct) <= 1.1 * np.percentile(want, pct):
            return round(t - healed, 2)
        t += 0.25
    return None


def _fresh(lab: Lab, switch: bool) -> None:
    """Empty pool nodes; switchd on fresh maps (``switch``) or a plain bridge."""
    if lab.switch is not None:
        lab.stop_switch()
    lab.switchd("reset")
    for i in range(len(lab.pools)):
        if lab.pools[i] is not None:
            lab.stop_pool(i)
    lab.start_pools()
    if switch:
        lab.start_switch()
    else:
        plain_bridge_ports(lab.topo, True)


def blocks_lost(lab: Lab, ns: int, keys: list[str], block_bytes: int) -> tuple[int, int]:
    """(blocks the pool no longer serves, wrong bytes among those it does), read from h1 past
    the switch's cache."""
    return tuple(lab.task(lab.topo.host_nodes[0].name, f"{__name__}:read_back", lab.pool_addrs,
                          CHUNK, ns, keys, block_bytes))


def read_back(pools, chunk_size, ns, keys, block_bytes) -> list[int]:
    """In a node: fetch every block of ``keys`` bypassing the switch's cache, from its owner
    and then from every other pool node: a block is lost when none serves it (a Mooncake node
    whose read meets its dead incarnation's replica refuses it; another replica serves it)."""
    from hostagent.inference.fetch.engine import FetchEngine
    from ..serve.serve_node import wrong_bytes
    from ..serve.serve_workloads import payload
    todo, wrong = [bytes.fromhex(k) for k in keys], 0
    for route in [pools] + [[p] for p in pools]:
        if not todo:
            break
        missed = []
        with FetchEngine(route, chunk_size, deadline=READ_BACK_DEADLINE_S) as eng:
            for i in range(0, len(todo), 64):
                part = todo[i:i + 64]
                for k, b in zip(part, eng.get_blocks([(ns, k) for k in part], no_cache=True,
                                                     return_exceptions=True)):
                    if isinstance(b, BaseException):
                        missed.append(k)
                    else:
                        wrong += wrong_bytes(b.tobytes(), payload(k, block_bytes))
                        b.release()
        todo = missed
    return [len(todo), wrong]


class FaultBench:
    def __init__(self, nodes=8, pools=2, link_gbit=0.025, run_s=40.0, fault_seconds=None,
                 target: Target | None = None, seed=1, model="llama3-8b", prefix="fb",
                 log=print):
        self.nodes, self.pools, self.link_gbit, self.run_s = nodes, pools, link_gbit, run_s
        self.fault_seconds, self.target = fault_seconds, target or Target()
        self.rng, self.seed, self.prefix, self.log = random.Random(seed), seed, prefix, log
        self.preset, self.model = MODELS[model], model
        self.block_bytes = block_bytes_for(link_gbit)
        self.ns = NS_BASE

    def lab(self, store: str) -> Lab:
        self.holding = holding_for(store, self.pools)          # the runs on this testbed's
        return Lab(self.prefix, hosts=self.nodes, pools=self.pools, chunk_size=CHUNK,
                   store="mooncake" if store == "mooncake" else "memory",
                   replicas=2 if store == "mooncake" else 1,
                   pool_capacity=DISK_POOL_DRAM if store == "disk" else "1GiB",
                   pool_disk="1GiB" if store == "disk" else None,
                   link_gbit=self.link_gbit, pool_link_gbit=self.link_gbit)

    def run(self, lab: Lab, mode: str, fault: str | None = None) -> tuple[dict, Timeline]:
        """One run of the traffic: ``bridge``, ``switch``, or ``switch`` with ``fault``."""
        self.log(f"bench faults: {mode}, {fault or 'no fault'} ({self.run_s:g} s of traffic) ...")
        _fresh(lab, mode == "switch")
        self.ns += 1
        wl = mixed_workload(self.nodes, lab.pool_addrs, self.ns, seconds=self.run_s)
        _preload(lab, self.ns, wl.preload, self.holding, self.block_bytes)
        when: dict = {}

        def strike(start: float) -> None:
            burst = wl.params["bursts_at_s"][min(1, len(wl.params["bursts_at_s"]) - 1)]
            when["fault_at_s"] = round(burst + self.rng.uniform(0.0, 0.3), 3)
            time.sleep(max(0.0, start + when["fault_at_s"] - time.time()))
            when["did"] = inject(lab, fault, self.target)
            when["injected_at_s"] = round(time.time() - start, 3)     # in effect from here
            time.sleep(self.fault_seconds if self.fault_seconds is not None else SECONDS[fault])
            when["heal_at_s"] = round(time.time() - start, 3)
            when["healing"] = heal(lab, fault, self.target)
            when["healed_at_s"] = round(time.time() - start, 3)       # (a restart's time too)

        died: list = []
        t0 = time.monotonic()
        res = serve_phases(lab, wl, self.ns, self.preset.prefill_tokens_per_s, self.block_bytes,
                           self.holding, at_start=strike if fault else None,
                           deadline=DEADLINE_S, failed=died)
        expected = {p.pid for p in lab.pools if p} | ({lab.switch.pid} if lab.switch else set())
        if lab.master is not None and lab.master.proc is not None:
            expected.add(lab.master.proc.pid)
        lost, wrong_read = blocks_lost(lab, self.ns, wl.preload, self.block_bytes)
        tl = Timeline(wl, res)
        row = {"mode": mode, "requests": len(tl.ttft), "failed_requests": tl.failed(),
               "wrong_bytes": sum(r.get("wrong_bytes", 0) for r in res) + wrong_read,
               "blocks_lost": lost, "blocks_before": len(wl.preload),
               "fetch_errors": sum(r.get("fetch_errors", 0) for r in res),
               "recomputed_blocks": sum(r.get("recomputed_blocks", 0) for r in res),
               "byte_exact": all(r.get("byte_exact", False) for r in res),
               "ttft_p50_s": _pct(tl.window(0, 1e9), 50), "ttft_p99_s": _pct(tl.window(0, 1e9), 99),
               "nodes_failed": died, "seconds": round(time.monotonic() - t0, 1),
               "left_behind": leftover_processes(lab, expected), **when}
        return row, tl

    def measure(self, fault: str, store: str, lab: Lab, calm: dict | None) -> dict:
        """The run with ``fault``, beside the fault-free ones (``calm``; None: not run)."""
        row, tl = self.run(lab, "switch", fault)
        fault_at, healed = row.pop("fault_at_s"), row.pop("healed_at_s")
        until = healed + AFTER_S
        bridge, switch = (calm["bridge"][1], calm["switch"][1]) if calm else (None, None)
        out = {"fault": fault, "store": store, "failed_requests": row["failed_requests"],
               "fetch_errors": row["fetch_errors"], "recomputed_blocks": row["recomputed_blocks"],
               "wrong_bytes": row["wrong_bytes"], "blocks_lost": row["blocks_lost"],
               "ttft_p50_before_s": _pct(tl.window(0, fault_at), 50),
               "ttft_p99_before_s": _pct(tl.window(0, fault_at), 99),
               "ttft_p50_during_s": _pct(tl.window(fault_at, until), 50),
               "ttft_p99_during_s": _pct(tl.window(fault_at, until), 99),
               "ttft_p50_after_s": _pct(tl.window(until, 1e9), 50),
               "ttft_p99_after_s": _pct(tl.window(until, 1e9), 99),
               "bridge_ttft_p99_s": _pct(bridge.window(fault_at, until), 99) if calm else None,
               "fault_free_ttft_p99_s": _pct(switch.window(fault_at, until), 99)
               if calm else None,
               "recovery_s": recovery_s(tl, switch, healed, self.run_s) if calm else None,
               "recovery_p99_s": recovery_s(tl, switch, healed, self.run_s, 99)
               if calm else None,
               "left_behind": row.pop("left_behind"),
               "fault_at_s": fault_at, "injected_at_s": row.pop("injected_at_s"),
               "heal_at_s": row.pop("heal_at_s"), "healed_at_s": healed, "run": row,
               "timeline": {"at": [round(float(a), 3) for a in tl.at], "ttft": tl.ttft}}
        if calm and fault not in SWITCH_FAULTS:      # a pool or link fault: the bridge has it too
            out["bridge_with_fault"] = self.bridge_with(lab, fault)
        self.log(f"{fault:12} {store:8} failed {out['failed_requests']} fetch errors "
                 f"{out['fetch_errors']} recomputed {out['recomputed_blocks']} wrong "
                 f"{out['wrong_bytes']} lost {out['blocks_lost']} p99 during "
                 f"{out['ttft_p99_during_s']:.3f}s (bridge {out['bridge_ttft_p99_s']} s, "
                 f"no fault {out['fault_free_ttft_p99_s']} s) recovery p50 {out['recovery_s']} "
                 f"s p99 {out['recovery_p99_s']} s left {len(out['left_behind'])}")
        return out

    def bridge_with(self, lab: Lab, fault: str) -> dict:
        """The same fault over the plain bridge (no switch anywhere): what it costs there."""
        row, tl = self.run(lab, "bridge", fault)
        lo, hi = row["fault_at_s"], row["healed_at_s"] + AFTER_S
        return {"failed_requests": row["failed_requests"], "wrong_bytes": row["wrong_bytes"],
                "blocks_lost": row["blocks_lost"], "fault_at_s": lo,
                "healed_at_s": row["healed_at_s"], "ttft_p50_during_s": _pct(tl.window(lo, hi), 50),
                "ttft_p99_during_s": _pct(tl.window(lo, hi), 99), "left_behind": row["left_behind"]}

    def baselines(self, lab: Lab) -> dict:
        calm = {m: self.run(lab, m) for m in ("bridge", "switch")}
        for m, (row, _) in calm.items():
            self.log(f"{'no fault':12} {m:8} failed {row['failed_requests']} p50 "
                     f"{row['ttft_p50_s']:.3f}s p99 {row['ttft_p99_s']:.3f}s")
        return calm


def run_faults(faults=FAULTS, stores=STORES, nodes: int = 8, pools: int = 2,
               link_gbit: float = 0.025, run_s: float = 40.0, fault_seconds: float | None = None,
               target: Target | None = None, seed: int = 1, json_path: str | None = None,
               plot_path: str | None = None, prefix: str = "fb", baselines: bool = True,
               log=print) -> dict:
    """The benchmark; ``baselines=False`` runs the faults alone (no bridge or fault-free run
    beside them: no ratios or recovery times, for the tests' tiny runs)."""
    target = target or Target()
    check(faults, stores, nodes, pools, link_gbit, fault_seconds, run_s, target)
    bench = FaultBench(nodes, pools, link_gbit, run_s, fault_seconds, target, seed,
                       prefix=prefix, log=log)
    runs, results, calm_rows = runs_for(faults, stores), [], []
    by_store: dict[str, list[str]] = {}
    for f, s in runs:
        by_store.setdefault(s, []).append(f)
    log(f"bench faults: {len(runs)} fault runs ({', '.join(faults)}) on {nodes} nodes and "
        f"{pools} pool nodes, stores {', '.join(by_store)}")
    for store, fs in by_store.items():
        # Mooncake keeps blocks in its master across pool restarts: a testbed per run there
        groups = [fs] if store != "mooncake" else [[f] for f in fs]
        for group in groups:
            rows = []
            with contextlib.ExitStack() as stack:
                log(f"bench faults: store {store}: building the testbed ...")
                lab = stack.enter_context(bench.lab(store))
                calm = bench.baselines(lab) if baselines else None
                calm_rows += [{"store": store, **calm[m][0]} for m in calm or ()]
                for f in group:
                    rows.append(bench.measure(f, store, lab, calm))
            after = left_after_teardown(prefix)
            for r in rows:
                r["left_behind"] += after
            results += rows
    config = {"nodes": nodes, "pools": pools, "link_gbit": link_gbit, "run_s": run_s,
              "chunk_bytes": CHUNK, "block_bytes": bench.block_bytes, "seed": seed,
              "fault_seconds": {f: fault_seconds if fault_seconds is not None else SECONDS[f]
                                for f in faults},
              "switch_faults": [f for f in faults if f in SWITCH_FAULTS],
              "request_timeout_s": REQUEST_TIMEOUT_S, "fetch_deadline_s": DEADLINE_S,
              "during": f"from the fault to {AFTER_S:g} s after its end",
              "recovery_window_s": WINDOW_S, "disk_pool_dram": DISK_POOL_DRAM,
              "mooncake_replicas": 2, "preset": bench.model}
    out = {"config": config, "results": results, "fault_free": calm_rows,
           "summary": summary(results)}
    write_json(json_path, out)
    if plot_path:
        plot(out, plot_path)
    return out


def left_after_teardown(prefix: str) -> list[str]:
    """Namespaces, pins, cgroups and processes of testbed ``prefix`` still there after it."""
    from ...lab.topology import namespaces_of
    left = [f"namespace {n}" for n in namespaces_of(prefix)]
    pins = Path(f"/sys/fs/bpf/kvswitch-{prefix}")
    left += [f"pin directory {pins}"] if pins.exists() else []
    with contextlib.suppress(TestbedError):
        left += [f"cgroup {c}" for c in MemoryLimit(prefix).left_behind()]
    r = subprocess.run(["pgrep", "-af", f"kvswitch-{prefix}|kvlab-{prefix}-"],
                       capture_output=True, text=True)
    left += [f"process {ln[:120]}" for ln in r.stdout.splitlines()]
    return left


def summary(results: list[dict]) -> dict:
    def worst(key):
        vals = [r[key] for r in results if r[key] is not None]
        return max(vals) if vals else None
    return {
        "failed_requests": sum(r["failed_requests"] + r.get("bridge_with_fault", {}).get(
            "failed_requests", 0) for r in results),
        "wrong_bytes": sum(r["wrong_bytes"] + r.get("bridge_with_fault", {}).get(
            "wrong_bytes", 0) for r in results),
        "blocks_lost": {f"{r['fault']}/{r['store']}": r["blocks_lost"] for r in results
                        if r["blocks_lost"]},
        "p99_during_over_bridge": {f"{r['fault']}/{r['store']}":
                                   round(r["ttft_p99_during_s"] / r["bridge_ttft_p99_s"], 3)
                                   for r in results if r["bridge_ttft_p99_s"]},
        "recovery_s": {f"{r['fault']}/{r['store']}": r["recovery_s"] for r in results},
        "recovery_p99_s": {f"{r['fault']}/{r['store']}": r.get("recovery_p99_s")
                           for r in results},
        "fetch_errors": {f"{r['fault']}/{r['store']}": r.get("fetch_errors", 0)
                         for r in results},
        "recomputed_blocks": {f"{r['fault']}/{r['store']}": r.get("recomputed_blocks", 0)
                              for r in results},
        # the target: a failing switch is never worse than having none
        "switch_faults_p99_within_bridge": all(
            r["ttft_p99_during_s"] <= r["bridge_ttft_p99_s"] for r in results
            if r["fault"] in SWITCH_FAULTS and r["bridge_ttft_p99_s"] is not None),
        # a pool or link fault through the switch beside the same fault over the bridge
        "p99_during_over_bridge_with_fault": {
            f"{r['fault']}/{r['store']}": round(r["ttft_p99_during_s"] /
                                                r["bridge_with_fault"]["ttft_p99_during_s"], 3)
            for r in results if r.get("bridge_with_fault", {}).get("ttft_p99_during_s")},
        "recovery_s_max": worst("recovery_s"),
        "not_recovered": [f"{r['fault']}/{r['store']}" for r in results
                          if r["recovery_s"] is None and r["bridge_ttft_p99_s"] is not None],
        "left_behind": sum(len(r["left_behind"]) for r in results)}


def plot(out: dict, path: str) -> None:
    """TTFT over time per fault run, the fault's span shaded, fault-free runs faint."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    res = out["results"]
    cols = 2
    rows = max(1, -(-len(res) // cols))
    fig, axes = plt.subplots(rows, cols, figsize=(12, 2.6 * rows), squeeze=False)
    for ax, r in zip(axes.flat, res):
        tl = r["timeline"]
        at = [a for a, t in zip(tl["at"], tl["ttft"]) if t is not None]
        ttft = [t for t in tl["ttft"] if t is not None]
        ax.scatter(at, ttft, s=3, color="C3", label="with the fault")
        ax.axvspan(r["fault_at_s"], r["healed_at_s"] + 0.05, color="C1", alpha=0.25,
                   label="fault")
        if r["bridge_ttft_p99_s"]:
            ax.axhline(r["bridge_ttft_p99_s"], color="C0", lw=0.8, ls="--",
                       label="bridge p99 (same requests)")
        ax.set(yscale="log", ylabel="TTFT, s",
               title=f"{r['fault']} ({r['store']}): failed {r['failed_requests']}, "
                     f"wrong bytes {r['wrong_bytes']}, recovery {r['recovery_s']} s")
        ax.title.set_fontsize(9)
        ax.grid(alpha=0.3)
    for ax in axes.flat[len(res):]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=7)
    for ax in axes[-1]:
        ax.set_xlabel("arrival, s from the run's start")
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
