"""`testbed replay`: drive a Mooncake-format trace through the veth testbed and report the hit
ratio the switch actually achieved, beside the offline evaluator's for the same capacity.

Scaling: every trace block (512 tokens) becomes a KV block of one chunk; its key is derived from
its hash id. Time: requests keep their order and are paced at ``speedup`` times the trace's pace
(or as fast as the client goes, if that is slower). The switch's cache holds ``capacity`` blocks
(a fraction of the trace's distinct blocks, or a count), and switchd's default policy (or the
one asked for), stepping every ``interval`` seconds, decides what it holds; the cache map has
``fill_headroom`` more entries for speculative fills (blocks learned on their first miss, kept
or evicted at the next step), so the policy's own capacity is the evaluator's. One inference
node fetches each request's blocks in chain order; a block is a hit when the switch answered it.

The orchestrator runs here; the client part (``drive``) runs as a task inside the inference
node's namespace.
"""
from __future__ import annotations

import asyncio
import hashlib
import os
import time
from pathlib import Path

from ...lab import Lab
from ...results import write_json
from ...sim.evaluate import capacity_blocks, evaluate
from ...sim.trace import load_trace

NS = 11


def block_key(hash_id: int) -> bytes:
    return hashlib.sha256(b"trace-block" + int(hash_id).to_bytes(8, "little")).digest()[:16]


def block_payload(hash_id: int, size: int) -> bytes:
    seed = hashlib.sha256(b"payload" + int(hash_id).to_bytes(8, "little")).digest()
    return (seed * (size // len(seed) + 1))[:size]


async def put_blocks(client, hash_ids, block_bytes: int, parallel: int = 32) -> None:
    """Put every trace block (by hash id) on its pool node, ``parallel`` at a time."""
    sem = asyncio.Semaphore(parallel)

    async def put(h):
        async with sem:
            await client.put_block(NS, block_key(h), block_payload(h, block_bytes))

    await asyncio.gather(*(put(h) for h in hash_ids))


async def drive(trace_path: str, pool: str, limit: int | None, speedup: float,
                block_bytes: int) -> dict:
    """In the inference node: put the trace's blocks, then fetch every request's blocks at the
    trace's pace; count the switch's answers."""
    from hostagent.inference.client import KVClient
    trace = load_trace(trace_path)
    n = min(trace.n_requests, limit or trace.n_requests)
    wanted = sorted({int(h) for i in range(n) for h in trace.blocks(i)})
    async with KVClient([pool], chunk_size=block_bytes, window=64) as c:
        await put_blocks(c, wanted, block_bytes)
        hits = total = exact = 0
        t0, ts0 = time.monotonic(), int(trace.timestamp[0])
        for i in range(n):
            due = (int(trace.timestamp[i]) - ts0) / 1000 / speedup
            lag = due - (time.monotonic() - t0)
            if lag > 0:
                await asyncio.sleep(lag)
            for h in trace.blocks(i):
                data, stats = await c.get_block(NS, block_key(int(h)), nchunks=1)
                total += 1
                hits += stats.from_switch
                exact += data == block_payload(int(h), block_bytes)
    return {"requests": n, "block_requests": total, "switch_hits": hits,
            "byte_exact": exact == total, "seconds": round(time.monotonic() - t0, 2)}


def run_replay(trace_path: str, capacity: float, limit: int | None = None,
               speedup: float = 10.0, interval: float = 0.1, block_bytes: int = 1024,
               json_path: str | None = None, fill_headroom: int | None = None,
               policy: str | None = None, log=print) -> dict:
    trace = load_trace(trace_path)
    n = min(trace.n_requests, limit or trace.n_requests)
    log(f"replay: {n} requests; the offline evaluator ...")
    if n < trace.n_requests:
        trace_for_eval = [{"timestamp": int(trace.timestamp[i]),
                           "input_length": int(trace.input_length[i]),
                           "output_length": int(trace.output_length[i]),
                           "hash_ids": [int(h) for h in trace.blocks(i)]} for i in range(n)]
        distinct = len({h for r in trace_for_eval for h in r["hash_ids"]})
    else:
        trace_for_eval, distinct = trace_path, trace.distinct_blocks
    cap = capacity_blocks(capacity, distinct)
    offline = evaluate(trace_for_eval, cap)
    name = policy or offline["default_policy"]
    log(f"offline: {name} hits {offline['hit_ratio'][name]:.4f} of block requests at "
        f"{cap} blocks (belady {offline['hit_ratio']['belady']:.4f})")
    headroom = max(16, cap // 4) if fill_headroom is None else fill_headroom
    log(f"replay: building the testbed, replaying at {speedup:g}x ...")
    with Lab(f"rp{os.getpid() % 100000}", hosts=1, pools=1, chunk_size=block_bytes,
             cache_entries=cap + headroom,
             switchd_args=("--interval", str(interval), "--fill-headroom", str(headroom),
                           "--policy", name)) as lab:
        live = lab.task("h1", f"{__name__}:drive", str(Path(trace_path).resolve()),
                        lab.pool_addrs[0], n, speedup, block_bytes)
        counters = lab.stats()
    live_ratio = live["switch_hits"] / live["block_requests"]
    out = {"trace": trace_path, "capacity_blocks": cap, "fill_headroom_blocks": headroom,
           "policy": name, "speedup": speedup, "interval_s": interval,
           "live": {**live, "hit_ratio": round(live_ratio, 4),
                    "filled_chunks": counters["fill"],
                    "speculative_fills": counters["spec_fill"]},
           "offline_hit_ratio": offline["hit_ratio"],
           "difference_pp": round(100 * (live_ratio - offline["hit_ratio"][name]), 2)}
    log(f"live: switch answered {live['switch_hits']} of {live['block_requests']} block "
        f"requests = {live_ratio:.4f} ({out['difference_pp']:+.2f} pp vs offline), "
        f"byte-exact {live['byte_exact']}, {live['seconds']}s")
    write_json(json_path, out)
    return out
