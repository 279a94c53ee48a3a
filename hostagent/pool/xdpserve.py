"""A pool node's GETs answered from XDP (xdp/kvserve.c) on its interface.

``ServeProgram`` (an ``xdp.program.Program``) compiles and loads kvserve.c for an arena of a given
size (BCC, a few seconds) and maps its memory: the arena (the program's segment array, one
contiguous mmap), the chunk slots (a numpy structured array over the mmapped slot map) and the block
index. ``XdpArena`` is a ``staging.Arena`` whose buffer *is* that arena, so stores read blocks into
the memory XDP serves from (no copy), and whose ``publish``/``retract`` hooks keep the slots and the
index in the order kvserve.c relies on: a published block's slots are written with their generation
last, then its index entry; a retracted block's index entry is deleted and its generations zeroed
before its slots or bytes can be reused. A block's slots lie where its pages do (no tenant can take
another's); blocks of small chunks share a few dense slots, a namespace's share at most (issue #26:
one block of 64,000 one-byte chunks used to take 64,000 of 65,536). ``XdpServer`` attaches the
program to the interface that holds the bind address in generic mode (replacing a crashed server's
program) and on close puts back a native program holding no map if one was there (a veth end needs
one to receive what a switch sends it with XDP_TX). ``start`` is what ``hostagent serve`` calls: an
``XdpServer``, or None when XDP cannot serve (not root, no interface, another port, no BCC), with
one log line saying which path answers GETs (HOSTAGENT_XDP_SERVE=0 turns XDP off).
"""
from __future__ import annotations

import ctypes
import ipaddress
import json
import logging
import mmap
import os
import socket
import subprocess
from collections import Counter, OrderedDict

import numpy as np

import xdp
from kvproto import PORT
from xdp import NoXdp
from xdp.attach import attach_mode, attach_xdp, detach_port
from xdp.loader import load_xdp
from xdp.program import Program

from .staging import DEFAULT_PAGE, Arena, Runs, StagedBlock

log = logging.getLogger("hostagent.xdpserve")


class ServeProgram(Program, source="kvserve.c", stats="KV_SERVE_STAT_"):
    """kvserve.c loaded (not attached) for an arena of at least ``capacity`` bytes. Its
    constants come from xdp/kvserve.h; its slots are viewed with the layout BCC built from
    struct kv_serve_slot (no copy of it in Python)."""

    def __init__(self, capacity: int):
        self.segs, self.nslots, self.nblocks = sizes(capacity)
        self.mapped_slots = mapped_slots(capacity)
        flags = [f"-DKV_SERVE_SEGS={self.segs}", f"-DKV_SERVE_SLOTS={self.nslots}",
                 f"-DKV_SERVE_BLOCKS={self.nblocks}"]
        self.bpf, fns = load_xdp(xdp.source(self.SOURCE), ("kv_serve", "kv_serve_pass"), flags)
        self.fn, self.pass_fn = fns["kv_serve"], fns["kv_serve_pass"]
        self.fd = self.fn.fd
        tables = {n: self.bpf.get_table(n.encode())
                  for n in ("kvs_arena", "kvs_slots", "kvs_index", "kvs_addrs", "kvs_stats")}
        self.index, self.addrs, self._stats = (tables["kvs_index"], tables["kvs_addrs"],
                                               tables["kvs_stats"])
        rw = mmap.PROT_READ | mmap.PROT_WRITE
        self.arena = mmap.mmap(tables["kvs_arena"].get_fd(), self.segs * SEG, mmap.MAP_SHARED,
                               rw)
        slot = self.struct_dtype(np.dtype(tables["kvs_slots"].Leaf), "KV_SERVE_SLOT_SIZE")
        self._slots_mm = mmap.mmap(tables["kvs_slots"].get_fd(), self.nslots * slot.itemsize,
                                   mmap.MAP_SHARED, rw)
        self.slots = np.frombuffer(self._slots_mm, slot)

    def stats_fd(self) -> int:
        return self._stats.get_fd()

    def index_key(self, ns: int, key: bytes):
        return self.index.Key(ns, (ctypes.c_ubyte * 16)(*key))

    def set_index(self, ns: int, key: bytes, first: int, nchunks: int) -> None:
        self.index[self.index_key(ns, key)] = self.index.Leaf(first, nchunks)

    def del_index(self, ns: int, key: bytes) -> None:
        try:
            del self.index[self.index_key(ns, key)]
        except KeyError:
            pass

    def set_addrs(self, addrs: list[str]) -> None:
        for a in addrs:
            raw = int.from_bytes(socket.inet_aton(a), "little")   # as __be32 reads in memory
            self.addrs[self.addrs.Key(raw)] = self.addrs.Leaf(1)

    def close(self) -> None:
        self.slots = None
        for m in (self._slots_mm, self.arena):
            try:
                m.close()
            except BufferError:
                pass                       # views still alive: the GC unmaps
        self.bpf.cleanup()


