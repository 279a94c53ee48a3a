"""xdp/kvfetch.c as the engine runs it: compiled once per chunk size, loaded with maps of the
engine's own sizes, its maps mmapped as numpy arrays.

Compiling with BCC takes seconds (8-30 s on this loaded 2-core machine) and needs BCC and kernel
headers; loading bytecode takes milliseconds. So the first compile of a (source, chunk size,
kernel) writes the program's bytecode, its map references and its map definitions to a cache
directory only root may write (``/run/kvswitch/kvfetch``, a tmpfs: gone at reboot, so never
used on another kernel), and every later engine, in any process or namespace, creates its maps
and loads that bytecode with libbpf directly, rewriting the map references to its maps. The
kernel's verifier checks the program at every load, as it does for BCC's. BCC is then only
needed on the first compile, and the arena's size is chosen at load time, not compile time.

``FetchProgram`` is loaded, not attached (``attach.Attachment`` attaches it; the XDP tests run
it on crafted frames).
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

import xdp
from xdp import libbpf

from .netpath import NoXdp

SOURCE = "kvfetch.c"
C = xdp.constants(SOURCE)
PROG_NAME = "kv_fetch"
STAT_NAMES = {v: n[len("KV_FETCH_STAT_"):].lower() for n, v in C.items()
              if n.startswith("KV_FETCH_STAT_") and n != "KV_FETCH_STAT_MAX"}
GEN_MASK = C["KV_FETCH_GEN_MASK"]
XFERS, SENDQ = C["KV_FETCH_XFERS"], C["KV_FETCH_SENDQ"]
CACHE_DIR = Path(os.environ.get("KVSWITCH_CACHE_DIR", "/run/kvswitch/kvfetch"))
MAP_NAMES = ("kvf_arena", "kvf_meta", "kvf_xfers", "kvf_sendq", "kvf_ctl", "kvf_routes",
             "kvf_stats")
SIZED_BY_SLOTS = ("kvf_arena", "kvf_meta")

XFER_DTYPE = np.dtype([("gen", "<u4"), ("ns", "<u4"), ("key", "u1", 16), ("nchunks", "<u4"),
                       ("base", "<u4"), ("nslots", "<u4"), ("route", "<u4"), ("status", "<u4"),
                       ("err", "<u4"), ("received", "<u4"), ("tail_len", "<u4"),
                       ("seen_nchunks", "<u4"), ("bad", "<u4")])
CTL_DTYPE = np.dtype([("nonce", "<u8"), ("send_pos", "<u8"), ("send_end", "<u8"),
                      ("port", "<u4"), ("loss_ppm", "<u4"), ("frame_len", "<u4"),
                      ("owner", "<u4")])
assert XFER_DTYPE.itemsize == C["KV_FETCH_XFER_SIZE"], "struct kv_fetch_xfer and XFER_DTYPE"
assert CTL_DTYPE.itemsize == C["KV_FETCH_CTL_SIZE"], "struct kv_fetch_ctl and CTL_DTYPE"
OWNER_OFF = CTL_DTYPE.fields["owner"][1]


@dataclass(frozen=True)
class Bytecode:
    """A compiled kv_fetch: instructions, (instruction index, map name) of every map reference,
    and each map's (type, key size, value size, entries, flags)."""
    insns: bytes
    relocs: tuple[tuple[int, str], ...]
    maps: dict[str, tuple[int, int, int, int, int]]


def _cache_key(chunk_size: int) -> str:
    h = hashlib.sha256()
    for name in (SOURCE, "parse.h", "kvproto.h"):
        h.update(xdp.source(name).read_bytes())
    u = os.uname()
    h.update(f"{chunk_size}|{u.release}|{u.version}".encode())
    return h.hexdigest()[:24]


def _trusted_dir(path: Path) -> bool:
    st = path.stat()
    return st.st_uid == os.geteuid() and not st.st_mode & 0o022


