"""The pool disk tier (issue #29): blocks that leave a pool node's DRAM kept in a local
directory, bounded in bytes, and staged back on a GET instead of being lost.

A block is written as the object the staging arena holds (``hostagent.pool.blockfmt``: a 64-byte
header naming it, with its own CRC over the header and the writer's CRC-32 of every chunk,
then the payload), so the file is self-checking with the project's CRCs: on a read the header
and every chunk are checked against them, and the file must be exactly the object's size. One
file a block, ``<ns hex>-<key hex>.kvb``, written to a temporary name and renamed (a reader
never sees half a file; a crash leaves at most a ``.tmp`` file, removed at the next start).
No fsync by default: a block torn by a power cut fails its CRCs and is dropped like any
corrupt file. The write itself runs in a worker thread, from a copy (``max_pending`` bytes of
copies at most, then the caller writes): the pool's event loop pays a memory copy, not the
disk.

The index (which blocks, their sizes, least recently used first) lives in memory and is
rebuilt from the directory at start (file names, sizes, modification times, each header and
CRC array read and checked), so the tier survives a pool process restart. Past
``capacity_bytes`` the least recently used files go first. A corrupt file is dropped with one
log line; a write that fails (full disk, unwritable directory) logs one line, the block is not
kept and the pool keeps serving from DRAM (one more line when writes work again).

Nothing here touches the network or the staging arena's bookkeeping: ``hostagent.pool.store``
writes evicted blocks here (``write``) and reads them back into a reserved run (``read_into``).
"""
from __future__ import annotations

import errno
import logging
import os
import re
import threading
from array import array
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from .blockfmt import (HEAD_LEN, HEAD, BlockFormatError, ObjectLayout, bad_chunks, read_crcs,
                       read_layout)

log = logging.getLogger("hostagent.disk")

SUFFIX = ".kvb"
DEFAULT_PENDING = 256 << 20       # bytes of evicted blocks copied and waiting for the writer
_NAME = re.compile(r"^([0-9a-f]{8})-([0-9a-f]{32})\.kvb$")


class DiskCorrupt(Exception):
    """A block's file failed its checks (it has been dropped)."""


def file_name(ns: int, key: bytes) -> str:
    return f"{ns:08x}-{key.hex()}{SUFFIX}"


