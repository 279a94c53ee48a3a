"""`testbed sim sweep`: the cluster model over nodes x switch memory x cases (a sharing ratio,
and a skew: Zipf popularity of prefix trees, the hot-object case), the break-even point of the
switch pool (where what it saves exceeds what it costs), JSON and a plot.

Per point: ``requests_per_node * nodes`` requests (at most ``max_requests``) resampled from the
trace, simulated with the switch pool on and off by ``testbed.sim.model.point``, the function
``sim run`` calls (so a point and ``sim run`` with the same flags agree). The pool pays when
``switch_benefit.net_usd_per_hour`` > 0: GPU time saved (prefill and waiting for KV) priced at the
GPU's hourly rate, against switch memory, switchd's core and the data plane's per-frame CPU. The
break-even of a (memory, case) curve is the smallest node count where it pays, interpolated
log-linearly between the two sweep points around the sign change; the default node grid is
fine (4..64 in steps of 1.33-1.5x) where the break-even lies. With ``kv_codec`` every point's
blocks are coded (testbed.sim.codec); the result names the codec's file and row (``kv_codec``).
"""
from __future__ import annotations

import math
import time
from pathlib import Path

from ..results import write_json
from .codec import kv_codec
from .config import MAX_REQUESTS, REQUESTS_PER_NODE, SimConfig, SimError, xdp_frame_cost
from .model import point
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


def parse_cases(text: str) -> list[tuple[float, float]]:
    """"SHARING:SKEW,..." -> [(sharing, skew)]; SimError on anything else."""
    cases = []
    for item in filter(None, (x.strip() for x in (text or "").split(","))):
        try:
            s, k = (float(v) for v in item.split(":"))
        except ValueError:
            raise SimError(f"a skew case is SHARING:SKEW (e.g. 0.5:0.99), got {item!r}") from None
        if not (0 <= s <= 1 and k >= 0):
            raise SimError(f"a skew case needs 0 <= sharing <= 1 and skew >= 0, got {item!r}")
        cases.append((s, k))
    return cases


def _case(p) -> tuple:
    return (p["sharing"], p.get("skew", 0.0))


def break_even_curves(points: list[dict], cases, switch_gib) -> list[dict]:
    """Per (case, switch memory): the break-even node count and the node counts where the
    pool pays (a curve may fall below break-even again as the cluster grows)."""
    curves = []
    for s, k in cases:
        for mem in switch_gib:
            pts = [p for p in points if _case(p) == (s, k) and p["switch_gib"] == mem]
            curves.append({"sharing": s, "skew": k, "switch_gib": mem,
                           "break_even_nodes": break_even([p["nodes"] for p in pts],
                                                          [p["net_usd_per_hour"] for p in pts]),
                           "pays_at": [p["nodes"] for p in pts if p["net_usd_per_hour"] > 0]})
    return curves


def run_sweep(trace_path, nodes, switch_gib, cases, requests_per_node=REQUESTS_PER_NODE,
              max_requests=MAX_REQUESTS, json_path=None, plot_path=None, log=print,
              **cfg_kw) -> dict:
    """Every point (case x switch memory x nodes), each ``point``'s summary; ``cases`` are
    (sharing, skew) pairs (a bare number: that sharing, no skew); ``cfg_kw`` are SimConfig
    fields shared by all points."""
    cases = [(float(c), 0.0) if not isinstance(c, (tuple, list)) else tuple(map(float, c))
             for c in cases]
    trace = load_trace(trace_path)
    cfg_kw.pop("skew", None)
    base = SimConfig(**cfg_kw)
    xdp = xdp_frame_cost(base)              # fail before the first point if it cannot be priced
    codec = kv_codec(base)                  # likewise for the KV codec
    log(f"data plane: {xdp['ns_per_frame']} ns/frame from {xdp['source']}"
        + (f"; {xdp['fallback']}" if "fallback" in xdp else ""))
    log(f"KV codec {codec['name']}: {codec['source']}")
    log(f"sim sweep: {len(cases) * len(switch_gib) * len(nodes)} points (cases x switch memory "
        "x nodes), a line each ...")
    points, t0 = [], time.perf_counter()
    for s, k in cases:
        for mem in switch_gib:
            for n in nodes:
                cfg = SimConfig(nodes=n, switch_gib=mem, skew=k, **cfg_kw)
                # every point priced at the cost the header records (not read again per
                # point: a throughput.json rewritten mid-sweep would price points unlike it)
                points.append(point(trace, cfg, min(max_requests, requests_per_node * n),
                                    s, xdp=xdp)["point"])
                p = points[-1]
                log(f"sharing {s} skew {k} switch {mem} GiB nodes {n}: switch hits "
                    f"{p['switch_hit_ratio']:.3f}, egress saved {p['pool_egress_saved']:.3f}, "
                    f"peak pool link {p['peak_pool_link_off']:.2f}, "
                    f"net ${p['net_usd_per_hour']:.3f}/h, xdp cores {p['xdp_cores']:.1f} "
                    f"(p99 {p['xdp_cores_p99']:.1f}) ({p['wall_seconds']}s)")
    curves = break_even_curves(points, cases, switch_gib)
    out = {"trace": str(trace_path), "routing": base.routing, "pools": base.pools,
           "nodes": nodes, "switch_gib": switch_gib,
           "sharing": sorted({s for s, _ in cases}), "cases": [list(c) for c in cases],
           "requests_per_node": requests_per_node, "max_requests": max_requests,
           "defaults": {k: v for k, v in vars(base).items()
                        if k not in ("nodes", "switch_gib", "skew")},
           "xdp": xdp, "kv_codec": codec,
           "break_even": curves, "points": points,
           "wall_seconds": round(time.perf_counter() - t0, 1)}
    write_json(json_path, out)
    if plot_path:
        plot(out, plot_path)
    return out


