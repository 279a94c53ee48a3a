"""The cache's storage as switchd sees it (xdp/kvswitch.h): kv_cache, an array of chunk slots that
switchd maps into memory and reads in place; kv_blocks, the index of blocks, (ns, key) -> the
block's first slot, chunk count and allocation generation (chunk i at slot base + i); the one
allocator of slot ranges; and the writer through which switchd writes every slot.

Writes: a slot is written in place, by the data plane filling it from a passing pool reply on
any CPU and by switchd, so both follow the slot protocol of xdp/kvslot.h (a sequence word, odd
while a writer holds the slot). switchd never writes slot memory itself: it runs the writer
program (xdp/kvwrite.c) with BPF_PROG_TEST_RUN, one command per slot, which claims the slot
with a compare-and-swap exactly as the fill path does.

Allocation: slot ranges are handed out here only, under a lock shared by every process that
opens the same pinned maps (the daemon, `switchd cache` commands). The index is the books: the
free space is every slot no index entry and no open fill region covers, so a restarted switchd
finds its allocations in the pinned maps. The data plane allocates nothing itself: for a block
admitted before its size was known, or learned speculatively on its first miss, it carves slots
from the fill region switchd grants it (settings KV_SET_FILL_NEXT..END) and inserts the index
entry; switchd takes those entries into its books when it next reads the index. Evicting a
block deletes its index entry: its slots, still stamped with its generation, are no block's
(never served) and are reused by a later allocation."""
from __future__ import annotations

import contextlib
import ctypes
import fcntl
import hashlib
import mmap
import os
import struct
import threading
from dataclasses import dataclass

import numpy as np

from .dataplane import CONSTANTS, DataPlane, SwitchError

HEADER = CONSTANTS["KV_CACHE_VAL_HEADER"]
WRITE_HEADER = CONSTANTS["KV_WRITE_HEADER"]
DONE, BUSY = CONSTANTS["KV_WRITE_DONE"], CONSTANTS["KV_WRITE_BUSY"]
SPECULATIVE = CONSTANTS["KV_CF_SPECULATIVE"]
GEN_LIMIT = CONSTANTS["KV_GEN_DATAPLANE"]        # switchd's generations stay below it
LOCK_DIR = "/run/kvswitch"
_LOCAL = threading.Lock()                         # maps private to this process (unit tests)
BlockId = tuple[int, bytes]


@dataclass(frozen=True)
class Block:
    base: int
    nchunks: int           # chunks in the block
    gen: int
    slots: int             # chunks 0..slots-1 have slots (a prefix if the data plane carved it)


@dataclass
class BlockSummary:
    nchunks: int
    chunks: int = 0        # slots holding a finished chunk
    hits: int = 0          # hits of chunk 0 (every fetch asks for it)
    speculative: bool = False


