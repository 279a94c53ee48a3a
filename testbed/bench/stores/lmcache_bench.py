"""`testbed bench lmcache`: kvswitch as LMCache's remote tier, side by side in one run with the
remote stores LMCache users pick today, each reached through LMCache's own connector for it:

  kvswitch-switch   kvswitch's LMCache plugin, the pool node behind the switch
  kvswitch-bridge   the same plugin and pool node over the plain bridge (no switch)
  lmcache-server    LMCache's own server (``python -m lmcache.v1.server``, ``lm://``)
  redis             Debian's ``redis-server`` (``redis://``)
  mooncake          Mooncake Store (``mooncakestore://``): its master, and a pool node's segment

Every store runs on the same storage node (p1) behind links of the same rate; the peers over the
plain bridge. Each of N inference nodes (default 8) runs LMCache's cache engine with SmolLM2's
KV shape (testbed.bench.stores.lmcache_node), no local CPU tier, so every retrieve reaches the
store. Node 1 stores the prefixes first; then the workloads:

  incast   every node retrieves one hot prefix at once (``incast_rounds`` prefixes in turn)
  zipf     every node retrieves prefixes drawn from a Zipf law, one after another
  single   one node alone, on an unshaped testbed of its own: GB/s; the stores take turns,
           ``single_rounds`` times each (their order rotating), fresh prefixes every turn, and
           the figures are medians with their spread (an order decided by 4 reads in one run
           had flipped between runs)

Per store and workload: retrieve latency p50/p99, GB/s, the bytes leaving the storage node
(its interface's counter) and byte-exactness of everything retrieved."""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field

import numpy as np

from ...lab import Lab, TestbedError
from ...lab.mooncake import HTTP_PORT, RPC_PORT, port_open
from ...lab.tasks import StartLine, gather
from ...results import write_json
from ...lmcache_engine import CHUNK_TOKENS
from ..faults.faults import _fresh
from .lmcache_node import LMCACHE_FIX
from ..serve.serve_vllm import hit_ratio

STORES = ("kvswitch-switch", "kvswitch-bridge", "lmcache-server", "redis", "mooncake")
WORKLOADS = ("incast", "zipf", "single")
CHUNK, NS = 3072, 7                     # kvswitch's chunk (the MTU fits it) and namespace
LM_PORT, REDIS_PORT = 65432, 6379
HOT, ZIPF, SINGLE, WARM = 0, 100, 200, 999   # prefix ids of each workload start here
PHASE_TIMEOUT_S = 240                   # a store that has not ended a phase by then hangs


