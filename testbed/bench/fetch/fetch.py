"""`testbed bench fetch`: whole-block fetch throughput at an inference node, GB/s of block payload,
every path measured in one run, on one testbed per chunk size (h1 reads, p1 holds):

  xdp/switch    the XDP fetch engine (hostagent.inference.fetch) from the switch's cache, byte-exact
                (the CRC of every chunk, and compared here), loss-free and under 1% and 5% loss of
                the KV frames h1 receives (the engine's stand-in for the testbed's loss injector);
  xdp/pool      the engine past the switch (KV_F_NO_CACHE), answered by `hostagent serve`;
  xdp/pool-learned  a first reader's fetch: the switch holds none of the block but admits it,
                so every chunk comes from the pool node and the switch learns it (its CRC
                checked in XDP) as the reply passes (the cold fetch a deployment sees);
  asyncio       today's asyncio client (hostagent.inference.client.KVClient) from the switch's
                cache;
  mooncake      Mooncake Store's TCP get (get_into a registered buffer) of the same bytes
                from a segment on p1, with the switch's program detached (a plain bridge) and
                attached; its master (testbed.lab.mooncake) runs in the topology's m1;
  switch hit    the switch's hit rate as `bench throughput` measures it (its GET generator,
                replies counted and dropped by an XDP program on h1: no copy, no check, no
                Python) over the block's chunks: the ceiling;
  xdp-auth      the engine fetching the same data sealed with a namespace key
                (hostagent/common/auth.py: one header chunk more, its AES-GMAC tag checked over the
                arena as the fetch goes), from the switch and past it: the cost of keyed
                authentication.

  lone          a lone first read of a block nobody else wants, through the switch as deployed
                against the same read over a plain bridge, alternated (fetch_lone.py).

The hit path and the engine (each loss rate, and with authentication right after the loss-free
fetch of the same round) are measured in interleaved rounds (the engine

steps aside with suspend()/resume() while the generator's counter holds h1's interface; the loss
conditions rotate), so load from other work falls on all alike; ratios are medians of per-round
ratios. The other paths follow once (the engine from the pool node: ``rounds`` fetches, their
median). switchd runs with --no-coalesce --policy off (the cache
holds what the benchmark put there). Writes JSON and a plot.
"""
from __future__ import annotations

import contextlib
import os
import statistics
import time
from pathlib import Path

import numpy as np

from hostagent.common import auth
from hostagent.common.transfer import TransferTimeout
from hostagent.inference.fetch import FetchEngine
from switchd.cache import Cache
from switchd.dataplane import DataPlane, pinned_deployment

from ...lab import Lab, Topology
from ...results import write_json
from .fetch_lone import bench_lone
from .fetch_mooncake import _block, _gbps, _mooncake
from .generator import Generator, check_kv_reply, endpoint, kv_get
from .throughput import fill_cache

PREFIX = "ffb"
NS, NS_AUTH = 11, 12                       # NS_AUTH's blocks are sealed with AUTH_KEY
AUTH_KEY = bytes(range(32))
MIB = 1 << 20
TARGETS = {"xdp_switch_gbytes_per_s": 2.0, "xdp_vs_hit_path": 0.4,
           "xdp_pool_vs_mooncake_pool": 1.0, "loss_0.01_vs_loss_free": 0.8,
           "loss_0.05_vs_loss_free": 0.5, "auth_vs_no_auth": 0.9,
           "lone_first_read_vs_bridge": 0.9}


def _key(tag: str) -> bytes:
    return tag.encode().ljust(16, b"-")[:16]


def _rate(nbytes: int, seconds: list[float]) -> float:
    """GB/s of a round's fetches; nan when all of them timed out."""
    return nbytes / statistics.median(seconds) / 1e9 if seconds else float("nan")


def _median_ratio(a: list[float], b: list[float]) -> float | None:
    """Median of per-round ratios a/b, over the rounds where both fetched."""
    r = [x / y for x, y in zip(a, b) if x == x and y == y]
    return round(statistics.median(r), 3) if r else None


def _row(path: str, source: str, cs: int, nbytes: int, seconds: list[float], exact: bool,
         **more) -> dict:
    return {"path": path, "source": source, "chunk_bytes": cs, "block_bytes": nbytes,
            "gbytes_per_s": _gbps(nbytes, seconds), "byte_exact": exact,
            "best_gbytes_per_s": round(nbytes / min(seconds) / 1e9, 4) if seconds else None,
            "fetches": len(seconds),
            **more}


