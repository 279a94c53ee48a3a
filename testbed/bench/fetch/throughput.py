"""`testbed bench throughput`: GET replies per second counted at the requester (by the counting
XDP program on its veth end, not requests sent), with the same live-frames generator and the same
frame sizes for every scenario, measured in one run:

  ceiling       a bare XDP_TX reflector on the switch port: the limit of this path;
  switch_hit    the real data plane (switchd), every GET a cache hit; and again over only 128
                chunks (switch_hit_hot), which stay in the CPU's L2: the cost of a hit
                without the cost of fetching its payload from memory;
  pool_server   every GET a miss, answered by `hostagent serve` behind the switch;
  memcached     Debian's memcached behind the switch, GET over UDP, values of the chunk size;
  hit ratios    0..100 % hits, misses answered by the pool server (at one chunk size);
  cache scaling the hit path as the cache grows to a million entries, and (the target's ratio)
                the smallest and the largest working set of the full cache in alternating rounds;
  tcp           iperf3 through the switch, program attached vs detached (and vs a bare
                XDP_PASS program, the cost of any XDP program on a veth), in interleaved rounds.

switchd runs with --no-coalesce (the generator asks for the same chunks again and again; with
coalescing on, a repeated miss from the same asker is held, not forwarded) and --policy off (the
cache holds exactly what the benchmark put there). Every scenario checks one sampled reply byte
for byte. Writes JSON and a plot next to it.
"""
from __future__ import annotations

import os
import socket
import statistics
import subprocess
import time
from pathlib import Path

import numpy as np

from switchd.cache import Cache
from switchd.dataplane import DataPlane, pinned_deployment
from xdp import netns
from xdp.attach import attached_program, detach_port
from xdp.program import program_run_time, run_time_stats

from .generator import (MC_PORT, Endpoint, Generator, Iperf3, check_kv_reply,
                        check_memcached_reply, check_reflected, endpoint, kv_get, memcached_get,
                        memcached_key, payload)
from ...lab import Lab, TestbedError, Topology, attach_pass_programs
from ...results import write_json

PREFIX = "tp"
NS = 9
KEY = bytes.fromhex("7470" * 8)
SWITCHD_ARGS = ("--no-coalesce", "--policy", "off")
SCENARIOS = ("ceiling", "switch_hit_hot", "switch_hit", "pool_server", "memcached")
SERVER_OFFERS = (1.25, 1.5)  # fixed offered rates tried, x the reply rate under a flood
TCP_MODES = ("detached", "pass_program", "attached")
RUN_TIME_WINDOWS = 3  # bpf_stats windows per run-time figure, their median
SCALING_ROUNDS = 3    # alternating rounds of the smallest and the largest working set
HOT_KEYS = 128  # switch_hit_hot sweeps this many chunks: at most 384 KiB, within the CPU's L2


