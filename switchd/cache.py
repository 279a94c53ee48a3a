"""Cache entries and the admit set, edited from userspace: put/get/ls/evict/flush chunks in
kv_cache (one at a time or in bulk), admit/unadmit blocks in kv_admit (whose passing pool replies
the data plane learns). Keys and values are the ctypes types BCC built from xdp/kvswitch.h."""
from __future__ import annotations

import ctypes
import time
from dataclasses import dataclass

import numpy as np

from kvproto import KEY_LEN, checksum

from .dataplane import CONSTANTS, DataPlane, SwitchError

FILLED = CONSTANTS["KV_CF_FILLED"]
SPECULATIVE = CONSTANTS["KV_CF_SPECULATIVE"]
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


def _column(rows: np.ndarray, field, values: np.ndarray) -> None:
    """Write little-endian ``values`` (one per row) into a ctypes field's bytes of each row."""
    rows[:, field.offset:field.offset + field.size] = values.view(np.uint8).reshape(len(rows), -1)


def _set_bytes(field, data: bytes) -> None:
    ctypes.memmove(ctypes.addressof(field), data, len(data))


class Cache:
    def __init__(self, dp: DataPlane):
        self.dp = dp
        self.table, self.admit_table = dp.cache, dp.admit
        self.chunk_size = dp.deployment.chunk_size

    def chunk_key(self, ns: int, key: bytes, chunk: int):
        k = self.table.Key()
        k.ns, k.chunk = ns, chunk
        _set_bytes(k.key, key)
        return k

    def block_key(self, ns: int, key: bytes):
        k = self.admit_table.Key()
        k.ns = ns
        _set_bytes(k.key, key)
        return k

    def put(self, ns: int, key: bytes, chunk: int, payload: bytes, nchunks: int = 1) -> None:
        if not 1 <= len(payload) <= self.chunk_size:
            raise SwitchError(f"chunk payload must be 1..{self.chunk_size} bytes, "
                              f"got {len(payload)}")
        if not 0 <= chunk < nchunks:
            raise SwitchError(f"chunk {chunk} is outside a {nchunks}-chunk block")
        v = self.table.Leaf()
        v.len, v.csum, v.nchunks = len(payload), checksum(payload), nchunks
        v.owner.ns, v.owner.chunk = ns, chunk
        _set_bytes(v.owner.key, key)
        _set_bytes(v.data, payload)
        try:
            self.table[self.chunk_key(ns, key, chunk)] = v
        except Exception as exc:
            raise SwitchError(f"cache full or map error: {exc}") from None

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
        ``lengths[i]`` bytes (default: the whole row) each, with BPF_MAP_UPDATE_BATCH: the bulk
        counterpart of ``put``, fast enough for a million entries."""
        table = self.table
        K, V = table.Key, table.Leaf
        n, width = rows.shape
        if width > self.chunk_size or first < 0 or first + n > nchunks:
            raise SwitchError(f"chunks {first}..{first + n - 1} of {width} bytes do not fit a "
                              f"{nchunks}-chunk block of {self.chunk_size}-byte chunks")
        lengths = np.full(n, width) if lengths is None else np.asarray(lengths)
        for lo in range(0, n, batch):
            hi = min(n, lo + batch)
            m = hi - lo
            kb = np.zeros((m, ctypes.sizeof(K)), np.uint8)
            _column(kb, K.ns, np.full(m, ns, "<u4"))
            _column(kb, K.chunk, np.arange(first + lo, first + hi, dtype="<u4"))
            kb[:, K.key.offset:K.key.offset + KEY_LEN] = np.frombuffer(key, np.uint8)
            vb = np.zeros((m, ctypes.sizeof(V)), np.uint8)
            _column(vb, V.len, lengths[lo:hi].astype("<u2"))
            _column(vb, V.csum, np.array([checksum(rows[i, :lengths[i]].tobytes())
                                          for i in range(lo, hi)], "<u4"))
            _column(vb, V.nchunks, np.full(m, nchunks, "<u4"))
            vb[:, V.owner.offset:V.owner.offset + kb.shape[1]] = kb
            vb[:, V.data.offset:V.data.offset + width] = rows[lo:hi]
            try:
                table.items_update_batch((K * m).from_buffer(kb), (V * m).from_buffer(vb))
            except Exception as exc:
                raise SwitchError(f"cache full or map error: {exc}") from None

    def get(self, ns: int, key: bytes, chunk: int) -> tuple[Entry, bytes] | None:
        k = self.chunk_key(ns, key, chunk)
        try:
            v = self.table[k]
        except KeyError:
            return None
        return self._entry(k, v), bytes(v.data[:v.len])

    @staticmethod
    def _entry(k, v) -> Entry:
        return Entry(k.ns, bytes(k.key), k.chunk, v.len, v.nchunks, v.csum, v.hits,
                     bool(v.flags & FILLED), bool(v.flags & SPECULATIVE))

    def entries(self, ns: int | None = None) -> list[Entry]:
        out = [self._entry(k, v) for k, v in self.table.items()]
        return sorted((e for e in out if ns is None or e.ns == ns),
                      key=lambda e: (e.ns, e.key, e.chunk))

    def evict(self, ns: int, key: bytes, chunk: int | None = None) -> int:
        """Remove one chunk, or (chunk=None) every chunk of the block; returns chunks removed."""
        if chunk is not None:
            return self._delete(self.table, self.chunk_key(ns, key, chunk))
        return sum(self._delete(self.table, self.chunk_key(e.ns, e.key, e.chunk))
                   for e in self.entries(ns) if e.key == key)

    def evict_block(self, ns: int, key: bytes, nchunks: int) -> int:
        """Remove a block whose size is known (no scan) and its admission."""
        removed = sum(self._delete(self.table, self.chunk_key(ns, key, c))
                      for c in range(nchunks))
        self.unadmit(ns, key)
        return removed

    def flush(self, ns: int | None = None) -> int:
        return sum(self._delete(self.table, self.chunk_key(e.ns, e.key, e.chunk))
                   for e in self.entries(ns))

    @staticmethod
    def _delete(table, k) -> int:
        try:
            del table[k]
            return 1
        except KeyError:
            return 0

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
