"""The bytecode cache: XDP programs compiled once per (their sources and the local headers those
include, compiler flags, kernel), kept with what loading them needs without BCC: each program's
instructions and the map every map reference names, each map's layout, whether it is pinned, and
the C types BCC derived for its keys and values.

Compiling with BCC takes seconds (4 of them parsing the kernel's headers, before any program);
loading from the cache takes milliseconds, so a restarted switchd or pool server serves again at
once instead of compiling while its box serves. ``load`` creates the maps, or opens them from
their pins, with libbpf, loads the programs on them (the kernel's verifier checks each one, as at
every load) and hands the maps out as BCC's own table classes, built from the kernel's layout
instead of BCC's compiled module: callers of ``xdp.loader.load_xdp`` cannot tell the difference.

The cache lives in a directory only root may write (``/run/kvswitch/bytecode``, a tmpfs: gone at
reboot, so never used on another kernel); without it everything is compiled every time. A
program's code depends on whether its maps are pinned, not where, so the pin directory is not
part of the key (``xdp.pin.split_cflag``)."""
from __future__ import annotations

import contextlib
import ctypes
import fcntl
import functools
import hashlib
import json
import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path

from . import NoXdp, libbpf

CACHE_DIR = Path(os.environ.get("KVSWITCH_CACHE_DIR", "/run/kvswitch/bytecode"))
_INCLUDE = re.compile(r'^#include\s+"([^"]+)"', re.M)
PSEUDO_MAP_FD = 1                     # an ld_imm64 of a map fd (src_reg), BCC's map reference
# flags the kernel sets on a map of a type itself (a devmap is read-only to programs)
KERNEL_SET_FLAGS = {libbpf.BPF_MAP_TYPE_DEVMAP: 1 << 7}      # BPF_F_RDONLY_PROG


@dataclass(frozen=True)
class Bytecode:
    """A compiled program: instructions, (instruction index, map name) of every map reference,
    and each map's (type, key size, value size, entries, flags)."""
    insns: bytes
    relocs: tuple[tuple[int, str], ...]
    maps: dict[str, tuple[int, int, int, int, int]]


# ---- where an entry lives ----------------------------------------------------------------------
def _sources(path: Path, seen: set[Path]) -> None:
    """``path`` and the local headers it includes, recursively."""
    if path in seen or not path.exists():
        return
    seen.add(path)
    for name in _INCLUDE.findall(path.read_text()):
        _sources(path.parent / name, seen)


def _key(sources: tuple[Path, ...], programs: dict[str, int], flags: list[str]) -> str:
    seen: set[Path] = set()
    for s in sources:
        _sources(s, seen)
    h = hashlib.sha256()
    for p in [*sources, *sorted(seen - set(sources))]:
        h.update(p.name.encode() + b"\0" + p.read_bytes())
    u = os.uname()
    h.update(f"{sorted(programs.items())}|{' '.join(flags)}|{u.release}|{u.version}".encode())
    return h.hexdigest()[:24]


def _trusted_dir(path: Path) -> bool:
    st = path.stat()
    return st.st_uid == os.geteuid() and not st.st_mode & 0o022


@contextlib.contextmanager
def slot(sources: tuple[Path, ...], programs: dict[str, int], flags: list[str]):
    """The entry's path for ``programs`` (name -> attach type) of ``sources`` compiled with
    ``flags``, under the cache's lock (one process compiles, the others then read); None
    without root's cache directory."""
    try:
        CACHE_DIR.mkdir(mode=0o700, parents=True, exist_ok=True)
        usable = _trusted_dir(CACHE_DIR)
    except OSError:
        usable = False
    if not usable:
        yield None
        return
    with open(CACHE_DIR / "compile.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield CACHE_DIR / f"{sources[0].stem}-{_key(sources, programs, flags)}.json"


def read(path: Path | None) -> dict | None:
    """The entry at ``path``; None if there is none (or it is unreadable: compiled again)."""
    try:
        return json.loads(path.read_text()) if path else None
    except (OSError, ValueError):
        return None


def write(path: Path | None, entry: dict) -> None:
    if path:
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(entry))
        tmp.rename(path)


