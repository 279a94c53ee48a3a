"""PUT assembly on a pool node, under budgets no tenant can take from another.

A block is PUT one chunk per datagram; ``Assembler`` holds its chunks until every one is in,
then hands the whole block to the store. What it holds is charged in real memory, each chunk's
payload plus ``CHUNK_OVERHEAD`` (the Python objects that hold it) and each block
``BLOCK_OVERHEAD``, against ``PutBudgets``: bytes and incomplete blocks in all, per namespace
(tenant) and per source address. A namespace or a source over its own budget is refused
(NO_SPACE) without touching anyone else's; when the node-wide budget is what runs out, a PUT of
a namespace holding less than the largest holder takes the largest holder's oldest incomplete
block away (``reclaimed_blocks``), so tenants filling their budgets together cannot shut a
smaller one out either. A block whose every chunk could never fit its budgets is refused at its
first chunk. Every chunk but a block's last has the block's chunk size (the pool's
``chunk_size`` when set, else the block's first full chunk's); the last is no longer.
An incomplete block that made no progress (a new chunk: a retransmitted one does not count) in
``timeout`` seconds is dropped.
"""
from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field

from kvproto import Status

DEFAULT_ASSEMBLY_BYTES = 256 << 20
DEFAULT_ASSEMBLY_TIMEOUT = 10.0
# what holding a chunk costs beyond its payload: its bytes object's header and allocator
# rounding, the (payload, crc) tuple, the CRC's int and its slot in the block's dict (measured
# with tracemalloc: tests/test_pool_store.py holds the accounting to it)
CHUNK_OVERHEAD = 224
BLOCK_OVERHEAD = 1024     # a block's record, its dicts, its key


class StoreError(Exception):
    """A request the store refuses; ``status`` is the protocol status to answer with."""

    def __init__(self, status: int, reason: str):
        super().__init__(reason)
        self.status = status


@dataclass(frozen=True)
class PutBudgets:
    """What incomplete PUT blocks may hold: bytes (payload and overhead) and blocks, node-wide,
    per namespace and per source address; ``timeout``: seconds without progress before an
    incomplete block is dropped; ``chunk_size``: the size every chunk but a block's last must
    have (0: the block's own, set by its first full chunk)."""
    total: int = DEFAULT_ASSEMBLY_BYTES
    per_ns: int = DEFAULT_ASSEMBLY_BYTES // 2
    per_source: int = DEFAULT_ASSEMBLY_BYTES // 2
    blocks: int = 4096
    blocks_per_ns: int = 256
    blocks_per_source: int = 256
    timeout: float = DEFAULT_ASSEMBLY_TIMEOUT
    chunk_size: int = 0

    def __post_init__(self):
        if min(self.total, self.per_ns, self.per_source, self.blocks, self.blocks_per_ns,
               self.blocks_per_source) <= 0 or self.timeout <= 0 or self.chunk_size < 0:
            raise ValueError("assembly budgets and timeout must be positive")

    def capped(self, total: int) -> PutBudgets:
        """The same budgets with no more than ``total`` bytes anywhere."""
        return PutBudgets(min(self.total, total), min(self.per_ns, total),
                          min(self.per_source, total), self.blocks, self.blocks_per_ns,
                          self.blocks_per_source, self.timeout, self.chunk_size)


@dataclass(eq=False)
class Partial:
    ns: int
    source: str                  # whose incomplete block it is (its first chunk's sender)
    nchunks: int
    progressed: float            # when a new chunk last came in
    chunks: dict[int, tuple[bytes, int]] = field(default_factory=dict)  # i -> (payload, crc)
    charged: dict[str, int] = field(default_factory=dict)   # source -> bytes charged
    nbytes: int = 0              # payload bytes
    chunk_size: int = 0          # set by the first chunk that is not the last (or n == 1)
    last_len: int = 0


