"""Whole blocks a pool node serves from, in one contiguous arena of fixed-size pages.

``Arena`` owns the memory: one buffer (an anonymous mmap here; an mmapable BPF array map with
one page per value can take its place, so an XDP program can serve the same bytes) cut into
pages, a block taking a contiguous run of them (first fit, neighbouring free runs merged).
``Staging`` owns what is in it: an index from (namespace, key) to the staged block (its run,
its layout as ``hostagent.pool.blockfmt`` stores it, its CRC array), a byte bound (the arena's
size), the eviction order (``lru``: least recently used first; ``value``: lowest ``value_fn(ns, key,
nbytes)`` first, ties least recent first), the eviction hook (``on_evict(block)``, called while
the block is still whole in its run: where a pool disk tier writes it down) and pins: a run
being filled or written out is never evicted.
Nothing here touches a socket or a store; the server reads chunks from ``StagedBlock``s, the
stores fill runs (``reserve`` then ``commit``, or ``release`` on failure), and the arena hears
of every block that becomes servable (``publish``) and of every one about to leave
(``retract``), which is where an arena served by XDP (``hostagent.pool.xdpserve``) updates its
index.
"""
from __future__ import annotations

import ctypes
import mmap
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field

from .blockfmt import ObjectLayout
from hostagent.common.eviction import ValueHeap, check_eviction

DEFAULT_PAGE = 4096


class StagingFull(Exception):
    """No run of the size asked for can be made free (the stores answer NO_SPACE)."""


class Runs:
    """An allocator of contiguous runs among ``n`` units (first fit, neighbouring free runs
    merged): an arena's pages, the chunk slots of an XDP-served arena."""

    def __init__(self, n: int):
        self._free: dict[int, int] = {0: n} if n else {}   # start -> run length
        self._free_end: dict[int, int] = {n: 0} if n else {}   # end -> start
        self.free_pages = n

    def alloc(self, npages: int) -> int | None:
        """First unit of a free run of ``npages`` units, or None."""
        for start, length in self._free.items():
            if length >= npages:
                del self._free[start]
                del self._free_end[start + length]
                if length > npages:
                    self._free[start + npages] = length - npages
                    self._free_end[start + length] = start + npages
                self.free_pages -= npages
                return start
        return None

    def release(self, start: int, npages: int) -> None:
        end = start + npages
        self.free_pages += npages
        before = self._free_end.pop(start, None)          # a free run ending where this starts
        if before is not None:
            del self._free[before]
            start = before
        after = self._free.pop(end, None)                   # a free run starting where it ends
        if after is not None:
            del self._free_end[end + after]
            end += after
        self._free[start] = end - start
        self._free_end[end] = start


