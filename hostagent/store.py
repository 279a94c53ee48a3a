"""What a pool node stores blocks in, and the in-memory store (the embedded default).

Every store has the same two halves. PUT chunks, one datagram each, are assembled
(``Assembler``: bounded bytes, an incomplete block is dropped after a timeout) until the block
is whole; then it is laid out as one object (``hostagent.blockfmt``: header, the writer's CRC of
every chunk, payload) in the node's staging arena (``hostagent.staging``), from which GETs are
answered. ``PoolStore`` is that common part and the interface the server uses: ``get`` and
``put_chunk`` answer at once or hand back a future when the backing store has to be asked.

``MemoryStore`` (alias ``BlockStore``) has no backing store: the arena is the store, a miss is
NOT_FOUND and the least recently used blocks go when space runs out. The Mooncake Store one is
``hostagent.mooncake_store``. Blocks are immutable: a PUT of a chunk that differs from the
stored one is refused; one that matches (a retransmission) is acknowledged again.
"""
from __future__ import annotations

import asyncio
import time
from array import array
from collections import Counter
from dataclasses import dataclass, field

from kvproto import Status, checksum
from .blockfmt import Layout, write_block
from .staging import DEFAULT_PAGE, Arena, StagedBlock, Staging, StagingFull

# the status a pool node answers with while its backing store is unreachable
UNAVAILABLE = Status.UNAVAILABLE
DEFAULT_ASSEMBLY_BYTES = 256 << 20
DEFAULT_ASSEMBLY_TIMEOUT = 10.0


class StoreError(Exception):
    """A request the store refuses; ``status`` is the protocol status to answer with."""

    def __init__(self, status: int, reason: str):
        super().__init__(reason)
        self.status = status


@dataclass
class Partial:
    nchunks: int
    touched: float
    chunks: dict[int, tuple[bytes, int]] = field(default_factory=dict)  # index -> (payload, crc)
    nbytes: int = 0
    chunk_size: int = 0          # set by the first chunk that is not the last (or n == 1)
    last_len: int = 0


class Assembler:
    """Blocks being PUT, chunk by chunk, until every chunk is in. At most ``budget`` bytes are
    held; a block no chunk arrived for in ``timeout`` seconds is dropped."""

    def __init__(self, budget: int = DEFAULT_ASSEMBLY_BYTES,
                 timeout: float = DEFAULT_ASSEMBLY_TIMEOUT, max_block: int | None = None,
                 clock=time.monotonic):
        if budget <= 0 or timeout <= 0:
            raise ValueError("assembly budget and timeout must be positive")
        self.budget, self.timeout, self.clock = budget, timeout, clock
        self.max_block = max_block if max_block is not None else budget
        self.partial: dict[tuple[int, bytes], Partial] = {}
        self.used = 0
        self.expired_blocks = 0

    def __contains__(self, name: tuple[int, bytes]) -> bool:
        return name in self.partial

    def __len__(self) -> int:
        return len(self.partial)

    def add(self, ns: int, key: bytes, chunk: int, nchunks: int, payload: bytes,
            crc: int) -> bool:
        """Take one chunk; True when it completes its block (then ``take`` it)."""
        if nchunks < 1 or chunk >= nchunks:
            raise StoreError(Status.BAD_REQUEST, f"chunk {chunk} of a {nchunks}-chunk block")
        if not payload:
            raise StoreError(Status.BAD_REQUEST, "a chunk carries at least one byte")
        size, last = len(payload), chunk == nchunks - 1
        p = self.partial.get((ns, key))
        if p is not None and p.nchunks == nchunks and chunk in p.chunks:
            old_payload, old_crc = p.chunks[chunk]
            if old_crc != crc or len(old_payload) != size:
                raise StoreError(Status.BAD_REQUEST, "blocks are immutable: chunk differs")
            p.touched = self.clock()
            return False                                # a retransmitted PUT
        if (size if last else (nchunks - 1) * size + 1) > self.max_block:
            raise StoreError(Status.NO_SPACE, f"a block of {nchunks} chunks of {size} bytes "
                             f"is larger than the {self.max_block} bytes this node holds")
        self._make_room(size)
        p = self.partial.get((ns, key))                 # (making room may have expired it)
        if p is not None and p.nchunks != nchunks:
            raise StoreError(Status.BAD_REQUEST,
                             f"block has {p.nchunks} chunks, PUT says {nchunks}")
        known_size, known_last = (p.chunk_size, p.last_len) if p else (0, 0)
        if last:
            if known_size and size > known_size:
                raise StoreError(Status.BAD_REQUEST, "the last chunk is longer than the others")
        elif (known_size and size != known_size) or known_last > size:
            raise StoreError(Status.BAD_REQUEST,
                             "the chunks of a block have one size (the last may be shorter)")
        if p is None:
            p = self.partial[(ns, key)] = Partial(nchunks, self.clock())
        if last:
            p.last_len = size
        if not last or nchunks == 1:
            p.chunk_size = size
        p.chunks[chunk] = (payload, crc)
        p.nbytes += size
        p.touched = self.clock()
        self.used += size
        return len(p.chunks) == nchunks

    def take(self, ns: int, key: bytes) -> tuple[int, list[bytes], list[int]]:
        """(chunk size, payloads, CRCs) of a complete block, which leaves the assembler."""
        p = self.partial.pop((ns, key))
        self.used -= p.nbytes
        items = [p.chunks[i] for i in range(p.nchunks)]
        return p.chunk_size, [c for c, _ in items], [crc for _, crc in items]

    def drop(self, ns: int, key: bytes) -> None:
        p = self.partial.pop((ns, key), None)
        if p is not None:
            self.used -= p.nbytes

    def expire(self) -> int:
        """Drop the blocks no chunk arrived for in ``timeout`` seconds; how many."""
        horizon = self.clock() - self.timeout
        stale = [name for name, p in self.partial.items() if p.touched < horizon]
        for name in stale:
            self.drop(*name)
        self.expired_blocks += len(stale)
        return len(stale)

    def _make_room(self, size: int) -> None:
        if self.used + size > self.budget:
            self.expire()
        if self.used + size > self.budget:
            raise StoreError(Status.NO_SPACE, f"{self.used} bytes of incomplete blocks are "
                             "waiting for their other chunks")


