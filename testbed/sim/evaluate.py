"""Offline cache-policy evaluation: replay a trace's block requests against every switchd policy
and two offline references at one capacity, print a table and write JSON (``testbed
policy-eval``). The references: Belady's optimum (``belady``, knows when every block comes back)
and the best fixed set in hindsight (``static``, knows how often each block comes, not when).

Replay: the block requests are every hash_id of every request, in order. Each one is
``policy.access``-ed at its request's timestamp; a miss is then offered to ``policy.admit``. Every
block occupies one unit of capacity. The hit ratio is hits / block requests.

Result (JSON): trace, requests, block_requests, distinct_blocks, capacity (as given),
capacity_blocks, default_policy, and per policy name: hit_ratio, of_belady (hit ratio / Belady's),
compute_saved (share of prefill compute the hits save, weight fill*(1+GAMMA*depth)), seconds.
"""
from __future__ import annotations

import time

import numpy as np

from switchd.policy import DEFAULT_POLICY, POLICIES, make_policy

from .hindsight import belady_hits, static_hits
from .trace import Trace, as_trace

BELADY = "belady"
OFFLINE = {BELADY: belady_hits, "static": static_hits}   # hindsight references, always run
GAMMA = 1 / 60       # attention share of a 512-token block's prefill per block of context


def capacity_blocks(capacity: float, distinct_blocks: int) -> int:
    """< 1: that fraction of the trace's distinct blocks (at least 1); else a block count."""
    if not capacity > 0:
        raise ValueError(f"capacity must be > 0, got {capacity}")
    if capacity < 1:
        return max(1, int(round(capacity * distinct_blocks)))
    return int(capacity)


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


def evaluate(trace, capacity: float, policies=None) -> dict:
    """Replay ``trace`` (path, Trace or list of request dicts) against ``policies`` (names;
    default: all) plus Belady at ``capacity``; returns the result (see the module doc)."""
    trace: Trace = as_trace(trace)
    names = list(policies or POLICIES)
    unknown = [p for p in names if p not in POLICIES and p not in OFFLINE]
    if unknown:
        raise ValueError(f"unknown policy {', '.join(unknown)} (choose from "
                         f"{', '.join([*POLICIES, *OFFLINE])})")
    names += [name for name in OFFLINE if name not in names]
    stream = trace.stream()
    cap = capacity_blocks(capacity, trace.distinct_blocks)
    work = stream.fill * (1 + GAMMA * stream.depth)   # prefill compute a hit saves (relative)
    ratio, saved, seconds = {}, {}, {}
    for name in names:
        t0 = time.perf_counter()
        hits = (OFFLINE[name](stream.key, cap) if name in OFFLINE
                else replay(make_policy(name, cap), stream))
        seconds[name] = round(time.perf_counter() - t0, 3)
        ratio[name] = float(hits.mean())
        saved[name] = float(work[hits].sum() / work.sum())
    best = ratio[BELADY]
    return {
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
    }


def render(result: dict) -> None:
    """Print the result as a table (rich if available)."""
    title = (f"{result['trace']}: {result['capacity_blocks']} blocks "
             f"({result['capacity_blocks'] / result['distinct_blocks']:.1%} of "
             f"{result['distinct_blocks']} distinct), {result['block_requests']} block requests")
    rows = [(name + (" (default)" if name == result["default_policy"] else ""),
             f"{r:.4f}", f"{result['of_belady'][name]:.3f}" if result["of_belady"][name] is not
             None else "-", f"{result['compute_saved'][name]:.4f}",
             f"{result['seconds'][name]:.2f}")
            for name, r in result["hit_ratio"].items()]
    header = ("policy", "hit ratio", "x belady", "compute saved", "seconds")
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        print(title)
        print("  ".join(f"{h:>14}" for h in header))
        for row in rows:
            print("  ".join(f"{c:>14}" for c in row))
        return
    table = Table(title=title)
    for i, h in enumerate(header):
        table.add_column(h, justify="left" if i == 0 else "right")
    for row in rows:
        table.add_row(*row)
    Console().print(table)
