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

TTFT = queueing + fetch + modelled prefill. With ``spread`` (the replicas mode) every pool node
holds every block and each block is read from a pool node chosen at random. With ``failover``
(`testbed bench faults`) a block whose fetch timed out is asked once more of the next pool node
in its rendezvous order, and its owner is left out for a while, as a connector that knows its
store replicates would do; every fetched byte that is not the block's counts as wrong.
"""
from __future__ import annotations

import asyncio
import queue
import random
import threading
import time

import numpy as np

from kvproto import Status
from hostagent.common.netif import has_carrier
from hostagent.common.transfer import Refused, TransferTimeout, pool_for
from hostagent.inference.client import KVClient
from hostagent.inference.fetch.engine import FetchEngine

from .serve_workloads import payload

BLOCK_TOKENS = 512


class SpreadEngine(FetchEngine):
    """Reads spread over the pool nodes (each holds every block) instead of the owner."""

    def _route(self, ns: int, key: bytes):
        return self._routes[random.choice(self.pools)]


class FailoverEngine(FetchEngine):
    """Routes around a pool node that stopped answering or cannot serve: a transfer with no
    chunk back after ``first_reply_timeout`` fails at once (the engine's own rule judges only
    its first transfers: here every transfer is judged alone), as does one the node refuses
    as UNAVAILABLE (a Mooncake node whose read hit a dead replica); while that node is marked
    silent (for ``retry_s``) its blocks go to the next node of their rendezvous order (with a
    replicated store, such as Mooncake's, any pool node serves any block)."""
    retry_s = 5.0

    def __init__(self, *args, **kw):
        super().__init__(*args, first_reply_timeout=1.0, **kw)
        self._silent: dict = {}                     # pool address -> until (monotonic)

    @property
    def answered(self) -> bool:
        return False

    @answered.setter
    def answered(self, _value) -> None:
        pass

    def _up(self) -> list:
        now = time.monotonic()
        return [p for p in self.pools if self._silent.get(p, 0.0) <= now] or self.pools

    def _route(self, ns: int, key: bytes):
        return self._routes[pool_for(self._up(), ns, key)]

    def mark_silent(self, ns: int, keys: list[bytes]) -> None:
        """The pool nodes ``keys`` are routed to now failed them: leave those nodes out. Every
        owner is found before any is left out (else the second key of a dead node would be
        routed to, and blamed on, the node that is still up)."""
        up, until = self._up(), time.monotonic() + self.retry_s
        for pool in {pool_for(up, ns, k) for k in keys}:
            self._silent[pool] = until


class LinkDown(ConnectionError):
    """This node's own interface has no carrier: no pool node can be reached."""


def routed_around(b) -> bool:
    """Whether a block's failure sends it to another pool node: no answer in time, or the
    node refused it as UNAVAILABLE (its store cannot reach the block's replica now)."""
    return isinstance(b, TransferTimeout) or (isinstance(b, Refused)
                                              and b.status == Status.UNAVAILABLE)


def fetch_blocks(eng: FetchEngine, ns: int, keys: list[bytes], failover: bool) -> list:
    """The blocks of ``keys`` (an exception in a block's place where it failed); with
    ``failover``, the ones routed around (``routed_around``) asked once more after their
    owners are marked silent, and none asked for while this node's own link is down (the
    node computes them rather than wait out the silence)."""
    if failover and not has_carrier(eng.ifname):    # cable out: compute, do not wait
        return [LinkDown(f"{eng.ifname} has no carrier")] * len(keys)
    got = eng.get_blocks([(ns, k, None) for k in keys], return_exceptions=True)
    again = [i for i, b in enumerate(got) if routed_around(b)] if failover else []
    if again and not has_carrier(eng.ifname):
        return got                     # silent because our own cable is out, not the nodes
    if again:
        eng.mark_silent(ns, [keys[i] for i in again])
        retry = eng.get_blocks([(ns, keys[i], None) for i in again], return_exceptions=True)
        for i, b in zip(again, retry):
            got[i] = b
    return got


class Writer:
    """Puts computed blocks to the pool (every pool node with ``replicas``) in a thread."""

    def __init__(self, pools: list[str], chunk_size: int, ns: int, block_bytes: int,
                 replicas: bool):
        self.q: queue.Queue = queue.Queue()
        self.pools, self.cs, self.ns, self.size = pools, chunk_size, ns, block_bytes
        self.replicas, self.errors, self.written = replicas, 0, 0
        self.thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)
        self.thread.start()

    async def _run(self) -> None:
        groups = [[p] for p in self.pools] if self.replicas else [self.pools]
        clients = [KVClient(g, self.cs, 64, 30.0) for g in groups]
        for c in clients:
            await c.__aenter__()
        try:
            while (keys := await asyncio.to_thread(self.q.get)) is not None:
                for key in keys:
                    data = payload(key, self.size)
                    for c in clients:
                        try:
                            await c.put_block(self.ns, key, data)
                            self.written += 1
                        except Exception:   # noqa: BLE001 - counted, the run goes on
                            self.errors += 1
        finally:
            for c in clients:
                await c.__aexit__(None, None, None)

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
          start_at: float | str, prefill_tok_s: float, spread: bool, write: bool = True,
          failover: bool = False, deadline: float = 30.0) -> dict:
    cls = SpreadEngine if spread else FailoverEngine if failover else FetchEngine
    out = {"ttft": [], "warmup": [], "queue": [], "fetch": [], "prefill": [], "cached_blocks": 0,
           "blocks": 0, "chunks": 0, "from_switch": 0, "replicas": 0, "from_pool": 0,
           "retransmits": 0, "byte_exact": True, "wrong_bytes": 0, "fetch_errors": 0,
           "recomputed_blocks": 0}
    writer = Writer(pools, chunk_size, ns, block_bytes, spread) if write else None
    with cls(pools, chunk_size, deadline=deadline) as eng:
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
            got = fetch_blocks(eng, ns, keys, failover)
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