@dataclass
class LmcacheBench:
    nodes: int = 8
    link_gbit: float = 0.1
    timeout_s: int = 60                 # LMCache's wait for a remote chunk, every store alike
    hot_tokens: int = 1024              # the incast's hot prefix
    incast_rounds: int = 3
    zipf_prefixes: int = 16
    zipf_tokens: int = 256
    zipf_requests: int = 6              # per node
    zipf_alpha: float = 1.0
    zipf_gap_s: float = 0.1             # mean pause between a node's retrieves
    single_prefixes: int = 4
    single_tokens: int = 1024
    single_rounds: int = 5              # turns each store takes at the lone retriever
    stores: tuple[str, ...] = STORES
    workloads: tuple[str, ...] = WORKLOADS
    dtype: str = "bfloat16"
    switch_cache_mib: int = 256
    seed: int = 1
    prefix: str = "lb"
    pool_capacity: str = "2GiB"
    extra: dict = field(default_factory=dict)

    def bytes_per_token(self) -> int:
        import torch
        from ... import lmcache_engine
        return lmcache_engine.kv_bytes_per_token(getattr(torch, self.dtype))

    def shaped_phases(self) -> list[tuple[str, dict]]:
        """(workload, phase) in order: the store phase, the incast rounds, the zipf phase."""
        everyone = list(range(self.nodes))
        stored = [[HOT + r, self.hot_tokens] for r in range(self.incast_rounds)] + \
            [[ZIPF + i, self.zipf_tokens] for i in range(self.zipf_prefixes)]
        out = self.warm_up(everyone, stored)
        for r in range(self.incast_rounds):
            out.append(("incast", {"kind": "retrieve", "nodes": everyone, "plan": {
                str(i): [[HOT + r, self.hot_tokens, 0.0]] for i in everyone}}))
        rng = np.random.default_rng(self.seed)
        weights = 1.0 / np.arange(1, self.zipf_prefixes + 1) ** self.zipf_alpha
        weights /= weights.sum()
        plan = {str(i): [[ZIPF + int(rng.choice(self.zipf_prefixes, p=weights)),
                          self.zipf_tokens, round(float(rng.exponential(self.zipf_gap_s)), 4)]
                         for _ in range(self.zipf_requests)] for i in everyone}
        out.append(("zipf", {"kind": "retrieve", "nodes": everyone, "plan": plan}))
        return out

    def single_phases(self, turn: int = 0) -> list[tuple[str, dict]]:
        """One turn of the lone retriever: prefixes of its own (none a store has seen)."""
        ids = [[SINGLE + self.single_prefixes * turn + i, self.single_tokens]
               for i in range(self.single_prefixes)]
        return self.warm_up([0], ids) + [("single", {"kind": "retrieve", "nodes": [0],
                                                     "plan": {"0": [[i, n, 0.0] for i, n in ids]}})]

    @staticmethod
    def warm_up(nodes: list[int], stored: list[list[int]]) -> list[tuple[str, dict]]:
        """Node 1 stores the prefixes and one more, which every node then retrieves once,
        unmeasured: connections open, the fetch engine loaded, LMCache's paths warm."""
        warm = [WARM, CHUNK_TOKENS]
        return [("store", {"kind": "store", "nodes": [0], "prefixes": [warm] + stored}),
                ("warm-up", {"kind": "retrieve", "nodes": nodes,
                             "plan": {str(i): [warm + [0.0]] for i in nodes}})]


