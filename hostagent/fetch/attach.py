"""The engine's program on the node's interface, in place of what was there, and that program
put back afterwards.

A veth end carries an XDP program anyway (the testbed's ``xdp_pass``: frames sent with XDP_TX
into a veth are dropped unless its peer has one); kv_fetch passes every frame that is not its
own, so it can stand in. It also stands in for the testbed's loss injector (``xdp_lossy``),
dropping the same share of KV frames (its ``loss_ppm`` is read from the injector's map). It
takes the place of a kv_fetch whose process is gone, never of one still running (its control
block records its pid) nor of any other program: then the asyncio client is used.

Attach and restore use ``XDP_FLAGS_REPLACE`` with the program expected there, so neither can
clobber a program someone attached meanwhile.
"""
from __future__ import annotations

import os
import socket

from xdp import libbpf

from xdp.netns import Netns

from .netpath import NoXdp
from .program import PROG_NAME, loss_ppm_of, owner_of

STAND_INS = ("xdp_pass", "xdp_lossy")       # programs the engine may stand in for


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def program_on(ifname: str) -> str | None:
    """Name of the native XDP program on ``ifname`` in this thread's namespace (None: none)."""
    pid = libbpf.attached_id(socket.if_nametoindex(ifname))
    if not pid:
        return None
    fd = libbpf.prog_fd_by_id(pid)
    try:
        return libbpf.prog_info(fd)[0]
    finally:
        os.close(fd)


class Attachment:
    """Where the engine runs: ``inspect`` (NoXdp if it may not), ``attach``, ``swap`` (another
    instance of the engine's program), ``restore``; ``suspend``/``resume`` put the previous
    program back for a while."""

    def __init__(self, ifname: str, ns: Netns):
        self.ifname, self.ns = ifname, ns
        self.ifindex = 0
        self.old_fd: int | None = None
        self.old_name: str | None = None
        self.loss_ppm = 0
        self.prog_fd: int | None = None
        self.suspended = False

    def inspect(self) -> None:
        """What is on the interface now, and whether the engine may take its place."""
        with self.ns:
            try:
                self.ifindex = socket.if_nametoindex(self.ifname)
            except OSError:
                raise NoXdp(f"no interface {self.ifname}") from None
            self.old_fd, self.old_name = self._current()
        try:
            self._check_replaceable()
        except BaseException:
            self.close()
            raise

    def _current(self) -> tuple[int | None, str | None]:
        pid = libbpf.attached_id(self.ifindex)
        if not pid:
            return None, None
        fd = libbpf.prog_fd_by_id(pid)
        return fd, libbpf.prog_info(fd)[0]

    def _check_replaceable(self) -> None:
        name, fd = self.old_name, self.old_fd
        if name is None or name == "xdp_pass":
            return
        if name == "xdp_lossy":
            self.loss_ppm = loss_ppm_of(fd)
            return
        if name == PROG_NAME:
            owner = owner_of(fd)
            if owner and _alive(owner):
                raise NoXdp(f"another fetch engine (pid {owner}) runs on {self.ifname}")
            return                                  # left by a process that is gone
        raise NoXdp(f"{self.ifname} runs another XDP program ({name!r})")

    def attach(self, prog_fd: int) -> None:
        with self.ns:
            try:
                libbpf.xdp_attach(self.ifindex, prog_fd, self.old_fd)
            except OSError as exc:
                raise NoXdp(f"attaching to {self.ifname} failed: {exc}") from None
        self.prog_fd = prog_fd

    def swap(self, prog_fd: int) -> None:
        """Another instance of the engine's program in place of the attached one."""
        if not self.suspended:
            with self.ns:
                libbpf.xdp_attach(self.ifindex, prog_fd, self.prog_fd)
        self.prog_fd = prog_fd

    def _put_back(self) -> None:
        with self.ns:
            if self.old_fd is not None:
                libbpf.xdp_attach(self.ifindex, self.old_fd, self.prog_fd)
            else:
                libbpf.xdp_attach(self.ifindex, -1, self.prog_fd)     # detach, if still ours

    def restore(self) -> None:
        """Put back the program that was there (or none); a warning if it cannot be."""
        if self.prog_fd is not None and not self.suspended:
            self._put_back()
        self.prog_fd = None

    def suspend(self) -> None:
        if not self.suspended:
            self._put_back()
            self.suspended = True

    def resume(self) -> None:
        """Attach again, in place of whatever may stand in for us by now (checked as at
        first: a program that is not a stand-in is left alone, RuntimeError)."""
        if not self.suspended:
            return
        with self.ns:
            old_fd, old_name = self._current()
        keep_fd, keep_name = self.old_fd, self.old_name
        self.old_fd, self.old_name = old_fd, old_name
        try:
            self._check_replaceable()
            with self.ns:
                libbpf.xdp_attach(self.ifindex, self.prog_fd, old_fd)
        except (NoXdp, OSError) as exc:
            if old_fd is not None:
                os.close(old_fd)
            self.old_fd, self.old_name = keep_fd, keep_name
            raise RuntimeError(f"cannot resume on {self.ifname}: {exc}") from None
        if keep_fd is not None:
            os.close(keep_fd)
        self.suspended = False

    def close(self) -> None:
        if self.old_fd is not None:
            os.close(self.old_fd)
            self.old_fd = None