class DiskTier:
    """Blocks on local disk under ``directory``, ``capacity_bytes`` of them at most."""

    def __init__(self, directory: str | os.PathLike, capacity_bytes: int, fsync: bool = False,
                 max_pending: int = DEFAULT_PENDING):
        if capacity_bytes <= 0:
            raise ValueError("a disk tier's capacity must be positive")
        self.dir = Path(directory)
        self.capacity, self.fsync, self.max_pending = int(capacity_bytes), fsync, max_pending
        self.pending: dict[tuple[int, bytes], bytes] = {}     # copies being written
        self.pending_bytes = 0
        self._cancelled: list = []            # pending copies removed before they landed
        self._writer: ThreadPoolExecutor | None = None
        self.index: OrderedDict[tuple[int, bytes], int] = OrderedDict()   # name -> bytes
        self.used = 0
        self.counters = {"disk_writes": 0, "disk_write_bytes": 0, "disk_reads": 0,
                         "disk_read_bytes": 0, "disk_corrupt": 0, "disk_dropped": 0,
                         "disk_write_errors": 0, "disk_skipped": 0}
        self.failing: str | None = None       # why writes fail now (logged once)
        self._lock = threading.Lock()         # reads run in worker threads
        self._tmp = f".tmp.{os.getpid()}."
        self._open()

    # ---- start -------------------------------------------------------------------------
    def _open(self) -> None:
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            entries = list(os.scandir(self.dir))
        except OSError as exc:
            self._failed(exc, "open")
            return
        found = []
        for e in entries:
            if e.name.startswith(".tmp."):
                _unlink(e.path)
                continue
            m = _NAME.match(e.name)
            if not m or not e.is_file():
                continue
            ns, key = int(m.group(1), 16), bytes.fromhex(m.group(2))
            st = e.stat()
            try:
                self._check_head(e.path, ns, key, st.st_size)
            except (OSError, BlockFormatError) as exc:
                self._corrupt(e.path, exc)
                continue
            found.append((st.st_mtime_ns, e.name, ns, key, st.st_size))
        for _, _, ns, key, size in sorted(found):          # least recently used first
            self.index[(ns, key)] = size
            self.used += size
        while self.used > self.capacity and self.index:
            self._drop_oldest()
        if self.index:
            log.info("disk tier %s: %d blocks, %d bytes found", self.dir, len(self.index),
                     self.used)

    @staticmethod
    def _check_head(path: str, ns: int, key: bytes, size: int) -> None:
        with open(path, "rb", buffering=0) as f:
            head = f.read(HEAD_LEN)
            if len(head) < HEAD_LEN:
                raise BlockFormatError(f"{len(head)} bytes is shorter than a block header")
            nchunks = HEAD.unpack_from(head)[5]
            head += f.read(min(4 * nchunks, max(0, size - HEAD_LEN)))
        read_layout(head, size, ns, key)       # reads the header and CRC array only

    # ---- what the store calls ----------------------------------------------------------
    def __contains__(self, name: tuple[int, bytes]) -> bool:
        return name in self.index or name in self.pending

    def __len__(self) -> int:
        return len(self.index) + len(self.pending)

    def size(self, ns: int, key: bytes, touch: bool = True) -> int | None:
        """Bytes of a block's object on disk or on its way there (None: neither); ``touch``:
        now most recent (so the evictions its staging-back causes do not drop it first)."""
        with self._lock:
            data = self.pending.get((ns, key))
            if data is not None:
                return len(data)
            size = self.index.get((ns, key))
            if size is not None and touch:
                self.index.move_to_end((ns, key))
        return size

    def write(self, ns: int, key: bytes, obj, wait: bool = False) -> bool:
        """Keep a block (``obj``: its whole stored object, header first) on disk; True if it is
        (or already was) there, or on its way. Unless ``wait``, the bytes are copied and written
        by a worker thread while fewer than ``max_pending`` bytes wait (the caller's buffer is
        free at once; a GET meanwhile is answered from the copy). Never raises: a failure is
        logged once and counted."""
        name, view = (ns, key), memoryview(obj)
        size = len(view)
        with self._lock:
            if name in self.index:            # blocks are immutable: the copy there is it
                self.index.move_to_end(name)
                return True
            if name in self.pending:
                return True
            if size > self.capacity:
                self.counters["disk_skipped"] += 1
                return False
            later = not wait and self.pending_bytes + size <= self.max_pending
        if not later:
            return self._write_file(name, view)
        data = bytes(view)
        with self._lock:
            self.pending[name] = data
            self.pending_bytes += size
        if self._writer is None:
            self._writer = ThreadPoolExecutor(1, thread_name_prefix="disk-writer")
        self._writer.submit(self._write_pending, name, data)
        return True

    def drain(self) -> None:
        """Wait until every pending write has landed (or failed)."""
        if self._writer is not None:
            self._writer.submit(lambda: None).result()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.shutdown(wait=True)
            self._writer = None

    def _write_pending(self, name, data: bytes) -> None:
        try:
            self._write_file(name, data)
        finally:
            with self._lock:
                if self.pending.get(name) is data:
                    del self.pending[name]
                    self.pending_bytes -= len(data)
                elif any(c is data for c in self._cancelled):    # removed meanwhile
                    self._cancelled = [c for c in self._cancelled if c is not data]
                    if name in self.index and name not in self.pending:
                        self.used -= self.index.pop(name)
                        _unlink(self.dir / file_name(*name))

    def _write_file(self, name, obj) -> bool:
        ns, key = name
        view = memoryview(obj)
        size = len(view)
        with self._lock:
            while self.used + size > self.capacity and self.index:
                self._drop_oldest()
        final = self.dir / file_name(ns, key)
        tmp = self.dir / (self._tmp + final.name)
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                done = 0
                while done < size:
                    done += os.write(fd, view[done:])
                if self.fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            os.rename(tmp, final)
        except OSError as exc:
            _unlink(tmp)
            self.counters["disk_write_errors"] += 1
            self._failed(exc, "write")
            return False
        with self._lock:
            self.used += size - self.index.pop(name, 0)
            self.index[name] = size
            self.counters["disk_writes"] += 1
            self.counters["disk_write_bytes"] += size
        if self.failing is not None:
            log.warning("disk tier %s: writable again: blocks leaving DRAM are kept on disk",
                        self.dir)
            self.failing = None
        return True

    def read_into(self, ns: int, key: bytes, buf) -> tuple[ObjectLayout, array]:
        """Read a block's object into ``buf`` (at least ``size(ns, key)`` bytes) and check it:
        its layout and chunk CRCs. Raises KeyError (not here) or DiskCorrupt (dropped). Safe
        to call from a worker thread."""
        with self._lock:
            data = self.pending.get((ns, key))
            size = len(data) if data is not None else self.index.get((ns, key))
        if size is None:
            raise KeyError((ns, key))
        path = self.dir / file_name(ns, key)
        view = memoryview(buf)[:size]
        if data is not None:                  # still on its way: from the copy
            view[:] = data
            layout = read_layout(view, size, ns, key)
            return layout, read_crcs(view, layout)
        try:
            with open(path, "rb", buffering=0) as f:
                got = f.readinto(view)
                if got != size or f.read(1):
                    raise BlockFormatError(f"{got} bytes, the index says {size}")
            layout = read_layout(view, size, ns, key)
            crcs = read_crcs(view, layout)
            bad = bad_chunks(view, layout, crcs)
            if bad:
                raise BlockFormatError(f"{len(bad)} chunk(s) do not match their CRC "
                                       f"(first: {bad[0]})")
        except FileNotFoundError:
            self._forget(ns, key)
            raise KeyError((ns, key)) from None
        except (OSError, BlockFormatError) as exc:
            self._forget(ns, key)
            self._corrupt(str(path), exc)
            raise DiskCorrupt(f"{path.name}: {exc}") from None
        with self._lock:
            if (ns, key) in self.index:
                self.index.move_to_end((ns, key))
            self.counters["disk_reads"] += 1
            self.counters["disk_read_bytes"] += size
        try:
            os.utime(path)                    # recency survives a restart
        except OSError:
            pass
        return layout, crcs

    def remove(self, ns: int, key: bytes) -> bool:
        with self._lock:
            data = self.pending.pop((ns, key), None)
            if data is not None:
                self.pending_bytes -= len(data)
                self._cancelled.append(data)
        if not self._forget(ns, key):
            return data is not None
        _unlink(self.dir / file_name(ns, key))
        return True

    def stats(self) -> dict:
        return {"disk_blocks": len(self.index), "disk_bytes": self.used,
                "disk_capacity": self.capacity, "disk_ok": int(self.failing is None),
                "disk_pending": len(self.pending), "disk_pending_bytes": self.pending_bytes,
                **self.counters}

    # ---- internals -----------------------------------------------------------------------
    def _forget(self, ns: int, key: bytes) -> bool:
        with self._lock:
            size = self.index.pop((ns, key), None)
            if size is not None:
                self.used -= size
        return size is not None

    def _drop_oldest(self) -> None:
        (ns, key), size = self.index.popitem(last=False)
        self.used -= size
        self.counters["disk_dropped"] += 1
        _unlink(self.dir / file_name(ns, key))

    def _corrupt(self, path: str, exc: Exception) -> None:
        self.counters["disk_corrupt"] += 1
        log.warning("disk tier: %s is corrupt (%s): dropped", path, exc)
        _unlink(path)

    def _failed(self, exc: OSError, doing: str) -> None:
        why = exc.strerror or str(exc)
        if exc.errno == errno.ENOSPC:
            why = "disk full"
        if self.failing is None:
            log.warning("disk tier %s: cannot %s (%s): blocks leaving DRAM are dropped, the "
                        "pool keeps serving from DRAM", self.dir, doing, why)
        self.failing = why


def _unlink(path) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
