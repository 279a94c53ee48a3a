"""The pool as the LMCache plugin and the SGLang HiCache backend see it (neither imported here):
their options checked (``StoreSettings``), their keys mapped to block keys (``store_key``) and
one asyncio loop thread per process ("kvswitch-store-io") holding the client (``StoreIO``).

Keys. LMCache and SGLang name a chunk or page by a string of their own (LMCache's
``CacheEngineKey.to_string()``: model, world size, worker, chained token hash, dtype; SGLang's
chained page hash). A block key is

    SHA-256(STORE_DOMAIN || len(model) || model || len(layout) || layout || len(name) || name)[:16]

(lengths u32 little-endian), where ``layout`` says how the bytes are laid out (shapes, dtypes,
memory format, parallel rank, ...), so engines share a block only under the same model id and
layout. ``STORE_DOMAIN`` differs from ``hostagent.common.hashing``'s prefix and passage domains,
so a store key never equals a key of the other connectors unless SHA-256 collides. A pure
function of its arguments: the same in every process (no ``hash()``).

I/O. Existence is a GET of chunk 0 alone (``KVClient.first_chunk``: the chunk is not moved
beyond the first one), whole blocks come through the XDP fetch engine where the node can run it
(``fetch_engine: auto``, else the asyncio client) and go to the pool with the asyncio client,
awaited. Which nodes hold a block and which answer is the clients' one ``Placement``
(``hostagent.common.pools``: ``replicas``, ``shared_store``, ``silence_s``, ``retry_s``): a
transfer left unanswered moves on to the block's next holder, a silent node is left out for a
back-off (one log line when it goes, one when it is back); while no node holding a block
answers, it is a miss and writes of it are dropped, never an exception into the engine.
Every call is bounded: ``probe_deadline`` for existence, ``deadline`` for a block.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import hashlib
import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from hostagent.common import auth as auth_mod
from hostagent.common.transfer import BlockNotFound, Refused
from kvproto import DEFAULT_CHUNK
from . import options as options_mod
from ..client import KVClient
from hostagent.common.pools import Placement
from hostagent.common.transfer import unreachable

log = logging.getLogger("kvswitch.store")

STORE_DOMAIN = b"kvpool/store/v1"


def store_key(model: str, layout: str, name: str | bytes) -> bytes:
    """The 16-byte block key of an engine's chunk or page ``name`` (module docstring)."""
    parts = [model.encode(), layout.encode(), name.encode() if isinstance(name, str) else name]
    h = hashlib.sha256(STORE_DOMAIN)
    for p in parts:
        h.update(len(p).to_bytes(4, "little"))
        h.update(p)
    return h.digest()[:16]


# ---- options ---------------------------------------------------------------------------------
class StoreConfigError(ValueError):
    """A bad option: one line that names it (``key`` None: the options as a whole)."""

    def __init__(self, where: str, key: str | None, why: str):
        super().__init__(f"kvswitch {where}: " + (f"option {key!r}: " if key else "") + why)
        self.key = key


@dataclass(frozen=True)
class StoreSettings:
    """The options both stores take. Only ``pools`` is required."""
    pools: tuple[str, ...]
    namespace: int = options_mod.DEFAULT_NS   # 0..2^32-1, as every connector's (options)
    chunk_size: int = DEFAULT_CHUNK    # must be the switch's --chunk-size for hits
    window: int = 64                   # chunks in flight per block
    concurrency: int = 16              # blocks (or probes) in flight per batch
    deadline: float = 10.0             # seconds for one block (at least options.MIN_DEADLINE)
    probe_deadline: float = 2.0        # seconds for one existence probe (the same)
    retry_s: float = 5.0               # a silent pool node is asked again after this (doubling)
    silence_s: float = 1.0             # a transfer unanswered this long asks the next holder
    replicas: int = 1                  # pool nodes holding each block (1..len(pools))
    shared_store: bool = False         # pool nodes on one Mooncake Store: any node reads any
    model_id: str | None = None        # names the weights in every key; default: the engine's
    fetch_engine: str = "auto"         # auto: the XDP fetch engine where it can run; off
    auth_key_file: str | None = None   # keyed authentication (hostagent/common/auth.py)

    @classmethod
    def from_options(cls, options: Mapping[str, Any], where: str) -> StoreSettings:
        """Checked settings (``hostagent.inference.connectors.options``, the checks every connector
        shares); StoreConfigError names the first bad option (unknown, of the wrong type, out
        of range, an address that does not resolve or is no node's, a key file that cannot be
        used or has no key for the namespace)."""
        try:
            opts = options_mod.mapping(options, "the options")
            options_mod.known(opts, cls.__dataclass_fields__)
            pools = options_mod.common(
                opts, {"window": (1, 1 << 16), "concurrency": (1, 4096)},
                '"IP[:PORT],..."', {"fetch_engine": ("auto", "off")})
        except options_mod.BadOption as exc:
            raise StoreConfigError(where, exc.key, exc.why) from None
        return cls(**{**opts, "pools": pools})

    def keyring(self):
        """The client's ``auth``: the key file's keyring, else the process's (None: off)."""
        return auth_mod.keyring_for(self.namespace, self.auth_key_file)


