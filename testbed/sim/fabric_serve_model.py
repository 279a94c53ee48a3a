"""The serve-level model on a fabric of switches (issue 43; ``testbed sim validate --serve
--racks``): bench serve's request lists replayed over R racks of H inference nodes, each rack's
uplink shared by its hosts' transfers, a pool-side ("agg") switch in front of P pool nodes, in
the four modes of `testbed bench serve --racks`:

  bridge     no kvswitch: every block from its owner pool node;
  rack       a switch model per rack switch, seeing its hosts' fetches;
  pool-side  one switch model at the agg switch, seeing every host's fetch;
  fabric     both: the agg switch sees only what the racks missed.

The serving loops, the fluid links and the timing are serve_model's (``replay``: one request
at a time per node, all its blocks fetched at once, a round trip after the last reply, the
modelled prefill, write-through one block at a time); this module is the network. Links: host
down/up links at the calibrated rate, each rack's uplink (both ways) at H x link / oversub,
pool links at ``pool_link_bytes_per_s``; each link serves what was asked of it in the order it
was asked, a window per route at a time (serve_model.serve_links). A reply from a pool node
crosses the pool's egress, the uplink and the host's downlink; an agg hit the uplink and the
downlink; a rack hit the downlink alone; a write the host's uplink, the rack's uplink and the
pool's ingress.

Each switch is serve_model.HeldSwitch (switchd's admission loop over the data plane's model)
at the testbed's cache, interval and fill headroom; a fetch of a block whose fetch upstream of
that switch is under way, and which the switch is learning, is held and gets the reply
(coalescing at each level: a rack's concurrent GETs leave it once, the racks' reach a pool node
once); one the switch does not learn misses again. The agg switch keeps one waiter per
downlink port, as the data plane does: in pool-side mode a second host of a rack whose GET is
already held there is not held; its GETs follow the first's.

Placement (bench serve --racks --placement): ``independent``, each switch on the demand it
sees, or ``split`` (DistCache-style): the rack switches cache only the blocks of key share 0/2,
the agg switch those of 1/2 (switchd --cache-share: its admission loop never admits another
block and the data plane learns none speculatively; switchd.manager.in_share decides).

Hit ratio per level, as the bench counts it (chunk GETs): hits / (hits + misses + coalesced).
The model moves blocks, the switches count chunks, so a fetch held behind an upstream fetch
(a replica) is split as the chunks would fall: a follower on links no faster than its leader's
trails it, and asks for each chunk after the switch has learned it (a hit); the chunks it
would ask for before its leader's reply passed (``caught``: the upstream's bytes left when the
follower's own bytes were done) are coalesced, or at the agg switch's second waiter of a port
go to the pool (misses, pool egress). A follower of a block the switch does not learn trails
its leader's replies past a switch that keeps none of them: its GETs miss and go upstream
again (at block granularity: its fetch is a miss). A lookup of a block the pool lacks
(NOT_FOUND) is one chunk GET missed at each switch it passes. Counters, uplink bytes (delivered
into the rack: replies, NOT_FOUNDs, write acks) and pool egress count from ``measure_from``
(the bench's last phase, after a burst's warm-up: ``measure_start``). What it does not have:
the data plane's slot array (a switch's cache is a store of whole blocks), retransmissions, CPU
contention (serve_model's list)."""
from __future__ import annotations

import math
from dataclasses import asdict

from switchd.manager import in_share

from ..errors import TestbedError
from .config import FRAME_OVERHEAD
from .serve_model import Calibration, HeldSwitch, _Transfer, owner, replay
from .tiers import POOL, SWITCH

FABRIC_MODES = ("bridge", "rack", "pool-side", "fabric")
PLACEMENTS = {"independent": (None, None), "split": ((0, 2), (1, 2))}   # (rack, agg) shares
LEVELS = ("rack", "pool-side")
_RACK_MODES, _AGG_MODES = ("rack", "fabric"), ("pool-side", "fabric")


class ShareSwitch(HeldSwitch):
    """A HeldSwitch caching only its key share (None: every block), as switchd
    --cache-share: the admission loop keeps to it and a block outside it is never learned."""

    def __init__(self, *a, share: tuple[int, int] | None = None, **kw):
        super().__init__(*a, **kw)
        self.share = share
        if share is not None:
            self.loop.keep = lambda k: in_share(k, share)

    def fetch(self, k, t: float, inflight: bool) -> int:
        """A fetch; one of a block whose fetch upstream is under way is held only if this
        switch learns the block (its follower trails the leader and hits what was learned);
        else it misses again, as a trailing follower's GETs do."""
        self.advance(t)
        inflight = inflight and k in self.filled
        if self.share is None or in_share(k, self.share):
            return super().fetch(k, t, inflight)
        budget, self.spec_budget = self.spec_budget, 0.0     # the data plane learns none
        try:
            return super().fetch(k, t, inflight)
        finally:
            self.spec_budget = budget


