"""Entering a named network namespace (as `ip netns` names them) from inside this process, so
switchd and the testbed can act on a namespace's interfaces without `ip netns exec`, which would
also hide the host's bpffs under a fresh /sys."""
from __future__ import annotations

import ctypes
import os

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


class inside:
    """Context manager: run a block inside namespace ``name``, then return to where we were."""

    def __init__(self, name: str):
        self.name = name
        self._home = -1

    def __enter__(self):
        self._home = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
        try:
            enter(self.name)
        except BaseException:
            os.close(self._home)
            raise
        return self

    def __exit__(self, *exc):
        try:
            _setns(self._home, f"returning from namespace {self.name}")
        finally:
            os.close(self._home)