class Memcached:
    """Debian's memcached on a node with UDP on (-U), values preloaded over TCP."""

    def __init__(self, topo: Topology, node: str, threads: int):
        self.topo, self.node, self.threads = topo, topo.node(node), threads
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> Memcached:
        self.proc = self.topo.popen(self.node.name, [
            "memcached", "-u", "memcache", "-l", self.node.ip, "-p", str(MC_PORT),
            "-U", str(MC_PORT), "-t", str(self.threads), "-m", "1024"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        return self

    def __exit__(self, *exc) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def preload(self, n: int, size: int) -> None:
        """Values payload(i, size) under memcached_key(i), i < n."""
        deadline = time.monotonic() + 10
        with netns.inside(self.node.netns):
            while True:
                try:
                    s = socket.create_connection((self.node.ip, MC_PORT), timeout=10)
                    break
                except OSError:
                    if self.proc.poll() is not None or time.monotonic() > deadline:
                        raise TestbedError(f"memcached did not start: "
                                           f"{self.proc.stderr.read().strip()[-400:]}")
                    time.sleep(0.05)
        with s:
            s.sendall(b"".join(b"set %s 0 0 %d noreply\r\n%s\r\n" % (memcached_key(i), size,
                                                                     payload(i, size))
                               for i in range(n)) + b"mn\r\n")
            buf = b""
            while not buf.endswith(b"MN\r\n"):
                chunk = s.recv(4096)
                if not chunk:
                    raise TestbedError(f"memcached closed the connection: {buf[-200:]!r}")
                buf += chunk


def fill_cache(cache: Cache, ns: int, key: bytes, first: int, last: int, nchunks: int,
               batch: int = 1 << 16) -> None:
    """Chunks first..last-1 of a block, payload(i, chunk size) each (as ``payload`` makes them,
    but built with numpy: a million of them), into the cache in bulk."""
    size = cache.chunk_size
    for lo in range(first, last, batch):
        idx = np.arange(lo, min(last, lo + batch), dtype=np.uint32)
        unit = np.concatenate([idx.astype(">u4").view(np.uint8).reshape(-1, 4),
                               np.repeat((idx & 0xFF).astype(np.uint8)[:, None], 4, 1)], 1)
        cache.put_chunks(ns, key, lo, np.tile(unit, (1, size // 8)), nchunks)


class _Bench:
    def __init__(self, gen: Generator, seconds: float, windows: int, rate: float,
                 cores: tuple[int, ...], log):
        self.gen, self.seconds, self.windows = gen, seconds, windows
        self.rate, self.cores, self.log = rate, cores, log
        self.problems: list[str] = []

    def measure(self, label: str, src: Endpoint, template, nkeys: int, check,
                sweep: str = "sequential", rate: float | None = None) -> dict:
        self.gen.configure(template, nkeys, sweep)
        rate = self.rate if rate is None else rate
        run = self.gen.run(src, self.seconds, rate=rate, cores=self.cores, windows=self.windows)
        problem = check(self.gen.sample())
        if problem:
            self.problems.append(f"{label}: {problem}")
        self.log(f"  {label:34} {run.median_pps():>12,.0f} replies/s  "
                 f"(sent {run.pps('sent'):,.0f}/s)"
                 f"  sample {'byte-exact' if not problem else 'WRONG: ' + problem}")
        return {**run.as_dict(), "byte_exact": problem is None}

    def run_time(self, prog: int, src: Endpoint, template, nkeys: int,
                 sweep: str = "sequential") -> float:
        """kv_ingress's own run time per frame (ns) on this traffic, from the kernel's bpf_stats:
        the median of RUN_TIME_WINDOWS windows of its own (one window's figure moved 1.5x
        between runs minutes apart). The stats cost two clock reads per program run (a
        paravirtual clock here: a tenth of the hit path's cycles), so no rate is measured while
        they are on."""
        self.gen.configure(template, nkeys, sweep)
        per_frame = []
        with run_time_stats():
            for _ in range(RUN_TIME_WINDOWS):
                ran = program_run_time(prog)
                self.gen.run(src, max(0.5, self.seconds / 2), rate=self.rate, cores=self.cores)
                ns, runs = [a - b for a, b in zip(program_run_time(prog), ran)]
                per_frame.append(ns / max(1, runs))
        return round(statistics.median(per_frame), 1)

    def server(self, label: str, src: Endpoint, template, nkeys: int, check) -> dict:
        """A server behind the switch, given the benefit of the doubt: offered as much as the
        generator can send and then fixed rates around what it answered (a flood can cost a
        server more than it serves); the best of these counts."""
        tries = [self.measure(label, src, template, nkeys, check)]
        if not self.rate:
            base = tries[0]["reply_pps"]
            tries += [self.measure(f"{label} at {f:g}x", src, template, nkeys, check,
                                   rate=max(1000, f * base)) for f in SERVER_OFFERS]
        best = max(tries, key=lambda r: r["reply_pps"])
        return {**best, "offered": [{"offered_rate": r["offered_rate"],
                                     "reply_pps": r["reply_pps"]} for r in tries]}


def _lab(chunk_size: int, **kw) -> Lab:
    """One requester, one pool node, switchd as this benchmark needs it (the MTU is the one Lab
    picks for the chunk size)."""
    return Lab(PREFIX, hosts=1, pools=1, chunk_size=chunk_size, switchd_args=SWITCHD_ARGS, **kw)


def _tcp(cs: int, rounds: int, seconds: float, log) -> dict:
    """iperf3 h1 -> p1 through the switch with the ports detached, running xdp/pass.c (what any
    XDP program at all costs on a veth) and running kv_ingress. Each round measures every mode
    once, in an order that rotates from round to round, so drift on a shared machine falls on
    all three alike instead of on whichever ran last."""
    out: dict = {"chunk_bytes": cs, "rounds": rounds, "seconds": seconds}
    with _lab(cs) as lab:              # switchd running, as deployed
        topo = lab.topo
        out["mtu"] = topo.mtu
        dp = DataPlane(pinned_deployment(topo.pin_dir))  # switchd's program, to re-attach
        try:
            for i in range(rounds):
                for mode in TCP_MODES[i % 3:] + TCP_MODES[:i % 3]:
                    with netns.inside(topo.switch_ns):
                        for port in topo.ports:
                            detach_port(port)
                            if mode == "attached":
                                dp.attach(port)
                    if mode == "pass_program":
                        for port in topo.ports:
                            attach_pass_programs([topo.switch_ns], port)
                    bps = Iperf3(topo, "h1", "p1", seconds, cpus=(0, 1)).run()["bits_per_second"]
                    out.setdefault(f"{mode}_bps", []).append(bps)
                log(f"  tcp round {i + 1}: " + ", ".join(
                    f"{m} {out[f'{m}_bps'][-1] / 1e9:.2f}" for m in TCP_MODES) + " Gbit/s")
        finally:
            dp.bpf.cleanup()
    for m in TCP_MODES:
        out[f"{m}_median_bps"] = statistics.median(out[f"{m}_bps"])
    out["attached_vs_pass_program"] = round(out["attached_median_bps"] /
                                            out["pass_program_median_bps"], 3)
    out["pass_program_vs_detached"] = round(out["pass_program_median_bps"] /
                                            out["detached_median_bps"], 3)
    return out


def _chunk_size(b: _Bench, cs: int, nkeys: int, hit_ratios: list[int] | None,
                mc_threads: int) -> tuple[dict, list]:
    """Every per-chunk-size scenario in one testbed; the hit-ratio sweep when asked."""
    row, sweep = {"chunk_bytes": cs}, []
    with _lab(cs, switch=False, pool_capacity="1GiB", cache_entries=max(65536, nkeys)) as lab:
        topo = lab.topo
        row["mtu"] = topo.mtu
        h1, p1 = endpoint(topo.node("h1").netns), endpoint(topo.node("p1").netns)
        topo.run("h1", ["ping", "-c", "1", "-W", "2", p1.ip])  # ARP and bridge learning
        block = b"".join(payload(i, cs) for i in range(nkeys))
        lab.put("h1", NS, KEY, block)
        kv = kv_get(h1, p1, NS, KEY, cs)

        def check_kv(frame):
            return check_kv_reply(frame, h1, p1, NS, KEY, nkeys, cs)

        details = {}
        with Memcached(topo, "p1", mc_threads) as mc, b.gen.counting(h1.netns):
            mc.preload(nkeys, cs)
            with b.gen.reflecting(topo.switch_ns, "h1"):
                details["ceiling"] = b.measure(f"{cs} B ceiling", h1, kv, nkeys,
                                               lambda f: check_reflected(f, kv))
            lab.start_switch()
            dp = DataPlane(pinned_deployment(topo.pin_dir), programs=False)
            try:
                cache = Cache(dp)
                details["pool_server"] = b.server(f"{cs} B pool_server", h1, kv, nkeys, check_kv)
                details["memcached"] = b.server(
                    f"{cs} B memcached", h1, memcached_get(h1, p1), nkeys,
                    lambda f: check_memcached_reply(f, h1, cs))
                cache.put_block(NS, KEY, block)
                details["switch_hit"] = b.measure(f"{cs} B switch_hit", h1, kv, nkeys, check_kv)
                with netns.inside(topo.switch_ns):
                    prog = attached_program("h1")[1]
                row["switch_hit_ns_per_frame"] = b.run_time(prog, h1, kv, nkeys)
                row["switch_hit_ns_per_kib"] = round(row["switch_hit_ns_per_frame"] * 1024 / cs,
                                                     1)
                details["switch_hit_hot"] = b.measure(  # every chunk in the CPU's L2
                    f"{cs} B switch_hit, {HOT_KEYS} chunks", h1, kv, min(HOT_KEYS, nkeys),
                    check_kv)
                for pct in sorted(hit_ratios or [], reverse=True):
                    cached = nkeys * pct // 100
                    for chunk in range(cached, nkeys):
                        cache.evict(NS, KEY, chunk)
                    r = b.measure(f"{cs} B {pct}% hits", h1, kv, nkeys, check_kv)
                    c = r["counts"]
                    sweep.append({"hit_percent": pct, "chunk_bytes": cs,
                                  "reply_pps": r["reply_pps"], "sent_pps": r["sent_pps"],
                                  "from_switch_pps": round(c["kv_switch"] / r["seconds"]),
                                  "from_pool_pps": round(c["kv_pool"] / r["seconds"]),
                                  "byte_exact": r["byte_exact"]})
            finally:
                dp.bpf.cleanup()
    for name in SCENARIOS:
        row[f"{name}_pps"] = details[name]["reply_pps"]
    row["details"] = details
    return row, sweep


def _cache_scaling(b: _Bench, entries: list[int], cs: int) -> list[dict]:
    """The hit path at growing cache sizes (one deployment of the largest, filled step by
    step), each with kv_ingress's own ns per frame (sequential sweep, bpf_stats window)."""
    rows, most = [], max(entries)
    with _lab(cs, cache_entries=most) as lab:
        topo = lab.topo
        h1, p1 = endpoint(topo.node("h1").netns), endpoint(topo.node("p1").netns)
        kv = kv_get(h1, p1, NS, KEY, cs)
        dp = DataPlane(pinned_deployment(topo.pin_dir), programs=False)
        with netns.inside(topo.switch_ns):
            prog = attached_program("h1")[1]
        filled = 0
        try:
            with b.gen.counting(h1.netns):
                for n in sorted(entries):
                    t0 = time.monotonic()
                    fill_cache(Cache(dp), NS, KEY, filled, n, most)
                    filled = n
                    b.log(f"  cache filled to {n:,} entries of {cs} B "
                          f"({time.monotonic() - t0:.1f} s)")
                    row = {"entries": n, "chunk_bytes": cs}
                    for sweep in ("sequential", "zipf"):
                        r = b.measure(f"{n:,} entries {sweep}", h1, kv, n,
                                      lambda f: check_kv_reply(f, h1, p1, NS, KEY, n, cs, most),
                                      sweep)
                        row[f"hit_pps_{sweep}"] = r["reply_pps"]
                        row[f"byte_exact_{sweep}"] = r["byte_exact"]
                    row["ns_per_frame"] = b.run_time(prog, h1, kv, n)
                    row["ns_per_kib"] = round(row["ns_per_frame"] * 1024 / cs, 1)
                    b.log(f"  {n:,} entries: kv_ingress {row['ns_per_frame']} ns per frame")
                    rows.append(row)
                alternating = _alternating(b, h1, p1, kv, min(entries), most, cs)
        finally:
            dp.bpf.cleanup()
    for row in rows:
        row["ratio_vs_smallest"] = round(row["hit_pps_sequential"] /
                                         rows[0]["hit_pps_sequential"], 3)
    rows[-1]["alternating"] = alternating
    return rows


def _alternating(b: _Bench, h1: Endpoint, p1: Endpoint, kv, small: int, most: int,
                 cs: int) -> dict:
    """The hit rate over the ``small`` first chunks and over all ``most`` of the full cache, in
    SCALING_ROUNDS alternating rounds: the two sizes' rows above are measured minutes apart,
    and their ratio moved 0.58-0.96 between runs. A sweep over ``small`` chunks touches what a
    cache of that many entries would (its slots and their index entries)."""
    pps = {small: [], most: []}
    for r in range(SCALING_ROUNDS):
        for n in (small, most) if r % 2 == 0 else (most, small):
            pps[n].append(b.measure(f"{n:,} of {most:,} entries, round {r + 1}", h1, kv, n,
                                    lambda f: check_kv_reply(f, h1, p1, NS, KEY, n, cs, most)
                                    )["reply_pps"])
    ratios = [x / y for x, y in zip(pps[most], pps[small])]
    return {"small_entries": small, "small_pps": pps[small], "large_pps": pps[most],
            "ratio": round(statistics.median(ratios), 3)}


def run_throughput(chunk_sizes=(256, 1024, 3072), seconds: float = 2.0, windows: int = 5,
                   cores: tuple[int, ...] = (0,), nkeys: int = 4096, rate: float = 0,
                   hit_ratios=(0, 25, 50, 75, 100), sweep_chunk: int = 1024,
                   scaling=(1000, 10000, 100000, 1000000), scaling_chunks=(64, 3072),
                   tcp_runs: int = 5, tcp_seconds: float = 2.0, memcached_threads: int = 2,
                   json_path: str | None = None, plot_path: str | None = None,
                   log=print) -> dict:
    """Run every scenario; returns (and writes, when given paths) the results."""
    started = time.monotonic()
    log(f"bench throughput: chunk sizes {', '.join(map(str, chunk_sizes))} B; the traffic "
        "generator ...")
    gen = Generator()
    b = _Bench(gen, seconds, windows, rate, tuple(cores), log)
    load_before = os.getloadavg()
    results, sweep, tcp = [], [], {}
    tcp_chunk = sweep_chunk if sweep_chunk in chunk_sizes else chunk_sizes[0]
    try:
        for cs in chunk_sizes:
            log(f"chunk {cs} B:")
            row, s = _chunk_size(b, cs, nkeys, list(hit_ratios) if cs == sweep_chunk else None,
                                 memcached_threads)
            results.append(row)
            sweep += s
        if tcp_runs:
            log(f"tcp, {tcp_chunk} B chunks' MTU:")
            tcp = _tcp(tcp_chunk, tcp_runs, tcp_seconds, log)
        scaling_rows = []
        for scs in scaling_chunks if scaling else ():
            log(f"cache scaling, {scs} B chunks:")
            scaling_rows += _cache_scaling(b, list(scaling), scs)
    finally:
        gen.close()
    if tcp:
        log(f"tcp: attached {tcp['attached_median_bps'] / 1e9:.2f} Gbit/s, detached "
            f"{tcp['detached_median_bps'] / 1e9:.2f} Gbit/s, xdp/pass.c on the ports "
            f"{tcp['pass_program_median_bps'] / 1e9:.2f} Gbit/s (medians of {tcp_runs} rounds)")
    out = {"results": results, "cache_scaling": scaling_rows, "hit_ratio_sweep": sweep,
           "tcp_ratio": round(tcp["attached_median_bps"] / tcp["detached_median_bps"], 3)
           if tcp else None,
           "tcp": tcp,
           "config": {"cpus": os.cpu_count(), "generator_cores": list(cores),
                      "offered_rate": rate or "max", "keys": nkeys, "seconds": seconds,
                      "windows": windows, "reply_pps": "median of the windows",
                      "loadavg_before": load_before, "loadavg_after": os.getloadavg(),
                      "switchd_args": list(SWITCHD_ARGS), "memcached_threads": memcached_threads,
                      "scaling_chunk_bytes": scaling_chunks[0] if scaling_chunks else None,
                      "scaling_chunks_bytes": list(scaling_chunks),
                      "run_time": "kv_ingress's bpf_stats run time per frame, the median of "
                                  f"{RUN_TIME_WINDOWS} windows of its own after each rate (stats "
                                  "off while rates are measured)",
                      "scaling_target": "largest vs smallest working set of the full cache, "
                                        f"median of {SCALING_ROUNDS} alternating rounds",
                      "sweep": "sequential",
                      "zipf": "s=1.0 over a 65536-slot table (cache scaling only)",
                      "counted_at": "requester eth0 (count_replies XDP program)",
                      "wall_seconds": None},
           "sample_problems": b.problems}
    out["targets"] = _targets(out)
    out["config"]["wall_seconds"] = round(time.monotonic() - started, 1)
    write_json(json_path, out)
    if plot_path:
        plot_throughput(out, plot_path)
    return out


def _targets(out: dict) -> dict:
    t = {}

    def target(name, ratio, want):
        t[name] = {"ratio": round(ratio, 3), "target": want, "met": ratio >= want}

    row = next((r for r in out["results"] if r["chunk_bytes"] == 1024), None)
    if row:
        hit = row["switch_hit_pps"]
        target("switch_hit_vs_ceiling_1024", hit / max(row["ceiling_pps"], 1), 0.8)
        target("switch_hit_vs_memcached_1024", hit / max(row["memcached_pps"], 1), 6)
        target("switch_hit_vs_pool_server_1024", hit / max(row["pool_server_pps"], 1), 20)
    sizes = sorted({r["chunk_bytes"] for r in out["cache_scaling"]},
                   key=[r["chunk_bytes"] for r in out["cache_scaling"]].index)
    for i, cs in enumerate(sizes):
        rows = [r for r in out["cache_scaling"] if r["chunk_bytes"] == cs]
        if len(rows) > 1:
            target("hit_path_largest_vs_smallest_cache" + (f"_{cs}" if i else ""),
                   rows[-1]["alternating"]["ratio"], 0.9)
    if out["tcp_ratio"] is not None:
        target("tcp_attached_vs_detached", out["tcp_ratio"], 0.95)
    return t


def plot_throughput(out: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    ax = axes[0]
    sizes = [r["chunk_bytes"] for r in out["results"]]
    width = 0.8 / len(SCENARIOS)
    for i, name in enumerate(SCENARIOS):
        ax.bar(np.arange(len(sizes)) + i * width, [r[f"{name}_pps"] for r in out["results"]],
               width, label=name)
    ax.set(xticks=np.arange(len(sizes)) + width * (len(SCENARIOS) - 1) / 2, xticklabels=sizes,
           xlabel="chunk payload (bytes)", ylabel="replies/s at the requester", yscale="log",
           title="GET replies per second, one generator core")
    ax.legend(fontsize=8)
    ax = axes[1]
    sw = out["hit_ratio_sweep"]
    if sw:
        x = [r["hit_percent"] for r in sw]
        for key, label in (("reply_pps", "all replies"), ("from_switch_pps", "from the switch"),
                           ("from_pool_pps", "from the pool server")):
            ax.plot(x, [r[key] or np.nan for r in sw], "o-", label=label)  # log axis: no 0
        ax.set(xlabel="hit ratio (%)", ylabel="replies/s", yscale="log",
               title=f"Hit ratio sweep, {sw[0]['chunk_bytes']} B chunks")
        ax.legend(fontsize=8)
    ax = axes[2]
    sc = out["cache_scaling"]
    if sc:
        for cs in sorted({r["chunk_bytes"] for r in sc}):
            rows = [r for r in sc if r["chunk_bytes"] == cs]
            x = [r["entries"] for r in rows]
            for sweep, style in (("sequential", "o-"), ("zipf", "s--")):
                ax.plot(x, [r[f"hit_pps_{sweep}"] for r in rows], style,
                        label=f"{cs} B, {sweep} keys")
        ax.set(xscale="log", xlabel="cache entries", ylabel="hit replies/s", ylim=(0, None),
               title="Hit path vs cache size")
        ax.legend(fontsize=8)
    if out["tcp_ratio"] is not None:
        fig.suptitle(f"TCP through the switch: program attached / detached = "
                     f"{out['tcp_ratio']:.3f}; a bare XDP_PASS program / detached = "
                     f"{out['tcp']['pass_program_vs_detached']:.3f}", fontsize=10)
    for ax in axes:
        ax.grid(alpha=0.3)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