def _repriced(p: dict, f: float, core_hour_usd: float) -> dict:
    """A point's (or a run's switch_benefit's) cores, cost, net and verdict with the data
    plane's cost per frame scaled by ``f``: the benefit stays, the XDP cores scale."""
    cores = p["xdp_cores"] * f
    cost = p["cost_usd_per_hour"] + (cores - p["xdp_cores"]) * core_hour_usd
    net = p["benefit_usd_per_hour"] - cost
    return {"xdp_cores": round(cores, 3), "xdp_cores_p99": round(p["xdp_cores_p99"] * f, 3),
            "cost_usd_per_hour": round(cost, 4), "net_usd_per_hour": round(net, 4),
            "pays": bool(net > 0)}


def reprice(out: dict, xdp: dict, core_hour_usd: float) -> dict:
    """A sweep's result priced at another data-plane cost per frame (``xdp``, as
    ``xdp_frame_cost`` gives it): the benefit does not depend on it, the cost's XDP cores scale
    with it, so every point's cost, net and cores, and the break-even, follow exactly."""
    f = xdp["ns_per_frame"] / out["xdp"]["ns_per_frame"]
    points = [{**p, **_repriced(p, f, core_hour_usd)} for p in out["points"]]
    cases = [tuple(c) for c in out.get("cases", [[s, 0.0] for s in out["sharing"]])]
    curves = [c for c in break_even_curves(points, cases, out["switch_gib"])
              if any(_case(p) == _case(c) and p["switch_gib"] == c["switch_gib"] for p in points)]
    return {**out, "xdp": xdp, "repriced_from": out["xdp"], "points": points,
            "break_even": curves}


def reprice_run(out: dict, xdp: dict) -> dict:
    """A `sim run` result priced at another data-plane cost per frame, as ``reprice`` does a
    sweep's: its ``switch_benefit`` and its sweep-row ``point``."""
    b = out["switch_benefit"]
    new = _repriced(b, xdp["ns_per_frame"] / b["xdp"]["ns_per_frame"],
                    out["config"]["core_hour_usd"])
    return {**out, "switch_benefit": {**b, **new, "xdp": xdp, "repriced_from": b["xdp"]},
            "point": {**out["point"], **new}}


def reprice_file(path: str, xdp: dict, plot_path: str | None = None) -> dict:
    """Reprice the `sim run` or `sim sweep` result in ``path`` in place (and redraw a sweep's
    plot at ``plot_path``); what it was priced at before is kept as ``repriced_from``."""
    import json
    out = json.loads(Path(path).read_text())
    if "points" in out:
        out = reprice(out, xdp, out["defaults"]["core_hour_usd"])
        if plot_path:
            plot(out, plot_path)
    elif "switch_benefit" in out:
        out = reprice_run(out, xdp)
    else:
        raise ValueError(f"{path} is neither a `sim run` nor a `sim sweep` result")
    Path(path).write_text(json.dumps(out, indent=2) + "\n")
    return out


def plot(out: dict, path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    cases = [tuple(c) for c in out.get("cases", [[s, 0.0] for s in out["sharing"]])]
    fig, axes = plt.subplots(2, len(cases), figsize=(4.6 * len(cases), 7.4), sharey="row",
                             squeeze=False, gridspec_kw={"height_ratios": [3, 2]})
    for ax, cores, (s, k) in zip(axes[0], axes[1], cases):
        for mem in out["switch_gib"]:
            pts = [p for p in out["points"] if _case(p) == (s, k) and p["switch_gib"] == mem]
            if not pts:
                continue
            ratio = [max(p["benefit_usd_per_hour"], 0) / p["cost_usd_per_hour"] for p in pts]
            x = [p["nodes"] for p in pts]
            color = f"C{list(out['switch_gib']).index(mem)}"
            ax.plot(x, [max(r, 1e-3) for r in ratio], marker="o", color=color,
                    label=f"{mem:g} GiB switch")
            be = next((c["break_even_nodes"] for c in out["break_even"]
                       if _case(c) == (s, k) and c["switch_gib"] == mem), None)
            if be:
                ax.axvline(be, ls=":", lw=1, color=color)
            cores.plot(x, [p["xdp_cores_p99"] for p in pts], marker="o", color=color)
            cores.plot(x, [p["xdp_cores"] for p in pts], ls="--", lw=1, color=color)
        ax.axhline(1.0, color="k", lw=1)
        ax.set_title(f"sharing ratio {s:g}" + (f", skew (Zipf) {k:g}" if k else ""))
        for a in (ax, cores):
            a.set_xscale("log", base=2)
            a.set_yscale("log")
            a.grid(alpha=0.3, which="both")
        cores.set_xlabel("inference nodes")
    axes[0][0].set_ylabel("switch pool benefit / cost  (pays above 1)")
    axes[1][0].set_ylabel("XDP cores: busiest 1% of seconds\n(dashed: mean, charged)")
    for ax in axes[0]:
        ax.legend(fontsize=8)
    x, codec = out.get("xdp", {}), out.get("kv_codec", {}).get("name", "none")
    fig.suptitle(f"When the in-network KV pool pays for itself ({out['routing']} routing, "
                 f"{out['pools']} pool nodes; dotted: break-even; XDP "
                 f"{x.get('ns_per_frame', '?')} ns/frame"
                 + (f"; KV codec {codec}" if codec != "none" else "") + ")", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
