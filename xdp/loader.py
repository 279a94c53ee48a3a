"""Compiling and loading XDP programs: BCC (``load_xdp``: compile a C file of this package or the
testbed's, load its programs, devmap egress ones too), the checks that turn a BCC traceback into
one line (``preflight``), and the bytecode cache.

Compiling with BCC takes seconds and needs BCC and kernel headers; loading bytecode takes
milliseconds. ``cached_bytecode`` compiles a program once per (source and its local includes,
compiler flags, kernel) and keeps its instructions, map references and map definitions in a
directory only root may write (``/run/kvswitch/bytecode``, a tmpfs: gone at reboot, so never used
on another kernel); ``load_bytecode`` then creates maps of the caller's sizes and loads the
program with libbpf, rewriting its map references. The kernel's verifier checks the program at
every load, as it does for BCC's. Every failure here is ``xdp.NoXdp``.
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path

from . import NoXdp, cflags as xdp_cflags, libbpf

CACHE_DIR = Path(os.environ.get("KVSWITCH_CACHE_DIR", "/run/kvswitch/bytecode"))
_INCLUDE = re.compile(r'^#include\s+"([^"]+)"', re.M)


def import_bcc():
    """The bcc module, or NoXdp saying how to get it."""
    try:
        import bcc
    except ImportError:
        raise NoXdp("BCC is not importable: install Debian's python3-bpfcc and run from "
                    "/usr/bin/python3 or a venv made with --system-site-packages "
                    "('make setup' does both)") from None
    return bcc


def preflight(pin_dir: str | None = None) -> None:
    """Fail early, with one clear line, on what would otherwise be a BCC traceback: not root,
    no kernel headers, ``pin_dir`` not on a bpf filesystem, no BCC."""
    from .pin import require_bpffs
    if os.geteuid() != 0:
        raise NoXdp("must run as root: loading XDP programs and pinning maps need "
                    "CAP_BPF and CAP_NET_ADMIN")
    build = Path("/lib/modules") / os.uname().release / "build"
    if not (build / "include").exists():
        raise NoXdp(f"no kernel headers at {build}: install linux-headers-amd64 and link "
                    "them there ('make setup' does it)")
    if pin_dir:
        require_bpffs(pin_dir)
    import_bcc()


def load_xdp(source: str | Path, functions: tuple[str, ...], cflags: list[str] | None = None,
             devmap_egress: tuple[str, ...] = (), append: tuple[str | Path, ...] = ()):
    """Compile a C file with BCC and load XDP programs from it (``devmap_egress``: programs run
    on devmap redirects; ``append``: C files compiled as if pasted after it, one object and its
    maps shared: BCC rewrites map calls in its main file only, not in included files). Returns
    the BPF object and the programs by name."""
    bcc = import_bcc()
    flags = xdp_cflags(*(cflags or []))
    try:
        if append:
            text = "\n".join(Path(p).read_text() for p in (source, *append))
            bpf = bcc.BPF(text=text.encode(), cflags=flags)
        else:
            bpf = bcc.BPF(src_file=str(source).encode(), cflags=flags)
    except Exception as exc:
        raise NoXdp(f"compiling {Path(source).name} failed: {exc}") from None
    try:
        fns = {name: bpf.load_func(name.encode(), bcc.BPF.XDP) for name in functions}
        fns.update({name: bpf.load_func(name.encode(), bcc.BPF.XDP, None,
                                        bcc.BPFAttachType.XDP_DEVMAP) for name in devmap_egress})
    except Exception as exc:                    # the verifier's log went to stderr
        bpf.cleanup()
        raise NoXdp(f"loading {Path(source).name} failed: {exc}") from None
    return bpf, fns


# ---- the bytecode cache ------------------------------------------------------------------------
@dataclass(frozen=True)
class Bytecode:
    """A compiled program: instructions, (instruction index, map name) of every map reference,
    and each map's (type, key size, value size, entries, flags)."""
    insns: bytes
    relocs: tuple[tuple[int, str], ...]
    maps: dict[str, tuple[int, int, int, int, int]]


