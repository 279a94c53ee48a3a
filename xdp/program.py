"""``Program``, the base of every XDP program the project loads (the switch's DataPlane, the
fetch engine's FetchProgram, the pool node's ServeProgram): its C source in this package, the
constants it defines (``C``, parsed from the source and its headers), its per-CPU counters by
name (``STAT_NAMES``, ``counters()``) and the check that a numpy view of one of its structs has
the size the C header states. Also what the kernel says about loaded programs: the maps one
uses, its run time while the kernel's accounting is on."""
from __future__ import annotations

import contextlib
import json
import os
import struct
import subprocess
from pathlib import Path
from typing import ClassVar

import numpy as np

from . import constants, libbpf


def prefixed(c: dict[str, int], prefix: str) -> dict[int, str]:
    """{value: lower-case name without ``prefix``} of the constants ``<prefix><NAME>`` (not
    ``<prefix>MAX``): stat and setting indexes."""
    return {v: n[len(prefix):].lower() for n, v in c.items()
            if n.startswith(prefix) and n != prefix + "MAX"}


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


class Program:
    """A loaded XDP program of this package. Subclasses name their source and the prefix of
    their counters' indexes: ``class P(Program, source="kvfetch.c", stats="KV_FETCH_STAT_")``;
    an instance says which map holds the counters (``stats_fd``)."""

    SOURCE: ClassVar[str]
    C: ClassVar[dict[str, int]]
    STAT_NAMES: ClassVar[dict[int, str]] = {}

    def __init_subclass__(cls, source: str | None = None, stats: str | None = None,
                          header: str | None = None, **kw):
        super().__init_subclass__(**kw)
        if source:
            cls.SOURCE, cls.C = source, constants(header or source)
            cls.STAT_NAMES = prefixed(cls.C, stats) if stats else {}

    @classmethod
    def struct_dtype(cls, dtype: np.dtype, size_name: str) -> np.dtype:
        """``dtype``, checked against the size its C struct has (the constant ``size_name``)."""
        if dtype.itemsize != cls.C[size_name]:
            raise TypeError(f"{cls.SOURCE}: {size_name} is {cls.C[size_name]} bytes, the numpy "
                            f"view {dtype.itemsize}")
        return dtype

    def stats_fd(self) -> int:
        """fd of the per-CPU array of u64 counters."""
        raise NotImplementedError

    def counters(self) -> dict[str, int]:
        """The data plane's per-CPU counters, summed, by name."""
        fd, ncpu = self.stats_fd(), possible_cpus()
        return {name: sum(struct.unpack(f"<{ncpu}Q", libbpf.map_lookup(fd, i, 8 * ncpu)))
                for i, name in sorted(self.STAT_NAMES.items())}


# ---- loaded programs as the kernel sees them ---------------------------------------------------
def program_map_ids(prog_id: int) -> set[int]:
    """Kernel ids of the maps a loaded program uses (none if it is gone)."""
    try:
        fd = libbpf.prog_fd_by_id(prog_id)
    except OSError:
        return set()
    try:
        return set(libbpf.prog_info(fd)[1])
    finally:
        os.close(fd)


@contextlib.contextmanager
def run_time_stats():
    """The kernel's per-program run-time accounting (kernel.bpf_stats_enabled) on for the
    block; it costs two clock reads per program run, so it is off otherwise."""
    path = Path("/proc/sys/kernel/bpf_stats_enabled")
    before = path.read_text().strip()
    path.write_text("1")
    try:
        yield
    finally:
        path.write_text(before)


def program_run_time(prog_id: int) -> tuple[int, int]:
    """(nanoseconds run, runs) of a loaded program since it was loaded, while stats were on."""
    r = subprocess.run(["bpftool", "-j", "prog", "show", "id", str(prog_id)],
                       capture_output=True, text=True)
    info = json.loads(r.stdout) if r.returncode == 0 else {}
    return int(info.get("run_time_ns", 0)), int(info.get("run_cnt", 0))