class Arena(Runs):
    """``size`` bytes (rounded down to whole pages) of page-aligned memory with an allocator of
    contiguous page runs. ``addr`` is the buffer's address, for zero-copy I/O into it."""

    def __init__(self, size: int, page: int = DEFAULT_PAGE, buffer: mmap.mmap | None = None):
        if page < 64 or size < page:
            raise ValueError(f"an arena holds at least one page of at least 64 bytes "
                             f"(size {size}, page {page})")
        self.page, self.pages = page, size // page
        super().__init__(self.pages)
        self.mem = buffer if buffer is not None else mmap.mmap(-1, self.pages * page)
        self.view = memoryview(self.mem)
        self._anchor = ctypes.c_char.from_buffer(self.mem)
        self.addr = ctypes.addressof(self._anchor)

    @property
    def size(self) -> int:
        return self.pages * self.page

    def pages_for(self, nbytes: int) -> int:
        return max(1, -(-nbytes // self.page))

    # where an arena that an XDP program serves from hooks in (this one serves nothing itself)
    def publish(self, block: StagedBlock) -> None:
        """``block`` is whole in its run and may be served from now on."""

    def retract(self, block: StagedBlock) -> None:
        """``block`` is leaving: serve no more of it (its pages are freed right after)."""

    def refresh(self, blocks: OrderedDict) -> None:
        """Before evicting: move blocks served elsewhere (XDP) since to the recent end."""

    def stats(self) -> dict:
        return {}

    def close(self) -> None:
        """Unmap the buffer, unless views of it are still around (then the GC will)."""
        self._anchor = None
        try:
            self.view.release()
            self.mem.close()
        except BufferError:
            pass


@dataclass
class Run:
    """A run of arena pages: ``view`` and ``addr`` cover its bytes."""
    start: int
    npages: int
    view: memoryview
    addr: int


@dataclass(eq=False)
class StagedBlock:
    """A whole block in the arena, ready to serve: chunk i is ``chunk(i)``."""
    layout: ObjectLayout
    run: Run
    crcs: array
    pins: int = 0
    meta: dict = field(default_factory=dict)

    @property
    def nchunks(self) -> int:
        return self.layout.nchunks

    @property
    def nbytes(self) -> int:
        return self.layout.size

    def chunk(self, i: int) -> tuple[memoryview, int]:
        """(payload, writer's CRC) of chunk i."""
        off, ln = self.layout.chunk_span(i)
        return self.run.view[off:off + ln], self.crcs[i]


class Staging:
    """The staged blocks of one arena, by (namespace, key), least recently used first."""

    def __init__(self, arena: Arena, evict: str = "lru", value_fn=None, on_evict=None):
        self.arena = arena
        self.blocks: OrderedDict[tuple[int, bytes], StagedBlock] = OrderedDict()
        self.evicted_blocks = 0
        self.reserved_pages = 0
        self.on_evict = on_evict
        self.set_eviction(evict, value_fn)

    def set_eviction(self, evict: str, value_fn=None) -> None:
        """``lru``, or ``value`` with ``value_fn(ns, key, nbytes)`` (anything comparable:
        lowest leaves first)."""
        check_eviction(evict, value_fn)
        self.evict, self.value_fn = evict, value_fn
        self._values = None
        if evict == "value":
            self._values = ValueHeap(value_fn)
            self._values.rebuild(self._held())

    def _held(self):
        return [(k, b, b.nbytes) for k, b in self.blocks.items()]

    def _victims(self):
        """Unpinned staged blocks in the order they leave (lazily: the caller removes each
        before asking for the next)."""
        if self.evict == "value":
            yield from self._values.victims(self.blocks, lambda b: b.pins, lambda b: b.nbytes,
                                            self._held)
            return
        while True:
            name = next((k for k, b in self.blocks.items() if not b.pins), None)
            if name is None:
                return
            yield name

    def __len__(self) -> int:
        return len(self.blocks)

    @property
    def used(self) -> int:
        """Bytes of arena the staged and reserved blocks take."""
        return (self.arena.pages - self.arena.free_pages) * self.arena.page

    @property
    def capacity(self) -> int:
        return self.arena.size

    def get(self, ns: int, key: bytes, touch: bool = True) -> StagedBlock | None:
        block = self.blocks.get((ns, key))
        if block is not None and touch:
            self.blocks.move_to_end((ns, key))
        return block

    def reserve(self, nbytes: int) -> Run:
        """A run of at least ``nbytes`` for a block about to be staged, evicting the least
        recently used unpinned blocks as needed. Raises StagingFull."""
        arena = self.arena
        npages = arena.pages_for(nbytes)
        if npages > arena.pages:
            raise StagingFull(f"a {nbytes}-byte block is larger than the {arena.size}-byte "
                              "staging area")
        start = arena.alloc(npages)
        if start is not None:
            return self._reserved(start, npages)
        arena.refresh(self.blocks)
        for victim in self._victims():
            block = self.blocks.get(victim)
            if block is None or block.pins:
                continue
            if self.on_evict is not None:
                self.on_evict(block)
            self.remove(*victim)
            self.evicted_blocks += 1
            start = arena.alloc(npages)
            if start is not None:
                return self._reserved(start, npages)
        raise StagingFull("the staging area is full of blocks in use")

    def _reserved(self, start: int, npages: int) -> Run:
        arena = self.arena
        self.reserved_pages += npages
        lo = start * arena.page
        return Run(start, npages, arena.view[lo:lo + npages * arena.page], arena.addr + lo)

    def release(self, run: Run) -> None:
        """Give back a reserved run that was not committed."""
        self.reserved_pages -= run.npages
        self.arena.release(run.start, run.npages)

    def commit(self, run: Run, layout: ObjectLayout, crcs: array, pins: int = 0,
               meta: dict | None = None) -> StagedBlock:
        """Make a reserved run, now holding ``layout``'s object, the staged copy of its block
        (``meta``: what the arena may know of it, e.g. the source that PUT it)."""
        if layout.size > run.npages * self.arena.page:
            raise ValueError("the block does not fit its run")
        self.reserved_pages -= run.npages
        name = (layout.ns, layout.key)
        old = self.blocks.pop(name, None)
        if old is not None:
            self._free(old)
        block = self.blocks[name] = StagedBlock(layout, run, crcs, pins, dict(meta or {}))
        if self._values is not None:
            self._values.push(name, block, block.nbytes)
        self.arena.publish(block)
        return block

    def remove(self, ns: int, key: bytes) -> bool:
        block = self.blocks.pop((ns, key), None)
        if block is not None:
            self._free(block)
        return block is not None

    def _free(self, block: StagedBlock) -> None:
        self.arena.retract(block)
        self.arena.release(block.run.start, block.run.npages)