class Slots:
    """kv_cache and kv_blocks of one data plane (``Slots.of(dp)``: one mapping per data plane)."""

    @classmethod
    def of(cls, dp: DataPlane) -> Slots:
        if getattr(dp, "_slots", None) is None:
            dp._slots = cls(dp)
        return dp._slots

    def __init__(self, dp: DataPlane):
        self.dp, self.table, self.index = dp, dp.cache, dp.blocks
        self.size, self.chunk_size = dp.deployment.cache_entries, dp.deployment.chunk_size
        self.V = V = self.table.Leaf
        self.stride = ctypes.sizeof(V)
        self._mm = mmap.mmap(self.table.get_fd(), self.size * self.stride, mmap.MAP_SHARED,
                             mmap.PROT_READ)
        self.view = np.frombuffer(self._mm, np.uint8).reshape(self.size, self.stride)
        self._seq = V.seq.offset
        owner = dict(V._fields_)["owner"]
        self._owner = (V.owner.offset, owner.ns.offset, owner.chunk.offset, owner.key.offset,
                       ctypes.sizeof(owner))
        self._writer = None

    # ---- the index and the allocator ------------------------------------------------------
    def block(self, ns: int, key: bytes) -> Block | None:
        try:
            v = self.index[self._bkey(ns, key)]
        except KeyError:
            return None
        return Block(v.base, v.nchunks, v.gen, v.slots)

    def blocks(self) -> dict[BlockId, Block]:
        return {(k.ns, bytes(k.key)): Block(v.base, v.nchunks, v.gen, v.slots)
                for k, v in self.index.items()}

    def _bkey(self, ns: int, key: bytes):
        k = self.index.Key()
        k.ns = ns
        ctypes.memmove(ctypes.addressof(k.key), key, len(key))
        return k

    def drop(self, ns: int, key: bytes) -> bool:
        """Forget a block's slots (its chunks are no longer served)."""
        try:
            del self.index[self._bkey(ns, key)]
            return True
        except KeyError:
            return False

    @contextlib.contextmanager
    def allocating(self):
        """The allocator's lock: per pin directory across processes, else this process's."""
        pin = self.dp.deployment.pin_dir
        if not pin:
            with _LOCAL:
                yield
            return
        os.makedirs(LOCK_DIR, exist_ok=True)
        name = hashlib.sha256(os.path.realpath(pin).encode()).hexdigest()[:16]
        with open(os.path.join(LOCK_DIR, f"alloc-{name}.lock"), "a") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            yield

    def _region(self) -> tuple[int, int]:
        return self.dp.get("fill_next"), self.dp.get("fill_end")

    def _used(self, blocks: dict[BlockId, Block]) -> list[tuple[int, int]]:
        used = [(b.base, b.base + b.slots) for b in blocks.values()]
        nxt, end = self._region()
        if nxt < end:
            used.append((nxt, end))
        return sorted(used)

    def _free_runs(self, blocks: dict[BlockId, Block]):
        at = 0
        for lo, hi in self._used(blocks) + [(self.size, self.size)]:
            if lo > at:
                yield at, lo - at
            at = max(at, hi)

    def _fit(self, n: int, blocks: dict[BlockId, Block]) -> int | None:
        return next((at for at, free in self._free_runs(blocks) if free >= n), None)

    def place(self, ns: int, key: bytes, nchunks: int) -> Block:
        """The block's slots: its own if it has a slot for every chunk, else a new range (first
        fit, taking back what the data plane has not carved of its fill region if need be)
        under a new generation, its old range and chunks dropped. Raises SwitchError, keeping
        what the block had, when no free run is long enough."""
        with self.allocating():
            blocks = self.blocks()
            have = blocks.pop((ns, key), None)
            if have and have.nchunks == have.slots == nchunks:
                return have
            base = self._fit(nchunks, blocks)
            if base is None and self.dp.get("fill_end"):
                self.dp.set("fill_end", 0)   # switchd's placements before the region's rest
                base = self._fit(nchunks, blocks)
            if base is None:
                raise SwitchError(f"cache full: no run of {nchunks} free slots")
            gen = self.dp.get("gen") % (GEN_LIMIT - 1) + 1
            self.dp.set("gen", gen)
            self.index[self._bkey(ns, key)] = self.index.Leaf(base, nchunks, gen, nchunks)
            return Block(base, nchunks, gen, nchunks)

    def grant_region(self, size: int) -> tuple[int, int]:
        """Give the data plane a new fill region of up to ``size`` free slots (the largest free
        run if none is that long). Closed first, so no CPU carves across the change."""
        with self.allocating():
            self.dp.set("fill_end", 0)
            runs = list(self._free_runs(self.blocks()))
            fit = [r for r in runs if r[1] >= size]
            base, n = fit[0] if fit else max(runs, key=lambda r: r[1], default=(0, 0))
            n = min(n, size)
            self.dp.set("fill_next", base)
            self.dp.set("fill_end", base + n)
            return base, base + n

    def ensure_region(self, size: int) -> None:
        """A fill region with at least half of ``size`` slots left."""
        nxt, end = self._region()
        if size and end - min(nxt, end) < max(1, size // 2):
            self.grant_region(size)

    # ---- writing (through the writer program) -------------------------------------------
    def _run(self, frame: bytes) -> None:
        from xdp.libbpf import XdpRunner
        if self._writer is None:
            self._writer = XdpRunner(self.dp.writer.fd, WRITE_HEADER + self.chunk_size)
        for _ in range(10000):
            verdict = self._writer.run(frame)
            if verdict == DONE:
                return
            if verdict != BUSY:
                raise SwitchError("the slot writer refused a command (bad slot or length)")
        raise SwitchError("a cache slot stayed busy: the data plane keeps writing it")

    def header_rows(self, m: int) -> np.ndarray:
        """``m`` zeroed write commands' headers (slot index, then a kv_cache_val header)."""
        return np.zeros((m, WRITE_HEADER), np.uint8)

    def field(self, rows: np.ndarray, name: str, values, dtype: str) -> None:
        """Set one kv_cache_val field in command rows (little-endian ``values``, one a row)."""
        f = getattr(self.V, name)
        at = WRITE_HEADER - HEADER + f.offset
        rows[:, at:at + f.size] = np.asarray(values, dtype).reshape(-1, 1).view(np.uint8)

    def write_rows(self, block: Block, ns: int, key: bytes, first: int, cmds: np.ndarray,
                   payloads: list[bytes]) -> None:
        """Write chunk first + i of ``block`` from command row i (its other header fields set by
        the caller) and payload i."""
        m = len(payloads)
        chunks = np.arange(first, first + m)
        cmds[:, 0:4] = (block.base + chunks).astype("<u4").reshape(-1, 1).view(np.uint8)
        self.field(cmds, "gen", np.full(m, block.gen), "<u4")
        self.field(cmds, "nchunks", np.full(m, block.nchunks), "<u4")
        o, ons, ochunk, okey, _ = self._owner
        base = WRITE_HEADER - HEADER + o
        cmds[:, base + ons:base + ons + 4] = np.frombuffer(struct.pack("<I", ns), np.uint8)
        cmds[:, base + ochunk:base + ochunk + 4] = chunks.astype("<u4").reshape(-1, 1).view(
            np.uint8)
        cmds[:, base + okey:base + okey + len(key)] = np.frombuffer(key, np.uint8)
        for row, payload in zip(cmds, payloads):
            self._run(row.tobytes() + payload)

    def clear(self, slot: int) -> None:
        """Empty one slot (it is no chunk's until written again)."""
        self._run(struct.pack("<II", slot, 0) + bytes(HEADER))

    # ---- reading (the mapped array) ------------------------------------------------------
    def read(self, slot: int):
        """A consistent copy of one slot (kv_cache_val), or None if it kept being written."""
        at = slot * self.stride + self._seq
        for _ in range(1000):
            q = int.from_bytes(self._mm[at:at + 8], "little")
            raw = self.view[slot].tobytes()
            if not q & 1 and int.from_bytes(self._mm[at:at + 8], "little") == q:
                return self.V.from_buffer_copy(raw)
        return None

    def column(self, rows: np.ndarray, name: str, dtype: str) -> np.ndarray:
        f = getattr(self.V, name)
        return np.ascontiguousarray(rows[:, f.offset:f.offset + f.size]).view(dtype)[:, 0]

    def held(self, ns: int, key: bytes, b: Block) -> tuple[np.ndarray, np.ndarray]:
        """The block's slots and which of them hold a finished chunk of it (kvslot.h's test:
        even sequence word, the block's generation, a length, the chunk as owner)."""
        rows = self.view[b.base:b.base + b.slots]
        o, ons, ochunk, okey, osize = self._owner
        want = np.zeros((b.slots, osize), np.uint8)
        want[:, ons:ons + 4] = np.frombuffer(struct.pack("<I", ns), np.uint8)
        want[:, ochunk:ochunk + 4] = np.arange(b.slots, dtype="<u4").reshape(-1, 1).view(
            np.uint8)
        want[:, okey:okey + len(key)] = np.frombuffer(key, np.uint8)
        ok = ((self.column(rows, "seq", "<u8") & 1) == 0) & \
             (self.column(rows, "gen", "<u4") == b.gen) & (self.column(rows, "len", "<u2") > 0)
        ok &= (rows[:, o:o + osize] == want).all(axis=1)
        return rows, ok

    def summary(self) -> tuple[dict[BlockId, BlockSummary], int]:
        """Per cached block: its size, chunks held, chunk 0's hits, whether any chunk was filled
        speculatively; and the chunks held in all."""
        out, total = {}, 0
        for (ns, key), b in self.blocks().items():
            rows, ok = self.held(ns, key, b)
            n = int(ok.sum())
            if not n:
                continue
            s = out[(ns, key)] = BlockSummary(b.nchunks, n)
            s.speculative = bool((self.column(rows, "flags", "<u2")[ok] & SPECULATIVE).any())
            if ok[0]:
                s.hits = int(self.column(rows[:1], "hits", "<u8")[0])
            total += n
        return out, total
