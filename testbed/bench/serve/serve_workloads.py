"""The workloads of `testbed bench serve`: per inference node, a time-ordered list of requests,
each with its arrival time (seconds from the run's start), its prefix blocks (16-byte keys, in
chain order) and its prompt's length in tokens; plus the blocks the pool holds before the run.

Scale (testbed.bench.serve.serve): one trace block of 512 tokens is a KV block scaled with the links
(Llama-3-8B's 64 MiB at 100 Gbit/s; 15 KiB at the default 25 Mbit/s), so fetching a block takes
about as long as in the cluster and modelled prefill runs in real time.

  trace  the shared Mooncake trace's first requests, routed round robin, time-scaled so the
         nodes' modelled prefill is ``load`` busy; nothing in the pool at the start.
  burst  a new long prefix (a rolled-out system prompt): one node computes it first (and writes
         it through; a warm-up request, reported apart, which bench serve runs to its end
         before the rest), then every node gets ``burst_per_node`` requests sharing it within
         ``window`` seconds, then a tail of ordinary requests with prefixes of their own.
  zipf   Zipf(0.99) popularity over ``objects`` prefixes of ``object_blocks`` blocks, all in
         the pool from the start, the hottest ``hot`` objects on the first pool node.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import numpy as np

from hostagent.common.pools import pool_for

from ...sim.trace import BLOCK_TOKENS, load_trace

WORKLOADS = ("trace", "burst", "zipf")


@dataclass
class Workload:
    name: str
    requests: list[list[dict]]                 # per node: {"at", "keys" (hex), "tokens"}
    preload: list[str] = field(default_factory=list)   # keys (hex) in the pool from the start
    params: dict = field(default_factory=dict)

    @property
    def n_requests(self) -> int:
        return sum(len(r) for r in self.requests)


def block_key(tag: str, i: int, pools=None, ns: int = 0, on: int | None = None) -> bytes:
    """The key of block ``i`` of a workload; with ``on``, the first key of the series whose
    owner (rendezvous hash over ``pools``) is pool node ``on``."""
    salt = 0
    while True:
        key = hashlib.sha256(f"serve/{tag}/{i}/{salt}".encode()).digest()[:16]
        if on is None or pool_for(pools, ns, key) == pools[on]:
            return key
        salt += 1


def payload(key: bytes, size: int) -> bytes:
    """A block's content, derived from its key (every node can check what it got)."""
    return np.random.default_rng(int.from_bytes(key[:8], "little")).bytes(size)


def _request(at: float, keys: list[bytes], tokens: int) -> dict:
    return {"at": round(float(at), 4), "keys": [k.hex() for k in keys], "tokens": int(tokens)}