class PoolStore:
    """The store interface the pool server drives, from one event loop, and the part every
    store shares: assembly, staging, and answering from staged blocks."""

    kind = "abstract"

    def __init__(self, capacity: int, page: int = DEFAULT_PAGE,
                 assembly_bytes: int = DEFAULT_ASSEMBLY_BYTES,
                 assembly_timeout: float = DEFAULT_ASSEMBLY_TIMEOUT):
        if capacity <= 0:
            raise ValueError("capacity must be positive")
        self.staging = Staging(Arena(max(capacity, page), page))
        self.assembler = Assembler(min(assembly_bytes, self.staging.capacity), assembly_timeout,
                                   max_block=self.staging.capacity)
        self.counters: Counter[str] = Counter()
        self._writing: dict[tuple[int, bytes], asyncio.Future] = {}

    # ---- what the server calls -----------------------------------------------------------
    async def start(self) -> None:
        """Connect to whatever backs the store (returns once it can serve)."""

    async def close(self) -> None:
        self.staging.arena.close()

    def describe(self) -> str:
        return f"{self.kind} store, {self.capacity} bytes"

    def use_arena(self, arena: Arena) -> None:
        """Stage into ``arena`` (an XDP-served one) from now on: only before serving starts."""
        if len(self.staging) or self.staging.reserved_pages:
            raise RuntimeError("the staging arena can only be replaced while it is empty")
        old, self.staging = self.staging.arena, Staging(arena)
        old.close()

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
        return self._miss(ns, key)

    def put_chunk(self, ns: int, key: bytes, chunk: int, nchunks: int, payload: bytes,
                  crc: int) -> bool | asyncio.Future:
        """Take one PUT chunk: True once its block is stored, False while chunks are missing,
        a future (of True) while the complete block is being written out. Raises StoreError."""
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
        if not self.assembler.add(ns, key, chunk, nchunks, payload, crc):
            return False
        chunk_size, chunks, crcs = self.assembler.take(ns, key)
        layout = Layout.for_payload(ns, key, sum(map(len, chunks)), chunk_size)
        try:
            run = self.staging.reserve(layout.size)
        except StagingFull as exc:
            raise StoreError(Status.NO_SPACE, str(exc)) from None
        write_block(run.view, layout, chunks, crcs)
        block = self.staging.commit(run, layout, array("I", crcs))
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
        return self.staging.remove(ns, key)

    def stats(self) -> dict:
        s = self.staging
        return {"store": self.kind, "staged_blocks": len(s), "staged_bytes": s.used,
                "capacity": s.capacity, "evicted_blocks": s.evicted_blocks,
                "assembling_blocks": len(self.assembler),
                "assembling_bytes": self.assembler.used,
                "expired_blocks": self.assembler.expired_blocks, **self.counters,
                **s.arena.stats()}

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
    least recently used first out; lost when the process ends."""

    kind = "memory"


BlockStore = MemoryStore
