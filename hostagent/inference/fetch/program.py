"""xdp/kvfetch.c as the engine runs it: compiled once per chunk size (``xdp.loader``'s bytecode
cache: BCC only on the first compile, milliseconds to load after that, in any process or
namespace), loaded with maps of the engine's own sizes (the arena's size is chosen at load time,
not compile time), its maps mmapped as numpy arrays; and ``FetchAttachment``, the programs the
engine may take the place of on the node's interface.

A veth end carries an XDP program anyway (the testbed's ``xdp_pass``: frames sent with XDP_TX
into a veth are dropped unless its peer has one); kv_fetch passes every frame that is not its
own, so it can stand in. It also stands in for the testbed's loss injector (``xdp_lossy``),
dropping the same share of KV frames (its ``loss_ppm`` is read from the injector's map). It
takes the place of a kv_fetch whose process is gone, never of one still running (its control
block records its pid) nor of any other program: then the asyncio client is used.

``FetchProgram`` is loaded, not attached (the engine attaches it with a ``FetchAttachment``;
the XDP tests run it on crafted frames).
"""
from __future__ import annotations

import mmap
import os
import struct

import numpy as np

import xdp
from kvproto import check_chunk_size
from xdp import NoXdp, libbpf, loader
from xdp.attach import Attachment
from xdp.program import Program

PROG_NAME = "kv_fetch"
MAP_NAMES = ("kvf_arena", "kvf_meta", "kvf_xfers", "kvf_ctl", "kvf_routes", "kvf_stats")
SIZED_BY_SLOTS = ("kvf_arena", "kvf_meta")
STAND_INS = ("xdp_pass", "xdp_lossy")       # programs the engine may stand in for


def bytecode(chunk_size: int) -> loader.Bytecode:
    """kv_fetch compiled for ``chunk_size``: from the cache, else compiled (once) and cached."""
    return loader.cached_bytecode(xdp.source(FetchProgram.SOURCE), PROG_NAME,
                                  [f"-DKV_CHUNK={chunk_size}"], MAP_NAMES)


class FetchProgram(Program, source="kvfetch.c", stats="KV_FETCH_STAT_"):
    """kv_fetch loaded for one chunk size with an arena of ``slots`` chunks, its mmapable maps
    as numpy arrays (no system call per access)."""

    XFER_DTYPE = np.dtype([("gen", "<u4"), ("ns", "<u4"), ("key", "u1", 16),
                           ("nchunks", "<u4"), ("base", "<u4"), ("nslots", "<u4"),
                           ("route", "<u4"), ("status", "<u4"), ("err", "<u4"),
                           ("received", "<u4"), ("tail_len", "<u4"), ("seen_nchunks", "<u4"),
                           ("bad", "<u4")])
    CTL_DTYPE = np.dtype([("port", "<u4"), ("loss_ppm", "<u4"), ("owner", "<u4"),
                          ("reserved", "<u4")])

    def __init__(self, chunk_size: int, slots: int):
        check_chunk_size(chunk_size)
        self.chunk_size, self.slots = chunk_size, slots
        self.fds: dict[str, int] = {}
        self._mms: list[mmap.mmap] = []
        code = bytecode(chunk_size)
        self.fd, self.fds = loader.load_bytecode(code, PROG_NAME,
                                                 {name: slots for name in SIZED_BY_SLOTS})
        self._route_size = code.maps["kvf_routes"][2]

        def mm(name: str, nbytes: int) -> mmap.mmap:
            m = mmap.mmap(self.fds[name], nbytes, mmap.MAP_SHARED,
                          mmap.PROT_READ | mmap.PROT_WRITE)
            self._mms.append(m)
            return m

        arena = mm("kvf_arena", slots * chunk_size)
        self.arena = np.frombuffer(arena, np.uint8)
        self.arena_mv = memoryview(arena)
        self.meta = np.frombuffer(mm("kvf_meta", slots * 8), np.uint64)
        self.xfers = np.frombuffer(mm("kvf_xfers", XFERS * XFER_DTYPE.itemsize), XFER_DTYPE)
        self.ctl = np.frombuffer(mm("kvf_ctl", CTL_DTYPE.itemsize), CTL_DTYPE)

    def stats_fd(self) -> int:
        return self.fds["kvf_stats"]

    def set_route(self, index: int, header: bytes) -> None:
        libbpf.map_update(self.fds["kvf_routes"], index, header.ljust(self._route_size, b"\0"))

    def set_transfer(self, idx: int, gen: int, ns: int, key: bytes, nchunks: int, base: int,
                     nslots: int, route: int = 0, flags: int = 0) -> None:
        """Write transfer entry ``idx`` and clear its slot words; the generation goes last.
        ``flags``: GET flags every GET of the transfer carries (those queued already too)."""
        x = self.xfers[idx]
        x["gen"] = 0
        self.meta[base:base + nslots] = 0
        x["ns"], x["key"] = ns, np.frombuffer(key, np.uint8)
        x["nchunks"], x["base"], x["nslots"], x["route"] = (
            nchunks, base, nslots, route | flags << 16)
        for f in ("status", "err", "received", "tail_len", "seen_nchunks", "bad"):
            x[f] = 0
        x["gen"] = gen

    def close(self) -> None:
        """Close the program and the maps; the memory stays while numpy views of it live."""
        for fd in [getattr(self, "fd", -1), *self.fds.values()]:
            if fd >= 0:
                os.close(fd)
        self.fd, self.fds, self._mms = -1, {}, []


