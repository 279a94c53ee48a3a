"""The vLLM connector's I/O (no vLLM import), over the connectors' one ``PoolIO`` (its loop
thread "kvswitch-io", placement, clients and block getter, ``pool_io``) that every connector
instance of the process shares (in vLLM's single-process mode the scheduler's and the worker's).

It adds the probe with its transfer stats, block fetches and the copy of fetched blocks into
the paged cache as they arrive (``drain``: what landed, what failed and why), background saves
with back-pressure, their transfer totals and a bounded log of events the connector records
(per request: what the probe found, what a load moved and from where). The engine's threads
call in synchronously (``probe``), get results through a queue (``fetch``) or do not wait at
all (``save``: the bytes were already copied out of the cache).

The probe is ``PoolIO.prefix``: it goes through the switch like any GET, so a hot prefix is
probed at the switch. Whole blocks come from the block getter, opened when the worker registers
its KV cache (``open_getter``: the fetch engine's program compiles in the background, not in a
request's load; in vLLM's two-process layout the scheduler only probes).

A pool node that does not answer must not stall serving: the placement (``replicas`` holders per
block, ``shared_store`` for pool nodes on one Mooncake Store) moves a transfer left unanswered
for ``silence_s`` on to the block's next holder and leaves the silent node out for a back-off
that doubles while it keeps failing (``retry_s`` .. 60 s). Meanwhile probes say miss for blocks
no answering node holds (the scheduler does not wait: requests recompute) and saves no answering
node would hold are dropped and counted; one log line when a node goes, one when it is back.
"""
from __future__ import annotations

import asyncio
import atexit
import collections
import concurrent.futures
import logging
import queue
import threading
import time
from dataclasses import dataclass, field

from hostagent.common.block import Block
from hostagent.common.transfer import BlockNotFound, TransferStats
from .paged_kv import PagedKV
from .pool_io import DROPPED, FAILED, REFUSED, SAVED, PoolIO
from .vllm_blocks import LoadSpec, Settings

log = logging.getLogger("vllm.kvswitch")       # under "vllm": vLLM's handler prints it


