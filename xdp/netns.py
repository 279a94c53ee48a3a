"""Entering a named network namespace (as `ip netns` names them) from inside this process, per
thread, so switchd, the fetch engine and the testbed act on a namespace's interfaces without
`ip netns exec` (which would also hide the host's bpffs under a fresh /sys). ``enter`` moves the
thread for good, ``inside`` for a block, ``Netns`` for cheap repeated and nested entry (its fd
kept open)."""
from __future__ import annotations

import contextlib
import ctypes
import os
import threading
from collections.abc import Iterator

CLONE_NEWNET = 0x40000000
NETNS_DIR = "/run/netns"

_libc = ctypes.CDLL(None, use_errno=True)


def exists(name: str) -> bool:
    return os.path.exists(os.path.join(NETNS_DIR, name))


def _setns(fd: int, what: str) -> None:
    if _libc.setns(fd, CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def enter(name: str) -> None:
    """Move this thread into network namespace ``name``; FileNotFoundError if there is none."""
    fd = os.open(os.path.join(NETNS_DIR, name), os.O_RDONLY)
    try:
        _setns(fd, f"entering network namespace {name}")
    finally:
        os.close(fd)


class Netns:
    """Repeated cheap entry into a named network namespace (its fd is kept open until
    ``close``); FileNotFoundError if there is none. Namespaces belong to threads, so the nesting
    depth is per thread; ``None``: stay where we are."""

    def __init__(self, name: str | None):
        self.name = name
        self.fd = os.open(os.path.join(NETNS_DIR, name), os.O_RDONLY) if name else -1
        self._local = threading.local()

    def __enter__(self) -> Netns:
        if self.fd >= 0:
            st = self._local
            if getattr(st, "depth", 0) == 0:
                st.home = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
                try:
                    _setns(self.fd, f"entering network namespace {self.name}")
                except BaseException:
                    os.close(st.home)
                    raise
                st.depth = 0
            st.depth += 1
        return self

    def __exit__(self, *exc) -> None:
        if self.fd >= 0:
            st = self._local
            st.depth -= 1
            if st.depth == 0:
                try:
                    _setns(st.home, f"returning from namespace {self.name}")
                finally:
                    os.close(st.home)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


@contextlib.contextmanager
def inside(name: str) -> Iterator[Netns]:
    """Run a block inside namespace ``name``, then return to where we were."""
    ns = Netns(name)
    try:
        with ns:
            yield ns
    finally:
        ns.close()