C = FetchProgram.C
GEN_MASK = C["KV_FETCH_GEN_MASK"]
XFERS, ROUTES = C["KV_FETCH_XFERS"], C["KV_FETCH_ROUTES"]
SENDQ = 1 << 16                  # send-queue positions whose times the engine keeps (a power of 2)
XFER_DTYPE = FetchProgram.struct_dtype(FetchProgram.XFER_DTYPE, "KV_FETCH_XFER_SIZE")
CTL_DTYPE = FetchProgram.struct_dtype(FetchProgram.CTL_DTYPE, "KV_FETCH_CTL_SIZE")
OWNER_OFF = CTL_DTYPE.fields["owner"][1]


def _read_map(prog_fd: int, name: str, size: int | None = None) -> bytes | None:
    """Entry 0 of the program's map called ``name`` (None: it has none)."""
    found = libbpf.prog_map(prog_fd, name)
    if found is None:
        return None
    fd, info = found
    try:
        return libbpf.map_lookup(fd, 0, size or info.value_size)
    finally:
        os.close(fd)


def owner_of(prog_fd: int) -> int | None:
    """The pid recorded in a kv_fetch program's control block (None: not readable)."""
    raw = _read_map(prog_fd, "kvf_ctl")
    return None if raw is None else struct.unpack_from("<I", raw, OWNER_OFF)[0]


def loss_ppm_of(prog_fd: int) -> int:
    """The drop rate of the testbed's loss injector (its ``loss_ppm`` map), 0 if none."""
    raw = _read_map(prog_fd, "loss_ppm", 4)
    return 0 if raw is None else struct.unpack("<I", raw)[0]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class FetchAttachment(Attachment):
    """kv_fetch on the node's interface in place of a stand-in (``STAND_INS``) or of a kv_fetch
    whose process is gone; ``loss_ppm``: the loss injector's rate it takes over."""

    loss_ppm = 0

    def check_replaceable(self, name: str, fd: int) -> None:
        if name == "xdp_lossy":
            self.loss_ppm = loss_ppm_of(fd)
        elif name == PROG_NAME:
            owner = owner_of(fd)
            if owner and _alive(owner):
                raise NoXdp(f"another fetch engine (pid {owner}) runs on {self.ifname}")
        elif name not in STAND_INS:
            super().check_replaceable(name, fd)