def _compile(chunk_size: int) -> Bytecode:
    """BCC: compile, then take the bytecode and what its map fds stand for."""
    from switchd.dataplane import SwitchError, load_xdp
    try:
        bpf, _ = load_xdp(xdp.source(SOURCE), (PROG_NAME,), [f"-DKV_FETCH_CHUNK={chunk_size}"])
    except SwitchError as exc:
        raise NoXdp(str(exc)) from None
    try:
        insns = bytes(bpf.dump_func(PROG_NAME.encode()))
        by_fd, maps = {}, {}
        for name in MAP_NAMES:
            fd = bpf.get_table(name.encode()).get_fd()
            info = libbpf.map_info(fd)
            by_fd[fd] = name
            maps[name] = (info.type, info.key_size, info.value_size, info.max_entries,
                          info.map_flags)
    finally:
        bpf.cleanup()
    relocs = []
    for i in range(len(insns) // 8):
        code, regs, _, imm = struct.unpack_from("<BBhi", insns, 8 * i)
        if code == 0x18 and regs >> 4:           # ld_imm64 of a pseudo value
            if regs >> 4 != 1 or imm not in by_fd:
                raise NoXdp(f"{SOURCE}: unexpected reference in instruction {i}")
            relocs.append((i, by_fd[imm]))
    return Bytecode(insns, tuple(relocs), maps)


def bytecode(chunk_size: int) -> Bytecode:
    """The program for ``chunk_size``: from the cache, else compiled (once, under a lock) and
    cached. Without root's cache directory it is compiled every time."""
    key = _cache_key(chunk_size)
    path = CACHE_DIR / f"kvfetch-{chunk_size}-{key}.json"
    try:
        CACHE_DIR.mkdir(mode=0o700, parents=True, exist_ok=True)
        usable = _trusted_dir(CACHE_DIR)
    except OSError:
        usable = False
    if not usable:
        return _compile(chunk_size)
    with open(CACHE_DIR / "kvfetch.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)          # one compiles, the others then read
        if path.exists():
            d = json.loads(path.read_text())
            return Bytecode(bytes.fromhex(d["insns"]), tuple(map(tuple, d["relocs"])),
                            {k: tuple(v) for k, v in d["maps"].items()})
        bc = _compile(chunk_size)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"insns": bc.insns.hex(), "relocs": bc.relocs,
                                   "maps": bc.maps}))
        tmp.rename(path)
        return bc


def possible_cpus() -> int:
    """CPUs a per-CPU map has a value for."""
    try:
        text = Path("/sys/devices/system/cpu/possible").read_text().strip()
    except OSError:
        return os.cpu_count() or 1
    n = 0
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        n = max(n, int(hi or lo) + 1)
    return n


class FetchProgram:
    """kv_fetch loaded for one chunk size with an arena of ``slots`` chunks, its mmapable maps
    as numpy arrays (no system call per access)."""

    def __init__(self, chunk_size: int, slots: int):
        if not 8 <= chunk_size <= C["KV_MAX_PAYLOAD"] or chunk_size % 8:
            raise ValueError("chunk size must be a multiple of 8 up to the protocol's maximum")
        self.chunk_size, self.slots = chunk_size, slots
        code = bytecode(chunk_size)
        self.fds: dict[str, int] = {}
        self._mms: list[mmap.mmap] = []
        try:
            for name, (mtype, ksize, vsize, entries, flags) in code.maps.items():
                if name in SIZED_BY_SLOTS:
                    entries = slots
                self.fds[name] = libbpf.map_create(name, mtype, ksize, vsize, entries, flags)
            insns = bytearray(code.insns)
            for i, name in code.relocs:
                struct.pack_into("<i", insns, 8 * i + 4, self.fds[name])
            self.fd = libbpf.prog_load_xdp(PROG_NAME, bytes(insns))
        except OSError as exc:
            self.close()
            raise NoXdp(f"loading {SOURCE}: {exc}") from None
        self._route_size = code.maps["kvf_routes"][2]
        self._ncpu = possible_cpus()

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
        self.sendq = np.frombuffer(mm("kvf_sendq", SENDQ * 8), np.uint64)
        self.ctl = np.frombuffer(mm("kvf_ctl", CTL_DTYPE.itemsize), CTL_DTYPE)

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
        x["nchunks"], x["base"], x["nslots"], x["route"] = nchunks, base, nslots, route | flags << 16
        for f in ("status", "err", "received", "tail_len", "seen_nchunks", "bad"):
            x[f] = 0
        x["gen"] = gen

    def counters(self) -> dict[str, int]:
        """The data plane's per-CPU counters, summed, by name."""
        fd, out = self.fds["kvf_stats"], {}
        for i, name in sorted(STAT_NAMES.items()):
            raw = libbpf.map_lookup(fd, i, 8 * self._ncpu)
            out[name] = sum(struct.unpack(f"<{self._ncpu}Q", raw))
        return out

    def close(self) -> None:
        """Close the program and the maps; the memory stays while numpy views of it live."""
        for fd in [getattr(self, "fd", -1), *self.fds.values()]:
            if fd >= 0:
                os.close(fd)
        self.fd, self.fds, self._mms = -1, {}, []


def owner_of(prog_fd: int) -> int | None:
    """The pid recorded in a kv_fetch program's control block (None: not readable)."""
    found = libbpf.prog_map(prog_fd, "kvf_ctl")
    if found is None:
        return None
    fd, info = found
    try:
        raw = libbpf.map_lookup(fd, 0, info.value_size)
    finally:
        os.close(fd)
    return struct.unpack_from("<I", raw, OWNER_OFF)[0]


def loss_ppm_of(prog_fd: int) -> int:
    """The drop rate of the testbed's loss injector (its ``loss_ppm`` map), 0 if none."""
    found = libbpf.prog_map(prog_fd, "loss_ppm")
    if found is None:
        return 0
    fd, _ = found
    try:
        return struct.unpack("<I", libbpf.map_lookup(fd, 0, 4))[0]
    finally:
        os.close(fd)

