"""`testbed bench serve --tiers` (issue #29): the tiers measured live. Inference nodes with a
node-DRAM tier, the switch, pool nodes with bounded DRAM and a disk tier, every link at one
rate (as `bench serve`); capacities set so that the node tiers fill and the workload writes
``fill`` x the pool's DRAM. One testbed; for every mode (demote none|all|value x write-down
all|selective) the pool servers restart afresh and the switch is emptied (as a restart on
fresh maps would leave it, without compiling it again), and the mode runs with the pool
bounded and with an unbounded pool (its reference). The tier policy
(hostagent.common.tier_policy) decides on the inference nodes (serve_tiers_node) and on the
pool nodes (serve_tiers_pool); `testbed sim`'s exact tier replay
(testbed.sim.tiers.TierSim) runs the same requests through the same policy code at the same
capacities, and its per-tier hit ratios are reported beside the live ones.

Workload ``fill``: documents with Zipf popularity (a shared prefix of ``doc_blocks`` blocks
each) followed by ``own_blocks`` blocks only that request has (its question), Poisson
arrivals per node. Hit ratios are shares of block requests; a block counts as a hit of the
tier that served it when it is in the request's leading run of cached blocks.
"""
from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import numpy as np

from hostagent.common.tier_policy import DEMOTES, WRITE_DOWNS, PolicyConfig, PolicyError, TierCost
from hostagent.common.tier_policy import DEFAULT_COSTS

from ...lab import Lab, TestbedError
from ...lab.tasks import StartLine, gather
from ...results import write_json
from ...sim.config import MODELS
from .serve import CHUNK, CLUSTER_GBIT, block_bytes_for, check_choices
from .serve_workloads import Workload, _request, arrivals, block_key, zipf_weights

TIER_NAMES = ("node", "switch", "pool", "disk")
NS = 60
PAGE = 4096


def fill_workload(nodes: int, docs: int = 64, doc_blocks: int = 4, own_blocks: int = 3,
                  rate: float = 1.5, seconds: float = 40.0, alpha: float = 0.9,
                  suffix_tokens: int = 128, seed: int = 3) -> Workload:
    rng = np.random.default_rng(seed)
    doc_keys = [[block_key(f"tiers-doc-{d}", b) for b in range(doc_blocks)] for d in range(docs)]
    p = zipf_weights(docs, alpha)
    per: list[list[dict]] = [[] for _ in range(nodes)]
    uid = 0
    for node in range(nodes):
        for t in arrivals(rng, rate, 0.0, seconds):
            uid += 1
            d = int(rng.choice(docs, p=p))
            keys = doc_keys[d] + [block_key(f"tiers-own-{uid}", b) for b in range(own_blocks)]
            per[node].append(_request(t, keys, len(keys) * 512 + suffix_tokens))
    return Workload("fill", per, params={
        "docs": docs, "doc_blocks": doc_blocks, "own_blocks": own_blocks, "alpha": alpha,
        "rate_per_node": rate, "seconds": seconds, "suffix_tokens": suffix_tokens})


def object_bytes(block_bytes: int) -> int:
    """A block as a pool node stores it (header, CRCs, payload): a disk tier file."""
    from hostagent.pool.blockfmt import ObjectLayout
    return ObjectLayout.for_payload(NS, bytes(16), block_bytes, CHUNK).size