# ---- I/O -------------------------------------------------------------------------------------
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


class StoreIO:
    """Blocking and awaitable calls into the pool, run on one I/O thread. Thread-safe."""

    def __init__(self, settings: StoreSettings):
        self.settings = s = settings
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="kvswitch-store-io",
                                        daemon=True)
        self._thread.start()
        self.keyring = auth_mod.resolve(s.keyring())
        self.placement = Placement(s.pools, s.replicas, s.shared_store, s.retry_s, s.silence_s,
                                   log)
        self.client = KVClient(self.placement, s.chunk_size, s.window, s.deadline,
                               auth=self.keyring)
        self._call(self.client.__aenter__(), 10)
        self.getter = self.client if s.fetch_engine == "off" else None
        self._opening: asyncio.Future | None = None
        self.counts = {"hits": 0, "misses": 0, "puts": 0, "put_failed": 0, "skipped": 0}

    def _call(self, coro, timeout: float | None):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def _bounded(self, coro, timeout: float, fallback):
        """``coro``'s result on the I/O thread, or ``fallback`` past ``timeout`` seconds."""
        fut = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return fut.result(timeout)
        except concurrent.futures.TimeoutError:
            fut.cancel()
            log.warning("kvswitch: the pool did not finish within %g s: treated as a miss",
                        timeout)
            return fallback

    async def awaitable(self, coro, abandoned: Callable[[Any], Any] | None = None):
        """Await ``coro`` (one of the ``_`` coroutines) from another event loop; see
        ``await_on`` for ``abandoned``."""
        return await await_on(self.loop, coro, abandoned)

    # ---- existence (chunk 0 alone) ---------------------------------------------------------
    async def _exists(self, ns: int, key: bytes) -> bool:
        if not self.placement.readable(ns, key):
            self.counts["skipped"] += 1
            return False
        try:
            await self.client.first_chunk(ns, key, deadline=self.settings.probe_deadline)
        except BlockNotFound:
            return False
        except Exception as exc:
            if not unreachable(exc):
                log.warning("kvswitch: probe of %s failed: %s", key.hex(), exc)
            return False
        return True

    async def _prefix(self, ns: int, keys: Sequence[bytes]) -> int:
        """How many leading ``keys`` the pool has (probes in flight at once; the first miss
        cancels the probes after it)."""
        found, sem = len(keys), asyncio.Semaphore(self.settings.concurrency)

        async def one(i: int) -> None:
            nonlocal found
            async with sem:
                if i < found and not await self._exists(ns, keys[i]):
                    found = min(found, i)

        await asyncio.gather(*(one(i) for i in range(len(keys))))
        return found

    def prefix(self, ns: int, keys: Sequence[bytes]) -> int:
        if not keys:
            return 0
        return self._bounded(self._prefix(ns, list(keys)),
                             self.settings.probe_deadline * (1 + len(keys)) + 5, 0)

    def exists(self, ns: int, key: bytes) -> bool:
        return self._bounded(self._exists(ns, key), self.settings.probe_deadline + 5, False)

    # ---- whole blocks ----------------------------------------------------------------------
    async def _get(self, ns: int, key: bytes, sink: Callable[[memoryview], Any] = bytes):
        """``sink(view of the block)`` (on the I/O thread), or None for a miss or a failure."""
        if not self.placement.readable(ns, key):
            self.counts["skipped"] += 1
            return None
        try:
            getter = self.getter or await self._open_getter()
            if hasattr(getter, "get_block_view"):
                blk, _ = await getter.get_block_view(ns, key)
                try:
                    out = sink(memoryview(blk.view).cast("B"))
                finally:
                    blk.release()
            else:
                data, _ = await getter.get_block(ns, key)
                out = sink(memoryview(data))
        except BlockNotFound:
            self.counts["misses"] += 1
            return None
        except Exception as exc:
            if not unreachable(exc):
                log.warning("kvswitch: GET of %s failed: %s", key.hex(), exc)
            self.counts["misses"] += 1
            return None
        self.counts["hits"] += 1
        return out

    async def _get_many(self, ns: int, keys: Sequence[bytes], sinks: Sequence[Callable]):
        sem = asyncio.Semaphore(self.settings.concurrency)

        async def one(key, sink):
            async with sem:
                return await self._get(ns, key, sink)

        return await asyncio.gather(*(one(k, s) for k, s in zip(keys, sinks)))

    def get_many(self, ns: int, keys: Sequence[bytes], sinks: Sequence[Callable]) -> list:
        """Each block through its sink (None where missing); bounded by the deadline."""
        if not keys:
            return []
        waves = -(-len(keys) // self.settings.concurrency)
        return self._bounded(self._get_many(ns, list(keys), list(sinks)),
                             self.settings.deadline * (1 + waves) + 5, [None] * len(keys))

    async def _put(self, ns: int, key: bytes, data) -> bool:
        if not self.placement.writable(ns, key):
            self.counts["skipped"] += 1
            return False        # a lost write is a future miss, never an error
        try:
            await self.client.put_block(ns, key, data)
        except Refused as exc:  # stored already, with other bits: the pool's copy stays
            log.info("kvswitch: PUT of %s refused: %s", key.hex(), exc)
            return False
        except Exception as exc:
            self.counts["put_failed"] += 1
            if not unreachable(exc):
                log.warning("kvswitch: PUT of %s failed: %s", key.hex(), exc)
            return False
        self.counts["puts"] += 1
        return True

    async def _put_many(self, ns: int, keys: Sequence[bytes], blocks: Sequence) -> list[bool]:
        sem = asyncio.Semaphore(self.settings.concurrency)

        async def one(key, data):
            async with sem:
                return await self._put(ns, key, data)

        return list(await asyncio.gather(*(one(k, b) for k, b in zip(keys, blocks))))

    def put_many(self, ns: int, keys: Sequence[bytes], blocks: Sequence) -> list[bool]:
        if not keys:
            return []
        waves = -(-len(keys) // self.settings.concurrency)
        return self._bounded(self._put_many(ns, list(keys), list(blocks)),
                             self.settings.deadline * (1 + waves) + 5, [False] * len(keys))

    async def _open_getter(self):
        """The block getter, opened once: the fetch engine's client, else the asyncio client
        (one log line says which)."""
        if self.getter is None:
            if self._opening is None:
                self._opening = asyncio.ensure_future(self._open_engine())
            await asyncio.shield(self._opening)
        return self.getter

    async def _open_engine(self):
        from hostagent.inference.fetch import AsyncFetchClient, FetchEngine, NoXdp
        s = self.settings
        try:
            engine = FetchEngine(self.placement, s.chunk_size, deadline=s.deadline,
                                 arena_bytes=64 << 20, auth=self.keyring)
            c = AsyncFetchClient(engine, s.window, s.deadline, owns=True)
            self.getter = await c.__aenter__()
            log.warning("kvswitch: the XDP fetch engine on %s fetches blocks", engine.ifname)
        except Exception as exc:       # NoXdp, or anything else that keeps it from opening
            self.getter = self.client
            why = str(exc) if isinstance(exc, NoXdp) else f"{type(exc).__name__}: {exc}"
            log.warning("kvswitch: the asyncio client fetches blocks (%s)", why)
        return self.getter

    def close(self) -> None:
        async def shut():
            if self.getter is not None and self.getter is not self.client:
                await self.getter.__aexit__(None, None, None)
            await self.client.__aexit__(None, None, None)
        try:
            self._call(shut(), 10)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)


_IO: dict[StoreSettings, StoreIO] = {}
_LOCK = threading.Lock()


def io_for(settings: StoreSettings) -> StoreIO:
    """The process's StoreIO for these settings (made on first use, shared after)."""
    with _LOCK:
        if settings not in _IO:
            _IO[settings] = StoreIO(settings)
        return _IO[settings]