# ---- an entry, from BCC's compiled object ------------------------------------------------------
def describe(bpf, programs: dict[str, int], pin_dir: str | None) -> dict:
    """The entry for ``programs`` (name -> attach type) of ``bpf``, a BCC object that compiled
    them (and created its maps), its maps pinned in ``pin_dir`` where the source pins them."""
    from bcc.libbcc import lib
    lib.bpf_num_tables.argtypes, lib.bpf_num_tables.restype = [ctypes.c_void_p], ctypes.c_size_t
    lib.bpf_table_name.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    lib.bpf_table_name.restype = ctypes.c_char_p
    maps, by_fd = {}, {}
    for i in range(lib.bpf_num_tables(bpf.module)):
        raw = lib.bpf_table_name(bpf.module, i)
        name, fd = raw.decode(), lib.bpf_table_fd(bpf.module, raw)
        info = libbpf.map_info(fd)
        pin = os.path.join(pin_dir, name) if pin_dir else None
        by_fd[fd] = name
        maps[name] = {
            "layout": [info.type, info.key_size, info.value_size, info.max_entries,
                       info.map_flags],
            "key": lib.bpf_table_key_desc(bpf.module, raw).decode(),
            "leaf": lib.bpf_table_leaf_desc(bpf.module, raw).decode(),
            "pinned": bool(pin and os.path.exists(pin)
                           and libbpf.pinned_map_info(pin).id == info.id)}
    progs = {}
    for name, attach in programs.items():
        insns = bytes(bpf.dump_func(name.encode()))
        progs[name] = {"insns": insns.hex(), "relocs": _relocs(name, insns, by_fd),
                       "attach": attach}
    return {"programs": progs, "maps": maps}


