"""The XDP side of kvswitch: the data plane's C sources (installed with the Python packages as
package data), the one reader of the constants they define (every ``#define KV_<NAME> <integer>``
line of a C file and of the headers it includes from this directory; nothing in Python keeps a
copy of them), and the package that owns every program's lifecycle, as xdp-tools' lib/util
does for its tools. switchd, the fetch engine, the pool's XDP server and the testbed use it:

    libbpf      the one ctypes binding of libbpf (maps, bytecode loads, attach, test runs)
    netns       entering a named network namespace, per thread
    loader      loading a C file's programs and maps (BCC, then the cache), preflight checks
    cache       the bytecode cache: compiled once, loaded in milliseconds without BCC
    attach      attach/detach/query, and Attachment: in place of a program, put back after
    pin         pin directories on a bpf filesystem
    program     Program, the base of every loaded program: constants, counters, struct sizes

    kvproto.h   the wire format (every endpoint)       parse.h      bounds-checked frame parsing
    verifier.h  helpers the verifier needs             reply.h      GETs answered in place
    kvswitch.c  the switch: kvswitch_cache.c, kvswitch_rounds.c, kvswitch_ports.c its parts
                (pasted in by the loader), kvswitch.h layouts, kvmaps.h maps, kvslot.h slots
    kvwrite.c   switchd's cache-slot writer
    kvfetch.c   the fetch engine (kvfetch.h, kvfetch_maps.h)
    kvserve.c   a pool node's XDP GET server (kvserve.h layouts, kvserve_maps.h maps)

``NoXdp`` is the one "XDP cannot be used here" error; its message says why in one line.
"""
from __future__ import annotations

import re
from pathlib import Path

from .netns import Netns  # noqa: F401 (the one namespace handle, for users that need only it)


class NoXdp(RuntimeError):
    """XDP cannot be used here (no BCC, not root, a compile, load or attach refused, the
    interface taken); the message says why in one line."""


SOURCE_DIR = Path(__file__).resolve().parent
_DEFINE = re.compile(r"^#define\s+(KV_\w+)\s+(0x[0-9a-fA-F]+|\d+)\b", re.M)
_INCLUDE = re.compile(r'^#include\s+"([^"]+)"', re.M)


def source(name: str) -> Path:
    """Path of one of this directory's files."""
    return SOURCE_DIR / name


def cflags(*extra: str) -> list[str]:
    """BCC compiler flags that let any program include this directory's headers."""
    return [f"-I{SOURCE_DIR}", *extra]


def constants(path: str | Path = "kvproto.h") -> dict[str, int]:
    """The integer constants a C file defines, its local includes first (so a file may be given
    by name here or by a path anywhere, e.g. a test tool's program that includes kvproto.h)."""
    path = Path(path)
    if not path.is_absolute() and not path.exists():
        path = SOURCE_DIR / path
    text = path.read_text()
    out: dict[str, int] = {}
    for name in _INCLUDE.findall(text):
        local = path.parent / name
        out.update(constants(local if local.exists() else SOURCE_DIR / name))
    out.update({name: int(value, 0) for name, value in _DEFINE.findall(text)})
    return out
