"""`testbed bench lmcache`'s inference node: LMCache's own cache engine (testbed.lmcache_engine,
SmolLM2's KV shape) whose remote tier is the store under test, through LMCache's own connector
for it (kvswitch's plugin for kvswitch). It runs the benchmark's phases on the orchestrator's
start lines, one line per phase, so every node starts a phase at once and the orchestrator
reads the storage node's counters between phases. A phase is

  {"kind": "store", "nodes": [...], "prefixes": [[id, tokens], ...]}      stored by its nodes
  {"kind": "retrieve", "nodes": [...], "plan": {node: [[id, tokens, gap_s], ...]}}

and each retrieve is timed (LMCache's ``retrieve``: its lookup of the chunks in the remote store
and their transfer) and checked byte for byte against the seeded KV of its prefix."""
from __future__ import annotations

import json
import os
import time

from ...lab.tasks import StartLine


def store_config(store: dict):
    """The engine config for ``store`` (the orchestrator's description of it)."""
    from ... import lmcache_engine
    timeout = store.get("timeout_s")
    if store["kind"] == "kvswitch":      # the plugin's own bound on a block: the same wait
        plugin = {**store["plugin"], **({"deadline": timeout} if timeout else {})}
        return lmcache_engine.config(plugin=plugin, timeout_s=timeout)
    return lmcache_engine.config(remote_url=store["url"], extra=store.get("extra"),
                                 timeout_s=timeout)


# LMCache 0.5.6's AsyncPQExecutor (the job queue of its Redis, RESP, Valkey, S3 and other
# connectors) loses a worker whenever a caller gives up on a job before it ends (a
# blocking_timeout_secs that passes cancels the job's future; the worker's set_result then
# raises InvalidStateError out of its loop). After four, no job runs again and every lookup
# waits forever: with 8 engines at once on a 0.1 Gbit/s link, Redis hung the benchmark.
LMCACHE_FIX = ("AsyncPQExecutor.submit_job awaits its job's future through asyncio.shield, so "
               "a caller that gives up no longer kills a queue worker")


def fix_lmcache_executor() -> None:
    """The fix of LMCACHE_FIX, the peer's code otherwise unchanged: ``submit_job`` as LMCache
    writes it, its wait shielded so that cancelling the caller leaves the job's future alone."""
    import asyncio
    from lmcache.v1.storage_backend.job_executor.pq_executor import AsyncPQExecutor

    async def submit_job(self, fn, *args, **kwargs):
        priority = kwargs.pop("priority", 0)
        done = self.loop.create_future()
        await self._queue.put((priority, next(self._counter), fn, args, kwargs, done))
        return await asyncio.shield(done)
    AsyncPQExecutor.submit_job = submit_job


def run_node(store: dict, index: int, phases: list[dict], lines: list[str],
             dtype: str = "bfloat16") -> dict:
    """Task: node ``index``'s part of every phase; its records per phase."""
    import torch
    from ... import lmcache_engine as le
    fix_lmcache_executor()
    kv_dtype = getattr(torch, dtype)
    eng = le.engine(store_config(store), f"bench-{index}", kv_dtype)
    prompts: dict[tuple[int, int], tuple] = {}

    def prompt(pid: int, tokens: int):
        if (pid, tokens) not in prompts:
            prompts[(pid, tokens)] = le.prompt(tokens, 1000 + pid, kv_dtype)
        return prompts[(pid, tokens)]

    out = []
    for phase, line in zip(phases, lines):
        mine = index in phase["nodes"]
        if mine:                                       # the KV to compare with, made ahead
            items = phase["prefixes"] if phase["kind"] == "store" else \
                phase["plan"][str(index)]
            for item in items:
                prompt(item[0], item[1])
        at = StartLine.wait(line)
        time.sleep(max(0.0, at - time.time()))
        if not mine:
            out.append(None)
            continue
        t0 = time.time()
        records = []
        if phase["kind"] == "store":
            for pid, tokens in phase["prefixes"]:
                r = le.store(eng, *prompt(pid, tokens))
                records.append({"id": pid, "seconds": round(r["seconds"], 4),
                                "pending": r["pending"]})
        else:
            for pid, tokens, gap in phase["plan"][str(index)]:
                time.sleep(gap)
                start = time.time() - t0
                r = le.retrieve(eng, *prompt(pid, tokens))
                records.append({"id": pid, "at_s": round(start, 4),
                                "seconds": round(r["seconds"], 5), "tokens": r["tokens"],
                                "want_tokens": tokens, "exact": r["exact"]})
        out.append({"records": records, "seconds": round(time.time() - t0, 4)})
    # the task's result, then the end: LMCache's engine keeps threads that are not daemons,
    # and closing it can hang (its Redis connector's close waits on its own event loop)
    print(json.dumps({"phases": out}), flush=True)
    os._exit(0)
