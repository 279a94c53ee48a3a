"""The cluster model at `testbed bench serve`'s scale (``testbed sim validate --serve``): the same
per-node request lists (bench serve's workloads) replayed through the model's tiers and the
testbed's timing, so the two can be compared request for request.

Tiers, as in the cluster model: a block is in the pool from its preload or once a node's
write-through of it has completed; the switch tier is tiers.SwitchModel (switchd's own admission
loop stepping a model of the data plane: a miss's reply learned if admitted or while the
speculative-fill budget lasts), with a fetch of a block whose upstream fetch is still under way
held and answered by it (coalescing); what no tier holds is recomputed.

Timing, as bench serve's nodes do it: one request at a time per node (its GPU), queueing from
arrival; all of a request's blocks fetched at once (a block the pool lacks costs one round
trip); the longest fetched prefix is cached and the rest is prefilled at the preset's speed; the
blocks computed are then written through by a background writer, one at a time. Every transfer
crosses the links it uses (pool node egress and the node's downlink for a reply from the pool,
the downlink alone for a switch hit; the node's uplink and the pool's ingress for a write), and
a link serves the bytes asked of it in the order they were asked (fluid, stepped every ``dt``),
each node asking at most the fetch engine's first window (``INITIAL_WINDOW`` chunks) ahead per
route (``serve_links``): a request of a few blocks is asked at once and served before the
requests asked after it, a long prefix is asked a window at a time and interleaves with the
others' (with every link shared equally, as the model had it before, the Zipf rows over
bridges, requests of about a window, came out 18 % slow in every validation). Three constants,
measured on the testbed before the run and not fitted to its results (``Calibration``): the
links' rate, the fetch engine's round trip and the box's wake-up latency (a sleeping node wakes
that late for an arrival and at the end of a modelled prefill). The switch's cache is the
testbed's (entries / chunks per block) and switchd has run since before the workload (its fill
budget is there from the first fetch). Bytes on a link are the frames' (chunk + PAYLOAD_OFF per
chunk; one header-only frame per NOT_FOUND and per acknowledged chunk).

``replay`` is the serving loops and the fluid links alone, the network a caller's (callbacks
giving each fetch's links and upstream; testbed.sim.fabric_serve_model is a fabric of
switches); ``simulate_serve`` is one switch (or a bridge) in front of the pool nodes."""
from __future__ import annotations

import math
import random
from dataclasses import asdict, dataclass, field

import numpy as np

from hostagent.common.pools import pool_for
from hostagent.inference.fetch.transfers import INITIAL_WINDOW
from kvproto.wire import PORT

from .config import FRAME_OVERHEAD
from .tiers import POOL, REPLICA, SWITCH, SwitchModel

BLOCK_TOKENS = 512