def _relocs(name: str, insns: bytes, by_fd: dict[int, str]) -> list[tuple[int, str]]:
    relocs = []
    for i in range(len(insns) // 8):
        code, regs, _, imm = struct.unpack_from("<BBhi", insns, 8 * i)
        if code == 0x18 and regs >> 4:           # ld_imm64 of a pseudo value
            if regs >> 4 != PSEUDO_MAP_FD or imm not in by_fd:
                raise NoXdp(f"{name}: unexpected reference in instruction {i}")
            relocs.append((i, by_fd[imm]))
    return relocs


def bytecode(entry: dict, name: str, map_names: tuple[str, ...]) -> Bytecode:
    """Program ``name`` of an entry, with the maps ``map_names`` (every map it uses)."""
    prog = entry["programs"][name]
    relocs = tuple((i, m) for i, m in prog["relocs"])
    if {m for _, m in relocs} - set(map_names):
        raise NoXdp(f"{name} uses maps besides {', '.join(map_names)}")
    return Bytecode(bytes.fromhex(prog["insns"]), relocs,
                    {m: tuple(entry["maps"][m]["layout"]) for m in map_names})


# ---- loading an entry --------------------------------------------------------------------------
def patched(insns: bytes, relocs, fds: dict[str, int]) -> bytes:
    """``insns`` with each map reference pointing at the fd of its map."""
    out = bytearray(insns)
    for i, m in relocs:
        struct.pack_into("<i", out, 8 * i + 4, fds[m])
    return bytes(out)


class CachedObject:
    """What callers use of BCC's BPF object (``get_table``, ``cleanup``) for programs loaded
    from the cache: the maps as BCC's table classes, the programs' and maps' fds."""

    def __init__(self):
        self.tables: dict[str, object] = {}
        self.fds: list[int] = []

    def get_table(self, name: bytes | str):
        return self.tables[name.decode() if isinstance(name, bytes) else name]

    def cleanup(self) -> None:
        """Close every fd: programs not attached and maps not pinned are gone."""
        for fd in self.fds:
            os.close(fd)
        self.fds, self.tables = [], {}


def load(entry: dict, pin_dir: str | None):
    """(CachedObject, {program name: BCC Function}) from an entry: maps created, or opened from
    their pins in ``pin_dir``, and the programs loaded on them. NoXdp if the kernel refuses."""
    import bcc
    obj, fds = CachedObject(), {}
    try:
        for name, spec in entry["maps"].items():
            fds[name] = _open_map(name, spec, pin_dir, obj.fds)
            obj.tables[name] = _table(obj, fds[name], name, spec, bcc)
        fns = {}
        for name, prog in entry["programs"].items():
            insns = patched(bytes.fromhex(prog["insns"]), prog["relocs"], fds)
            fd = libbpf.prog_load_xdp(name, insns, attach_type=prog["attach"])
            obj.fds.append(fd)
            fns[name] = bcc.BPF.Function(obj, name.encode(), fd)
    except OSError as exc:
        obj.cleanup()
        raise NoXdp(f"loading {', '.join(entry['programs'])}: {exc}") from None
    return obj, fns


def _open_map(name: str, spec: dict, pin_dir: str | None, opened: list[int]) -> int:
    layout = tuple(spec["layout"])
    path = os.path.join(pin_dir, name) if pin_dir and spec["pinned"] else None
    if path and os.path.exists(path):
        fd = libbpf.obj_get(path)
        opened.append(fd)
        info = libbpf.map_info(fd, path)
        if (info.type, info.key_size, info.value_size, info.max_entries) != layout[:4]:
            raise NoXdp(f"the map pinned at {path} has another layout than the program's: "
                        "remove the pin")
        return fd
    mtype, ksize, vsize, entries, flags = layout
    if mtype in KERNEL_SET_FLAGS:            # reported, but refused at creation
        flags &= ~KERNEL_SET_FLAGS[mtype]
    fd = libbpf.map_create(name, mtype, ksize, vsize, entries, flags)
    opened.append(fd)
    if path:
        libbpf.obj_pin(fd, path)
    return fd


def _table(obj: CachedObject, fd: int, name: str, spec: dict, bcc):
    """BCC's table class for the map's type, constructed from the kernel's layout."""
    from bcc import table as bt
    classes = {bt.BPF_MAP_TYPE_HASH: bt.HashTable, bt.BPF_MAP_TYPE_ARRAY: bt.Array,
               bt.BPF_MAP_TYPE_PERCPU_HASH: bt.PerCpuHash,
               bt.BPF_MAP_TYPE_PERCPU_ARRAY: bt.PerCpuArray, bt.BPF_MAP_TYPE_LRU_HASH: bt.LruHash,
               bt.BPF_MAP_TYPE_LRU_PERCPU_HASH: bt.LruPerCpuHash,
               bt.BPF_MAP_TYPE_DEVMAP: bt.DevMap, bt.BPF_MAP_TYPE_CPUMAP: bt.CpuMap,
               bt.BPF_MAP_TYPE_PROG_ARRAY: bt.ProgArray}
    base = classes.get(spec["layout"][0])
    if base is None:
        raise NoXdp(f"map {name}: type {spec['layout'][0]} is not one the cache hands out")
    decode = bcc.BPF._decode_table_type
    return _from_kernel(base)(obj, -1, fd, decode(json.loads(spec["key"])),
                              decode(json.loads(spec["leaf"])), name.encode())


@functools.cache
def _from_kernel(base: type) -> type:
    """BCC's table class ``base`` with a constructor that asks the kernel, not BCC's compiled
    module, for the map's type, flags and capacity: placed before TableBase in the MRO, it
    takes TableBase's place in the chain of constructors, the rest of the class unchanged."""
    from bcc.table import TableBase

    class FromKernel(TableBase):
        def __init__(self, bpf, map_id, map_fd, keytype, leaftype, name=None):
            info = libbpf.map_info(map_fd)
            self.bpf, self.map_id, self.map_fd = bpf, map_id, map_fd
            self.Key, self.Leaf, self._cbs, self._name = keytype, leaftype, {}, name
            self.ttype, self.flags, self.max_entries = info.type, info.map_flags, info.max_entries

    return type(base.__name__, (base, FromKernel), {"__module__": __name__})