def check_shape(racks: int, hosts_per_rack: int, oversub: float) -> None:
    """A fabric the model cannot have: one line, as the lab's fabric (`testbed up --racks`) words
    it."""
    if racks < 1:
        raise TestbedError(f"--racks must be at least 1, got {racks}")
    if hosts_per_rack < 1:
        raise TestbedError(f"--hosts-per-rack must be at least 1, got {hosts_per_rack}")
    if not oversub > 0:
        raise TestbedError(f"--oversub must be > 0 (hosts' total : uplink), got {oversub:g}")


def check_modes(modes, placement: str = "independent") -> None:
    for m in modes:
        if m not in FABRIC_MODES:
            raise TestbedError(f"mode {m!r}: choose from {', '.join(FABRIC_MODES)}")
    if placement not in PLACEMENTS:
        raise TestbedError(f"placement {placement!r}: choose from {', '.join(PLACEMENTS)}")


def measure_start(requests: list[list[dict]]) -> float:
    """When the bench's measured phase starts: the first request after a warm-up (0 without)."""
    if not any(r.get("warmup") for q in requests for r in q):
        return 0.0
    return min((r["at"] for q in requests for r in q if not r.get("warmup")), default=0.0)


def rates(cal: Calibration, racks: int, hosts: int, pools: int, oversub: float,
          pool_link_bytes_per_s: float | None) -> dict:
    """Every link's rate (frame bytes per second), both directions."""
    host, pool = cal.link_bytes_per_s, pool_link_bytes_per_s or cal.link_bytes_per_s
    up = cal.link_bytes_per_s * hosts / oversub
    out = {(d, i): host for i in range(racks * hosts) for d in ("nd", "nu")}
    out.update({(d, r): up for r in range(racks) for d in ("ud", "uu")})
    out.update({(d, p): pool for p in range(pools) for d in ("pe", "pi")})
    return out


