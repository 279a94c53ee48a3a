"""A lone first read through the switch against the same read over a plain bridge (issue 62): part
of `testbed bench fetch`. One reader (h1, the XDP fetch engine) reads a block nobody else wants
now, one it has never read, from the pool node p1; the switch runs as deployed (switchd's
default policy: a block missed once is learned as its replies pass, speculatively, so its second
read is a hit) or is not there at all (switchd stopped, the ports a plain bridge). The two are
alternated, switch and bridge in turn, ``rounds`` times per block size, each read of a block of
its own (staged at the pool node beforehand, past the switch's cache, so both start from the same
pool node state). Each switch read is followed by a second read of its block, which must be all
switch hits. Reports, per size, the medians and spreads of both and their ratio (a ratio per
round, its median)."""
from __future__ import annotations

import os
import statistics
import time

import numpy as np

from hostagent.inference.fetch import FetchEngine
from switchd.cache import Cache
from switchd.dataplane import DataPlane, pinned_deployment

from ...lab import Lab
from ...lab.topology import plain_bridge_ports

PREFIX = "ffl"
NS = 13
MIB = 1 << 20
TARGET = 0.9                           # lone first read through the switch / over the bridge


def _spread(xs: list[float]) -> dict:
    return {"median": round(statistics.median(xs), 4), "min": round(min(xs), 4),
            "max": round(max(xs), 4), "runs": [round(x, 4) for x in xs]}


def _read(e: FetchEngine, key: bytes, n: int, data: bytes, no_cache: bool = False):
    t0 = time.monotonic()
    b = e.get_block(NS, key, n, no_cache=no_cache)
    seconds = time.monotonic() - t0
    try:
        return seconds, b.tobytes() == data, b.stats.from_switch
    finally:
        b.release()


def _learning_granted(dp: DataPlane, timeout: float = 10.0) -> None:
    """Wait for switchd's first policy step: the speculative budget it leaves the data plane."""
    end = time.monotonic() + timeout
    while dp.get("spec_fill") <= 0 and time.monotonic() < end:
        time.sleep(0.1)


def bench_lone(cs: int, sizes_mib: list[int], rounds: int, log=print) -> list[dict]:
    nch = {m: -(-(m * MIB) // cs) for m in sizes_mib}
    biggest = max(nch.values())
    entries = 1 << (3 * biggest).bit_length()
    lab = Lab(PREFIX, hosts=1, pools=1, chunk_size=cs, pool_capacity="2GiB",
              cache_entries=entries, switchd_args=("--fill-headroom", str(2 * biggest)))
    rng = np.random.default_rng(62)
    runs = {m: {"bridge": [], "switch": [], "then_all_hits": []} for m in sizes_mib}
    with lab:
        blocks = {(m, r, mode): (os.urandom(16),
                                 rng.integers(0, 256, nch[m] * cs, np.uint8).tobytes())
                  for m in sizes_mib for r in range(rounds) for mode in ("bridge", "switch")}
        for key, data in blocks.values():
            lab.put("h1", NS, key, data)
        dp = DataPlane(pinned_deployment(lab.topo.pin_dir), programs=False)
        e = FetchEngine(lab.pool_addrs, cs, netns=lab.topo.node("h1").netns,
                        arena_bytes=4 * biggest * cs)
        e.open()
        try:
            for (m, _, _), (key, data) in blocks.items():     # staged at the pool node
                _read(e, key, nch[m], data, no_cache=True)
            for r in range(rounds):
                for mode in ("bridge", "switch") if r % 2 == 0 else ("switch", "bridge"):
                    if mode == "bridge":
                        lab.stop_switch()
                        plain_bridge_ports(lab.topo, True)
                    else:
                        _learning_granted(dp)
                    for m in sizes_mib:
                        key, data = blocks[(m, r, mode)]
                        seconds, exact, _ = _read(e, key, nch[m], data)
                        if not exact:
                            raise RuntimeError(f"lone read ({mode}) was not byte-exact")
                        runs[m][mode].append(nch[m] * cs / seconds / 1e9)
                        if mode == "switch":
                            _, exact, hits = _read(e, key, nch[m], data)
                            runs[m]["then_all_hits"].append(exact and hits == nch[m])
                            Cache(dp).evict(NS, key)
                    if mode == "bridge":
                        lab.start_switch(replace=True)
                log(f"  {cs} B lone first read, round {r + 1}/{rounds}: " + ", ".join(
                    f"{m} MiB bridge {runs[m]['bridge'][-1]:.3f} switch "
                    f"{runs[m]['switch'][-1]:.3f} GB/s" for m in sizes_mib))
        finally:
            e.close()
            dp.bpf.cleanup()
    out = []
    for m in sizes_mib:
        b, s = runs[m]["bridge"], runs[m]["switch"]
        ratios = [x / y for x, y in zip(s, b)]
        out.append({"chunk_bytes": cs, "block_bytes": nch[m] * cs, "rounds": rounds,
                    "bridge_gbytes_per_s": _spread(b), "switch_gbytes_per_s": _spread(s),
                    "switch_vs_bridge": _spread(ratios),
                    "second_read_all_switch_hits": all(runs[m]["then_all_hits"]),
                    "target": TARGET, "met": statistics.median(ratios) >= TARGET})
    return out
