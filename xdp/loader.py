"""Compiling and loading XDP programs: ``load_xdp`` (a C file of this package or the testbed's,
its programs, devmap egress ones too, and its maps as BCC tables), the checks that turn a BCC
traceback into one line (``preflight``), and loading one program from bytecode on maps of the
caller's sizes (``cached_bytecode``, ``load_bytecode``: the fetch engine's per-socket copies).

Compiling with BCC takes seconds and needs BCC and kernel headers; both paths compile once per
(sources, flags, kernel) and load from the bytecode cache (``xdp.cache``) in milliseconds after
that. The kernel's verifier checks a program at every load, whichever path it came by. Every
failure here is ``xdp.NoXdp``.

A program may be split into parts: a local C file it includes (``#include "part.c"``) is pasted
in place of the line, as BCC rewrites map calls (``table.lookup(...)``) in its main file only;
``#line`` markers keep the compiler's messages pointing at each file's own lines.
"""
from __future__ import annotations

import os
import re
from pathlib import Path

from . import NoXdp, cache, cflags as xdp_cflags, libbpf, pin
from .cache import Bytecode

_PART = re.compile(r'^#include\s+"([^"]+\.c)"[ \t]*$', re.M)


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
    """Load XDP programs from a C file of this package or the testbed's (``devmap_egress``:
    programs run on devmap redirects; ``append``: C files compiled as if pasted after it, one
    object and its maps shared: BCC rewrites map calls in its main file only, not in included
    files). Compiled by BCC once per (sources, flags, kernel), from the bytecode cache after
    that (``xdp.cache``); loaded by libbpf either way, so a program the kernel refuses is one
    line naming why (``libbpf.prog_load_xdp``), never a verifier dump. Returns the cache's
    object (BCC's table classes over the maps) and the programs by name."""
    flags = xdp_cflags(*(cflags or []))
    pin_dir, key_flags = pin.split_cflag(flags)
    sources = (Path(source), *map(Path, append))
    programs = {**{n: 0 for n in functions},
                **{n: libbpf.BPF_XDP_DEVMAP for n in devmap_egress}}
    entry = _cached(sources, programs, flags, key_flags, pin_dir)
    import_bcc()
    return cache.load(entry, pin_dir)


def compiled_entry(sources: tuple[Path, ...], programs: dict[str, int],
                   flags: list[str]) -> dict:
    """The bytecode cache's entry for ``programs`` (name -> attach type) of ``sources``
    compiled with ``flags`` (``xdp.cflags``), compiled first where there is none: what they
    are, without loading them (``xdp.features``)."""
    pin_dir, key_flags = pin.split_cflag(flags)
    return _cached(tuple(map(Path, sources)), programs, flags, key_flags, pin_dir)


def _cached(sources: tuple[Path, ...], programs: dict[str, int], flags: list[str],
            key_flags: list[str], pin_dir: str | None) -> dict:
    """The cache's entry, or where there was none, that of a compile with ``flags`` (once,
    under the cache's lock), the entry written."""
    with cache.slot(sources, programs, key_flags) as path:
        entry = cache.read(path)
        if entry is not None:
            return entry
        bpf = _compile(sources, flags)
        try:
            entry = cache.describe(bpf, programs, pin_dir)
        finally:
            bpf.cleanup()
        cache.write(path, entry)
        return entry


def _compile(sources: tuple[Path, ...], flags: list[str]):
    """BCC: compile ``sources`` as one file (its maps created, pinned where it says so); the
    programs are loaded from the compiled bytecode by libbpf, not by BCC."""
    bcc = import_bcc()
    try:
        if len(sources) > 1 or _PART.search(sources[0].read_text()):
            text = "\n".join(program_text(p) for p in sources)
            return bcc.BPF(text=text.encode(), cflags=flags)
        return bcc.BPF(src_file=str(sources[0]).encode(), cflags=flags)
    except Exception as exc:
        raise NoXdp(f"compiling {sources[0].name} failed: {exc}") from None


def program_text(path: Path) -> str:
    """``path``'s text with each local C file it includes pasted in place of the line (theirs
    too), under ``#line`` markers naming the file each line comes from."""
    text, out, at = path.read_text(), [], 0
    for m in _PART.finditer(text):
        line = text.count("\n", 0, m.end()) + 2
        part = program_text(path.parent / m.group(1))
        out += [text[at:m.start()], part.rstrip("\n") + "\n", f'#line {line} "{path.name}"\n']
        at = m.end() + 1
    out.append(text[at:])
    return f'#line 1 "{path.name}"\n' + "".join(out)


def cached_bytecode(source: str | Path, name: str, cflags: list[str],
                    map_names: tuple[str, ...]) -> Bytecode:
    """Program ``name`` of ``source`` compiled with ``cflags``, for ``load_bytecode``: from the
    cache, else compiled (once, under the cache's lock) and cached. ``map_names``: every map the
    program uses."""
    flags = xdp_cflags(*cflags)
    entry = _cached((Path(source),), {name: 0}, flags, flags, None)
    return cache.bytecode(entry, name, map_names)


def load_bytecode(code: Bytecode, name: str,
                  entries: dict[str, int] | None = None) -> tuple[int, dict[str, int]]:
    """Fresh maps (``entries``: capacities other than the compiled ones, by map name) and the
    program loaded on them: (program fd, map fds by name). NoXdp if the kernel refuses."""
    fds: dict[str, int] = {}
    try:
        for m, (mtype, ksize, vsize, n, flags) in code.maps.items():
            fds[m] = libbpf.map_create(m, mtype, ksize, vsize, (entries or {}).get(m, n), flags)
        return libbpf.prog_load_xdp(name, cache.patched(code.insns, code.relocs, fds)), fds
    except OSError as exc:
        for fd in fds.values():
            os.close(fd)
        raise NoXdp(f"loading {name}: {exc}") from None