def simulate_fabric(requests: list[list[dict]], preload, mode: str, pools: list[str], ns: int,
                    cal: Calibration, prefill_tok_s: float, racks: int, hosts_per_rack: int,
                    oversub: float = 2.0, pool_link_bytes_per_s: float | None = None,
                    cache_blocks: float = 10_000, headroom_blocks: float | None = None,
                    interval: float = 1.0, policy: str = "prefix", dt: float = 5e-4,
                    measure_from: float | None = None, placement: str = "independent") -> dict:
    """Replay one workload in one mode on the fabric; ``requests[i]`` is host h(i+1)'s, in rack
    i // hosts_per_rack. Result: per request rows (serve_model's), hit ratio per level (None
    where the mode runs no switch there), the levels' chunk GET counters, bytes each rack's
    uplink delivered into the rack, pool egress per pool node, the share of fetched blocks
    served per level, cached blocks / blocks."""
    check_shape(racks, hosts_per_rack, oversub)
    check_modes([mode], placement)
    H = hosts_per_rack
    if len(requests) != racks * H:
        raise TestbedError(f"{len(requests)} nodes' requests for {racks} racks x {H} hosts")
    P, own = len(pools), owner(pools, ns)
    if measure_from is None:
        measure_from = measure_start(requests)
    avail = {bytes.fromhex(k): 0.0 for k in preload}
    head = cache_blocks / 16 if headroom_blocks is None else headroom_blocks

    rack_share, agg_share = PLACEMENTS[placement]

    def switch(share):
        return ShareSwitch(policy, cache_blocks, head, interval, share=share)
    rack_sw = [switch(rack_share) for _ in range(racks)] if mode in _RACK_MODES else None
    agg_sw = switch(agg_share) if mode in _AGG_MODES else None
    up_rack: dict = {}          # (rack, block) -> the transfer bringing it over the uplink
    up_agg: dict = {}           # block -> (its fetch from a pool node, racks waiting at agg)
    count = {lv: {"get_hit": 0, "get_miss": 0, "coalesced": 0} for lv in LEVELS}
    served = {"rack": 0, "pool-side": 0, "pool": 0}
    replicas: list = []         # (level, transfer, learned, unheld, pool node), resolved at end
    egress, uplink = [0.0] * P, [0.0] * racks
    chunk_wire = cal.chunk + FRAME_OVERHEAD

    def pool_fetch(i: int, r: int, k: bytes, links: tuple, t: float) -> _Transfer:
        p = own(k)
        x = _Transfer(cal.wire, (("pe", p), *links))
        if t >= measure_from:
            egress[p] += cal.wire
            served["pool"] += 1
        if agg_sw is not None:
            up_agg[k] = (x, {r})
            if t >= measure_from:
                count["pool-side"]["get_miss"] += cal.chunks
        return x

    def fetch(i: int, k: bytes, t: float) -> _Transfer:
        r, m = i // H, t >= measure_from
        if rack_sw is not None:
            up = up_rack.get((r, k))
            o = rack_sw[r].fetch(k, t, up is not None and up.done is None)
            if o == SWITCH:
                if m:
                    count["rack"]["get_hit"] += cal.chunks
                    served["rack"] += 1
                return _Transfer(cal.wire, (("nd", i),))
            if o != POOL:
                x = _Transfer(cal.wire, (("nd", i),), after=up)
                if m:
                    replicas.append(("rack", x, k in rack_sw[r].filled, False, None))
                    served["rack"] += 1
                return x
            if m:
                count["rack"]["get_miss"] += cal.chunks
        links = (("ud", r), ("nd", i))
        if m:
            uplink[r] += cal.wire
        x = None
        if agg_sw is not None:
            up = up_agg.get(k)
            inflight = up is not None and up[0].done is None
            o = agg_sw.fetch(k, t, inflight)
            if o == SWITCH:
                x = _Transfer(cal.wire, links)
                if m:
                    count["pool-side"]["get_hit"] += cal.chunks
                    served["pool-side"] += 1
            elif o != POOL:
                x = _Transfer(cal.wire, links, after=up[0])
                if m:
                    replicas.append(("pool-side", x, k in agg_sw.filled, r in up[1], own(k)))
                    served["pool-side"] += 1
                up[1].add(r)
        if x is None:
            x = pool_fetch(i, r, k, links, t)
        if rack_sw is not None:
            up_rack[(r, k)] = x
        return x

    def not_found(i: int, k: bytes, t: float) -> None:
        if t < measure_from:
            return
        egress[own(k)] += FRAME_OVERHEAD
        uplink[i // H] += FRAME_OVERHEAD
        for level, on in (("rack", rack_sw), ("pool-side", agg_sw)):
            if on is not None:
                count[level]["get_miss"] += 1

    def computed(i: int, k: bytes, t: float) -> list:
        p = own(k)
        if t >= measure_from:
            egress[p] += cal.chunks * FRAME_OVERHEAD        # acknowledgements
            uplink[i // H] += cal.chunks * FRAME_OVERHEAD
        return [(("nu", i), ("uu", i // H), ("pi", p))]

    out = replay(requests, avail, cal, prefill_tok_s, fetch, not_found, computed,
                 rates(cal, racks, H, P, oversub, pool_link_bytes_per_s), dt)
    for level, x, learned, unheld, p in replicas:
        caught = min(cal.chunks, math.ceil((x.caught or 0.0) / chunk_wire - 1e-9))
        c = count[level]
        if not learned:
            c["get_miss" if unheld else "coalesced"] += cal.chunks
            caught = cal.chunks if unheld else 0
        else:
            c["get_hit"] += cal.chunks - caught
            c["get_miss" if unheld else "coalesced"] += caught
        if unheld:
            egress[p] += caught * chunk_wire
    levels = {lv: count[lv] if on is not None else None
              for lv, on in (("rack", rack_sw), ("pool-side", agg_sw))}
    fetched = sum(served.values())
    blocks = sum(o["blocks"] for o in out)
    return {"mode": mode, "requests": out,
            "hit_ratio": {lv: level_hit_ratio(c) for lv, c in levels.items()},
            "level_counters": levels,
            "uplink_bytes": [int(round(u)) for u in uplink],
            "pool_egress_bytes": [int(round(e)) for e in egress],
            "served_share": {k: round(v / max(1, fetched), 4) for k, v in served.items()},
            "cached_block_ratio": round(sum(o["cached"] for o in out) / max(1, blocks), 4),
            "measure_from_s": round(measure_from, 4), "placement": placement,
            "calibration": asdict(cal),
            "policy_steps": {"rack": [s.steps for s in rack_sw] if rack_sw else None,
                             "pool-side": agg_sw.steps if agg_sw else None}}


def level_hit_ratio(c: dict | None) -> float | None:
    """The bench's hit ratio of a level (as `bench serve --racks` counts it: its hit_ratio)."""
    if c is None:
        return None
    seen = c["get_hit"] + c["get_miss"] + c["coalesced"]
    return round(c["get_hit"] / seen, 4) if seen else 0.0
