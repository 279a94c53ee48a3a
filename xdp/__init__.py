"""The data plane's C sources, installed with the Python packages as package data, and the one
reader of the constants they define: every ``#define KV_<NAME> <integer>`` line of a C file and
of the headers it includes from this directory. Nothing in Python keeps a copy of them.

    kvproto.h   the wire format (every endpoint)       kvswitch.h  the switch's map layouts
    parse.h     bounds-checked frame parsing            kvmaps.h    the switch's map declarations
    kvswitch.c  the switch's ingress and egress programs
"""
from __future__ import annotations

import re
from pathlib import Path

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
