"""Offline cache-policy evaluation: replay a trace's block requests at one capacity against every
policy switchd can run, the state of the art as implemented by libCacheSim, and the references
with hindsight; print a table and write JSON (``testbed policy-eval``).

- switchd's policies (``switchd.policy.POLICIES``, what ``switchd --policy`` offers; the default
  is the one under test), replayed here in Python exactly as the daemon drives them;
- libCacheSim's algorithms (``testbed.sim.baselines``, named ``lcs:<name>``: ARC, LIRS, S3-FIFO,
  SIEVE, W-TinyLFU, 2Q, Cacheus, LeCaR, LHD, GDSF, MQ, CAR...): the offline baselines;
- hindsight: Belady's optimum (``belady``, knows when every block comes back; may bypass a miss),
  the best fixed set (``static``, knows how often each block comes, not when) and libCacheSim's
  Belady (``lcs:Belady``, which admits every miss: a different cache, a cross-check of ours).

Replay: the block requests are every hash_id of every request, in order. Each one is
``policy.access``-ed at its request's timestamp; a miss is then offered to ``policy.admit``.
libCacheSim sees the same keys with size 1 and a cache of the same number of objects. Every block
occupies one unit of capacity. The hit ratio is hits / block requests.

Result (JSON): trace, requests, block_requests, distinct_blocks, capacity (as given),
capacity_blocks, default_policy, and per policy name: hit_ratio, of_belady (hit ratio / Belady's),
compute_saved (share of prefill compute the hits save, weight fill*(1+GAMMA*depth)), seconds;
then best_other (name and hit ratio of the best algorithm that is neither switchd's nor reads the
future; None if none ran), groups (the names of each kind) and libcachesim (version, seed, the
default algorithms too small for the capacity, and whether libCacheSim's Belady in our model
gives our Belady's hit mask).

``sweep`` repeats the evaluation over capacities; ``plot_sweep`` draws hit ratio vs capacity.
"""
from __future__ import annotations

import time

import numpy as np

from switchd.policy import DEFAULT_POLICY, POLICIES, make_policy

from . import baselines
from .hindsight import belady_hits, static_hits
from .trace import Trace, as_trace

BELADY = "belady"
OFFLINE = {BELADY: belady_hits, "static": static_hits}   # hindsight references, always run
LCS = "lcs:"                                              # prefix of libCacheSim's names
GAMMA = 1 / 60       # attention share of a 512-token block's prefill per block of context


def capacity_blocks(capacity: float, distinct_blocks: int) -> int:
    """< 1: that fraction of the trace's distinct blocks (at least 1); else a block count."""
    if not capacity > 0:
        raise ValueError(f"capacity must be > 0, got {capacity}")
    if capacity < 1:
        return max(1, int(round(capacity * distinct_blocks)))
    return int(capacity)


def policy_name(name: str) -> str:
    """The evaluator's name of a policy: switchd's and the hindsight ones as they are,
    libCacheSim's with the ``lcs:`` prefix (given with or without it). ValueError if unknown."""
    if name in POLICIES or name in OFFLINE:
        return name
    bare = name[len(LCS):] if name.startswith(LCS) else name
    if bare in baselines.ALGORITHMS:
        return LCS + bare
    raise ValueError(f"unknown policy {name} (choose from {', '.join([*POLICIES, *OFFLINE])} "
                     f"or libCacheSim's {', '.join(baselines.ALGORITHMS)})")


def is_hindsight(name: str) -> bool:
    return name in OFFLINE or (name.startswith(LCS) and name[len(LCS):] in baselines.HINDSIGHT)


def best_other(ratio: dict) -> dict | None:
    """The best algorithm that is neither switchd's nor reads the future (ties: first listed)."""
    others = [k for k in ratio if k not in POLICIES and not is_hindsight(k)]
    if not others:
        return None
    name = max(others, key=ratio.__getitem__)
    return {"name": name, "hit_ratio": ratio[name]}


def replay(policy, stream) -> np.ndarray:
    """Hit mask of one policy over a BlockStream."""
    hits = np.zeros(len(stream), bool)
    access, admit = policy.access, policy.admit
    rows = zip(stream.key.tolist(), stream.time.tolist(), stream.depth.tolist(),
               stream.parent.tolist(), stream.fill.tolist())
    for i, (key, now, depth, parent, fill) in enumerate(rows):
        hit = access(key, now, depth=depth, parent=None if parent < 0 else parent, fill=fill)
        if hit:
            hits[i] = True
        else:
            admit(key, now, depth=depth, parent=None if parent < 0 else parent, fill=fill)
    return hits


