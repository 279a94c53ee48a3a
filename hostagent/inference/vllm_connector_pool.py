"""The vLLM connector's I/O (no vLLM import): one asyncio event loop in a daemon thread
("kvswitch-io") per process, holding one ``KVClient`` (one UDP socket) that every connector
instance of the process shares (in vLLM's single-process mode the scheduler's and the worker's).

It owns the probe, block fetches and the copy of fetched blocks into the paged cache as they
arrive (``drain_load``), background saves, their transfer totals and a bounded log of events
the connector records (per request: what the probe found, what a load moved and from where).
The engine's threads call in synchronously (``probe``), get results through a queue
(``fetch``) or do not wait at all (``save``: the bytes were already copied out of the cache).

The probe is a GET of chunk 0 of each block, all in flight at once, in chain order: the answer
is the longest prefix of blocks whose chunk 0 came back (a NACK, a refusal or a short probe
deadline ends the prefix). It goes through the switch like any GET, so a hot prefix is probed
at the switch. Whole-block GETs go through ``getter``: anything with ``KVClient.get_block``'s
signature returning ``(block, TransferStats)``, the block a buffer or an object with a
zero-copy ``view`` and ``release()``: the XDP fetch engine's client (``hostagent.inference.fetch``),
opened at the first load, or the asyncio client where the engine cannot run (or with
``fetch_engine: "off"``).
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

from hostagent.common.transfer import BlockNotFound, Refused, TransferStats
from .client import KVClient
from .vllm_connector_blocks import LoadSpec, PoolLayout, Settings, write_block

log = logging.getLogger("vllm.kvswitch")       # under "vllm": vLLM's handler prints it

PROBE_DEADLINE = 2.0                            # seconds: a probe must not stall the scheduler


class PoolBackend:
    """The pool as the connector sees it. Thread-safe; results of its loop thread only."""

    def __init__(self, settings: Settings):
        self.settings = s = settings
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="kvswitch-io",
                                        daemon=True)
        self._thread.start()
        self.client = KVClient(list(s.pools), s.chunk_size, s.window, s.deadline)
        self._call(self.client.__aenter__(), 10)
        # Whole-block GETs: the XDP fetch engine where it can run, opened at the first load
        # (in vLLM's two-process layout the worker loads; the scheduler only probes)
        self.getter = self.client if s.fetch_engine == "off" else None
        self.totals = {op: TransferStats() for op in ("probe", "load", "save")}
        self.events: collections.deque[dict] = collections.deque(maxlen=4096)
        self.save_refused = self.save_failed = 0
        self._saves: set[concurrent.futures.Future] = set()
        self._pending = 0
        self._cond = threading.Condition()

    def _call(self, coro, timeout: float | None = None):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def record(self, **event) -> None:
        event["t"] = time.time()
        self.events.append(event)

    # ---- probe ---------------------------------------------------------------------------
    def probe(self, ns: int, keys: list[bytes]) -> tuple[int, TransferStats]:
        """How many leading ``keys`` the pool (or the switch) has; the probe's transfer stats."""
        if not keys:
            return 0, TransferStats()
        return self._call(self._probe(ns, keys), PROBE_DEADLINE + 5)

    async def _probe(self, ns: int, keys: list[bytes]) -> tuple[int, TransferStats]:
        stats, start = TransferStats(), time.monotonic()
        found, sem, tasks = len(keys), asyncio.Semaphore(self.settings.probe_window), []

        async def one(i: int) -> None:
            nonlocal found
            async with sem:
                if i > found:
                    return
                try:
                    await self.client.first_chunk(ns, keys[i], stats, PROBE_DEADLINE)
                except Exception as exc:       # unconfirmed: the prefix ends here
                    if not isinstance(exc, BlockNotFound):
                        log.warning("kvswitch: probe of block %d failed: %s", i, exc)
                    found = min(found, i)
                    for t in tasks[i + 1:]:
                        t.cancel()

        tasks.extend(asyncio.create_task(one(i)) for i in range(len(keys)))
        await asyncio.gather(*tasks, return_exceptions=True)
        stats.seconds = time.monotonic() - start
        self.totals["probe"].add(stats, seconds=True)
        return found, stats

    # ---- loads ---------------------------------------------------------------------------
    def fetch(self, ns: int, keys: list[bytes], nchunks: int) -> queue.SimpleQueue:
        """Start fetching ``keys`` (``concurrency`` blocks in flight, in chain order). The
        queue yields one ``(index, buffer | exception | None, stats | None)`` per key as blocks
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
                    getter = self.getter or await self._open_engine()
                    get = getattr(getter, "get_block_view", getter.get_block)
                    data, stats = await get(ns, keys[i], nchunks=nchunks)
                except Exception as exc:          # reported to vLLM as a load error
                    failed = min(failed, i)
                    q.put((i, exc, None))
                    return
                self.totals["load"].add(stats, seconds=True)
                q.put((i, data, stats))

        await asyncio.gather(*(one(i) for i in range(len(keys))))

    async def _open_engine(self):
        """The fetch engine's client (zero-copy blocks), else the asyncio client; one log
        line says which fetches blocks."""
        if self.getter is None:
            from hostagent.inference.fetch import AsyncFetchClient, FetchEngine, NoXdp
            s = self.settings
            c = AsyncFetchClient(FetchEngine(list(s.pools), s.chunk_size, deadline=s.deadline),
                                 s.window, s.deadline, owns=True)
            try:
                self.getter = await c.__aenter__()
                log.warning("kvswitch: the XDP fetch engine on %s fetches blocks",
                            c.engine.ifname)
            except NoXdp as exc:
                self.getter = self.client
                log.warning("kvswitch: the asyncio client fetches blocks (%s)", exc)
        return self.getter

    # ---- saves ---------------------------------------------------------------------------
    def save(self, ns: int, keys: list[bytes], blocks: list[bytes]) -> None:
        """Put blocks in the background (already copied: the paged cache may be reused). Waits
        only while more than ``max_pending_save_mib`` is unacknowledged."""
        nbytes = sum(len(b) for b in blocks)
        limit = self.settings.max_pending_save_mib << 20
        with self._cond:
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

    async def _save(self, ns: int, keys: list[bytes], blocks: list[bytes]) -> None:
        sem = asyncio.Semaphore(self.settings.concurrency)

        async def one(key: bytes, data: bytes) -> None:
            async with sem:
                try:
                    part = await self.client.put_block(ns, key, data)
                    self.totals["save"].add(part, seconds=True)
                except Refused as exc:     # stored already, with other bits: keep the pool's
                    self.save_refused += 1
                    log.info("kvswitch: PUT of %s refused: %s", key.hex(), exc)
                except Exception as exc:   # a lost save is a future miss, never an error
                    self.save_failed += 1
                    log.warning("kvswitch: PUT of %s failed: %s", key.hex(), exc)

        await asyncio.gather(*(one(k, b) for k, b in zip(keys, blocks)))

    def flush(self, timeout: float | None = 60) -> bool:
        """Wait for every save started so far; True if they all finished."""
        with self._cond:
            pending = list(self._saves)
        _, left = concurrent.futures.wait(pending, timeout)
        return not left

    def snapshot(self) -> dict:
        return {op: s.as_dict() for op, s in self.totals.items()} | {
            "save_refused": self.save_refused, "save_failed": self.save_failed}


def drain_load(ld: LoadSpec, q: queue.SimpleQueue, caches, layout: PoolLayout,
               timeout: float) -> tuple[int, TransferStats, str | None]:
    """Copy one load's blocks (from ``PoolBackend.fetch``'s queue) into the paged cache in the
    order they arrive. Returns how many leading blocks loaded (blocks from the first that
    failed, was refused by its size or never came within ``timeout`` on are not), the summed
    transfer stats and the first error."""
    stats, loaded, error, got = TransferStats(), len(ld.keys), None, set()
    for _ in ld.keys:
        try:
            i, data, part = q.get(timeout=timeout)
        except queue.Empty:              # the I/O thread is stuck: give the rest up
            return (min(loaded, min(set(range(len(ld.keys))) - got)), stats,
                    error or f"no block within {timeout:g} s")
        got.add(i)
        if part is None:                 # failed, or not asked for after a failure
            loaded, error = min(loaded, i), error or (repr(data) if data else None)
            continue
        try:
            write_block(_buffer(data), caches, layout, ld.targets[i])
        except ValueError as exc:
            loaded, error = min(loaded, i), error or str(exc)
        finally:
            if not _is_buffer(data) and hasattr(data, "release"):
                data.release()           # a zero-copy block: its slots may be reused now
        stats.add(part, seconds=True)
    return loaded, stats, error


def _is_buffer(data) -> bool:
    try:
        memoryview(data).release()
        return True
    except TypeError:
        return False


def _buffer(data):
    """A fetched block's bytes: ``data`` itself (bytes, memoryview, numpy), or the zero-copy
    ``view`` of a block object (the fetch engine's ``Block``, released once copied)."""
    return data if _is_buffer(data) else data.view


_BACKENDS: dict[tuple, PoolBackend] = {}
_LOCK = threading.Lock()


def backend_for(settings: Settings) -> PoolBackend:
    """The process's backend for these pools and transfer settings (made on first use)."""
    key = (settings.pools, settings.chunk_size, settings.window, settings.concurrency,
           settings.probe_window, settings.deadline, settings.max_pending_save_mib,
           settings.fetch_engine)
    with _LOCK:
        if key not in _BACKENDS:
            _BACKENDS[key] = PoolBackend(settings)
        return _BACKENDS[key]


def backends() -> list[PoolBackend]:
    """Every backend of this process (demos and tests read their totals and events)."""
    with _LOCK:
        return list(_BACKENDS.values())


@atexit.register
def _flush_at_exit() -> None:
    for b in backends():
        if not b.flush(30):
            log.warning("kvswitch: saves still unacknowledged at exit")
        if b.getter is not None and b.getter is not b.client:     # the engine's program off
            b._call(b.getter.__aexit__(None, None, None), 10)
