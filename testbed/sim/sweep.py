"""`testbed sim sweep`: the cluster model over nodes x switch memory x sharing ratio, the
break-even point of the switch pool (where what it saves exceeds what it costs), JSON and a plot.

Per point: ``requests_per_node * nodes`` requests (at most ``max_requests``) resampled from the
trace, simulated with the switch pool on and off (testbed.sim). The pool pays when
``switch_benefit.net_usd_per_hour`` > 0: GPU time saved (prefill and waiting for KV) priced at the
GPU's hourly rate, against switch memory, switchd's core and the data plane's per-frame CPU. The
break-even of a (memory, sharing) curve is the smallest node count where it pays, interpolated
log-linearly between the two sweep points around the sign change.
"""
from __future__ import annotations

import math
import time

from ..lab import write_json
from .config import SimConfig
from .model import run
from .trace import load_trace


def break_even(nodes: list[int], net: list[float]) -> float | None:
    """Smallest node count where ``net`` turns positive (log-interpolated), None if never."""
    for i, (n, v) in enumerate(zip(nodes, net)):
        if v > 0:
            if i == 0:
                return float(n)
            n0, v0 = nodes[i - 1], net[i - 1]
            f = -v0 / (v - v0)
            return round(2 ** (math.log2(n0) + f * (math.log2(n) - math.log2(n0))), 1)
    return None


def run_sweep(trace_path, nodes, switch_gib, sharing, requests_per_node=200,
              max_requests=200_000, routing="random", json_path=None, plot_path=None,
              log=print, **cfg_kw) -> dict:
    trace = load_trace(trace_path)
    points, t0 = [], time.perf_counter()
    for s in sharing:
        for mem in switch_gib:
            for n in nodes:
                cfg = SimConfig(nodes=n, switch_gib=mem, routing=routing, **cfg_kw)
                reqs = min(max_requests, requests_per_node * n)
                r = run(trace, cfg, reqs, s)
                b = r["switch_benefit"]
                points.append({
                    "nodes": n, "switch_gib": mem, "sharing": s, "requests": reqs,
                    "switch_hit_ratio": r["pool_on"]["hit_ratio"]["switch"]
                    + r["pool_on"]["hit_ratio"]["switch_replica"],
                    "pool_egress_saved": b["pool_egress_saved"],
                    "peak_pool_link_off": r["pool_off"]["pool_link"]["peak_utilisation"],
                    "peak_pool_link_on": r["pool_on"]["pool_link"]["peak_utilisation"],
                    "incast_max_off": r["pool_off"]["incast"]["max"],
                    "ttft_p50_off": r["pool_off"]["ttft_s"]["p50"],
                    "ttft_p50_on": r["pool_on"]["ttft_s"]["p50"],
                    "ttft_p99_off": r["pool_off"]["ttft_s"]["p99"],
                    "ttft_p99_on": r["pool_on"]["ttft_s"]["p99"],
                    **{k: b[k] for k in ("gpu_s_saved_per_hour", "benefit_usd_per_hour",
                                         "cost_usd_per_hour", "net_usd_per_hour", "pays")},
                    "sample_rate": r["pool_on"]["switch"].get("sample_rate", 1.0),
                    "wall_seconds": r["wall_seconds"]})
                p = points[-1]
                log(f"sharing {s} switch {mem} GiB nodes {n}: switch hits "
                    f"{p['switch_hit_ratio']:.3f}, egress saved {p['pool_egress_saved']:.3f}, "
                    f"net ${p['net_usd_per_hour']:.3f}/h ({p['wall_seconds']}s)")
    curves = []
    for s in sharing:
        for mem in switch_gib:
            pts = [p for p in points if p["sharing"] == s and p["switch_gib"] == mem]
            curves.append({"sharing": s, "switch_gib": mem,
                           "break_even_nodes": break_even([p["nodes"] for p in pts],
                                                          [p["net_usd_per_hour"] for p in pts])})
    out = {"trace": str(trace_path), "routing": routing, "nodes": nodes,
           "switch_gib": switch_gib, "sharing": sharing,
           "defaults": {k: v for k, v in vars(SimConfig(**cfg_kw)).items()
                        if k not in ("nodes", "switch_gib", "routing")},
           "break_even": curves, "points": points,
           "wall_seconds": round(time.perf_counter() - t0, 1)}
    write_json(json_path, out)
    if plot_path:
        plot(out, plot_path)
    return out


def plot(out: dict, path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    shares = out["sharing"]
    fig, axes = plt.subplots(1, len(shares), figsize=(4.6 * len(shares), 4.2), sharey=True,
                             squeeze=False)
    for ax, s in zip(axes[0], shares):
        for mem in out["switch_gib"]:
            pts = [p for p in out["points"] if p["sharing"] == s and p["switch_gib"] == mem]
            ratio = [max(p["benefit_usd_per_hour"], 0) / p["cost_usd_per_hour"] for p in pts]
            ax.plot([p["nodes"] for p in pts], [max(r, 1e-3) for r in ratio], marker="o",
                    label=f"{mem:g} GiB switch")
            be = next(c["break_even_nodes"] for c in out["break_even"]
                      if c["sharing"] == s and c["switch_gib"] == mem)
            if be:
                ax.axvline(be, ls=":", lw=1, color=ax.lines[-1].get_color())
        ax.axhline(1.0, color="k", lw=1)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(f"sharing ratio {s:g}")
        ax.set_xlabel("inference nodes")
        ax.grid(alpha=0.3, which="both")
    axes[0][0].set_ylabel("switch pool benefit / cost  (pays above 1)")
    axes[0][-1].legend(fontsize=8)
    fig.suptitle(f"When the in-network KV pool pays for itself ({out['routing']} routing; "
                 f"dotted: break-even)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