def evaluate(trace, capacity: float, policies=None, *, seed: int = 0) -> dict:
    """Replay ``trace`` (path, Trace or list of request dicts) against ``policies`` (names, see
    ``policy_name``; default: switchd's and libCacheSim's that work at this capacity) plus
    Belady and the best fixed set at ``capacity``; returns the result (see the module doc).
    ``seed`` seeds libCacheSim's randomised algorithms."""
    trace: Trace = as_trace(trace)
    cap = capacity_blocks(capacity, trace.distinct_blocks)
    skipped = []
    if policies is None:
        baselines.require()
        names = [*POLICIES, *(LCS + n for n in baselines.runnable(cap))]
        skipped = [n for n in baselines.DEFAULT_NAMES if LCS + n not in names]
    else:
        names = list(dict.fromkeys(policy_name(p) for p in policies))
    names = ([n for n in names if not is_hindsight(n)] + list(OFFLINE)
             + [n for n in names if is_hindsight(n) and n not in OFFLINE])
    lcs_names = [n[len(LCS):] for n in names if n.startswith(LCS)]
    baselines.runnable(cap, lcs_names)           # too small a capacity: refuse before any work
    stream = trace.stream()
    work = stream.fill * (1 + GAMMA * stream.depth)   # prefill compute a hit saves (relative)
    lcs_seconds: dict = {}
    lcs_masks = (baselines.run(stream.key, cap, lcs_names, times=stream.time, seed=seed,
                               seconds=lcs_seconds) if lcs_names else {})
    ratio, saved, seconds = {}, {}, {}
    for name in names:
        t0 = time.perf_counter()
        if name.startswith(LCS):
            hits, t0 = lcs_masks[name[len(LCS):]], t0 - lcs_seconds[name[len(LCS):]]
        elif name in OFFLINE:
            hits = OFFLINE[name](stream.key, cap)
        else:
            hits = replay(make_policy(name, cap), stream)
        seconds[name] = round(time.perf_counter() - t0, 3)
        ratio[name] = float(hits.mean())
        saved[name] = float(work[hits].sum() / work.sum())
        if name == BELADY:
            ours = hits
    best = ratio[BELADY]
    result = {
        "trace": trace.path,
        "requests": trace.n_requests,
        "block_requests": trace.n_block_requests,
        "distinct_blocks": trace.distinct_blocks,
        "capacity": capacity,
        "capacity_blocks": cap,
        "default_policy": DEFAULT_POLICY,
        "hit_ratio": ratio,
        "of_belady": {k: (v / best if best else None) for k, v in ratio.items()},
        "compute_saved": saved,
        "seconds": seconds,
        "best_other": best_other(ratio),
        "groups": {"switchd": [n for n in names if n in POLICIES],
                   "libcachesim": [n for n in names if n.startswith(LCS) and not is_hindsight(n)],
                   "hindsight": [n for n in names if is_hindsight(n)]},
    }
    if lcs_names:
        check = None
        if "Belady" in lcs_names:
            check = bool((baselines.belady_bypass(stream.key, cap) == ours).all())
        result["libcachesim"] = {"version": baselines.version(), "seed": seed,
                                 "too_small_for": skipped, "belady_in_our_model_equal": check}
    return result


def sweep(trace, capacities, policies=None, *, seed: int = 0, log=None) -> dict:
    """``evaluate`` at each capacity; the top-level fields are the trace's, ``results`` holds one
    result per capacity and ``plotted`` the libCacheSim algorithms ``plot_sweep`` draws."""
    trace = as_trace(trace)
    results = []
    for c in capacities:
        t0 = time.perf_counter()
        results.append(evaluate(trace, c, policies, seed=seed))
        r = results[-1]
        r["wall_seconds"] = round(time.perf_counter() - t0, 2)
        if log:
            bo = r["best_other"] or {"name": "-", "hit_ratio": float("nan")}
            log(f"{c:g} ({r['capacity_blocks']} blocks): {DEFAULT_POLICY} "
                f"{r['hit_ratio'].get(DEFAULT_POLICY, float('nan')):.4f}, best other "
                f"{bo['name']} {bo['hit_ratio']:.4f}, belady {r['hit_ratio'][BELADY]:.4f} "
                f"[{r['wall_seconds']:.0f} s]")
    head = {k: results[0][k] for k in ("trace", "requests", "block_requests", "distinct_blocks",
                                       "default_policy")}
    return {**head, "capacities": list(capacities), "plotted": top_baselines(results),
            "results": [{k: v for k, v in r.items() if k not in head} for r in results]}


