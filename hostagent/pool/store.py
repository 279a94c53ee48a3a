"""What a pool node stores blocks in, and the in-memory store (the embedded default).

Every store has the same two halves. PUT chunks, one datagram each, are assembled
(``hostagent.pool.assembly``: budgets per namespace and per source, an incomplete block is dropped
after a timeout) until the block is whole; then it is laid out as one object
(``hostagent.pool.blockfmt``: header, the writer's CRC of every chunk, payload) in the node's
staging arena (``hostagent.pool.staging``), from which GETs are
answered. ``PoolStore`` is that common part and the interface the server uses: ``get`` and
``put_chunk`` answer at once or hand back a future when the backing store has to be asked.

``MemoryStore`` (alias ``BlockStore``) has no backing store: the arena is the store, a miss is
NOT_FOUND and the least recently used blocks go when space runs out. The Mooncake Store one is
``hostagent.pool.mooncake_store``. Either may have a pool disk tier (``disk=``, a
``hostagent.pool.disk_tier.DiskTier``): a block evicted from the arena is written there first (if
``demote_fn(ns, key, nbytes)`` says so; default: every one), and a GET the arena misses is staged
back from it (read in a worker thread, every chunk checked) before the backing store is asked; at a
clean stop (``close``) the blocks only in DRAM are written there too. The eviction order is ``lru``
or ``value`` (``value_fn(ns, key, nbytes)``, lowest first: ``set_policy``); ``on_get(ns, key)``, if
set, hears of every fetch (a GET of chunk 0) the server process sees (not the ones XDP answers: run
with ``HOSTAGENT_XDP_SERVE=0`` to see them all). Blocks are immutable: a PUT of a chunk that differs
from the stored one is refused; one that matches (a retransmission) is acknowledged again.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from array import array
from concurrent.futures import ThreadPoolExecutor
from collections import Counter

from kvproto import Status, checksum
from .assembly import (DEFAULT_ASSEMBLY_BYTES, DEFAULT_ASSEMBLY_TIMEOUT, Assembler, PutBudgets,
                       StoreError)
from .blockfmt import ObjectLayout, write_block
from .disk_tier import DiskTier
from .staging import DEFAULT_PAGE, Arena, StagedBlock, Staging, StagingFull

__all__ = ["Assembler", "BlockStore", "MemoryStore", "PoolStore", "PutBudgets", "StoreError",
           "UNAVAILABLE", "DEFAULT_ASSEMBLY_BYTES", "DEFAULT_ASSEMBLY_TIMEOUT"]

log = logging.getLogger("hostagent.store")
# the status a pool node answers with while its backing store is unreachable
UNAVAILABLE = Status.UNAVAILABLE


class PoolStore:
    """The store interface the pool server drives, from one event loop, and the part every
    store shares: assembly, staging, and answering from staged blocks."""

    kind = "abstract"
    on_get = None       # on_get(ns, key): every GET of a chunk 0 the server process sees

    def __init__(self, capacity: int, page: int = DEFAULT_PAGE,
                 assembly_bytes: int | None = None, assembly_timeout: float | None = None,
                 budgets: PutBudgets | None = None, xdp_slots_per_ns: int | None = None,
                 disk: DiskTier | None = None, evict: str = "lru", value_fn=None,
                 demote_fn=None):
        if capacity <= 0:
            raise ValueError("capacity must be positive")
        budgets = budgets or PutBudgets()
        if assembly_bytes is not None or assembly_timeout is not None:   # the older knobs
            total = assembly_bytes if assembly_bytes is not None else budgets.total
            budgets = dataclasses.replace(
                budgets, total=total, per_ns=min(budgets.per_ns, total),
                per_source=min(budgets.per_source, total),
                timeout=assembly_timeout if assembly_timeout is not None else budgets.timeout)
        self.disk, self.demote_fn = disk, demote_fn
        self._disk_reads: dict[tuple[int, bytes], asyncio.Future] = {}
        self._disk_pool: ThreadPoolExecutor | None = None
        self.staging = Staging(Arena(max(capacity, page), page), evict, value_fn,
                               self._evicting)
        self.assembler = Assembler(budgets.capped(self.staging.capacity),
                                   max_block=self.staging.capacity)
        self.xdp_slots_per_ns = xdp_slots_per_ns    # (what an XDP-served arena lends a tenant)
        self.counters: Counter[str] = Counter()
        self._writing: dict[tuple[int, bytes], asyncio.Future] = {}

    # ---- what the server calls -----------------------------------------------------------
    async def start(self) -> None:
        """Connect to whatever backs the store (returns once it can serve)."""

    async def close(self) -> None:
        if self._disk_reads:
            await asyncio.gather(*self._disk_reads.values(), return_exceptions=True)
        if self._disk_pool is not None:
            self._disk_pool.shutdown(wait=True)
        if self.disk is not None:
            self._flush()
            self.disk.close()
        self.staging.arena.close()

    def _flush(self) -> None:
        """At a clean stop: what is only in DRAM goes to disk (least recent first), so a
        restarted pool process has it too."""
        t0, n = time.monotonic(), 0
        for block in list(self.staging.blocks.values()):
            name = (block.layout.ns, block.layout.key)
            if name not in self.disk and self.disk.write(*name, block.run.view[:block.nbytes],
                                                         wait=True):
                n += 1
        if n:
            log.info("disk tier: %d blocks only in DRAM written at shutdown in %.2f s", n,
                     time.monotonic() - t0)

    def describe(self) -> str:
        return f"{self.kind} store, {self.capacity} bytes{self._disk_text()}"

    def _disk_text(self) -> str:
        d = self.disk
        return "" if d is None else f", disk tier {d.dir} ({d.capacity} bytes)"

    def use_arena(self, arena: Arena) -> None:
        """Stage into ``arena`` (an XDP-served one) from now on: only before serving starts."""
        if len(self.staging) or self.staging.reserved_pages:
            raise RuntimeError("the staging arena can only be replaced while it is empty")
        s = self.staging
        old, self.staging = s.arena, Staging(arena, s.evict, s.value_fn, s.on_evict)
        old.close()

    def set_policy(self, evict: str = "lru", value_fn=None, demote_fn=None) -> None:
        """How pool DRAM gives way: ``evict`` ``lru`` or ``value`` (``value_fn(ns, key,
        nbytes)``, anything comparable, lowest leaves first); ``demote_fn(ns, key, nbytes)``:
        whether an evicted block goes to the disk tier (None: every one does)."""
        self.staging.set_eviction(evict, value_fn)
        self.demote_fn = demote_fn

    def tick(self) -> None:
        """Housekeeping, about once a second: drop stale incomplete blocks."""
        self.assembler.expire()

    def get(self, ns: int, key: bytes) -> StagedBlock | asyncio.Future:
        """The staged block, or a future of it while it is fetched. Raises StoreError."""
        block = self.staging.get(ns, key)
        if block is not None:
            return block
        if (ns, key) in self.assembler:
            raise StoreError(Status.INCOMPLETE, "block is still being written")
        staging_back = self._from_disk(ns, key)
        if staging_back is not None:
            return staging_back
        return self._miss(ns, key)

    def put_chunk(self, ns: int, key: bytes, chunk: int, nchunks: int, payload: bytes,
                  crc: int, source: str = "") -> bool | asyncio.Future:
        """Take one PUT chunk from ``source`` (its sender's address: budgets are per source):
        True once its block is stored, False while chunks are missing, a future (of True) while
        the complete block is being written out. Raises StoreError."""
        if checksum(payload) != crc:
            raise StoreError(Status.CHECKSUM, "payload does not match its checksum")
        writing = self._writing.get((ns, key))
        if writing is not None:
            return writing
        block = self.staging.get(ns, key, touch=False)
        if block is not None:
            _same_chunk(block, chunk, nchunks, payload, crc)
            return True
        self._accepting()
        if not self.assembler.add(ns, key, chunk, nchunks, payload, crc, source):
            return False
        chunk_size, chunks, crcs = self.assembler.take(ns, key)
        layout = ObjectLayout.for_payload(ns, key, sum(map(len, chunks)), chunk_size)
        try:
            run = self.staging.reserve(layout.size)
        except StagingFull as exc:
            raise StoreError(Status.NO_SPACE, str(exc)) from None
        write_block(run.view, layout, chunks, crcs)
        if self.disk is not None and (ns, key) in self.disk:
            self.disk.remove(ns, key)         # a new copy: the old one on disk is stale
        block = self.staging.commit(run, layout, array("I", crcs), meta={"source": source})
        self.counters["blocks_put"] += 1
        return self._persist(block)

    def get_chunk(self, ns: int, key: bytes, chunk: int) -> tuple[bytes, int, int]:
        """(payload, crc, nchunks) of one chunk of a staged block. Raises StoreError."""
        block = self.get(ns, key)
        if not isinstance(block, StagedBlock):
            block.cancel()
            raise StoreError(Status.NOT_FOUND, "block is not staged")
        if chunk >= block.nchunks:
            raise StoreError(Status.BAD_REQUEST, f"block has {block.nchunks} chunks")
        payload, crc = block.chunk(chunk)
        return bytes(payload), crc, block.nchunks

    def remove(self, ns: int, key: bytes) -> bool:
        on_disk = self.disk is not None and self.disk.remove(ns, key)
        return self.staging.remove(ns, key) or on_disk

    def stats(self) -> dict:
        s = self.staging
        return {"store": self.kind, "staged_blocks": len(s), "staged_bytes": s.used,
                "capacity": s.capacity, "evicted_blocks": s.evicted_blocks,
                "evict": s.evict, **self.assembler.stats(), **self.counters,
                **(self.disk.stats() if self.disk is not None else {}),
                **s.arena.stats()}

    # ---- the pool disk tier ----------------------------------------------------------------
    def _evicting(self, block: StagedBlock) -> None:
        """A block leaving pool DRAM (still whole in its run): to disk, if it goes there."""
        disk = self.disk
        if disk is None:
            return
        ns, key, n = block.layout.ns, block.layout.key, block.nbytes
        try:
            if self.demote_fn is not None and not self.demote_fn(ns, key, n):
                self.counters["disk_not_demoted"] += 1
                return
        except Exception:                     # a policy error must not fail the PUT
            log.exception("demote_fn failed: %d/%s goes to disk", ns, key.hex())
        disk.write(ns, key, block.run.view[:n])

    def _from_disk(self, ns: int, key: bytes) -> asyncio.Future | None:
        """A future of the block staged back from the disk tier, or None if it is not there."""
        name = (ns, key)
        reading = self._disk_reads.get(name)
        if reading is not None:
            return reading
        if self.disk is None or name not in self.disk:
            return None
        size = self.disk.size(ns, key)
        try:
            run = self.staging.reserve(size)
        except StagingFull as exc:
            raise StoreError(Status.NO_SPACE, str(exc)) from None
        loop = asyncio.get_running_loop()
        if self._disk_pool is None:
            self._disk_pool = ThreadPoolExecutor(1, thread_name_prefix="disk-tier")
        fut = self._disk_reads[name] = loop.create_future()
        read = loop.run_in_executor(self._disk_pool, self.disk.read_into, ns, key, run.view)
        read.add_done_callback(lambda r: self._staged_back(name, run, r, fut))
        return fut

    def _staged_back(self, name, run, read: asyncio.Future, fut: asyncio.Future) -> None:
        self._disk_reads.pop(name, None)
        exc = read.exception() if not read.cancelled() else StoreError(Status.NOT_FOUND, "")
        if exc is not None:
            self.staging.release(run)
            self.counters["disk_misses"] += 1
            if not fut.done():
                fut.set_exception(exc if isinstance(exc, StoreError) else
                                  StoreError(Status.NOT_FOUND, f"no such block ({exc})"))
            return
        layout, crcs = read.result()
        block = self.staging.commit(run, layout, crcs, meta={"source": "disk"})
        self.counters["disk_staged"] += 1
        if not fut.done():
            fut.set_result(block)

    # ---- what a store with a backing store overrides -------------------------------------
    def _miss(self, ns: int, key: bytes) -> asyncio.Future:
        raise StoreError(Status.NOT_FOUND, "no such block")

    def _accepting(self) -> None:
        """Raise StoreError when new blocks cannot be taken now."""

    def _persist(self, block: StagedBlock) -> bool | asyncio.Future:
        return True

    # memory-store compatible names
    @property
    def used(self) -> int:
        return self.staging.used

    @property
    def capacity(self) -> int:
        return self.staging.capacity

    @property
    def evicted_blocks(self) -> int:
        return self.staging.evicted_blocks

    def __len__(self) -> int:
        return len(self.staging)


def _same_chunk(block: StagedBlock, chunk: int, nchunks: int, payload: bytes, crc: int) -> None:
    """A PUT for a block already stored: fine if it is the stored chunk, else refused."""
    if nchunks != block.nchunks:
        raise StoreError(Status.BAD_REQUEST,
                         f"block has {block.nchunks} chunks, PUT says {nchunks}")
    if chunk >= nchunks:
        raise StoreError(Status.BAD_REQUEST, f"chunk {chunk} of a {nchunks}-chunk block")
    stored, stored_crc = block.chunk(chunk)
    if stored_crc != crc or len(stored) != len(payload):
        raise StoreError(Status.BAD_REQUEST, "blocks are immutable: chunk differs")


class MemoryStore(PoolStore):
    """Blocks in this process's memory only (the embedded default): ``capacity`` bytes of them,
    least recently used first out; lost when the process ends, unless a disk tier keeps them."""

    kind = "memory"


BlockStore = MemoryStore