class PoolBackend(PoolIO):
    """The pool as the connector sees it. Thread-safe; results of its loop thread only."""
    log = log
    arena_bytes = 256 << 20

    def __init__(self, settings: Settings):
        super().__init__(settings)
        self.totals = {op: TransferStats() for op in ("probe", "load", "save")}
        self.events: collections.deque[dict] = collections.deque(maxlen=4096)
        self.save_refused = self.save_failed = self.save_dropped = self.save_shed = 0
        self.saved_blocks = 0
        self._saves: set[concurrent.futures.Future] = set()
        self._pending = 0
        self._cond = threading.Condition()

    @classmethod
    def key(cls, settings: Settings) -> tuple:
        return super().key(settings) + (settings.probe_window, settings.max_pending_save_mib)

    def record(self, **event) -> None:
        event["t"] = time.time()
        self.events.append(event)

    # ---- probe ---------------------------------------------------------------------------
    def probe(self, ns: int, keys: list[bytes]) -> tuple[int, TransferStats]:
        """How many leading ``keys`` the pool (or the switch) has; the probe's transfer stats."""
        if not keys:
            return 0, TransferStats()
        return self.call(self._probe(ns, keys), self.settings.probe_deadline + 5)

    async def _probe(self, ns: int, keys: list[bytes]) -> tuple[int, TransferStats]:
        stats, start = TransferStats(), time.monotonic()
        found = await self.prefix(ns, keys, self.settings.probe_window, stats)
        stats.seconds = time.monotonic() - start
        self.totals["probe"].add(stats, seconds=True)
        return found, stats

    # ---- loads ---------------------------------------------------------------------------
    def fetch(self, ns: int, keys: list[bytes], nchunks: int) -> queue.SimpleQueue:
        """Start fetching ``keys`` (``concurrency`` blocks in flight, in chain order). The
        queue yields one ``(index, Block | exception | None, stats | None)`` per key as blocks
        complete; after a failure later blocks are not asked for (None)."""
        q: queue.SimpleQueue = queue.SimpleQueue()
        asyncio.run_coroutine_threadsafe(self._fetch(ns, keys, nchunks, q), self.loop)
        return q

    async def _fetch(self, ns: int, keys: list[bytes], nchunks: int,
                     q: queue.SimpleQueue) -> None:
        failed, sem = len(keys), asyncio.Semaphore(self.settings.concurrency)

        async def one(i: int) -> None:
            nonlocal failed
            async with sem:
                if i > failed:
                    q.put((i, None, None))
                    return
                try:
                    data, stats = await self.view(ns, keys[i], nchunks)
                except Exception as exc:          # reported to vLLM as a load error
                    failed = min(failed, i)
                    q.put((i, exc, None))
                    return
                self.totals["load"].add(stats, seconds=True)
                q.put((i, data, stats))

        await asyncio.gather(*(one(i) for i in range(len(keys))))

    # ---- saves ---------------------------------------------------------------------------
    def save(self, ns: int, keys: list[bytes], blocks: list[bytes], wait: bool = True) -> bool:
        """Put blocks in the background (already copied: the paged cache may be reused). Waits
        only while more than ``max_pending_save_mib`` is unacknowledged; without ``wait`` the
        blocks are shed instead (``save_shed``: a future miss). False when shed."""
        nbytes = sum(len(b) for b in blocks)
        limit = self.settings.max_pending_save_mib << 20
        with self._cond:
            if not wait and self._pending and self._pending + nbytes > limit:
                self.save_shed += len(keys)
                return False
            self._cond.wait_for(lambda: not self._pending or self._pending + nbytes <= limit)
            self._pending += nbytes
        fut = asyncio.run_coroutine_threadsafe(self._save(ns, keys, blocks), self.loop)
        with self._cond:
            self._saves.add(fut)

        def done(f: concurrent.futures.Future) -> None:
            with self._cond:
                self._saves.discard(f)
                self._pending -= nbytes
                self._cond.notify_all()
        fut.add_done_callback(done)
        return True

    async def _save(self, ns: int, keys: list[bytes], blocks: list[bytes]) -> None:
        sem = asyncio.Semaphore(self.settings.concurrency)

        async def one(key: bytes, data: bytes) -> None:
            async with sem:                # a lost save is a future miss, never an error
                outcome, part = await self.put(ns, key, data)
            if outcome == SAVED:
                self.totals["save"].add(part, seconds=True)
                self.saved_blocks += 1
            else:
                self.save_refused += outcome == REFUSED
                self.save_failed += outcome == FAILED
                self.save_dropped += outcome == DROPPED

        await asyncio.gather(*(one(k, b) for k, b in zip(keys, blocks)))

    def flush(self, timeout: float | None = 60) -> bool:
        """Wait for every save started so far; True if they all finished."""
        with self._cond:
            pending = list(self._saves)
        _, left = concurrent.futures.wait(pending, timeout)
        return not left

    def snapshot(self) -> dict:
        return {op: s.as_dict() for op, s in self.totals.items()} | {
            "save_refused": self.save_refused, "save_failed": self.save_failed,
            "save_dropped": self.save_dropped, "save_shed": self.save_shed,
            "saved_blocks": self.saved_blocks, "probes_skipped": self.placement.skipped}


@dataclass
class LoadOutcome:
    """What one load did (``drain``): how many leading blocks were written, the summed transfer
    stats, the first error, blocks that failed by why (``not_cached``: the pool node or the
    switch no longer had it; ``read_failed``: anything else, a timeout, a refusal, a block of
    the wrong size), and the leading blocks by where their chunks came from (``switch``: every
    chunk from the switch, its cache or a replica of another reader's fetch; ``pool``: every
    chunk from the pool node; ``both``)."""
    loaded: int
    stats: TransferStats = field(default_factory=TransferStats)
    error: str | None = None
    failures: dict[str, int] = field(default_factory=dict)
    sources: dict[str, int] = field(default_factory=dict)
    left: int = 0                      # blocks given up on before they came (still to come)


