"""The vLLM connector's I/O (no vLLM import): one asyncio event loop in a daemon thread
("kvswitch-io") per process, holding one ``KVClient`` (one UDP socket) that every connector
instance of the process shares (in vLLM's single-process mode the scheduler's and the worker's).

It owns the probe, block fetches and the copy of fetched blocks into the paged cache as they
arrive (``drain``: what landed, what failed and why), background saves, their transfer totals
and a bounded log of events the connector records (per request: what the probe found, what a
load moved and from where).
The engine's threads call in synchronously (``probe``), get results through a queue
(``fetch``) or do not wait at all (``save``: the bytes were already copied out of the cache).

The probe is a GET of chunk 0 of each block, all in flight at once, in chain order: the answer
is the longest prefix of blocks whose chunk 0 came back (a NACK, a refusal or a short probe
deadline ends the prefix). It goes through the switch like any GET, so a hot prefix is probed
at the switch. Whole-block GETs go through ``getter``: anything with ``KVClient.get_block``'s
signature returning ``(block, TransferStats)``, the block a buffer or an object with a
zero-copy ``view`` and ``release()``: the XDP fetch engine's client (``hostagent.inference.fetch``),
opened when the worker registers its KV cache (``open_getter``: the program compiles in the
background, not in a request's load), or the asyncio client where the engine cannot run (or with
``fetch_engine: "off"``).

A pool node that does not answer must not stall serving: the clients' one ``Placement``
(``hostagent.common.pools``: ``replicas`` holders per block, ``shared_store`` for pool nodes on
one Mooncake Store) moves a transfer left unanswered for ``silence_s`` on to the block's next
holder and leaves the silent node out for a back-off that doubles while it keeps failing
(``retry_s`` .. 60 s). Meanwhile probes say miss for blocks no answering node holds (the
scheduler does not wait: requests recompute) and saves no answering node would hold are dropped
and counted; one log line when a node goes, one when it answers again.
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

from hostagent.common.pools import Placement
from hostagent.common.transfer import BlockNotFound, Refused, TransferStats, unreachable
from ..client import KVClient
from .paged_kv import PagedKV
from .vllm_blocks import LoadSpec, Settings

log = logging.getLogger("vllm.kvswitch")       # under "vllm": vLLM's handler prints it


class PoolBackend:
    """The pool as the connector sees it. Thread-safe; results of its loop thread only."""

    def __init__(self, settings: Settings):
        self.settings = s = settings
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="kvswitch-io",
                                        daemon=True)
        self._thread.start()
        self.keyring = s.keyring()          # the key file's, else the process's (None: off)
        self.placement = Placement(s.pools, s.replicas, s.shared_store, s.retry_s, s.silence_s,
                                   log)
        self.client = KVClient(self.placement, s.chunk_size, s.window, s.deadline,
                               auth=self.keyring)
        self._call(self.client.__aenter__(), 10)
        # Whole-block GETs: the XDP fetch engine where it can run, opened by the worker
        # (open_getter; in vLLM's two-process layout the scheduler only probes)
        self.getter = self.client if s.fetch_engine == "off" else None
        self._opening: asyncio.Future | None = None           # the I/O thread's only
        self.totals = {op: TransferStats() for op in ("probe", "load", "save")}
        self.events: collections.deque[dict] = collections.deque(maxlen=4096)
        self.save_refused = self.save_failed = self.save_dropped = self.save_shed = 0
        self.saved_blocks = 0
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
        return self._call(self._probe(ns, keys), self.settings.probe_deadline + 5)

    async def _probe(self, ns: int, keys: list[bytes]) -> tuple[int, TransferStats]:
        stats, start = TransferStats(), time.monotonic()
        found, sem, tasks = len(keys), asyncio.Semaphore(self.settings.probe_window), []

        async def one(i: int) -> None:
            nonlocal found
            async with sem:
                if i > found:
                    return
                if not self.placement.readable(ns, keys[i]):
                    self.placement.skipped += 1
                    found = min(found, i)
                    return
                try:
                    await self.client.first_chunk(ns, keys[i], stats,
                                                  self.settings.probe_deadline)
                except Exception as exc:       # unconfirmed: the prefix ends here
                    if not isinstance(exc, BlockNotFound) and not unreachable(exc):
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
                    getter = self.getter or await self._getter()
                    get = getattr(getter, "get_block_view", getter.get_block)
                    data, stats = await get(ns, keys[i], nchunks=nchunks)
                except Exception as exc:          # reported to vLLM as a load error
                    failed = min(failed, i)
                    q.put((i, exc, None))
                    return
                self.totals["load"].add(stats, seconds=True)
                q.put((i, data, stats))

        await asyncio.gather(*(one(i) for i in range(len(keys))))

    def open_getter(self) -> None:
        """Start opening the block getter now (the worker, at start-up), so that no request's
        load waits for the fetch engine's program to compile."""
        if self.getter is None:
            asyncio.run_coroutine_threadsafe(self._getter(), self.loop)

    async def _getter(self):
        """The block getter, opened once (loads arriving while it opens wait for it)."""
        if self.getter is None:
            if self._opening is None:
                self._opening = asyncio.ensure_future(self._open_engine())
            await asyncio.shield(self._opening)
        return self.getter

    async def _open_engine(self):
        """The fetch engine's client (zero-copy blocks), else the asyncio client; one log
        line says which fetches blocks."""
        if self.getter is None:
            from hostagent.inference.fetch import AsyncFetchClient, FetchEngine, NoXdp
            s = self.settings
            c = AsyncFetchClient(FetchEngine(self.placement, s.chunk_size, deadline=s.deadline,
                                             auth=self.keyring), s.window, s.deadline, owns=True)
            try:
                self.getter = await c.__aenter__()
                log.warning("kvswitch: the XDP fetch engine on %s fetches blocks",
                            c.engine.ifname)
            except NoXdp as exc:
                self.getter = self.client
                log.warning("kvswitch: the asyncio client fetches blocks (%s)", exc)
        return self.getter

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
            async with sem:
                if not self.placement.writable(ns, key):
                    self.save_dropped += 1     # a lost save is a future miss, never an error
                    return
                try:
                    part = await self.client.put_block(ns, key, data)
                    self.totals["save"].add(part, seconds=True)
                    self.saved_blocks += 1
                except Refused as exc:     # stored already, with other bits: keep the pool's
                    self.save_refused += 1
                    log.info("kvswitch: PUT of %s refused: %s", key.hex(), exc)
                except Exception as exc:   # a lost save is a future miss, never an error
                    self.save_failed += 1
                    if not unreachable(exc):
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
            if not _is_buffer(data) and hasattr(data, "release"):
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
        if part is not None and not _is_buffer(data) and hasattr(data, "release"):
            data.release()


def drain_load(ld: LoadSpec, q: queue.SimpleQueue, paged: PagedKV,
               timeout: float) -> tuple[int, TransferStats, str | None]:
    """``drain`` as (leading blocks loaded, summed transfer stats, first error)."""
    out = drain(ld, q, paged, timeout)
    return out.loaded, out.stats, out.error


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
           settings.probe_window, settings.deadline, settings.probe_deadline, settings.retry_s,
           settings.silence_s, settings.replicas, settings.shared_store,
           settings.max_pending_save_mib, settings.fetch_engine, settings.auth_key_file)
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