class Assembler:
    """Blocks being PUT, chunk by chunk, until every chunk is in, within ``budgets``."""

    def __init__(self, budgets: PutBudgets | int = PutBudgets(), timeout: float | None = None,
                 max_block: int | None = None, clock=time.monotonic):
        if isinstance(budgets, int):             # (bytes, timeout): one node-wide budget
            if budgets <= 0:
                raise ValueError("assembly budgets and timeout must be positive")
            budgets = PutBudgets(budgets, budgets, budgets,
                                 timeout=timeout or DEFAULT_ASSEMBLY_TIMEOUT)
        elif timeout is not None:
            raise ValueError("the timeout is one of the budgets")
        self.budgets, self.clock = budgets, clock
        self.budget, self.timeout = budgets.total, budgets.timeout
        self.max_block = max_block if max_block is not None else budgets.total
        self.partial: dict[tuple[int, bytes], Partial] = {}
        self.used = 0                                  # bytes charged, overhead included
        self.payload_bytes = 0
        self.ns_bytes: Counter = Counter()
        self.src_bytes: Counter = Counter()
        self.ns_blocks: Counter = Counter()
        self.src_blocks: Counter = Counter()
        self.counters: Counter[str] = Counter()

    @property
    def expired_blocks(self) -> int:
        return self.counters["expired_blocks"]

    def __contains__(self, name: tuple[int, bytes]) -> bool:
        return name in self.partial

    def __len__(self) -> int:
        return len(self.partial)

    # ---- taking chunks ---------------------------------------------------------------------
    def add(self, ns: int, key: bytes, chunk: int, nchunks: int, payload: bytes, crc: int,
            source: str = "") -> bool:
        """Take one chunk from ``source``; True when it completes its block (then ``take``)."""
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
            self.counters["resent_chunks"] += 1
            return False                 # a retransmitted PUT: acknowledged, not progress
        if p is not None and p.nchunks != nchunks:
            raise StoreError(Status.BAD_REQUEST,
                             f"block has {p.nchunks} chunks, PUT says {nchunks}")
        self._check_size(p, size, last, nchunks)
        if p is None:
            self._fits_at_all(ns, source, nchunks, size, last)
        cost = size + CHUNK_OVERHEAD + (BLOCK_OVERHEAD if p is None else 0)
        self._make_room(ns, source, cost, new_block=p is None)
        p = self.partial.get((ns, key))               # (making room may have dropped it)
        if p is None:
            p = self.partial[(ns, key)] = Partial(ns, source, nchunks, self.clock())
            self.ns_blocks[ns] += 1
            self.src_blocks[source] += 1
        if last:
            p.last_len = size
        if not last or nchunks == 1:
            p.chunk_size = size
        p.chunks[chunk] = (payload, crc)
        p.nbytes += size
        p.progressed = self.clock()
        p.charged[source] = p.charged.get(source, 0) + cost
        self.used += cost
        self.payload_bytes += size
        self.ns_bytes[ns] += cost
        self.src_bytes[source] += cost
        return len(p.chunks) == nchunks

    def _check_size(self, p: Partial | None, size: int, last: bool, nchunks: int) -> None:
        """Every chunk but the last is full size; the last is no longer."""
        fixed = self.budgets.chunk_size
        known = fixed or (p.chunk_size if p else 0)
        known_last = p.last_len if p else 0
        if last and nchunks > 1:
            if known and size > known:
                raise StoreError(Status.BAD_REQUEST, f"the last chunk ({size} bytes) is longer "
                                 f"than the others ({known})")
        elif fixed and (size != fixed if not last else size > fixed):
            raise StoreError(Status.BAD_REQUEST, f"a chunk of {size} bytes: this pool's chunks "
                             f"are {fixed} bytes (a block's last may be shorter)")
        elif (known and size != known) or known_last > size:
            raise StoreError(Status.BAD_REQUEST, f"a chunk of {size} bytes: the chunks of a "
                             "block have one size (the last may be shorter)")

    def _fits_at_all(self, ns: int, source: str, nchunks: int, size: int, last: bool) -> None:
        """A new block whose chunks could never all be held is refused at its first."""
        least = nchunks * size if last else (nchunks - 1) * size + 1
        if least > self.max_block:
            raise StoreError(Status.NO_SPACE, f"a block of {nchunks} chunks of {size} bytes "
                             f"is larger than the {self.max_block} bytes this node holds")
        b = self.budgets
        need = least + nchunks * CHUNK_OVERHEAD + BLOCK_OVERHEAD
        if need > min(b.total, b.per_ns, b.per_source):
            self.counters["refused_too_large"] += 1
            raise StoreError(Status.NO_SPACE, f"a block of {nchunks} chunks of {size} bytes "
                             f"needs {need} bytes to assemble, more than a tenant may hold")

    # ---- budgets -----------------------------------------------------------------------------
    def _make_room(self, ns: int, source: str, cost: int, new_block: bool) -> None:
        b = self.budgets
        if self._over(ns, source, cost, new_block):
            self.expire()
        if self.ns_bytes[ns] + cost > b.per_ns or \
                (new_block and self.ns_blocks[ns] + 1 > b.blocks_per_ns):
            self._refuse("refused_ns", f"namespace {ns} holds {self.ns_bytes[ns]} bytes in "
                         f"{self.ns_blocks[ns]} incomplete blocks, its budget")
        if self.src_bytes[source] + cost > b.per_source or \
                (new_block and self.src_blocks[source] + 1 > b.blocks_per_source):
            self._refuse("refused_source", f"{source or 'this source'} holds "
                         f"{self.src_bytes[source]} bytes in {self.src_blocks[source]} "
                         "incomplete blocks, its budget")
        while self.used + cost > b.total or (new_block and len(self.partial) + 1 > b.blocks):
            if not self._reclaim(ns, cost, by_blocks=self.used + cost <= b.total):
                self._refuse("refused_total", f"{self.used} bytes of incomplete blocks are "
                             "waiting for their other chunks")

    def _over(self, ns: int, source: str, cost: int, new_block: bool) -> bool:
        b = self.budgets
        return (self.used + cost > b.total or self.ns_bytes[ns] + cost > b.per_ns or
                self.src_bytes[source] + cost > b.per_source or
                (new_block and (len(self.partial) + 1 > b.blocks or
                                self.ns_blocks[ns] + 1 > b.blocks_per_ns or
                                self.src_blocks[source] + 1 > b.blocks_per_source)))

    def _reclaim(self, ns: int, cost: int, by_blocks: bool) -> bool:
        """The node-wide budget is full: drop the oldest incomplete block of the namespace
        holding the most (bytes, or blocks when blocks ran out), if it holds more than ``ns``
        would after this chunk. False: ``ns`` is itself the largest holder."""
        held = self.ns_blocks if by_blocks else self.ns_bytes
        mine = held[ns] + (1 if by_blocks else cost)
        top = max(held, key=held.__getitem__, default=None)
        if top is None or top == ns or held[top] <= mine:
            return False
        oldest = min((p.progressed, name) for name, p in self.partial.items() if p.ns == top)
        self.drop(*oldest[1])
        self.counters["reclaimed_blocks"] += 1
        return True

    def _refuse(self, counter: str, reason: str):
        self.counters[counter] += 1
        raise StoreError(Status.NO_SPACE, reason)

    # ---- leaving -------------------------------------------------------------------------------
    def take(self, ns: int, key: bytes) -> tuple[int, list[bytes], list[int]]:
        """(chunk size, payloads, CRCs) of a complete block, which leaves the assembler."""
        p = self._remove(ns, key)
        items = [p.chunks[i] for i in range(p.nchunks)]
        return p.chunk_size, [c for c, _ in items], [crc for _, crc in items]

    def drop(self, ns: int, key: bytes) -> None:
        self._remove(ns, key)

    def _remove(self, ns: int, key: bytes) -> Partial | None:
        p = self.partial.pop((ns, key), None)
        if p is None:
            return None
        for src, charged in p.charged.items():
            self.used -= charged
            self.ns_bytes[ns] -= charged
            _settle(self.src_bytes, src, charged)
        self.payload_bytes -= p.nbytes
        _settle(self.ns_bytes, ns, 0)
        _settle(self.ns_blocks, ns, 1)
        _settle(self.src_blocks, p.source, 1)
        return p

    def expire(self) -> int:
        """Drop the blocks that made no progress in ``timeout`` seconds; how many."""
        horizon = self.clock() - self.timeout
        stale = [name for name, p in self.partial.items() if p.progressed < horizon]
        for name in stale:
            self.drop(*name)
        self.counters["expired_blocks"] += len(stale)
        return len(stale)

    def stats(self) -> dict:
        return {"assembling_blocks": len(self.partial), "assembling_bytes": self.used,
                "assembling_payload_bytes": self.payload_bytes,
                "assembling_namespaces": len(self.ns_blocks), **self.counters}


def _settle(counter: Counter, name, n: int) -> None:
    """Take ``n`` from ``counter[name]``, forgetting names that reach zero."""
    left = counter[name] - n
    if left > 0:
        counter[name] = left
    else:
        del counter[name]