# ---- the paths ---------------------------------------------------------------------------------
def _engine(e: FetchEngine, key: bytes, n: int, expect: bytes, reps: int,
            no_cache: bool = False, loss: float = 0.0, ns: int = NS) -> dict:
    out = {"seconds": [], "retransmits": 0, "checksum_errors": 0, "exact": True, "cpu": 0.0,
           "timeouts": 0, "from_pool": 0}
    e.loss_ppm = int(loss * 1e6)
    try:
        for _ in range(reps):
            cpu0 = e.stats.step_cpu
            try:
                b = e.get_block(ns, key, n, no_cache=no_cache)
            except TransferTimeout as exc:       # recorded, not the end of the run
                out["timeouts"] += 1
                out["timeout"] = str(exc)
                continue
            out["seconds"].append(b.stats.seconds)
            out["retransmits"] += b.stats.retransmits
            out["checksum_errors"] += b.stats.checksum_errors
            out["from_pool"] += b.stats.from_pool
            out["exact"] &= b.numpy().tobytes() == expect
            out["cpu"] += e.stats.step_cpu - cpu0
            b.release()
    finally:
        e.loss_ppm = 0
    return out


def _merge(parts: list[dict]) -> dict:
    seconds = [s for p in parts for s in p["seconds"]]
    return {"seconds": seconds, "exact": all(p["exact"] for p in parts),
            "retransmits": sum(p["retransmits"] for p in parts),
            "checksum_errors": sum(p["checksum_errors"] for p in parts),
            "from_pool": sum(p["from_pool"] for p in parts),
            "cpu_ms_per_fetch": round(sum(p["cpu"] for p in parts) / max(1, len(seconds)) * 1e3,
                                      2),
            "timeouts": sum(p.get("timeouts", 0) for p in parts),
            **({"timeout": next(p["timeout"] for p in parts if "timeout" in p)}
               if any("timeout" in p for p in parts) else {})}


def asyncio_get(pools: list[str], cs: int, key_hex: str, n: int, reps: int) -> dict:
    """Task in the reader: today's asyncio client, ``reps`` fetches of one block."""
    import asyncio
    from hostagent.inference.client import KVClient
    expect = _block(n, cs)

    async def go():
        async with KVClient(pools, cs) as c:
            out = []
            for _ in range(reps):
                data, st = await c.get_block(NS, bytes.fromhex(key_hex), n)
                out.append((st.seconds, data == expect))
            return out

    res = asyncio.run(go())
    return {"seconds": [s for s, _ in res], "exact": all(ok for _, ok in res)}


def _learned(e: FetchEngine, cache: Cache, block: tuple, fetches: int) -> dict:
    """A deployment's first reader of a block: the switch holds none of it but admits it, so
    every chunk comes from the pool node and the switch learns it (its CRC checked) as the
    reply passes. The block is dropped from the cache before each fetch, and switchd's step
    (``tend``) follows, as it would between readers a second apart: it grants the data plane a
    fill region again, so back-to-back refills do not use it up (the data plane carves only
    what the region holds, and the block's later chunks would go unlearned). A last fetch
    checks that the switch then answers all of it."""
    key, n, data = block
    parts = []
    for _ in range(fetches):
        cache.evict(NS, key)
        cache.admit(NS, key)
        cache.tend({})
        parts.append(_engine(e, key, n, data, 1))
    then = _engine(e, key, n, data, 1)
    return {**_merge(parts), "then_from_switch": then["from_pool"] == 0 and then["exact"]}


def _hit_path(gen: Generator, lab: Lab, key: bytes, n: int, cs: int, seconds: float) -> dict:
    h1, p1 = endpoint(lab.topo.node("h1").netns), endpoint(lab.topo.node("p1").netns)
    gen.configure(kv_get(h1, p1, NS, key, cs), n, "sequential")
    with gen.counting(h1.netns):
        run = gen.run(h1, seconds, warmup=0.2, windows=5)
        problem = check_kv_reply(gen.sample(), h1, p1, NS, key, n, cs)
    return {"gbps": run.median_pps() * cs / 1e9, "exact": problem is None}


