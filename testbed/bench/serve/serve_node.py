"""One inference node's serving loop in `testbed bench serve` (run inside the node's namespace
as a testbed.lab task): requests in arrival order, one at a time (one GPU), each one:

  1. wait for its arrival (counted from the common start even if this node's engine opened
     late; queueing: from arrival to the start of its turn);
  2. look its prefix blocks up and fetch them with the XDP fetch engine, all at once (each
     block's chunk 0 first: a block the pool does not hold costs one GET, NOT_FOUND); the
     longest run of fetched blocks from the first one is the cached prefix; every fetched
     block is checked against its content;
  3. model the prefill of the remaining tokens with the preset's prefill speed (a sleep: the
     node is busy, as its GPU would be);
  4. write the blocks it computed through to the pool (a background writer, as a serving
     engine's offload does; it shares the node's link).

TTFT = queueing + fetch + modelled prefill. Which pool nodes hold a block, and which are asked,
is the product's ``Placement`` (``holding``: its replicas, shared store and spread reads), so
the fetch engine's own failover (a silent node left out, its blocks asked of their next holder;
a node whose cable is out computes at once) is what `bench faults` measures. The replicas mode
of `bench serve` is every pool node holding every block, read from a random one. Every
fetched byte that is not the block's counts as wrong.
"""
from __future__ import annotations

import asyncio
import queue
import threading
import time

import numpy as np

from hostagent.common.pools import Placement
from hostagent.inference.client import KVClient
from hostagent.inference.fetch.engine import FetchEngine

from .serve_workloads import payload

BLOCK_TOKENS = 512


def placement(pools: list[str], holding: dict | None = None) -> Placement:
    """The product's placement of a run's blocks: ``holding`` is {"replicas": R, "shared":
    bool, "spread": bool} (JSON, for a task's arguments); none: one holder each."""
    return Placement(pools, **(holding or {}))


class Writer:
    """Puts computed blocks to the pool (each holder, as the placement says) in a thread."""

    def __init__(self, place: Placement, chunk_size: int, ns: int, block_bytes: int):
        self.q: queue.Queue = queue.Queue()
        self.place, self.cs, self.ns, self.size = place, chunk_size, ns, block_bytes
        self.errors = self.written = 0
        self.thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)
        self.thread.start()

    async def _run(self) -> None:
        async with KVClient(self.place, self.cs, 64, 30.0) as c:
            while (keys := await asyncio.to_thread(self.q.get)) is not None:
                for key in keys:
                    try:
                        await c.put_block(self.ns, key, payload(key, self.size))
                        self.written += 1
                    except Exception:   # noqa: BLE001 - counted, the run goes on
                        self.errors += 1

    def close(self) -> None:
        self.q.put(None)
        self.thread.join(120)


def common_start(start_at: float | str) -> float:
    """The run's start (epoch seconds): ``start_at``, or the one its testbed.lab StartLine
    (``start_at`` its path) sets once every node's engine is open."""
    if isinstance(start_at, str):
        from testbed.lab.tasks import StartLine
        return StartLine.wait(start_at)
    return start_at


def wrong_bytes(got: bytes, want: bytes) -> int:
    """Bytes of ``got`` that are not ``want``'s (a length apart counts its difference)."""
    n = min(len(got), len(want))
    a, b = np.frombuffer(got, np.uint8, n), np.frombuffer(want, np.uint8, n)
    return int(np.count_nonzero(a != b)) + abs(len(got) - len(want))


def serve(pools: list[str], chunk_size: int, ns: int, block_bytes: int, requests: list[dict],
          start_at: float | str, prefill_tok_s: float, holding: dict | None = None,
          write: bool = True, deadline: float = 30.0) -> dict:
    place = placement(pools, holding)
    out = {"ttft": [], "warmup": [], "queue": [], "fetch": [], "prefill": [], "cached_blocks": 0,
           "blocks": 0, "chunks": 0, "from_switch": 0, "replicas": 0, "from_pool": 0,
           "retransmits": 0, "byte_exact": True, "wrong_bytes": 0, "fetch_errors": 0,
           "recomputed_blocks": 0}
    writer = Writer(place, chunk_size, ns, block_bytes) if write else None
    with FetchEngine(place, chunk_size, deadline=deadline) as eng:
        # arrivals count from the common start, whenever this node's engine was open
        ahead = common_start(start_at) - time.time()
        out["late_s"] = round(max(0.0, -ahead), 4)
        t0 = time.monotonic() + max(0.0, ahead)
        time.sleep(max(0.0, ahead))
        for req in requests:
            arrival = t0 + req["at"]
            time.sleep(max(0.0, arrival - time.monotonic()))
            start = time.monotonic()
            keys = [bytes.fromhex(k) for k in req["keys"]]
            # a lookup first (chunk 0 of each block: NOT_FOUND costs one GET), then the rest
            got = eng.get_blocks([(ns, k, None) for k in keys], return_exceptions=True)
            cached = 0
            for k, b in zip(keys, got):
                if isinstance(b, BaseException):
                    out["fetch_errors"] += type(b).__name__ != "BlockNotFound"
                    continue
                s = b.stats
                out["chunks"] += s.chunks
                out["from_switch"] += s.from_switch
                out["replicas"] += s.replicas
                out["from_pool"] += s.from_pool
                out["retransmits"] += s.retransmits
                wrong = wrong_bytes(b.tobytes(), payload(k, block_bytes))
                out["wrong_bytes"] += wrong
                out["byte_exact"] &= wrong == 0
                b.release()
            for b in got:
                if isinstance(b, BaseException):
                    break
                cached += 1
            fetched = time.monotonic()
            compute = max(0, req["tokens"] - cached * BLOCK_TOKENS) / prefill_tok_s
            time.sleep(compute)
            out["queue"].append(start - arrival)
            out["fetch"].append(fetched - start)
            out["prefill"].append(compute)
            out["ttft"].append(time.monotonic() - arrival)
            out["warmup"].append(bool(req.get("warmup")))
            out["cached_blocks"] += cached
            out["recomputed_blocks"] += len(keys) - cached
            out["blocks"] += len(keys)
            if writer is not None and cached < len(keys):
                writer.q.put(keys[cached:])
    if writer is not None:
        writer.close()
        out["written"], out["write_errors"] = writer.written, writer.errors
    return out