def staged_bytes(block_bytes: int) -> int:
    """What a block takes in a pool node's DRAM (whole pages)."""
    return -(-object_bytes(block_bytes) // PAGE) * PAGE


def scaled_costs(link_gbit: float) -> dict:
    """The cluster's tier speeds scaled as the blocks are (a block moves as long as in the
    cluster), so the policy's cost terms keep their cluster meaning."""
    f = link_gbit / CLUSTER_GBIT
    return {k: TierCost(c.read_gbps * f, c.write_gbps * f) for k, c in DEFAULT_COSTS.items()}


def check_tiers(nodes: int, pools: int, link_gbit: float, demotes, write_downs,
                fill: float) -> None:
    if not 1 <= nodes <= 16:
        raise TestbedError(f"--nodes must be 1..16 for --tiers, got {nodes}")
    if not 1 <= pools <= 4:
        raise TestbedError(f"--pools must be 1..4 for --tiers, got {pools}")
    if not link_gbit > 0:
        raise TestbedError(f"--link-gbit must be > 0, got {link_gbit:g}")
    check_choices("demote mode", demotes, DEMOTES)
    check_choices("write-down mode", write_downs, WRITE_DOWNS)
    if not demotes or not write_downs:
        raise TestbedError("give at least one demote mode and one write-down mode")
    if not fill >= 1:
        raise TestbedError(f"--fill must be >= 1 (workload bytes / pool DRAM), got {fill:g}")


def plan(wl: Workload, nodes: int, pools: int, block_bytes: int, fill: float,
         node_blocks: int | None, switch_blocks: int | None) -> dict:
    """Capacities: the pool's DRAM holds 1/fill of the distinct blocks the workload computes,
    its disk the rest; node DRAM and the switch a share of the hot set."""
    distinct = len({k for r in wl.requests for q in r for k in q["keys"]})
    pool_blocks = max(2, int(distinct / fill / pools))
    return {"distinct_blocks": distinct, "pool_blocks": pool_blocks,
            "disk_blocks": max(2, distinct // pools + 8),
            "node_blocks": node_blocks or max(4, wl.params["doc_blocks"] * 3),
            "switch_blocks": switch_blocks if switch_blocks is not None else
            max(4, wl.params["doc_blocks"] * 6),
            "staged_block_bytes": staged_bytes(block_bytes),
            "disk_block_bytes": object_bytes(block_bytes)}


def simulate(wl: Workload, cap: dict, nodes: int, pool_addrs, cfg: PolicyConfig,
             block_bytes: int, unbounded: bool, fetch_s: float,
             prefill_tok_s: float | None = None, ns: int = NS) -> dict:
    """`testbed sim`'s exact tier replay of the same requests at the same capacities."""
    from hostagent.common.pools import pool_for
    from kvproto.wire import PORT
    from ...sim.tiers import TierSim
    pools = [(a, PORT) for a in pool_addrs]
    idx = {p: i for i, p in enumerate(pools)}
    nchunks = -(-block_bytes // CHUNK)
    b = block_bytes
    sim = TierSim(cfg, nodes, len(pools), b, cap["node_blocks"] * b,
                  None if unbounded else cap["pool_blocks"] * b,
                  0 if unbounded else cap["disk_blocks"] * b,
                  lambda k: idx[pool_for(pools, ns, k)], nchunks=nchunks,
                  switch_entries=cap["switch_blocks"] * nchunks, fetch_window=fetch_s,
                  prefill_tok_s=prefill_tok_s)
    reqs = sorted((q["at"], n, [bytes.fromhex(k) for k in q["keys"]], q["tokens"])
                  for n, r in enumerate(wl.requests) for q in r)
    for at, n, keys, tokens in reqs:
        sim.request(n, at, keys, tokens)
    return sim.summary()


class TiersLab(Lab):
    """A testbed whose pool nodes run the tier policy's pool side over bounded DRAM and a disk
    tier (testbed.bench.serve.serve_tiers_pool); ``reconfigure`` restarts them and empties the
    switch (testbed.bench.serve.serve_tiers_switch)."""

    def __init__(self, *a, disk_bytes: int = 0, policy: dict | None = None, tag: str = "0",
                 **kw):
        super().__init__(*a, **kw)
        self.disk_bytes, self.policy = disk_bytes, policy or {"demote": "none"}
        self.tag = tag

    def pool_argv(self, index: int) -> list[str]:
        argv = super().pool_argv(index)
        at = argv.index("serve")
        argv = [*argv[:at - 1], "testbed.bench.serve.serve_tiers_pool", json.dumps(self.policy),
                *argv[at + 1:]]
        if self.disk_bytes and self.policy["demote"] != "none":
            where = os.path.join(self.tmp.name, f"disk-{self.tag}-{index}")
            os.makedirs(where, exist_ok=True)
            argv += ["--disk-dir", where, "--disk-bytes", str(self.disk_bytes)]
        return argv

    def switchd_argv(self, *args: str) -> list[str]:
        argv = super().switchd_argv(*args)
        if args[:1] == ("run",):     # the switch that empties itself (serve_tiers_switch)
            argv[argv.index("switchd")] = "testbed.bench.serve.serve_tiers_switch"
        return argv

    def reconfigure(self, policy: dict, tag: str, pool_capacity: str, disk_bytes: int) -> None:
        """New pool servers (this policy, DRAM, a fresh disk directory) and an empty switch
        (its maps as a restart on fresh ones finds them, a new policy; not compiled again)."""
        self.policy, self.tag = policy, tag
        self.pool_capacity, self.disk_bytes = pool_capacity, disk_bytes
        for i in range(len(self.pools)):
            self.stop_pool(i)
        self.start_pools()
        self.switch.send_signal(signal.SIGHUP)
        self.await_switch_line("switchd: reset")


def policy_dict(cfg: PolicyConfig) -> dict:
    """What a node or pool process rebuilds the policy from."""
    return {"demote": cfg.demote, "write_down": cfg.write_down,
            "prefill_tokens_per_s": cfg.prefill_tokens_per_s, "half_life_s": cfg.half_life_s,
            "write_after": cfg.write_after, "write_prob": cfg.write_prob,
            "min_gain": cfg.min_gain, "sharers": cfg.sharers,
            "costs": {k: [c.read_gbps, c.write_gbps] for k, c in cfg.costs.items()}}


def _pool_disk_hits(lab: Lab) -> int:
    n = 0
    for i in range(len(lab.topo.pool_nodes)):
        c = lab.pool_counters(i)
        n += int(c.get("disk_hits", c.get("disk_reads", 0)))
    return n


def run_mode(lab: Lab, wl: Workload, cfg: PolicyConfig, block_bytes: int, node_bytes: int,
             preset, log, label: str, ns: int = NS) -> dict:
    disk0 = _pool_disk_hits(lab)
    nodes = lab.topo.host_nodes
    start = StartLine(lab.tmp.name, len(nodes))      # once every node's engine is open
    t0 = time.monotonic()
    pol = policy_dict(cfg)
    tasks = [lab.start_task(n.name, "testbed.bench.serve.serve_tiers_node:serve", lab.pool_addrs,
                            CHUNK, ns, block_bytes, wl.requests[i], start.path,
                            preset.prefill_tokens_per_s, pol, node_bytes)
             for i, n in enumerate(nodes)]
    start.go(tasks)
    res = gather(tasks, timeout=1800)
    disk = _pool_disk_hits(lab) - disk0
    blocks = max(1, sum(r["blocks"] for r in res))
    hits = {k: sum(r["hits"][k] for r in res) for k in ("node", "switch", "pool")}
    hits["disk"] = min(hits["pool"], disk)
    hits["pool"] -= hits["disk"]
    ttft = [x for r in res for x in r["ttft"]]
    row = {
        "hit_ratio": round(sum(hits.values()) / blocks, 4),
        "pool_write_bytes": sum(r["written"] for r in res) * block_bytes,
        "ttft_p50_s": round(float(np.percentile(ttft, 50)), 4) if ttft else 0.0,
        "tier_hits": {k: round(v / blocks, 4) for k, v in hits.items()},
        "byte_exact": all(r["byte_exact"] for r in res),
        "ttft_p99_s": round(float(np.percentile(ttft, 99)), 4) if ttft else 0.0,
        "block_requests": blocks, "requests": len(ttft),
        "fetch_p50_s": round(float(np.median([x for r in res for x in r["fetch"]])), 4),
        "blocks_written": sum(r["written"] for r in res),
        "write_errors": sum(r["write_errors"] for r in res),
        "fetch_errors": sum(r["fetch_errors"] for r in res),
        "pool_disk_reads": disk, "seconds": round(time.monotonic() - t0, 1),
    }
    log(f"{label:22} hit {row['hit_ratio']:.3f} {row['tier_hits']} written "
        f"{row['blocks_written']} ttft p50 {row['ttft_p50_s']:.3f}s exact {row['byte_exact']}"
        f" ({row['seconds']} s)")
    return row


def run_tiers(nodes: int = 4, pools: int = 1, link_gbit: float = 0.025,
              demotes=DEMOTES, write_downs=WRITE_DOWNS, model: str = "llama3-8b",
              fill: float = 2.0, scale: float = 1.0, node_blocks: int | None = None,
              switch_blocks: int | None = None, json_path: str | None = None,
              plot_path: str | None = None, prefix: str = "st", log=print) -> dict:
    check_tiers(nodes, pools, link_gbit, demotes, write_downs, fill)
    preset = MODELS[model]
    block_bytes = block_bytes_for(link_gbit)
    wl = fill_workload(nodes, seconds=40.0 * scale)
    costs = scaled_costs(link_gbit)
    fetch_s = block_bytes * 8 / (link_gbit * 1e9)
    # each mode bounded, then with an unbounded pool (its reference); one testbed, the pool
    # nodes restarted and the switch emptied for each, each in a namespace of its own
    runs = [(d, w, u) for d in demotes for w in write_downs for u in (False, True)]
    cfgs = []
    for demote, wd, _ in runs:
        try:
            cfgs.append(PolicyConfig(demote=demote, write_down=wd, sharers=nodes, costs=costs,
                                     prefill_tokens_per_s=preset.prefill_tokens_per_s))
        except PolicyError as exc:
            raise TestbedError(str(exc)) from None
    cap = plan(wl, nodes, pools, block_bytes, fill, node_blocks, switch_blocks)

    def setting(i: int) -> dict:
        unbounded = runs[i][2]
        return {"policy": policy_dict(cfgs[i]), "tag": str(i),
                "pool_capacity": str((1 << 30) if unbounded else
                                     cap["pool_blocks"] * cap["staged_block_bytes"]),
                "disk_bytes": 0 if unbounded else cap["disk_blocks"] * cap["disk_block_bytes"]}

    rows, refs = [], {}
    log(f"bench serve --tiers: {len(runs)} runs (demote x write-down, each bounded and "
        f"unbounded) on {nodes} nodes and {pools} pool nodes; building the testbed ...")
    with TiersLab(prefix, hosts=nodes, pools=pools, chunk_size=CHUNK, switch=True,
                  cache_entries=cap["switch_blocks"] * -(-block_bytes // CHUNK),
                  link_gbit=link_gbit, pool_link_gbit=link_gbit, **setting(0)) as lab:
        for i, (demote, wd, unbounded) in enumerate(runs):
            if i:
                lab.reconfigure(**setting(i))
            ns, cfg = NS + i, cfgs[i]
            label = f"{'unbounded' if unbounded else demote}/{wd}"
            log(f"bench serve --tiers: {label} ...")
            row = run_mode(lab, wl, cfg, block_bytes, cap["node_blocks"] * block_bytes,
                           preset, log, label, ns)
            sim = simulate(wl, cap, nodes, lab.pool_addrs, cfg, block_bytes, unbounded,
                           fetch_s, preset.prefill_tokens_per_s, ns)
            row = {"demote": demote, "write_down": wd, **row,
                   "sim_tier_hits": sim["tier_hits"], "sim_hit_ratio": sim["hit_ratio"],
                   "sim_pool_write_bytes": sim["pool_write_bytes"]}
            if unbounded:
                refs[(demote, wd)] = row
            else:
                rows.append(row)
    for r in rows:
        r["hit_ratio_unbounded"] = refs[(r["demote"], r["write_down"])]["hit_ratio"]
    config = {"nodes": nodes, "pools": pools, "link_gbit": link_gbit, "block_bytes": block_bytes,
              "chunk_bytes": CHUNK, "preset": model, "fill": fill, "scale": scale,
              "prefill_tokens_per_s": preset.prefill_tokens_per_s, **cap,
              "workload": wl.params, "requests": wl.n_requests, "cpus": os.cpu_count(),
              "policy": {k: v for k, v in policy_dict(PolicyConfig(sharers=nodes)).items()
                         if k not in ("demote", "write_down", "costs")},
              "switch_policy": "switchd default"}
    out = {"config": config, "results": rows, "reference": list(refs.values()),
           "summary": summary(rows)}
    write_json(json_path, out)
    if plot_path:
        plot(out, plot_path)
    return out


def summary(rows: list[dict]) -> dict:
    by = {(r["demote"], r["write_down"]): r for r in rows}
    s: dict = {"all_byte_exact": all(r["byte_exact"] for r in rows)}
    for r in rows:
        k = f"{r['demote']}/{r['write_down']}"
        s[f"gap_to_unbounded_pp_{k}"] = round(100 * (r["hit_ratio_unbounded"] - r["hit_ratio"]),
                                              2)
        s[f"max_sim_gap_pp_{k}"] = round(100 * max(abs(r["tier_hits"][t] - r["sim_tier_hits"][t])
                                                   for t in TIER_NAMES), 2)
    for d in DEMOTES:
        a, b = by.get((d, "all")), by.get((d, "selective"))
        if a and b and a["pool_write_bytes"]:
            s[f"selective_write_cut_{d}"] = round(1 - b["pool_write_bytes"] /
                                                  a["pool_write_bytes"], 3)
            s[f"selective_hit_loss_pp_{d}"] = round(100 * (a["hit_ratio"] - b["hit_ratio"]), 2)
    for w in WRITE_DOWNS:
        if all((d, w) in by for d in DEMOTES):
            s[f"ttft_p50_{w}"] = {d: by[(d, w)]["ttft_p50_s"] for d in DEMOTES}
    return s


def plot(out: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = out["results"] + out["reference"]
    labels = [f"{r['demote']}\n{r['write_down']}" + ("\nunbnd." if r in out["reference"]
                                                     else "") for r in rows]
    x = np.arange(len(rows))
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    bottom = np.zeros(len(rows))
    for i, t in enumerate(TIER_NAMES):
        v = np.array([r["tier_hits"][t] for r in rows])
        axes[0].bar(x - 0.2, v, 0.4, bottom=bottom, color=f"C{i}", label=f"{t} (live)")
        bottom += v
    bottom = np.zeros(len(rows))
    for i, t in enumerate(TIER_NAMES):
        v = np.array([r["sim_tier_hits"][t] for r in rows])
        axes[0].bar(x + 0.2, v, 0.4, bottom=bottom, color=f"C{i}", alpha=0.45)
        bottom += v
    axes[0].set(xticks=x, xticklabels=labels, ylabel="share of block requests",
                title="hits per tier (left live, right sim)")
    axes[1].bar(x, [r["pool_write_bytes"] / 2**20 for r in rows], color="C4")
    axes[1].set(xticks=x, xticklabels=labels, ylabel="MiB", title="bytes written to the pool")
    axes[2].bar(x, [r["ttft_p50_s"] for r in rows], color="C5")
    axes[2].set(xticks=x, xticklabels=labels, ylabel="s", title="TTFT p50")
    c = out["config"]
    fig.suptitle(f"{c['nodes']} nodes, {c['pools']} pool node(s), pool DRAM "
                 f"{c['pool_blocks']} blocks (workload {c['distinct_blocks']}), node DRAM "
                 f"{c['node_blocks']}, switch {c['switch_blocks']} blocks")
    for ax in axes:
        ax.tick_params(axis="x", labelsize=7)
        ax.grid(alpha=0.3, axis="y")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