def _sources(path: Path, seen: set[Path]) -> None:
    """``path`` and the local headers it includes, recursively."""
    if path in seen or not path.exists():
        return
    seen.add(path)
    for name in _INCLUDE.findall(path.read_text()):
        _sources(path.parent / name, seen)


def _cache_key(source: Path, cflags: list[str]) -> str:
    seen: set[Path] = set()
    _sources(source, seen)
    h = hashlib.sha256()
    for p in sorted(seen):
        h.update(p.name.encode() + b"\0" + p.read_bytes())
    u = os.uname()
    h.update(f"{' '.join(cflags)}|{u.release}|{u.version}".encode())
    return h.hexdigest()[:24]


def _trusted_dir(path: Path) -> bool:
    st = path.stat()
    return st.st_uid == os.geteuid() and not st.st_mode & 0o022


def _compile(source: Path, name: str, cflags: list[str], map_names: tuple[str, ...]) -> Bytecode:
    """BCC: compile, then take the bytecode and what its map fds stand for."""
    bpf, _ = load_xdp(source, (name,), cflags)
    try:
        insns = bytes(bpf.dump_func(name.encode()))
        by_fd, maps = {}, {}
        for m in map_names:
            fd = bpf.get_table(m.encode()).get_fd()
            info = libbpf.map_info(fd)
            by_fd[fd] = m
            maps[m] = (info.type, info.key_size, info.value_size, info.max_entries,
                       info.map_flags)
    finally:
        bpf.cleanup()
    relocs = []
    for i in range(len(insns) // 8):
        code, regs, _, imm = struct.unpack_from("<BBhi", insns, 8 * i)
        if code == 0x18 and regs >> 4:           # ld_imm64 of a pseudo value
            if regs >> 4 != 1 or imm not in by_fd:
                raise NoXdp(f"{source.name}: unexpected reference in instruction {i}")
            relocs.append((i, by_fd[imm]))
    return Bytecode(insns, tuple(relocs), maps)


def cached_bytecode(source: str | Path, name: str, cflags: list[str],
                    map_names: tuple[str, ...]) -> Bytecode:
    """Program ``name`` of ``source`` compiled with ``cflags``: from the cache, else compiled
    (once, under a lock) and cached. Without root's cache directory it is compiled every time.
    ``map_names``: every map the program uses."""
    source = Path(source)
    path = CACHE_DIR / f"{source.stem}-{name}-{_cache_key(source, cflags)}.json"
    try:
        CACHE_DIR.mkdir(mode=0o700, parents=True, exist_ok=True)
        usable = _trusted_dir(CACHE_DIR)
    except OSError:
        usable = False
    if not usable:
        return _compile(source, name, cflags, map_names)
    with open(CACHE_DIR / "compile.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)          # one compiles, the others then read
        if path.exists():
            d = json.loads(path.read_text())
            return Bytecode(bytes.fromhex(d["insns"]), tuple(map(tuple, d["relocs"])),
                            {k: tuple(v) for k, v in d["maps"].items()})
        bc = _compile(source, name, cflags, map_names)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"insns": bc.insns.hex(), "relocs": bc.relocs,
                                   "maps": bc.maps}))
        tmp.rename(path)
        return bc


def load_bytecode(code: Bytecode, name: str,
                  entries: dict[str, int] | None = None) -> tuple[int, dict[str, int]]:
    """Fresh maps (``entries``: capacities other than the compiled ones, by map name) and the
    program loaded on them: (program fd, map fds by name). NoXdp if the kernel refuses."""
    fds: dict[str, int] = {}
    try:
        for m, (mtype, ksize, vsize, n, flags) in code.maps.items():
            fds[m] = libbpf.map_create(m, mtype, ksize, vsize, (entries or {}).get(m, n), flags)
        insns = bytearray(code.insns)
        for i, m in code.relocs:
            struct.pack_into("<i", insns, 8 * i + 4, fds[m])
        return libbpf.prog_load_xdp(name, bytes(insns)), fds
    except OSError as exc:
        for fd in fds.values():
            os.close(fd)
        raise NoXdp(f"loading {name}: {exc}") from None
