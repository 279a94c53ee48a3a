"""Cache entries and the admit set, edited from userspace: put/get/ls/evict/flush chunks of the
switch's cache (slots in kv_cache found through the block index kv_blocks, written only through
the slot writer: switchd/slots.py), admit/unadmit blocks in kv_admit (whose passing pool replies
the data plane learns). Keys and values are the ctypes types BCC built from xdp/kvswitch.h."""
from __future__ import annotations

import ctypes
import time
from dataclasses import dataclass

import numpy as np

from kvproto import KEY_LEN, checksum

from .dataplane import CONSTANTS, DataPlane, SwitchError
from .slots import Slots

FILLED = CONSTANTS["KV_CF_FILLED"]
SPECULATIVE = CONSTANTS["KV_CF_SPECULATIVE"]
UNCHECKED = CONSTANTS["KV_CF_UNCHECKED"]
PINNED = CONSTANTS["KV_AF_PINNED"]


def monotonic_ns() -> int:
    """The clock of bpf_ktime_get_ns()."""
    return time.clock_gettime_ns(time.CLOCK_MONOTONIC)


@dataclass(frozen=True)
class Entry:
    ns: int
    key: bytes
    chunk: int
    len: int
    nchunks: int
    csum: int
    hits: int
    filled: bool
    speculative: bool = False   # filled before its block was admitted: switchd still decides

    def as_dict(self) -> dict:
        return {"ns": self.ns, "key": self.key.hex(), "chunk": self.chunk, "len": self.len,
                "nchunks": self.nchunks, "csum": self.csum, "hits": self.hits,
                "source": "speculative" if self.speculative else
                          "filled" if self.filled else "put"}


def parse_key(text: str) -> bytes:
    """A block key given as 32 hex digits."""
    try:
        key = bytes.fromhex(text)
    except ValueError:
        raise SwitchError(f"block key {text!r} is not hex") from None
    if len(key) != KEY_LEN:
        raise SwitchError(f"block key must be {KEY_LEN} bytes (32 hex digits), got {len(key)}")
    return key


def _set_bytes(field, data: bytes) -> None:
    ctypes.memmove(ctypes.addressof(field), data, len(data))