def top_baselines(results: list, k: int = 3) -> list[str]:
    """The ``k`` libCacheSim algorithms (no hindsight) with the highest mean hit ratio over the
    results, one per distinct curve (ARCv0 gives ARC's exactly)."""
    names = [n for n in results[0]["groups"]["libcachesim"]
             if all(n in r["hit_ratio"] for r in results)]
    curve = {n: tuple(round(r["hit_ratio"][n], 12) for r in results) for n in names}
    top: list[str] = []
    for n in sorted(names, key=lambda n: -sum(curve[n])):
        if all(curve[n] != curve[t] for t in top):
            top.append(n)
    return top[:k]


def plot_sweep(out: dict, path) -> None:
    """Hit ratio vs capacity (left) for the default policy, the plotted libCacheSim algorithms,
    the best fixed set and Belady; right: each in points above or below the best libCacheSim
    algorithm at that capacity."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = out["results"]
    x = [100 * (r["capacity"] if r["capacity"] < 1 else r["capacity_blocks"] /
                out["distinct_blocks"]) for r in rows]
    best = np.array([(r["best_other"] or {}).get("hit_ratio", np.nan) for r in rows])
    fig, (ax, rel) = plt.subplots(1, 2, figsize=(12, 4.8))
    series = [(out["default_policy"], f"{out['default_policy']} (switchd's default)",
               dict(color="C3", lw=2.5, marker="o"))]
    series += [(n, f"{n[len(LCS):]} (libCacheSim)", dict(marker="s")) for n in out["plotted"]]
    series += [("static", "static (best fixed set, hindsight)", dict(color="k", ls="--")),
               (BELADY, "Belady (hindsight)", dict(color="k", ls=":", marker="^"))]
    for key, label, style in series:
        y = np.array([r["hit_ratio"].get(key, np.nan) for r in rows])
        ax.plot(x, y, label=label, **style)
        if key not in ("static", BELADY):
            rel.plot(x, 100 * (y - best), label=label, **style)
    ax.plot(x, best, color="tab:purple", lw=7, alpha=0.18,
            label="best libCacheSim at each capacity")
    rel.axhline(0, color="tab:purple", lw=7, alpha=0.18)
    rel.set_ylabel("points vs the best libCacheSim algorithm at that capacity")
    ax.set_ylabel("hit ratio (hits / block requests)")
    for a in (ax, rel):
        a.set_xscale("log")
        a.set_xticks(x, [f"{v:.3g}%" for v in x])
        a.minorticks_off()
        a.set_xlabel("capacity (share of distinct blocks)")
        a.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    rel.legend(fontsize=8)
    fig.suptitle(f"{out['trace']}: {out['block_requests']} block requests, "
                 f"{out['distinct_blocks']} distinct", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def render(result: dict) -> None:
    """Print the result as a table (rich if available): switchd's policies, libCacheSim's best
    first, the references with hindsight."""
    title = (f"{result['trace']}: {result['capacity_blocks']} blocks "
             f"({result['capacity_blocks'] / result['distinct_blocks']:.1%} of "
             f"{result['distinct_blocks']} distinct), {result['block_requests']} block requests")
    ratio, groups = result["hit_ratio"], result.get("groups", {})
    order = [*groups.get("switchd", []),
             *sorted(groups.get("libcachesim", []), key=lambda n: -ratio[n]),
             *groups.get("hindsight", [])]
    order += [n for n in ratio if n not in order]
    rows = [(name + (" (default)" if name == result["default_policy"] else ""),
             f"{ratio[name]:.4f}", f"{result['of_belady'][name]:.3f}" if result["of_belady"][name]
             is not None else "-", f"{result['compute_saved'][name]:.4f}",
             f"{result['seconds'][name]:.2f}")
            for name in order]
    header = ("policy", "hit ratio", "x belady", "compute saved", "seconds")
    bo, mine = result.get("best_other"), ratio.get(result["default_policy"])
    note = (f"best other: {bo['name']} {bo['hit_ratio']:.4f}; {result['default_policy']} "
            f"{100 * (mine - bo['hit_ratio']):+.2f} pp" if bo and mine is not None else None)
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        print(title)
        print("  ".join(f"{h:>14}" for h in header))
        for row in rows:
            print("  ".join(f"{c:>14}" for c in row))
        if note:
            print(note)
        return
    table = Table(title=title, caption=note)
    for i, h in enumerate(header):
        table.add_column(h, justify="left" if i == 0 else "right")
    for row in rows:
        table.add_row(*row)
    Console().print(table)
