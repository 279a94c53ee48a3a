"""The fetch engine behind the asyncio client's interface, and the automatic choice between them.

``AsyncFetchClient`` offers ``KVClient``'s ``get_block`` (bytes and TransferStats) and
``put_block`` (passed to a KVClient: the engine only fetches) over a ``FetchEngine``, plus
``get_block_view``, which hands over the engine's ``Block`` without a copy. Concurrent calls
share one step loop, run by a task of the event loop. When the arena is full, a new transfer
waits for the running ones to finish; the engine then loads a larger arena. When nothing ever
comes back to the engine's GETs (``NoReply``: its frames do not leave the interface, e.g. a
veth whose peer carries no XDP program), the block is fetched again with the asyncio client;
if that one is answered, the client stays on it from then on (one log line each).

``open_client`` is what commands and connectors use: the engine when it can run here (root,
BCC or a cached compile, the interface free or carrying the testbed's XDP_PASS program or loss
injector, every pool on the KV port and reached through that interface), else the asyncio
``KVClient``; one log line says which path is in use and, for the asyncio one, why.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Sequence

from hostagent.common import auth as auth_mod
from hostagent.common.block import Block
from hostagent.common.pools import Placement
from hostagent.inference.client import KVClient
from hostagent.common.transfer import TransferStats
from kvproto import DEFAULT_CHUNK
from xdp import NoXdp
from xdp import netns as netns_mod

from .crcfold import CRC_IMPL
from .engine import FetchEngine, NoReply

log = logging.getLogger("hostagent.fetch")


class AsyncFetchClient:
    """``KVClient``'s get/put interface over a FetchEngine (opened on entry; closed on exit
    only if ``owns``)."""

    def __init__(self, engine: FetchEngine, window: int = 64, deadline: float | None = None,
                 owns: bool = False):
        self.engine, self.owns = engine, owns
        self.chunk_size, self.pools = engine.chunk_size, engine.pools
        self._window, self._deadline = window, deadline or engine.deadline
        self._driver: asyncio.Task | None = None
        self._socket: KVClient | None = None        # puts, and fetches the engine cannot do
        self.fell_back = False

    async def __aenter__(self) -> AsyncFetchClient:
        self.engine.open()
        return self

    async def __aexit__(self, *exc) -> None:
        if self._driver is not None and not self._driver.done():
            self._driver.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._driver
        self._driver = None
        if self._socket is not None:
            await self._socket.__aexit__(None, None, None)
            self._socket = None
        if self.owns:
            self.engine.close()

    async def _drive(self) -> None:
        eng = self.engine
        while eng.busy:
            eng.step()
            await asyncio.sleep(0)

    async def _submit(self, ns: int, key: bytes, nchunks: int | None, no_cache: bool):
        while True:
            try:
                return self.engine.submit(ns, key, nchunks, no_cache)
            except (MemoryError, RuntimeError):
                if not self.engine.busy:
                    raise                  # nothing to wait for: it will never fit
            await self._until(lambda: not self.engine.busy)

    async def _until(self, done) -> None:
        while not done():
            if self._driver is None or self._driver.done():
                if self._driver is not None:
                    self._driver.result()            # the loop's error, if it had one
                if not self.engine.busy:
                    return
                self._driver = asyncio.get_running_loop().create_task(self._drive())
            await asyncio.sleep(0)

    async def get_block_view(self, ns: int, key: bytes, nchunks: int | None = None,
                             no_cache: bool = False) -> tuple[Block, TransferStats]:
        """Fetch a whole block, byte-exact, as a zero-copy Block (release it when done)."""
        if self.fell_back:
            return await self._get_by_socket(ns, key, nchunks, no_cache)
        t = await self._submit(ns, key, nchunks, no_cache)
        try:
            await self._until(lambda: t.done)
        except asyncio.CancelledError:
            self.engine.cancel(t)                  # its slots back, late replies stale
            raise
        if isinstance(t.error, NoReply):
            log.warning("%s: the asyncio client fetches the block", t.error)
            got = await self._get_by_socket(ns, key, nchunks, no_cache)
            if not self.engine.answered and not self.fell_back:
                self.fell_back = True
                log.warning("asyncio socket client in use from now on (it is answered, the XDP "
                            "engine on %s is not)", self.engine.ifname)
            return got
        if t.error is not None:
            raise t.error
        return t.result, t.result.stats

    async def _get_by_socket(self, ns, key, nchunks, no_cache) -> tuple[Block, TransferStats]:
        return await (await self._socket_client()).get_block_view(ns, key, nchunks, no_cache)

    async def _socket_client(self) -> KVClient:
        """The asyncio client beside the engine (its socket in the engine's namespace)."""
        if self._socket is None:
            c = KVClient(self.engine.placement, self.chunk_size, self._window, self._deadline,
                         auth=self.engine.keyring)
            with _inside(self.engine.netns_name):
                await c.__aenter__()
            self._socket = c
        return self._socket

    async def get_block(self, ns: int, key: bytes, nchunks: int | None = None,
                        no_cache: bool = False) -> tuple[bytes, TransferStats]:
        """As KVClient.get_block: the block's bytes (a copy) and its stats."""
        blk, stats = await self.get_block_view(ns, key, nchunks, no_cache)
        try:
            return blk.tobytes(), stats
        finally:
            blk.release()

    async def put_block(self, ns: int, key: bytes, data: bytes) -> TransferStats:
        """As KVClient.put_block (the asyncio client does it: the engine only fetches)."""
        return await (await self._socket_client()).put_block(ns, key, data)


def _inside(netns: str | None):
    return netns_mod.inside(netns) if netns else contextlib.nullcontext()


@contextlib.asynccontextmanager
async def open_client(pools: Sequence[str | tuple[str, int]] | Placement,
                      chunk_size: int = DEFAULT_CHUNK, window: int = 64, deadline: float = 30.0,
                      *, netns: str | None = None, ifname: str = "eth0",
                      arena_bytes: int = 64 << 20, auth=auth_mod.DEFAULT,
                      **engine_kw) -> AsyncIterator[AsyncFetchClient | KVClient]:
    """The fetch engine's client if the engine can run here, else the asyncio KVClient (both
    offer get_block and put_block, over one ``Placement``: ``pools`` itself, or one holder of
    each block); logs which one is in use. ``auth``: the keyring (default:
    the process's, hostagent/common/auth.py), None to turn authentication off."""
    engine = FetchEngine(pools, chunk_size, ifname=ifname, netns=netns, deadline=deadline,
                         arena_bytes=arena_bytes, auth=auth, **engine_kw)
    try:
        engine.open()
    except NoXdp as exc:
        log.warning("asyncio socket client in use (%s)", exc)
        c = KVClient(engine.placement, chunk_size, window, deadline, auth=engine.keyring)
        with _inside(netns):
            await c.__aenter__()                     # its socket lives in the node's netns
        try:
            yield c
        finally:
            await c.__aexit__(None, None, None)
        return
    log.warning("XDP engine on %s in use (%d-byte chunks, CRC by %s)", ifname, chunk_size,
                CRC_IMPL)
    async with AsyncFetchClient(engine, window, deadline, owns=True) as c:
        yield c