class Cache:
    def __init__(self, dp: DataPlane, region: int | None = None):
        """``region``: slots the data plane may carve for blocks it learns before switchd
        placed them (default: the cache's whole size, i.e. the largest free run: an admitted
        block is learned whole on its first pass while there is room, as with a hash map;
        speculative fills of blocks not admitted are bounded by the policy's spec_fill budget,
        not by the region, and switchd's placements take back what is not carved)."""
        self.dp = dp
        self.slots = Slots.of(dp)
        self.admit_table = dp.admit
        self.chunk_size = dp.deployment.chunk_size
        self.region = dp.deployment.cache_entries if region is None else region
        self.slots.ensure_region(self.region)

    def block_key(self, ns: int, key: bytes):
        k = self.admit_table.Key()
        k.ns = ns
        _set_bytes(k.key, key)
        return k

    def slot_of(self, ns: int, key: bytes, chunk: int) -> int | None:
        """The slot chunk ``chunk`` of the block has (held or not), if the block has slots."""
        b = self.slots.block(ns, key)
        return b.base + chunk if b and 0 <= chunk < b.slots else None

    def put(self, ns: int, key: bytes, chunk: int, payload: bytes, nchunks: int = 1) -> None:
        if not 1 <= len(payload) <= self.chunk_size:
            raise SwitchError(f"chunk payload must be 1..{self.chunk_size} bytes, "
                              f"got {len(payload)}")
        if not 0 <= chunk < nchunks:
            raise SwitchError(f"chunk {chunk} is outside a {nchunks}-chunk block")
        self.put_chunks(ns, key, chunk, np.frombuffer(payload, np.uint8).reshape(1, -1), nchunks)

    def put_block(self, ns: int, key: bytes, data: bytes) -> int:
        """Put every chunk of a block (as the host agent would cut it); returns chunks put."""
        cs = self.chunk_size
        n = -(-len(data) // cs)
        rows = np.zeros((n, cs), np.uint8)
        rows.reshape(-1)[:len(data)] = np.frombuffer(data, np.uint8)
        lengths = np.full(n, cs)
        lengths[-1] = len(data) - (n - 1) * cs
        self.put_chunks(ns, key, 0, rows, n, lengths)
        return n

    def put_chunks(self, ns: int, key: bytes, first: int, rows: np.ndarray, nchunks: int,
                   lengths: np.ndarray | None = None, batch: int = 1 << 16) -> None:
        """Chunks first.. first+len(rows)-1 of a block of ``nchunks``, row i's first
        ``lengths[i]`` bytes (default: the whole row) each: the block gets its slots (kept if
        it has a range of that size) and each chunk is written through the slot writer."""
        n, width = rows.shape
        if width > self.chunk_size or first < 0 or first + n > nchunks:
            raise SwitchError(f"chunks {first}..{first + n - 1} of {width} bytes do not fit a "
                              f"{nchunks}-chunk block of {self.chunk_size}-byte chunks")
        lengths = np.full(n, width) if lengths is None else np.asarray(lengths)
        block = self.slots.place(ns, key, nchunks)
        for lo in range(0, n, batch):
            hi = min(n, lo + batch)
            payloads = [rows[i, :lengths[i]].tobytes() for i in range(lo, hi)]
            cmds = self.slots.header_rows(hi - lo)
            self.slots.field(cmds, "len", lengths[lo:hi], "<u2")
            self.slots.field(cmds, "csum", [checksum(p) for p in payloads], "<u4")
            self.slots.write_rows(block, ns, key, first + lo, cmds, payloads)

    def get(self, ns: int, key: bytes, chunk: int) -> tuple[Entry, bytes] | None:
        b = self.slots.block(ns, key)
        if not b or not 0 <= chunk < b.slots:
            return None
        v = self.slots.read(b.base + chunk)
        o = v.owner if v else None
        if not v or v.gen != b.gen or not v.len or (o.ns, o.chunk, bytes(o.key)) != (
                ns, chunk, key):
            return None
        data = bytes(v.data[:v.len])
        if v.flags & UNCHECKED and checksum(data) != v.csum:
            return None                # learned, not checked yet, and would fail: never served
        return self._entry(ns, key, chunk, v), data

    @staticmethod
    def _entry(ns, key, chunk, v) -> Entry:
        return Entry(ns, key, chunk, v.len, v.nchunks, v.csum, v.hits,
                     bool(v.flags & FILLED), bool(v.flags & SPECULATIVE))

    def entries(self, ns: int | None = None) -> list[Entry]:
        out = []
        for (bns, key), b in self.slots.blocks().items():
            if ns is not None and bns != ns:
                continue
            rows, ok = self.slots.held(bns, key, b)
            cols = {name: self.slots.column(rows, name, dt) for name, dt in (
                ("len", "<u2"), ("nchunks", "<u4"), ("csum", "<u4"), ("hits", "<u8"),
                ("flags", "<u2"))}
            for i in np.flatnonzero(ok):
                fl = int(cols["flags"][i])
                out.append(Entry(bns, key, int(i), int(cols["len"][i]), int(cols["nchunks"][i]),
                                 int(cols["csum"][i]), int(cols["hits"][i]), bool(fl & FILLED),
                                 bool(fl & SPECULATIVE)))
        return sorted(out, key=lambda e: (e.ns, e.key, e.chunk))

    def count(self) -> int:
        """Chunks the cache holds."""
        return self.slots.summary()[1]

    def _held(self, ns: int, key: bytes) -> int:
        b = self.slots.block(ns, key)
        return int(self.slots.held(ns, key, b)[1].sum()) if b else 0

    def evict(self, ns: int, key: bytes, chunk: int | None = None) -> int:
        """Remove one chunk, or (chunk=None) every chunk of the block; returns chunks removed."""
        if chunk is None:
            held = self._held(ns, key)
            self.slots.drop(ns, key)
            return held
        if self.get(ns, key, chunk) is None:
            return 0
        self.slots.clear(self.slot_of(ns, key, chunk))
        return 1

    def evict_block(self, ns: int, key: bytes, nchunks: int) -> int:
        """Remove a block and its admission."""
        removed = self.evict(ns, key)
        self.unadmit(ns, key)
        return removed

    def flush(self, ns: int | None = None) -> int:
        removed = sum(self.evict(bns, key) for bns, key in self.slots.blocks()
                      if ns is None or bns == ns)
        if ns is None:
            self.slots.grant_region(self.region)
        return removed

    @staticmethod
    def _delete(table, k) -> int:
        try:
            del table[k]
            return 1
        except KeyError:
            return 0

    def place_admitted(self, sizes: dict[tuple[int, bytes], int]) -> None:
        """Give every admitted block of known size that has no slots yet, or slots for a prefix
        of its chunks only, its range (the data plane then fills it as its replies pass)."""
        have = self.slots.blocks()
        for block in self.admitted():
            b = have.get(block)
            n = b.nchunks if b else sizes.get(block)
            if n and (not b or b.slots < n):
                try:
                    self.slots.place(*block, n)
                except SwitchError:
                    pass               # full: the policy's next evictions make room

    def tend(self, sizes: dict[tuple[int, bytes], int], room: int = 0) -> None:
        """Each interval, policy or not: admitted blocks of known size get their ranges and the
        data plane a fill region of at least ``room`` (the cache's region if larger)."""
        self.place_admitted(sizes)
        self.slots.ensure_region(max(room, self.region))

    def admit(self, ns: int, key: bytes, ttl: float | None = None, pinned: bool = False) -> None:
        """Add a block to the admit set; ``pinned`` ones are never evicted by the policy (until
        ``ttl`` seconds have passed, when given)."""
        v = self.admit_table.Leaf()
        v.expires_ns = monotonic_ns() + int(ttl * 1e9) if ttl else 0
        v.flags = PINNED if pinned else 0
        self.admit_table[self.block_key(ns, key)] = v

    def admit_entries(self) -> dict[tuple[int, bytes], tuple[int, int]]:
        """(ns, key) -> (flags, expires_ns) of every admitted block."""
        return {(k.ns, bytes(k.key)): (v.flags, v.expires_ns)
                for k, v in self.admit_table.items()}

    def unadmit(self, ns: int, key: bytes) -> bool:
        return bool(self._delete(self.admit_table, self.block_key(ns, key)))

    def admitted(self) -> list[tuple[int, bytes]]:
        return sorted((k.ns, bytes(k.key)) for k in self.admit_table.keys())