# ---- the stores --------------------------------------------------------------------------------
def start_store(lab: Lab, name: str, log_dir: str,
                timeout_s: int) -> tuple[dict, subprocess.Popen | None]:
    """Start store ``name`` on p1 (the switch on only for kvswitch-switch; every store empty);
    what the nodes' engines need to reach it, and its server process if it is not p1's pool
    server. ``timeout_s``: every store's wait for a chunk (Redis's client reads a reply for 5 s
    by default: 8 readers sharing a 12.5 MB/s link need longer for a 5.9 MB chunk)."""
    pool = lab.topo.pool_nodes[0]
    _fresh(lab, name == "kvswitch-switch")
    if name.startswith("kvswitch"):
        return {"kind": "kvswitch", "plugin": {"pools": pool.ip, "chunk_size": CHUNK,
                                               "namespace": NS}}, None
    if name == "mooncake":
        master = lab.topo.master_node.ip
        return {"kind": "url", "url": f"mooncakestore://{master}:{RPC_PORT}/", "extra": {
            "metadata_server": f"http://{master}:{HTTP_PORT}/metadata",
            "master_server_address": f"{master}:{RPC_PORT}", "protocol": "tcp",
            # Mooncake 0.3.13's setup(dict) reads master_server_addr, which LMCache 0.5.6
            # does not set (it sets master_server_address): its mooncake_ keys pass through
            "mooncake_master_server_addr": f"{master}:{RPC_PORT}",
            "global_segment_size": 0, "local_buffer_size": 64 << 20,
            "local_hostname": "{node_ip}"}}, None
    if name == "lmcache-server":
        argv, port = [sys.executable, "-m", "lmcache.v1.server", pool.ip, str(LM_PORT), "cpu"], \
            LM_PORT
        desc = {"kind": "url", "url": f"lm://{pool.ip}:{LM_PORT}"}
    elif name == "redis":
        argv = ["redis-server", "--bind", pool.ip, "--port", str(REDIS_PORT), "--save", "",
                "--appendonly", "no", "--protected-mode", "no"]
        url = f"redis://{pool.ip}:{REDIS_PORT}?socket_timeout={timeout_s}"
        port, desc = REDIS_PORT, {"kind": "url", "url": url}
    else:
        raise TestbedError(f"unknown store {name!r}: choose from {', '.join(STORES)}")
    with open(os.path.join(log_dir, f"{name}.log"), "ab") as f:
        proc = lab.topo.popen(pool.name, argv, stdout=f, stderr=subprocess.STDOUT,
                              stdin=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while not port_open(pool.netns, pool.ip, port):
        if proc.poll() is not None or time.monotonic() > deadline:
            stop(proc)
            raise TestbedError(f"{name} did not start on {pool.name}: see {log_dir}/{name}.log")
        time.sleep(0.1)
    return desc, proc


def stop(proc: subprocess.Popen | None) -> None:
    if proc is not None and proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


# ---- one store, one testbed ---------------------------------------------------------------------
def run_phases(lab: Lab, store: dict, phases: list[tuple[str, dict]], dtype: str,
               tmp: str) -> list[dict]:
    """Every node's engine through ``phases`` on one start line each; per phase: the nodes'
    records, the storage node's egress and the switch's counters over it."""
    hosts = lab.topo.host_nodes[:max(max(p["nodes"]) for _, p in phases) + 1]
    lines = [StartLine(tmp, len(hosts)) for _ in phases]
    tasks = []
    for i, h in enumerate(hosts):
        node_store = dict(store)
        if "extra" in store:
            node_store["extra"] = {k: (h.ip if v == "{node_ip}" else v)
                                   for k, v in store["extra"].items()}
        tasks.append(lab.start_task(h.name, "testbed.bench.stores.lmcache_node:run_node",
                                    node_store, i, [p for _, p in phases],
                                    [ln.path for ln in lines], dtype))
    pool = lab.topo.pool_nodes[0].name
    marks = []
    try:
        for k, line in enumerate(lines):     # engines start in minutes; a phase in seconds
            line.ready(tasks, timeout=600 if k == 0 else PHASE_TIMEOUT_S)
            marks.append((lab.link_bytes(pool, "tx"), lab.counters() if lab.switch else None))
            line.go(tasks)
        results = gather(tasks, timeout=PHASE_TIMEOUT_S)
    finally:
        for t in tasks:
            if t.proc.poll() is None:
                t.proc.kill()
    marks.append((lab.link_bytes(pool, "tx"), lab.counters() if lab.switch else None))
    out = []
    for k, (workload, _) in enumerate(phases):
        (e0, c0), (e1, c1) = marks[k], marks[k + 1]
        counters = {key: c1[key] - c0.get(key, 0) for key in c1} if c1 else None
        out.append({"workload": workload, "egress_bytes": e1 - e0,
                    "switch_hit_ratio": hit_ratio(counters),
                    "nodes": [r["phases"][k] for r in results]})
    return out


def summarize(store: str, workload: str, phases: list[dict], bytes_per_token: int) -> dict:
    recs = [r for p in phases if p["workload"] == workload for n in p["nodes"] if n
            for r in n["records"]]
    if not recs:
        return {}
    secs = np.array([r["seconds"] for r in recs])
    nbytes = sum(r["tokens"] for r in recs) * bytes_per_token
    hits = [p["switch_hit_ratio"] for p in phases if p["workload"] == workload]
    return {"store": store, "workload": workload, "retrieves": len(recs),
            "p50_s": round(float(np.percentile(secs, 50)), 4),
            "p99_s": round(float(np.percentile(secs, 99)), 4),
            "gbytes_per_s": round(nbytes / secs.sum() / 1e9, 4),
            "storage_egress_bytes": sum(p["egress_bytes"] for p in phases
                                        if p["workload"] == workload),
            "retrieved_bytes": nbytes,
            "byte_exact": all(r["exact"] for r in recs),
            "switch_hit_ratio": hits[0] if len(hits) == 1 else
            (round(float(np.mean([h for h in hits if h is not None])), 4)
             if any(h is not None for h in hits) else None)}


def lab_for(cfg: LmcacheBench, store: str, shaped: bool) -> Lab:
    mooncake = store == "mooncake"
    kw = dict(link_gbit=cfg.link_gbit, pool_link_gbit=cfg.link_gbit) if shaped else {}
    return Lab(f"{cfg.prefix}{'m' if mooncake else ''}{'' if shaped else 'u'}",
               hosts=cfg.nodes if shaped else 1, pools=1, chunk_size=CHUNK,
               cache_entries=max(1024, (cfg.switch_cache_mib << 20) // CHUNK),
               pool_capacity=cfg.pool_capacity, store="mooncake" if mooncake else "memory",
               switch=False,                    # start_store starts it where a store needs it
               segment=cfg.pool_capacity if mooncake else "256MiB",
               # a read holds a lease on its object; one longer than the lease fails as
               # LEASE_EXPIRED (10 s by default): the same wait as every store's
               master_args=(f"--default_kv_lease_ttl={cfg.timeout_s * 1000}",) if mooncake
               else (), **kw)


def run_lmcache_bench(cfg: LmcacheBench, json_path: str | None = None,
                      plot_path: str | None = None, log=print) -> dict:
    per_token = cfg.bytes_per_token()
    results, raw = [], {}
    started = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    with tempfile.TemporaryDirectory(prefix="kvlmbench-") as tmp:
        shaped_runs = [True] * bool({"incast", "zipf"} & set(cfg.workloads)) + \
            [False] * ("single" in cfg.workloads)
        for shaped in shaped_runs:
            groups = [[s for s in cfg.stores if s != "mooncake"],
                      [s for s in cfg.stores if s == "mooncake"]]
            for group in (g for g in groups if g):
                log(f"bench lmcache: {'shaped' if shaped else 'unshaped'} testbed for "
                    f"{', '.join(group)}: building it ...")
                with lab_for(cfg, group[0], shaped) as lab:
                    turns = 1 if shaped else cfg.single_rounds
                    for turn in range(turns):
                        for store in turn_order(group, turn):
                            _one_store(cfg, lab, store, shaped, turn, tmp, per_token, results,
                                       raw, log)
    config = {**asdict(cfg), "stores": list(cfg.stores), "kv_bytes_per_token": per_token,
              "hot_prefix_bytes": cfg.hot_tokens * per_token, "chunk_bytes": CHUNK,
              "lmcache_chunk_tokens": CHUNK_TOKENS, "cpus": len(os.sched_getaffinity(0)),
              "started": started, "load_average_end": os.getloadavg()[0],
              "lmcache_fixes": [LMCACHE_FIX]}
    out = {"config": config, "results": results, "summary": summary(results, config),
           "phases": raw}
    write_json(json_path, out)
    if plot_path:
        plot(out, plot_path)
    return out


def turn_order(stores: list[str], turn: int) -> list[str]:
    """The stores in the order they take turn ``turn`` (rotating: each goes first in turn)."""
    k = turn % len(stores)
    return stores[k:] + stores[:k]


def _one_store(cfg: LmcacheBench, lab: Lab, store: str, shaped: bool, turn: int, tmp: str,
               per_token: int, results: list, raw: dict, log) -> None:
    """The store started on the lab's storage node, its phases run, its rows added."""
    log(f"bench lmcache: {store}: {'incast, zipf' if shaped else f'single, turn {turn + 1}'} ...")
    desc, proc = start_store(lab, store, tmp, cfg.timeout_s)
    desc["timeout_s"] = cfg.timeout_s
    try:
        t0 = time.monotonic()
        phases = run_phases(lab, desc, cfg.shaped_phases() if shaped
                            else cfg.single_phases(turn), cfg.dtype, tmp)
    except TestbedError as exc:    # the store hung or failed: say so
        log(f"bench lmcache: {store}: {exc}")
        results += [{"store": store, "workload": wl, "error": str(exc)}
                    for wl in cfg.workloads if (wl != "single") == shaped]
        return
    finally:
        stop(proc)
    raw[f"{store}/{'shaped' if shaped else f'unshaped-{turn}'}"] = phases
    for wl in (w for w in cfg.workloads if (w != "single") == shaped):
        row = summarize(store, wl, phases, per_token)
        if not shaped:
            row["turn"] = turn
        results.append(row)
        log(f"bench lmcache: {store:16} {wl:7} p50 {row['p50_s']:.3f} s "
            f"p99 {row['p99_s']:.3f} s {row['gbytes_per_s']:.3f} GB/s "
            f"egress {row['storage_egress_bytes'] / 1e6:.1f} MB exact "
            f"{row['byte_exact']} ({time.monotonic() - t0:.0f} s)")


def lone_summary(results: list[dict]) -> dict:
    """The lone retriever per store: median GB/s and spread over its turns; kvswitch through
    the switch against each store, a ratio per turn (each turn's stores ran back to back), its
    median and spread."""
    rows = [r for r in results if r.get("workload") == "single" and "error" not in r]
    by: dict[str, dict[int, float]] = {}
    for r in rows:
        by.setdefault(r["store"], {})[r.get("turn", 0)] = r["gbytes_per_s"]
    out = {s: {"median": round(float(np.median(list(v.values()))), 4),
               "min": min(v.values()), "max": max(v.values()), "turns": len(v)}
           for s, v in by.items()}
    sw = by.get("kvswitch-switch", {})
    ratios = {}
    for s, v in by.items():
        per_turn = [sw[t] / v[t] for t in sw if t in v and v[t]] if s != "kvswitch-switch" \
            else []
        if per_turn:
            ratios[s] = {"median": round(float(np.median(per_turn)), 3),
                         "min": round(min(per_turn), 3), "max": round(max(per_turn), 3)}
    return {"gbytes_per_s": out, "kvswitch_switch_over": ratios}


def summary(results: list[dict], config: dict) -> dict:
    failed = sorted({r["store"] for r in results if "error" in r})
    by = {(r["store"], r["workload"]): r for r in results if "error" not in r}
    out: dict = {"byte_exact": all(r["byte_exact"] for r in results if "error" not in r),
                 "failed": failed}
    sw = by.get(("kvswitch-switch", "incast"))
    if sw:
        rounds = config["incast_rounds"] * config["hot_prefix_bytes"]
        out["incast_hot_prefix_leaves_storage_x"] = round(sw["storage_egress_bytes"] / rounds, 3)
        out["incast_p99_peer_over_switch"] = {
            s: round(r["p99_s"] / sw["p99_s"], 2) for (s, w), r in by.items()
            if w == "incast" and s != "kvswitch-switch"}
    if any(w == "single" for _, w in by):
        out["single"] = lone_summary(results)
    return out


def plot(out: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    stores = out["config"]["stores"]
    by = {(r["store"], r["workload"]): r for r in out["results"]}
    panels = [("incast", "p99_s", "incast: retrieve p99 (s)"),
              ("zipf", "p50_s", "zipf: retrieve p50 (s)"),
              ("single", "gbytes_per_s", "one retriever, unshaped: GB/s (median)"),
              ("incast", "storage_egress_bytes", "incast: MB out of the storage node")]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.6))
    lone = out["summary"].get("single", {}).get("gbytes_per_s", {})
    for ax, (wl, key, title) in zip(axes, panels):
        vals = [(lone.get(s, {}).get("median", 0) if wl == "single" else
                 by.get((s, wl), {}).get(key, 0)) or 0 for s in stores]
        if key.endswith("_bytes"):
            vals = [v / 1e6 for v in vals]
        ax.bar(range(len(stores)), vals, color=["C2", "C0", "C1", "C3", "C4"][:len(stores)])
        ax.set_xticks(range(len(stores)), stores, rotation=30, ha="right", fontsize=8)
        ax.set_title(title, fontsize=9)
    c = out["config"]
    fig.suptitle(f"LMCache remote stores: {c['nodes']} nodes, {c['link_gbit']} Gbit/s links, "
                 f"hot prefix {c['hot_prefix_bytes'] / 1e6:.1f} MB", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