C = ServeProgram.C
SEG_SHIFT = C["KV_SERVE_SEG_SHIFT"]
SEG = 1 << SEG_SHIFT
MAX_PAYLOAD = C["KV_MAX_PAYLOAD"]
ENV_SWITCH = "HOSTAGENT_XDP_SERVE"   # 0: never serve from XDP (to measure the difference)
ENV_MODE = "HOSTAGENT_XDP_MODE"      # generic (default) or native: see XdpServer
MIN_CHUNK = 1024          # slots are sized for the arena full of chunks this small (or larger)


DENSE_SHARE = 4          # a quarter more slots, for blocks of small chunks ...
DENSE_PER_NS = 4         # ... a quarter of them per namespace by default


def mapped_slots(capacity: int) -> int:
    """Slots that map the arena, one per MIN_CHUNK bytes (the rest are the dense ones)."""
    return max(1024, capacity // MIN_CHUNK)


def sizes(capacity: int) -> tuple[int, int, int]:
    """(segments, slots, index entries) of a program for an arena of ``capacity`` bytes: a slot
    per MIN_CHUNK bytes of arena (where a block's run is, its slots are), a quarter more for
    blocks of smaller chunks, an index entry per page (a block takes one at least), up to 1M."""
    segs = max(1, -(-capacity // SEG))
    mapped = mapped_slots(capacity)
    return segs, mapped + mapped // DENSE_SHARE, min(max(1024, capacity // DEFAULT_PAGE), 1 << 20)


class XdpArena(Arena):
    """A staging arena in kvserve.c's memory, telling the program of every block in it.

    A block's chunk slots come with its pages: slot ``off // MIN_CHUNK`` for every arena offset
    ``off`` its run covers, so a block of chunks of MIN_CHUNK bytes or more always has them and
    no tenant can take another's (the staging area's LRU decides whose blocks stay). A block of
    more chunks than its run has slots (small chunks) takes a run of the dense slots, at most
    ``dense_per_ns`` of them per namespace and as many per source that PUT them; past that it
    is served by the server process. Index
    entries are one per page (up to 1M, a 4 GiB arena); a larger arena's are shared out per
    namespace the same way."""

    def __init__(self, prog: ServeProgram, size: int, page: int = DEFAULT_PAGE,
                 dense_per_ns: int | None = None):
        super().__init__(size, page, buffer=prog.arena)
        if self.size > prog.segs * SEG or self.size // MIN_CHUNK > prog.mapped_slots:
            raise ValueError("the arena is larger than the program's memory")
        self.prog = prog
        self.dense = Runs(prog.nslots - prog.mapped_slots)
        ndense = prog.nslots - prog.mapped_slots
        self.dense_per_ns = ndense // DENSE_PER_NS if dense_per_ns is None else dense_per_ns
        self.index_per_ns = (prog.nblocks if prog.nblocks >= self.pages
                             else prog.nblocks // DENSE_PER_NS)
        self.ns_dense: Counter = Counter()
        self.src_dense: Counter = Counter()
        self.ns_index: Counter = Counter()
        self._gen = 0
        self.counters = Counter(xdp_published=0, xdp_unpublished=0)

    def _slots_for(self, block: StagedBlock) -> tuple[int, bool] | None:
        """(first slot, dense?) for ``block``, or None: it is left to the server process."""
        n, ns, run = block.nchunks, block.layout.ns, block.run
        lo = -(-run.start * self.page // MIN_CHUNK)
        hi = (run.start + run.npages) * self.page // MIN_CHUNK
        if n <= hi - lo:
            return lo, False
        src = block.meta.get("source")                   # (None: read from a backing store)
        if self.ns_dense[ns] + n > self.dense_per_ns or \
                (src is not None and self.src_dense[src] + n > self.dense_per_ns):
            self.counters["xdp_dense_refused"] += 1
            return None
        first = self.dense.alloc(n)
        if first is None:
            self.counters["xdp_dense_full"] += 1
            return None
        self.ns_dense[ns] += n
        if src is not None:
            self.src_dense[src] += n
        return self.prog.mapped_slots + first, True

    def _free_slots(self, block: StagedBlock, first: int) -> None:
        if block.meta.pop("xdp_dense", False):
            ns, n = block.layout.ns, block.nchunks
            self.dense.release(first - self.prog.mapped_slots, n)
            src = block.meta.get("source")
            for counter, name in ((self.ns_dense, ns), (self.src_dense, src)):
                if name is not None:
                    counter[name] -= n
                    if counter[name] <= 0:
                        del counter[name]

    def _next_gen(self) -> int:
        self._gen = self._gen % 0xFFFFFFFF + 1          # never 0
        return self._gen

    def publish(self, block: StagedBlock) -> None:
        lay, n = block.layout, block.nchunks
        if lay.chunk_size > MAX_PAYLOAD or self.ns_index[lay.ns] >= self.index_per_ns:
            self.counters["xdp_unpublished"] += 1
            return
        got = self._slots_for(block)
        if got is None:                                  # out of slots: Python serves it
            self.counters["xdp_unpublished"] += 1
            return
        first, dense = got
        block.meta["xdp_dense"] = dense
        s = self.prog.slots[first:first + n]
        s["gen"] = 0
        s["ns"] = lay.ns
        s["key"] = np.frombuffer(lay.key, np.uint8)
        s["chunk"] = np.arange(n, dtype=np.uint32)
        s["nchunks"] = n
        s["len"] = lay.chunk_size
        s["len"][-1] = lay.payload_len - (n - 1) * lay.chunk_size
        s["crc"] = np.frombuffer(block.crcs, np.uint32, n)
        s["off"] = (block.run.start * self.page + lay.payload_off +
                    np.arange(n, dtype=np.uint64) * lay.chunk_size)
        s["last_ns"] = 0
        s["gen"] = self._next_gen()                     # last: now each slot may be served
        try:
            self.prog.set_index(lay.ns, lay.key, first, n)
        except Exception:                                # index full: Python serves it
            s["gen"] = 0
            self._free_slots(block, first)
            self.counters["xdp_unpublished"] += 1
            return
        block.meta["xdp_slots"] = first
        self.ns_index[lay.ns] += 1
        self.counters["xdp_published"] += 1

    def retract(self, block: StagedBlock) -> None:
        first = block.meta.pop("xdp_slots", None)
        if first is None:
            return
        n, ns = block.nchunks, block.layout.ns
        self.prog.del_index(ns, block.layout.key)                # first: no new lookups
        self.prog.slots["gen"][first:first + n] = 0              # then: no copy is sent
        self._free_slots(block, first)
        self.ns_index[ns] -= 1
        if not self.ns_index[ns]:
            del self.ns_index[ns]

    def refresh(self, blocks: OrderedDict) -> None:
        """Blocks whose chunk 0 XDP served since the last look go to the recent end, in the
        order XDP served them."""
        last = self.prog.slots["last_ns"]
        served = []
        for name, b in blocks.items():
            first = b.meta.get("xdp_slots")
            if first is not None and int(last[first]) > b.meta.get("xdp_seen", 0):
                b.meta["xdp_seen"] = int(last[first])
                served.append((b.meta["xdp_seen"], name))
        for _, name in sorted(served):
            blocks.move_to_end(name)

    def stats(self) -> dict:
        return {**self.counters, "xdp_dense_slots_used": sum(self.ns_dense.values()),
                **{f"xdp_{k}": v for k, v in self.prog.counters().items()}}

    def close(self) -> None:
        super().close()


def _ip_json(*args: str) -> list:
    out = subprocess.run(["ip", "-j", *args], capture_output=True, text=True, check=True).stdout
    return json.loads(out or "[]")


def interface_for(host: str) -> tuple[str, list[str]]:
    """(interface, its IPv4 addresses GETs may be sent to) serving bind address ``host``:
    the one non-loopback interface holding it (any: the only non-loopback one with IPv4)."""
    wild = ipaddress.ip_address(host).is_unspecified
    found = []
    for link in _ip_json("-4", "addr", "show"):
        if "LOOPBACK" in link.get("flags", ()) or link.get("ifname") == "lo":
            continue
        addrs = [a["local"] for a in link.get("addr_info", ()) if a.get("family") == "inet"]
        if wild and addrs:
            found.append((link["ifname"], addrs))
        elif host in addrs:
            found.append((link["ifname"], [host]))
    if len(found) != 1:
        raise NoXdp(f"{len(found)} interfaces hold {host} (XDP serves from exactly one)")
    return found[0]


class XdpServer:
    """kvserve attached to ``ifname``, serving the staging arena it makes for a store.

    Attached in generic (SKB) mode by default: a reply it sends with XDP_TX then leaves like any
    frame the stack sends, so it arrives whatever the far end runs (a veth end drops frames sent
    from native XDP unless its peer carries an XDP program, and a switch port without switchd
    carries none). A node's native program (the testbed's XDP_PASS) makes way meanwhile.
    ``mode="native"`` (``HOSTAGENT_XDP_MODE=native``) attaches it in place of that native
    program, for a node whose peer always runs XDP (a switch port under switchd, a testbed's
    plain-bridge port): its replies go out as XDP frames, not skbs (measured no faster than
    generic while GETs reach it through a Linux bridge: docs/throughput.md); while the peer has
    no program its replies are lost (askers retry)."""

    def __init__(self, capacity: int, ifname: str, addrs: list[str], mode: str | None = None):
        self.ifname, self.addrs = ifname, addrs
        self.mode = mode or os.environ.get(ENV_MODE, "generic")
        if self.mode not in ("generic", "native"):
            raise NoXdp(f"{ENV_MODE} must be generic or native, not {self.mode!r}")
        self.prog = ServeProgram(capacity)
        try:
            self.prog.set_addrs(addrs)
            self.had_native = attach_mode(ifname) == "native"
            if self.had_native and self.mode == "generic":
                detach_port(ifname, "native")
            attach_xdp(ifname, self.prog.fn, self.mode)  # replaces a stale server's program
        except Exception as exc:
            self.prog.close()
            raise NoXdp(f"attaching to {ifname}: {exc}") from None
        self.attached = True

    def arena(self, size: int, page: int = DEFAULT_PAGE,
              dense_per_ns: int | None = None) -> XdpArena:
        return XdpArena(self.prog, size, page, dense_per_ns)

    def detach(self) -> None:
        """Take the program off; a native one was there: a map-less passing one goes back."""
        if not self.attached:
            return
        self.attached = False
        try:
            detach_port(self.ifname, self.mode)
            if self.had_native:
                attach_xdp(self.ifname, self.prog.pass_fn)
        except Exception as exc:                        # the interface went away
            log.warning("detaching from %s: %s", self.ifname, exc)

    def close(self) -> None:
        self.detach()
        self.prog.close()


def start(host: str, port: int, store) -> XdpServer | None:
    """Serve ``store``'s staged blocks from XDP when this process can (its staging arena moves
    into the program's memory), else None; logs which path answers GETs either way."""
    try:
        if os.environ.get(ENV_SWITCH, "1") == "0":
            raise NoXdp(f"{ENV_SWITCH}=0")
        if port != PORT:
            raise NoXdp(f"XDP serves port {PORT} only, not {port}")
        if os.geteuid() != 0:
            raise NoXdp("not root")
        ifname, addrs = interface_for(host)
        server = XdpServer(store.capacity, ifname, addrs)
    except (NoXdp, OSError, ValueError, subprocess.CalledProcessError) as exc:
        log.warning("GETs are answered by the server process (asyncio): no XDP serving (%s)",
                    exc)
        return None
    try:
        store.use_arena(server.arena(store.capacity, store.staging.arena.page,
                                     getattr(store, "xdp_slots_per_ns", None)))
    except Exception:
        server.close()
        raise
    log.warning("GETs for staged blocks are answered by XDP on %s (%s), the rest by the "
                "server process", ifname, ", ".join(addrs))
    return server
