"""`testbed soak`: sustained load for a bounded time, watching for growth that should not happen:
pending rounds and waiters, cache occupancy beyond capacity, and switchd's memory. Two inference
nodes fetch blocks drawn from a Zipf distribution over a working set larger than the cache, with
the policy daemon admitting and evicting; a sample of the maps and the daemon is taken every
``sample_s`` seconds."""
from __future__ import annotations

import json
import os
import subprocess
import time

from ...lab import Lab
from ...results import write_json

NS = 13


async def drive(pool: str, seconds: float, seed: int, keys_hex: list[str]) -> dict:
    """In an inference node: fetch blocks drawn Zipf(1) from ``keys_hex`` for ``seconds``."""
    import numpy as np
    from hostagent.inference.client import KVClient
    keys = [bytes.fromhex(k) for k in keys_hex]
    rng = np.random.default_rng(seed)
    p = np.arange(1, len(keys) + 1) ** -1.0
    p /= p.sum()
    done = hits = 0
    end = time.monotonic() + seconds
    async with KVClient([pool], deadline=20) as c:
        while time.monotonic() < end:
            _data, st = await c.get_block(NS, keys[rng.choice(len(keys), p=p)])
            done += 1
            hits += st.from_switch
    return {"fetches": done, "chunks_from_switch": hits}


def _rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


def run_soak(minutes: float, json_path: str | None, blocks: int = 200, block_kib: int = 32,
             sample_s: float = 10.0, log=print) -> dict:
    keys = [os.urandom(16) for _ in range(blocks)]
    capacity = blocks * block_kib // 4           # room for a quarter of the working set
    log(f"soak: building the testbed, {blocks} blocks of {block_kib} KiB put ...")
    with Lab(f"sk{os.getpid() % 10000}", hosts=2, pools=1, cache_entries=capacity,
             switchd_args=("--interval", "0.5")) as lab:
        for key in keys:
            lab.put("h1", NS, key, os.urandom(block_kib * 1024))
        seconds = minutes * 60
        log(f"soak: {minutes:g} minutes of load, a sample every {sample_s:g} s ...")
        drivers = [lab.start_task(h, f"{__name__}:drive", lab.pool_addrs[0], seconds, i,
                                  [k.hex() for k in keys]) for i, h in enumerate(("h1", "h2"))]
        samples, start = [], time.monotonic()
        while any(d.proc.poll() is None for d in drivers):
            time.sleep(sample_s)
            listing = json.loads(lab.switchd("cache", "ls", "--json").stdout)
            stats = lab.stats()
            sample = {"t_s": round(time.monotonic() - start, 1),
                      "cached_chunks": len(listing["entries"]), "capacity": capacity,
                      "admitted_blocks": len(listing["admitted"]),
                      "switchd_rss_kib": _rss_kib(lab.switch.pid),
                      "pending_rounds": _count(lab, "pending"), "waiters": _count(lab, "waiters"),
                      "hits": stats["get_hit"], "misses": stats["get_miss"]}
            samples.append(sample)
            log(json.dumps(sample))
        fetched = [d.result() for d in drivers]
    rss = [s["switchd_rss_kib"] for s in samples]
    half = len(rss) // 2
    out = {"minutes": minutes, "working_set_blocks": blocks, "block_bytes": block_kib * 1024,
           "capacity_chunks": capacity, "drivers": fetched, "samples": samples,
           "max_cached_chunks": max(s["cached_chunks"] for s in samples),
           "max_pending_rounds": max(s["pending_rounds"] for s in samples),
           "rss_growth_kib_second_half": (max(rss[half:]) - max(rss[:half])) if half else 0,
           "within_capacity": all(s["cached_chunks"] <= capacity for s in samples)}
    write_json(json_path, out)
    return out


def _count(lab: Lab, table: str) -> int:
    """Entries of a coalescing map, counted by bpftool in the switch namespace's pin dir."""
    r = subprocess.run(["bpftool", "-j", "map", "dump", "pinned",
                        f"{lab.topo.pin_dir}/kv_{table}"], capture_output=True, text=True)
    return len(json.loads(r.stdout or "[]")) if r.returncode == 0 else -1