# ---- one chunk size ----------------------------------------------------------------------------
def bench_chunk(cs: int, sizes_mib: list[int], rounds: int, reps: int, losses: list[float],
                gen: Generator, hit_seconds: float, mooncake: bool, log) -> tuple[list, list]:
    nch = {m: -(-(m * MIB) // cs) for m in sizes_mib}
    conds = [0.0] + list(losses)
    lab = Lab(PREFIX, hosts=1, pools=1, chunk_size=cs, pool_capacity="1GiB",
              # every block and its sealed twin placed, and a fill region the largest can be
              # learned into whole (xdp/pool-learned)
              cache_entries=max(65536, 1 << (2 * sum(nch.values()) + max(nch.values()))
                                .bit_length()),
              switchd_args=("--no-coalesce", "--policy", "off"))
    lab.topo = Topology(PREFIX, 1, 1, mtu=lab.topo.mtu, master=mooncake)   # + m1, the master
    rows, hits = [], []
    with lab, contextlib.ExitStack() as stack:
        dp = DataPlane(pinned_deployment(lab.topo.pin_dir), programs=False)   # one BCC compile
        stack.callback(dp.bpf.cleanup)
        cache = Cache(dp)
        blocks, akeys = {}, {}
        for m in sizes_mib:
            key, data = _key(f"b{m}-{cs}"), _block(nch[m], cs)
            blocks[m] = (key, nch[m], data)
            fill_cache(cache, NS, key, 0, nch[m], nch[m])
            lab.put("h1", NS, key, data)
            akeys[m] = _key(f"a{m}-{cs}")                      # the same data, sealed
            sealed = auth.seal(AUTH_KEY, NS_AUTH, akeys[m], data, cs)
            cache.put_chunks(NS_AUTH, akeys[m], 0, np.frombuffer(sealed, np.uint8)
                             .reshape(-1, cs), len(sealed) // cs)
            lab.put("h1", NS_AUTH, akeys[m], sealed)
        e = FetchEngine(lab.pool_addrs, cs, netns=lab.topo.node("h1").netns,
                        arena_bytes=2 * sum(n + 1 for n in nch.values()) * cs,
                        auth=auth.Keyring({NS_AUTH: AUTH_KEY}))
        e.open()
        hit = {m: [] for m in sizes_mib}
        runs = {(m, c): [] for m in sizes_mib for c in conds + ["auth"]}
        try:
            for m in sizes_mib:                                  # warm
                e.get_block(NS, blocks[m][0], nch[m]).release()
                e.get_block(NS_AUTH, akeys[m], nch[m]).release()
            for r in range(rounds):
                e.suspend()                                      # the counter takes eth0
                for m in sizes_mib:
                    hit[m].append(_hit_path(gen, lab, blocks[m][0], nch[m], cs, hit_seconds))
                e.resume()
                time.sleep(0.2)                                  # the generator's frames drain
                e.get_block(NS, blocks[sizes_mib[0]][0], nch[sizes_mib[0]]).release()
                for m in sizes_mib:
                    key, n, data = blocks[m]
                    k = reps if n * cs <= 8 * MIB else 1
                    for c in conds[r % len(conds):] + conds[:r % len(conds)]:     # rotating
                        runs[(m, c)].append(_engine(e, key, n, data, k, loss=c))
                        if c == 0.0:                             # the same data, sealed
                            runs[(m, "auth")].append(_engine(e, akeys[m], n, data, k,
                                                             ns=NS_AUTH))
                log(f"  {cs} B: round {r + 1}/{rounds}: " + ", ".join(
                    f"{m} MiB hit {hit[m][-1]['gbps']:.2f} engine "
                    f"{_rate(m * MIB, runs[(m, 0.0)][-1]['seconds']):.2f}"
                    f" with auth {_rate(m * MIB, runs[(m, 'auth')][-1]['seconds']):.2f}"
                    for m in sizes_mib) + " GB/s")
            pool = {m: _engine(e, blocks[m][0], nch[m], blocks[m][2], rounds, no_cache=True)
                    for m in sizes_mib}
            apool = {m: _engine(e, akeys[m], nch[m], blocks[m][2], rounds, no_cache=True,
                                ns=NS_AUTH) for m in sizes_mib}
            learned = {m: _learned(e, cache, blocks[m], rounds) for m in sizes_mib}
        finally:
            e.close()
        for m in sizes_mib:
            key, n, data = blocks[m]
            nbytes, first = n * cs, len(rows)
            hr = [h["gbps"] for h in hit[m]]
            hits.append({"chunk_bytes": cs, "block_bytes": nbytes, "rounds": [round(h, 3) for h
                                                                              in hr],
                         "gbytes_per_s": round(statistics.median(hr), 4),
                         "byte_exact": all(h["exact"] for h in hit[m])})
            per_round = {c: [_rate(nbytes, p["seconds"]) for p in runs[(m, c)]]
                         for c in conds + ["auth"]}
            for c in conds:
                s = _merge(runs[(m, c)])
                extra = ({"vs_hit_path": _median_ratio(per_round[0.0], hr)} if c == 0 else
                         {"vs_loss_free": _median_ratio(per_round[c], per_round[0.0])})
                rows.append(_row("xdp", "switch", cs, nbytes, s["seconds"], s["exact"], loss=c,
                                 retransmits=s["retransmits"],
                                 checksum_errors=s["checksum_errors"],
                                 cpu_ms_per_fetch=s["cpu_ms_per_fetch"], timeouts=s["timeouts"],
                                 **extra, **({"timeout": s["timeout"]} if "timeout" in s else {})))
            s = _merge(runs[(m, "auth")])
            rows.append(_row("xdp-auth", "switch", cs, nbytes, s["seconds"], s["exact"],
                             loss=0.0, retransmits=s["retransmits"], timeouts=s["timeouts"],
                             cpu_ms_per_fetch=s["cpu_ms_per_fetch"],
                             vs_no_auth=_median_ratio(per_round["auth"], per_round[0.0])))
            s = _merge([pool[m]])
            rows.append(_row("xdp", "pool", cs, nbytes, s["seconds"], s["exact"], loss=0.0,
                             retransmits=s["retransmits"]))
            s = _merge([apool[m]])
            rows.append(_row("xdp-auth", "pool", cs, nbytes, s["seconds"], s["exact"], loss=0.0,
                             retransmits=s["retransmits"]))
            s = learned[m]
            rows.append(_row("xdp", "pool-learned", cs, nbytes, s["seconds"], s["exact"],
                             loss=0.0, retransmits=s["retransmits"], from_pool=s["from_pool"],
                             then_from_switch=s["then_from_switch"]))
            ratio = _rate(nbytes, s["seconds"]) / _rate(nbytes, pool[m]["seconds"])
            rows[-1]["vs_pool_bypass"] = round(ratio, 3) if ratio == ratio else None
            a = lab.task("h1", f"{__name__}:asyncio_get", lab.pool_addrs, cs, key.hex(), n,
                         3 if nbytes <= 8 * MIB else 1)
            rows.append(_row("asyncio", "switch", cs, nbytes, a["seconds"], a["exact"],
                             loss=0.0))
            for r in rows[first:]:
                log(f"  {cs} B, {m} MiB: {r['path']}/{r['source']} loss {r['loss']:g}: "
                    f"{r['gbytes_per_s'] or 0:.3f} GB/s, byte-exact {r['byte_exact']}")
        if mooncake:
            mc = _mooncake(lab, {m: blocks[m] for m in sizes_mib}, cs, reps * 5, log)
            for (mode, m), got in mc.items():
                rows.append(_row("mooncake", "mooncake", cs, nch[m] * cs, got["seconds"],
                                 got["exact"], loss=0.0, switch=mode))
    return rows, hits


# ---- the run -----------------------------------------------------------------------------------
def _find(rows, **match):
    return next((r for r in rows if all(r.get(k) == v for k, v in match.items())), None)


def _targets(out: dict) -> dict:
    """The issue's targets at 3072-byte chunks, per block size: value, goal, met."""
    t, rows = {}, out["results"]
    for h in [h for h in out["switch_hit"] if h["chunk_bytes"] == 3072]:
        cs, nb = 3072, h["block_bytes"]
        x = _find(rows, path="xdp", source="switch", chunk_bytes=cs, block_bytes=nb, loss=0.0)
        # like for like: the engine from the pool node (past the switch's cache) against
        # Mooncake's get from a segment on the same pool node, the switch attached for both
        xp = _find(rows, path="xdp", source="pool", chunk_bytes=cs, block_bytes=nb)
        mc = _find(rows, path="mooncake", chunk_bytes=cs, block_bytes=nb, switch="attached")
        lone = next((r for r in out.get("lone_first_read", []) if r["chunk_bytes"] == cs and
                     r["block_bytes"] == nb), None)
        vals = {"xdp_switch_gbytes_per_s": x["gbytes_per_s"], "xdp_vs_hit_path": x["vs_hit_path"],
                "xdp_pool_vs_mooncake_pool": mc and xp and xp["gbytes_per_s"] and
                mc["gbytes_per_s"] and round(xp["gbytes_per_s"] / mc["gbytes_per_s"], 2),
                "lone_first_read_vs_bridge": lone and lone["switch_vs_bridge"]["median"]}
        for loss in (0.01, 0.05):
            lr = _find(rows, path="xdp", source="switch", chunk_bytes=cs, block_bytes=nb,
                       loss=loss)
            vals[f"loss_{loss:g}_vs_loss_free"] = lr and lr["vs_loss_free"]
        ar = _find(rows, path="xdp-auth", source="switch", chunk_bytes=cs, block_bytes=nb)
        vals["auth_vs_no_auth"] = ar and ar["vs_no_auth"]
        t[f"{nb >> 20}MiB"] = {k: {"value": v, "goal": TARGETS[k],
                                   "met": v is not None and v >= TARGETS[k]}
                               for k, v in vals.items()}
    return t


def run_fetch(chunk_sizes=(3072, 1024), sizes_mib=(2, 64), rounds: int = 5, reps: int = 3,
              losses=(0.01, 0.05), hit_seconds: float = 0.5, mooncake: bool = True,
              json_path: str | None = None, plot_path: str | None = None, log=print) -> dict:
    started, load0 = time.monotonic(), os.getloadavg()
    log(f"bench fetch: chunk sizes {', '.join(map(str, chunk_sizes))} B, blocks of "
        f"{', '.join(map(str, sizes_mib))} MiB; the traffic generator ...")
    gen = Generator()
    rows, hits, lone = [], [], []
    try:
        for cs in chunk_sizes:
            log(f"chunk {cs} B:")
            r, h = bench_chunk(cs, list(sizes_mib), rounds, reps, list(losses), gen,
                               hit_seconds, mooncake, log)
            rows += r
            hits += h
            lone += bench_lone(cs, list(sizes_mib), max(rounds, 5), log)
    finally:
        gen.close()
    at = [h["gbytes_per_s"] for h in hits if h["chunk_bytes"] == 3072] or \
        [h["gbytes_per_s"] for h in hits]
    out = {"results": rows, "switch_hit_gbytes_per_s": round(statistics.median(at), 4),
           "switch_hit": hits, "lone_first_read": lone,
           "load_average_before": [round(x, 2) for x in load0],
           "load_average_after": [round(x, 2) for x in os.getloadavg()],
           "seconds": round(time.monotonic() - started, 1)}
    out["targets"] = _targets(out)
    write_json(json_path, out)
    if plot_path:
        plot_fetch(out, plot_path)
    return out


SERIES = [("switch hit path (ceiling)", None), ("xdp engine, switch", ("xdp", "switch", None)),
          ("mooncake TCP, plain bridge", ("mooncake", "mooncake", "detached")),
          ("mooncake TCP, switch attached", ("mooncake", "mooncake", "attached")),
          ("asyncio client, switch", ("asyncio", "switch", None)),
          ("xdp engine, pool node", ("xdp", "pool", None)),
          ("xdp engine, pool node, switch learning", ("xdp", "pool-learned", None))]


def plot_fetch(out: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    rows = out["results"]
    configs = [(h["chunk_bytes"], h["block_bytes"]) for h in out["switch_hit"]]
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(15, 4.8), gridspec_kw={"width_ratios": [3, 1]})
    width = 0.8 / len(SERIES)
    for i, (label, sel) in enumerate(SERIES):
        vals = []
        for cs, nb in configs:
            if sel is None:
                r = _find(out["switch_hit"], chunk_bytes=cs, block_bytes=nb)
            else:
                match = dict(path=sel[0], source=sel[1], chunk_bytes=cs, block_bytes=nb)
                match.update({"switch": sel[2]} if sel[2] else {"loss": 0.0})
                r = _find(rows, **match)
            vals.append((r or {}).get("gbytes_per_s") or np.nan)
        ax.bar(np.arange(len(configs)) + i * width, vals, width, label=label)
    ax.set(xticks=np.arange(len(configs)) + width * (len(SERIES) - 1) / 2, yscale="log",
           xticklabels=[f"{cs} B chunks\n{nb >> 20} MiB block" for cs, nb in configs],
           ylabel="GB/s of block payload", title="Whole-block fetch at the inference node")
    ax.legend(fontsize=8)
    for loss in sorted({r["loss"] for r in rows if r.get("loss")}):
        vals = [(_find(rows, path="xdp", source="switch", chunk_bytes=cs, block_bytes=nb,
                       loss=loss) or {}).get("vs_loss_free") or np.nan for cs, nb in configs]
        bx.plot(range(len(configs)), vals, "o-", label=f"{loss:.0%} loss")
    bx.axhline(1.0, color="grey", lw=0.8)
    bx.set(xticks=range(len(configs)), xticklabels=[f"{cs}/{nb >> 20}M" for cs, nb in configs],
           ylim=(0, None), ylabel="x the loss-free rate", title="Engine under loss")
    bx.legend(fontsize=8)
    for a in (ax, bx):
        a.grid(alpha=0.3)
    la = out["load_average_before"][0], out["load_average_after"][0]
    fig.suptitle(f"testbed bench fetch (2 shared cores, load average {la[0]:.1f} -> "
                 f"{la[1]:.1f})", fontsize=10)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