def drain(ld: LoadSpec, q: queue.SimpleQueue, paged: PagedKV, timeout: float,
          overall: float | None = None) -> LoadOutcome:
    """Copy one load's blocks (from ``PoolBackend.fetch``'s queue) into the paged cache in the
    order they arrive. Blocks from the first that failed, was refused by its size or did not
    come (within ``timeout`` of the one before, or ``overall`` seconds of the start) on are not
    loaded; a block that comes after that is not written (``discard``)."""
    n, out, got, sources = len(ld.keys), LoadOutcome(len(ld.keys)), set(), {}
    end = time.monotonic() + overall if overall is not None else None

    def fail(i: int, why: str, error: str | None) -> None:
        out.loaded, out.error = min(out.loaded, i), out.error or error
        out.failures[why] = out.failures.get(why, 0) + 1

    while len(got) < n:
        wait = timeout if end is None else min(timeout, end - time.monotonic())
        try:
            i, data, part = q.get(timeout=max(0.0, wait))
        except queue.Empty:              # stuck, or too slow: give the rest up
            why = (f"no block within {timeout:g} s" if end is None or wait == timeout else
                   f"the load took over {overall:g} s")
            for i in sorted(set(range(n)) - got):
                fail(i, "read_failed", why)
            break
        got.add(i)
        if part is None:                 # failed, or not asked for after a failure
            if data is None:
                out.loaded = min(out.loaded, i)
            else:
                fail(i, "not_cached" if isinstance(data, BlockNotFound) else "read_failed",
                     repr(data))
            continue
        try:
            if i < out.loaded:
                paged.write(_buffer(data), ld.targets[i])
        except ValueError as exc:
            fail(i, "read_failed", str(exc))
        finally:
            if isinstance(data, Block):
                data.release()           # a zero-copy block: its slots may be reused now
        out.stats.add(part, seconds=True)
        sources[i] = ("pool" if not part.from_switch + part.replicas else
                      "switch" if not part.from_pool else "both")
    for i in range(out.loaded):
        out.sources[sources[i]] = out.sources.get(sources[i], 0) + 1
    out.left = n - len(got)
    return out


def discard(q: queue.SimpleQueue, left: int, timeout: float) -> None:
    """Release the zero-copy blocks of a load given up on as they still come (``left`` of them,
    until nothing came for ``timeout`` seconds): the fetch engine's slots are not leaked."""
    for _ in range(left):
        try:
            _, data, part = q.get(timeout=timeout)
        except queue.Empty:
            return
        if part is not None and isinstance(data, Block):
            data.release()


def drain_load(ld: LoadSpec, q: queue.SimpleQueue, paged: PagedKV,
               timeout: float) -> tuple[int, TransferStats, str | None]:
    """``drain`` as (leading blocks loaded, summed transfer stats, first error)."""
    out = drain(ld, q, paged, timeout)
    return out.loaded, out.stats, out.error


def _buffer(data):
    """A fetched block's bytes: a ``Block``'s zero-copy view (released once copied), or
    ``data`` itself (bytes-like)."""
    return data.view if isinstance(data, Block) else data


def backend_for(settings: Settings) -> PoolBackend:
    """The process's backend for these pools and transfer settings (made on first use)."""
    return PoolBackend.shared(settings)


def backends() -> list[PoolBackend]:
    """Every backend of this process (demos and tests read their totals and events)."""
    return PoolBackend.instances()


@atexit.register
def _flush_at_exit() -> None:
    for b in backends():
        if not b.flush(30):
            log.warning("kvswitch: saves still unacknowledged at exit")
        if b.getter is not None and b.getter is not b.client:     # the engine's program off
            b.call(b.getter.__aexit__(None, None, None), 10)