@dataclass
class Calibration:
    """What the model is told about the testbed's links and fetch engine (measured)."""
    link_bytes_per_s: float       # each link's rate, frame bytes per second
    rtt_s: float                  # the fetch engine's round trip (a NOT_FOUND lookup)
    chunk: int                    # payload bytes per frame
    block_bytes: int
    wake_s: float = 0.0           # a sleeping node's wake-up latency (arrival, end of prefill)
    source: dict = field(default_factory=dict)

    @property
    def chunks(self) -> int:
        return -(-self.block_bytes // self.chunk)

    @property
    def wire(self) -> float:
        return self.chunks * (self.chunk + FRAME_OVERHEAD)


class HeldSwitch(SwitchModel):
    """SwitchModel fetch by fetch in time order across calls, with a fetch of a block whose
    upstream fetch is under way held (a replica of its reply)."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.next_step = None

    def advance(self, t: float) -> None:
        """switchd's policy steps up to ``t``."""
        if self.next_step is None:          # switchd has run since before the workload:
            self.step(t)                    # its fill budget is there from the start
            self.next_step = t + self.interval
        while t >= self.next_step:
            self.step(self.next_step)
            self.next_step += self.interval

    def fetch(self, k, t: float, inflight: bool) -> int:
        self.advance(t)
        if inflight and self.coalesce:
            self.misses[k] += 1
            self.sizes[k] = 1.0
            return REPLICA
        if k in self.filled:
            self.hits[k] += 1
            return SWITCH
        self.misses[k] += 1
        self.sizes[k] = 1.0
        if self.used + 1.0 <= self.total + 1e-9:
            if k in self.admitted:
                self.filled[k] = (1.0, False)
                self.used += 1.0
            elif 1.0 <= self.spec_budget:
                self.filled[k] = (1.0, True)
                self.used += 1.0
                self.spec_budget -= 1.0
        return POOL


class _Transfer:
    __slots__ = ("left", "links", "done", "after", "caught", "route", "unasked", "asked")

    def __init__(self, size: float, links: tuple, after=None):
        self.left, self.links, self.done, self.after = size, links, None, after
        self.caught = None      # bytes its upstream still had to send when it caught up
        self.route = None       # whose window it is asked in (replay sets it)
        self.unasked = size     # bytes not asked for yet
        self.asked: list = []   # [when, bytes] asked for and not served yet, oldest first


def _route_key(links: tuple):
    """What a transfer is asked on (``serve_links``): a fetch from the pool, the pool node
    whose link its reply crosses, as the engine's window per pool node; one that crosses no
    pool node's link, its links: a switch's answers (the engine holds them to a wider bound,
    COPIED_HEADROOM) and a node's writes."""
    return next((link for link in links if link[0] == "pe"), links)


def serve_links(active: list[_Transfer], t: float, step_of: dict, window: float) -> None:
    """One step of the links: each route (a node's fetches from one pool node; its fetches a
    switch answers over the same links; its writes over the same links) keeps up to
    ``window`` bytes asked for, topped up in the order its transfers were submitted; every
    link then serves the bytes asked of it oldest first, ``step_of[link]`` bytes a step (a
    pool node answers GETs in the order they came, the links' queues are FIFO)."""
    in_flight: dict = {}
    for x in active:
        in_flight[x.route] = in_flight.get(x.route, 0.0) + x.left - x.unasked
    for x in active:
        n = min(x.unasked, window - in_flight[x.route])
        if n > 0:
            x.asked.append([t, n])
            x.unasked -= n
            in_flight[x.route] += n
    room = dict(step_of)
    oldest_first = sorted((a[0], i, a) for i, x in enumerate(active) for a in x.asked)
    for _, i, a in oldest_first:
        x = active[i]
        n = min(a[1], *(room[link] for link in x.links))
        if n > 0:
            a[1] -= n
            for link in x.links:
                room[link] -= n
    for x in active:
        x.asked = [a for a in x.asked if a[1] > 0]
        x.left = x.unasked + sum(a[1] for a in x.asked)


def replay(requests: list[list[dict]], avail: dict, cal: Calibration, prefill_tok_s: float,
           fetch, not_found, computed, rates: dict | None = None, dt: float = 5e-4) -> list:
    """The nodes' serving loops over shared links, as bench serve's nodes run them (module
    docstring): per request TTFT, queueing, fetch and prefill. The network is the caller's:
    ``fetch(i, k, t)`` gives the _Transfer of node i's fetch of block k (available in the pool
    at t), with the links it crosses and the upstream transfer it is a replica of (``after``);
    ``not_found(i, k, t)`` is a lookup of a block the pool lacks; ``computed(i, k, t)`` gives
    the links of the writes of a block node i computed (it accounts the pool's acks). ``avail``
    (block -> time it is in the pool) is updated as writes are acknowledged. A link's rate is
    ``rates[link]`` (frame bytes per second), else ``cal.link_bytes_per_s``. A transfer that
    finishes its own bytes while its upstream is still under way waits for it, and notes the
    upstream's bytes left then (``caught``)."""
    queues = [[(r, bytes_keys(r)) for r in q] for q in requests]
    window = INITIAL_WINDOW * (cal.chunk + FRAME_OVERHEAD)
    step_of: dict = {}                     # link -> bytes it moves in dt
    rates = rates or {}
    nxt = [0] * len(queues)
    free_at = [0.0] * len(queues)
    busy: dict[int, dict] = {}             # node -> the request it is fetching
    prefilling: list = []                  # (end, node)
    writes = [[] for _ in queues]          # per node: blocks waiting to be written
    writing: dict[int, _Transfer] = {}
    active: list[_Transfer] = []
    out = []
    t = 0.0
    total = sum(len(q) for q in queues)

    def start(i: int, r: dict, keys: list[bytes]) -> None:
        held = [k for k in keys if avail.get(k, math.inf) <= t]
        cached = 0
        for k in keys:
            if avail.get(k, math.inf) > t:
                break
            cached += 1
        xs = []
        missing = len(keys) - len(held)
        for k in keys:
            if avail.get(k, math.inf) > t:
                not_found(i, k, t)
                continue
            x = fetch(i, k, t)
            x.route = (i, _route_key(x.links))
            xs.append(x)
        active.extend(xs)
        busy[i] = {"r": r, "keys": keys, "xs": xs, "start": t, "cached": cached,
                   "fetched": len(held), "missing": missing}

    while len(out) < total:
        # requests whose node is free start (in arrival order per node)
        for i, q in enumerate(queues):
            if i in busy or nxt[i] >= len(q) or free_at[i] > t:
                continue
            r, keys = q[nxt[i]]
            # a node asleep until the arrival wakes late; one still busy goes straight on
            if r["at"] + (cal.wake_s if free_at[i] < r["at"] else 0.0) <= t:
                nxt[i] += 1
                start(i, r, keys)
        # writers: one block at a time per node (to every pool node in the replicas mode)
        for i, w in enumerate(writes):
            if i not in writing and w:
                k, links = w.pop(0)
                writing[i] = x = _Transfer(cal.wire, links)
                x.route = (i, _route_key(links))
                x.after = k                       # the block it makes available
                active.append(x)
        for x in active:
            for link in x.links:
                if link not in step_of:
                    step_of[link] = dt * rates.get(link, cal.link_bytes_per_s)
        serve_links(active, t, step_of, window)
        t += dt
        still = []
        for x in active:
            if x.left <= 0 and not (isinstance(x.after, _Transfer) and x.after.done is None):
                x.done = t
            else:
                if x.left <= 0 and x.caught is None:
                    x.caught = max(0.0, x.after.left)
                still.append(x)
        active[:] = still
        for i, x in list(writing.items()):
            if x.done is not None:
                del writing[i]
                avail.setdefault(x.after, x.done + cal.rtt_s / 2)     # acknowledged
        # fetches complete: a round trip after the last reply; then the modelled prefill
        for i, f in list(busy.items()):
            if all(x.done is not None for x in f["xs"]):
                done = max([f["start"], *(x.done for x in f["xs"])]) + cal.rtt_s
                r, keys = f["r"], f["keys"]
                compute = max(0, r["tokens"] - f["cached"] * BLOCK_TOKENS) / prefill_tok_s
                end = done + compute + (cal.wake_s if compute > 0 else 0.0)
                out.append({"node": i, "at": r["at"], "queue": f["start"] - r["at"],
                            "fetch": done - f["start"], "prefill": compute,
                            "ttft": end - r["at"], "warmup": bool(r.get("warmup")),
                            "blocks": len(keys), "cached": f["cached"],
                            "fetched": f["fetched"]})
                del busy[i]
                free_at[i] = end
                prefilling.append((end, i, keys[f["cached"]:]))
        for item in [p for p in prefilling if p[0] <= t]:
            prefilling.remove(item)
            _, i, rest = item
            for k in rest:
                for links in computed(i, k, t):
                    writes[i].append((k, links))
    return out


def simulate_serve(requests: list[list[dict]], preload, mode: str, pools: list[str], ns: int,
                   cal: Calibration, prefill_tok_s: float, cache_blocks: float = 10_000,
                   headroom_blocks: float | None = None, interval: float = 1.0,
                   policy: str = "prefix", dt: float = 5e-4, seed: int = 0) -> dict:
    """Replay one workload in one mode (bridge, switch or replicas). Result: per request TTFT,
    queueing, fetch and prefill (and whether it is a warm-up), the share of fetched blocks per
    tier (switch hit, switch replica, pool), cached blocks / blocks, pool egress bytes per pool
    node, and the chunks fetched."""
    rng = random.Random(seed)
    P = len(pools)
    own = owner(pools, ns)
    avail = {bytes.fromhex(k): 0.0 for k in preload}
    headroom = cache_blocks / 16 if headroom_blocks is None else headroom_blocks
    sw = (HeldSwitch(policy, cache_blocks, headroom, interval) if mode == "switch" else None)
    upstream: dict[bytes, _Transfer] = {}  # block -> its fetch from a pool node under way
    egress = [0.0] * P
    tiers = {"switch": 0, "switch_replica": 0, "pool": 0}

    def fetch(i: int, k: bytes, t: float) -> _Transfer:
        if sw is not None:
            up = upstream.get(k)
            o = sw.fetch(k, t, up is not None and up.done is None)
        else:
            o = POOL
        if o == POOL:
            p = rng.randrange(P) if mode == "replicas" else own(k)
            x = _Transfer(cal.wire, (("pe", p), ("nd", i)))
            egress[p] += cal.wire
            upstream[k] = x
            tiers["pool"] += 1
        elif o == SWITCH:
            x = _Transfer(cal.wire, (("nd", i),))
            tiers["switch"] += 1
        else:
            x = _Transfer(cal.wire, (("nd", i),), after=upstream[k])
            tiers["switch_replica"] += 1
        return x

    def not_found(i: int, k: bytes, t: float) -> None:
        egress[own(k)] += FRAME_OVERHEAD              # NOT_FOUND

    def computed(i: int, k: bytes, t: float) -> list:
        links = []
        for p in (range(P) if mode == "replicas" else [own(k)]):
            links.append((("nu", i), ("pi", p)))
            egress[p] += cal.chunks * FRAME_OVERHEAD      # acknowledgements
        return links

    out = replay(requests, avail, cal, prefill_tok_s, fetch, not_found, computed, dt=dt)
    fetched = sum(tiers.values())
    blocks = sum(o["blocks"] for o in out)
    return {"mode": mode, "requests": out,
            "tier_share": {k: round(v / max(1, fetched), 4) for k, v in tiers.items()},
            "switch_hit_ratio": round(tiers["switch"] / max(1, fetched), 4),
            "cached_block_ratio": round(sum(o["cached"] for o in out) / max(1, blocks), 4),
            "pool_egress_bytes": [int(round(e)) for e in egress],
            "chunks_fetched": fetched * cal.chunks, "calibration": asdict(cal),
            "policy_steps": sw.steps if sw else 0}


def owner(pools: list[str], ns: int):
    """Block -> index of its owner pool node (bench serve's rendezvous placement), cached."""
    addrs = [(a, PORT) for a in pools]
    memo: dict = {}

    def own(k: bytes) -> int:
        if k not in memo:
            memo[k] = addrs.index(pool_for(addrs, ns, k))
        return memo[k]
    return own


def bytes_keys(r: dict) -> list[bytes]:
    return [bytes.fromhex(k) for k in r["keys"]]


def summarise(rows: list[dict]) -> dict:
    """TTFT p50/p99 (warm-up requests apart, as bench serve reports them)."""
    x = np.array([o["ttft"] for o in rows if not o["warmup"]])
    pct = (lambda q: round(float(np.percentile(x, q)), 4)) if len(x) else (lambda q: 0.0)
    return {"ttft_p50_s": pct(50), "ttft_p99_s": pct(99), "requests": int(len(x))}
