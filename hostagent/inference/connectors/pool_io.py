"""One way to the pool for every connector: a process's asyncio loop thread ("kvswitch-io" and
the like) holding the clients' one ``Placement`` (``hostagent.common.pools``: the nodes that
hold a block, and which of them answer), the asyncio ``KVClient`` (probes and PUTs) and the
block getter (the XDP fetch engine's client where the node can run it, ``fetch_engine: auto``,
else the asyncio client; opened once, in the background). Both getters offer
``get_block_view``, a ``Block`` either way.

The engines' threads call in with ``call`` (blocking), ``bounded`` (blocking, a fallback past a
timeout) or ``awaitable`` (from another event loop; ``await_on`` hands back a result whose
caller gave up). The calls every connector makes:

  prefix   how many leading blocks the pool (or the switch) has: a GET of each block's chunk 0,
           in flight at once in chain order, of holders that answered last time only (a
           suspect is asked again in the background, ``readable``); the first miss, refusal or
           silence ends the prefix and cancels the probes after it; a block no answering node
           holds is a miss at once;
  view     a whole block (``Block``; the caller releases it);
  put      a block to its holders (saved, refused as stored already, failed, or dropped
           because none of its holders answers now): never an exception.

``PoolIO.shared(settings)`` is the process's one instance per class and I/O settings (a vLLM
scheduler and worker of one process share theirs). The connectors add what their engine needs:
``connectors.store`` (LMCache, SGLang), ``connectors.vllm_pool`` (vLLM).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

from hostagent.common import auth as auth_mod
from hostagent.common.block import Block
from hostagent.common.pools import Placement
from hostagent.common.transfer import BlockNotFound, Refused, TransferStats, unreachable
from ..client import KVClient

# the settings a PoolIO reads (every connector's settings have them: options.common checks them)
IO_FIELDS = ("pools", "namespace", "chunk_size", "window", "concurrency", "deadline",
             "probe_deadline", "retry_s", "silence_s", "replicas", "shared_store",
             "fetch_engine", "auth_key_file")
SAVED, REFUSED, FAILED, DROPPED = "saved", "refused", "failed", "dropped"


async def await_on(loop: asyncio.AbstractEventLoop, coro,
                   abandoned: Callable[[Any], Any] | None = None):
    """``coro``'s result, run on ``loop`` (another thread's) and awaited from this one.

    A caller that is cancelled cancels ``coro`` too, but ``coro`` may finish in the meantime
    (the cancel reaches ``loop`` later), and asyncio then drops its result. Where that result
    holds something that must be given back (a MemoryObj), pass ``abandoned``: it is called
    with every result the caller never received, exactly once, on whichever thread learns
    second that the result exists and that the caller has gone."""
    if abandoned is None:
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, loop))
    lock, state = threading.Lock(), {"gone": False, "done": False, "result": None}

    async def run():
        result = await coro
        with lock:                   # no await between coro's end and this: a cancel from
            gone = state["gone"]     # the caller cannot come between them
            state["done"], state["result"] = True, result
        if gone:
            abandoned(result)
        return result

    try:
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(run(), loop))
    except asyncio.CancelledError:
        with lock:
            state["gone"] = True
            done, result = state["done"], state["result"]
        if done:                     # finished, but the result never reached the caller
            abandoned(result)
        raise


class PoolIO:
    """The pool for one set of I/O settings (module docstring). Thread-safe: every call runs
    on the loop thread."""
    thread_name = "kvswitch-io"
    log = logging.getLogger("kvswitch")
    arena_bytes = 64 << 20              # the fetch engine's first arena (it grows when full)
    _shared: dict[tuple, PoolIO] = {}
    _lock = threading.Lock()

    def __init__(self, settings):
        self.settings = s = settings
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=self.thread_name,
                                        daemon=True)
        self._thread.start()
        self.keyring = auth_mod.resolve(s.keyring())   # the key file's, else the process's
        self.placement = Placement(s.pools, s.replicas, s.shared_store, s.retry_s, s.silence_s,
                                   self.log)
        self.client = KVClient(self.placement, s.chunk_size, s.window, s.deadline,
                               auth=self.keyring)
        self.call(self.client.__aenter__(), 10)
        self.getter = self.client if s.fetch_engine == "off" else None
        self._opening: asyncio.Future | None = None       # the loop thread's only
        self._rechecks: set[asyncio.Task] = set()          # the loop thread's only

    @classmethod
    def key(cls, settings) -> tuple:
        """What makes two connectors' settings share one instance."""
        return tuple(getattr(settings, f) for f in IO_FIELDS)

    @classmethod
    def shared(cls, settings) -> PoolIO:
        """The process's instance of this class for ``settings`` (made on first use)."""
        key = (cls, cls.key(settings))
        with cls._lock:
            if key not in cls._shared:
                cls._shared[key] = cls(settings)
            return cls._shared[key]

    @classmethod
    def instances(cls) -> list[PoolIO]:
        with cls._lock:
            return [io for (kind, _), io in cls._shared.items() if issubclass(kind, cls)]

    # ---- calling in --------------------------------------------------------------------------
    def call(self, coro, timeout: float | None = None):
        """``coro``'s result, run on the loop thread (blocking the caller)."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def bounded(self, coro, timeout: float, fallback):
        """``coro``'s result on the loop thread, or ``fallback`` past ``timeout`` seconds."""
        fut = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return fut.result(timeout)
        except concurrent.futures.TimeoutError:
            fut.cancel()
            self.log.warning("kvswitch: the pool did not finish within %g s: treated as a "
                             "miss", timeout)
            return fallback

    async def awaitable(self, coro, abandoned: Callable[[Any], Any] | None = None):
        """Await ``coro`` (one of this object's coroutines) from another event loop; see
        ``await_on`` for ``abandoned``."""
        return await await_on(self.loop, coro, abandoned)

    # ---- the block getter --------------------------------------------------------------------
    def open_getter(self) -> None:
        """Start opening the block getter now (a worker at start-up), so that no request's
        load waits for the fetch engine's program to compile."""
        if self.getter is None:
            asyncio.run_coroutine_threadsafe(self.block_getter(), self.loop)

    async def block_getter(self):
        """The block getter, opened once (calls arriving while it opens wait for it)."""
        if self.getter is None:
            if self._opening is None:
                self._opening = asyncio.ensure_future(self._open_engine())
            await asyncio.shield(self._opening)
        return self.getter

    async def _open_engine(self):
        """The fetch engine's client, else the asyncio client; one log line says which."""
        from hostagent.inference.fetch import AsyncFetchClient, FetchEngine, NoXdp
        s = self.settings
        try:
            engine = FetchEngine(self.placement, s.chunk_size, deadline=s.deadline,
                                 arena_bytes=self.arena_bytes, auth=self.keyring)
            c = AsyncFetchClient(engine, s.window, s.deadline, owns=True)
            self.getter = await c.__aenter__()
            self.log.warning("kvswitch: the XDP fetch engine on %s fetches blocks",
                             engine.ifname)
        except Exception as exc:       # NoXdp, or anything else that keeps it from opening
            self.getter = self.client
            why = str(exc) if isinstance(exc, NoXdp) else f"{type(exc).__name__}: {exc}"
            self.log.warning("kvswitch: the asyncio client fetches blocks (%s)", why)
        return self.getter

    # ---- what connectors call (on the loop thread) --------------------------------------------
    def readable(self, ns: int, key: bytes) -> bool:
        """Whether a holder of the block answered last time (``Placement.readable``: a caller
        that must not wait asks only those). If none did, a holder past its back-off is asked
        again in the background (``KVClient.recheck``), so that such callers find it again once
        it answers."""
        if self.placement.readable(ns, key):
            return True
        if (addr := self.placement.due(ns, key)) is not None:
            task = asyncio.ensure_future(self.client.recheck(addr, ns, key))
            self._rechecks.add(task)
            task.add_done_callback(self._rechecks.discard)
        return False

    async def prefix(self, ns: int, keys: Sequence[bytes], window: int,
                     stats: TransferStats | None = None) -> int:
        """How many leading ``keys`` the pool (or the switch) has (module docstring)."""
        stats = TransferStats() if stats is None else stats
        found, sem, tasks = len(keys), asyncio.Semaphore(window), []
        deadline = self.settings.probe_deadline

        async def one(i: int) -> None:
            nonlocal found
            async with sem:
                if i > found:
                    return
                if not self.readable(ns, keys[i]):
                    self.placement.skipped += 1
                    found = min(found, i)
                    return
                try:
                    await self.client.first_chunk(ns, keys[i], stats, deadline, wary=True)
                except Exception as exc:       # unconfirmed: the prefix ends here
                    if not isinstance(exc, BlockNotFound) and not unreachable(exc):
                        self.log.warning("kvswitch: probe of block %s failed: %s",
                                         keys[i].hex(), exc)
                    found = min(found, i)
                    for t in tasks[i + 1:]:
                        t.cancel()

        tasks.extend(asyncio.create_task(one(i)) for i in range(len(keys)))
        await asyncio.gather(*tasks, return_exceptions=True)
        return found

    async def view(self, ns: int, key: bytes,
                   nchunks: int | None = None) -> tuple[Block, TransferStats]:
        """A whole block (the caller releases it); raises what the fetch raises."""
        getter = self.getter or await self.block_getter()
        return await getter.get_block_view(ns, key, nchunks)

    async def put(self, ns: int, key: bytes, data) -> tuple[str, TransferStats | None]:
        """PUT a block to its holders; never raises. The outcome: SAVED (with the PUT's
        stats), REFUSED (stored already, with other bits: the pool's copy stays), FAILED
        (logged, unless a silent node: that one line is the placement's) or DROPPED (no holder
        answers now: a future miss)."""
        if not self.placement.writable(ns, key):
            return DROPPED, None
        try:
            stats = await self.client.put_block(ns, key, data)
        except Refused as exc:
            self.log.info("kvswitch: PUT of %s refused: %s", key.hex(), exc)
            return REFUSED, None
        except Exception as exc:
            if not unreachable(exc):
                self.log.warning("kvswitch: PUT of %s failed: %s", key.hex(), exc)
            return FAILED, None
        return SAVED, stats

    def close(self) -> None:
        """Close the getter and the client, stop the loop thread."""
        async def shut():
            if self.getter is not None and self.getter is not self.client:
                await self.getter.__aexit__(None, None, None)
            await self.client.__aexit__(None, None, None)
        try:
            self.call(shut(), 10)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