def trace_workload(trace_path: str, nodes: int, prefill_tok_s: float, requests: int,
                   load: float = 0.6, max_blocks: int = 48) -> Workload:
    t = load_trace(trace_path)
    n = min(requests, t.n_requests)
    tokens = np.minimum(t.input_length[:n], max_blocks * BLOCK_TOKENS)
    span = (t.timestamp[n - 1] - t.timestamp[0]) / 1000 or 1.0
    # the nodes' prefill (without any cache) busy ``load`` of the run
    run_s = float(tokens.sum()) / prefill_tok_s / nodes / load
    scale = run_s / span
    per = [[] for _ in range(nodes)]
    for i in range(n):
        ids = t.blocks(i)[:max(1, -(-int(tokens[i]) // BLOCK_TOKENS))]
        at = (t.timestamp[i] - t.timestamp[0]) / 1000 * scale
        per[i % nodes].append(_request(at, [block_key("trace", int(h)) for h in ids],
                                       tokens[i]))
    return Workload("trace", per, params={"requests": n, "time_scale": round(scale, 4),
                                          "load": load, "max_blocks": max_blocks,
                                          "trace": trace_path})


def arrivals(rng: np.random.Generator, rate: float, start: float, end: float):
    """Poisson arrival times at ``rate`` per second after ``start``, up to ``end``; drawn one at
    a time, so a caller's own draws between arrivals keep their place in ``rng``'s stream."""
    t = start
    while True:
        t += rng.exponential(1 / rate)
        if t > end:
            return
        yield t


def zipf_weights(n: int, alpha: float) -> np.ndarray:
    """Zipf(alpha) probabilities of ranks 1..n."""
    p = 1 / np.arange(1, n + 1) ** alpha
    return p / p.sum()


def burst_workload(nodes: int, prefill_tok_s: float, prefix_blocks: int = 32,
                   burst_per_node: int = 2, window: float = 0.2, suffix_tokens: int = 256,
                   tail_s: float = 6.0, tail_rate: float = 0.3, tail_blocks: int = 4,
                   seed: int = 1) -> Workload:
    rng = np.random.default_rng(seed)
    prefix = [block_key("burst-prefix", i) for i in range(prefix_blocks)]
    ptok = prefix_blocks * BLOCK_TOKENS
    per = [[] for _ in range(nodes)]
    # the first to see it computes it: the rollout, not the burst (apart in the figures)
    per[0].append({**_request(0.0, prefix, ptok + suffix_tokens), "warmup": True})
    start = ptok / prefill_tok_s + 1.5       # its prefill is over and its blocks written
    uid = 0
    for node in range(nodes):
        for _ in range(burst_per_node):
            per[node].append(_request(start + rng.uniform(0, window), prefix,
                                      ptok + suffix_tokens))
        for t in arrivals(rng, tail_rate, start + window, start + window + tail_s):
            uid += 1
            keys = [block_key(f"burst-tail-{uid}", i) for i in range(tail_blocks)]
            per[node].append(_request(t, keys, tail_blocks * BLOCK_TOKENS + suffix_tokens))
    for r in per:
        r.sort(key=lambda q: q["at"])
    return Workload("burst", per, params={
        "prefix_blocks": prefix_blocks, "burst_per_node": burst_per_node, "window_s": window,
        "burst_at_s": round(start, 3), "suffix_tokens": suffix_tokens, "tail_s": tail_s,
        "tail_rate_per_node": tail_rate, "tail_blocks": tail_blocks})


def zipf_workload(nodes: int, pools, ns: int, objects: int = 64, object_blocks: int = 4,
                  hot: int = 8, rate: float = 6.0, seconds: float = 15.0, alpha: float = 0.99,
                  suffix_tokens: int = 128, seed: int = 2) -> Workload:
    rng = np.random.default_rng(seed)
    keys = [[block_key(f"zipf-{o}", b, pools, ns, on=0 if o < hot else None)
             for b in range(object_blocks)] for o in range(objects)]
    p = zipf_weights(objects, alpha)
    per = [[] for _ in range(nodes)]
    for node in range(nodes):
        for t in arrivals(rng, rate, 0.0, seconds):
            o = int(rng.choice(objects, p=p))
            per[node].append(_request(t, keys[o], object_blocks * BLOCK_TOKENS +
                                      suffix_tokens))
    return Workload("zipf", per, preload=[k.hex() for obj in keys for k in obj], params={
        "objects": objects, "object_blocks": object_blocks, "hot_on_first_pool": hot,
        "rate_per_node": rate, "seconds": seconds, "alpha": alpha,
        "suffix_tokens": suffix_tokens})


def mixed_workload(nodes: int, pools, ns: int, seconds: float = 26.0, burst_every: float = 6.0,
                   first_burst: float = 4.0, prefix_blocks: int = 32, window: float = 0.2,
                   suffix_tokens: int = 256, seed: int = 3, **zipf) -> Workload:
    """`bench faults`' traffic: the zipf workload for ``seconds`` and, every ``burst_every``
    seconds from ``first_burst``, a new prefix of ``prefix_blocks`` blocks (in the pool from the
    start: rolled out, not yet asked for) requested by every node within ``window``."""
    from kvproto.wire import PORT
    pools = [(p, PORT) if isinstance(p, str) else tuple(p) for p in pools]   # addresses too
    wl = zipf_workload(nodes, pools, ns, seconds=seconds, seed=seed, **zipf)
    rng = np.random.default_rng(seed)
    bursts, t = [], first_burst
    while t < seconds - 1.0:
        prefix = [block_key(f"mixed-burst-{len(bursts)}", i) for i in range(prefix_blocks)]
        for node in range(nodes):
            wl.requests[node].append(_request(t + rng.uniform(0, window), prefix,
                                              prefix_blocks * BLOCK_TOKENS + suffix_tokens))
        wl.preload += [k.hex() for k in prefix]
        bursts.append(round(t, 3))
        t += burst_every
    for r in wl.requests:
        r.sort(key=lambda q: q["at"])
    return Workload("mixed", wl.requests, preload=wl.preload, params={
        **wl.params, "bursts_at_s": bursts, "burst_prefix_blocks": prefix_blocks,
        "burst_window_s": window})
