"""XDP programs on interfaces: attach (replacing what is there), detach, what is attached, and
``Attachment``: one program in place of the one that was there, put back afterwards.

Everything goes through libbpf's ``bpf_xdp_attach`` in the calling thread's network namespace
(``xdp.netns``). ``Attachment`` attaches and restores with ``XDP_FLAGS_REPLACE`` and the
program expected there, so neither can clobber a program someone attached meanwhile; which
programs it may take the place of is its ``check_replaceable`` (by default: none).
"""
from __future__ import annotations

import os
import socket

from . import NoXdp, libbpf
from .netns import Netns

MODES = ("native", "generic")             # XDP attach modes: driver (veth, NICs) or SKB
# This kernel refuses native XDP on a veth whose MTU exceeds this (no multi-buffer programs here):
# kvproto.h's KV_VETH_MAX_MTU, the one definition
VETH_MAX_MTU = __import__("xdp").constants("kvproto.h")["KV_VETH_MAX_MTU"]


def _fd(prog) -> int:
    return prog if isinstance(prog, int) else prog.fd      # an fd or BCC's loaded function


def _ifindex(ifname: str) -> int:
    try:
        return socket.if_nametoindex(ifname)
    except OSError:
        raise NoXdp(f"no interface named {ifname!r} in this network namespace") from None


def attach_xdp(ifname: str, prog, mode: str = "native") -> None:
    """Attach a loaded program (fd or BCC function) to an interface of this namespace,
    replacing what is there in that mode. OSError with the kernel's reason if refused."""
    libbpf.xdp_attach(_ifindex(ifname), _fd(prog), None, mode)


def detach_port(ifname: str, mode: str = "native") -> None:
    """Remove whatever XDP program is attached to ``ifname`` in that mode."""
    libbpf.xdp_attach(_ifindex(ifname), -1, None, mode)


def program_name(prog_id: int) -> str:
    fd = libbpf.prog_fd_by_id(prog_id)
    try:
        return libbpf.prog_info(fd)[0] or f"id {prog_id}"
    finally:
        os.close(fd)


def attached_program(ifname: str, mode: str | None = None) -> tuple[str | None, int | None]:
    """Name and id of the XDP program attached to ``ifname`` (in this namespace) in ``mode``
    (None: either), or (None, None)."""
    try:
        index = socket.if_nametoindex(ifname)
    except OSError:
        return None, None
    for m in (mode,) if mode else MODES:
        prog_id = libbpf.attached_id(index, m)
        if prog_id:
            return program_name(prog_id), prog_id
    return None, None


def attach_mode(ifname: str) -> str | None:
    """'native' or 'generic': how a program is attached to ``ifname`` (None: none is)."""
    try:
        index = socket.if_nametoindex(ifname)
    except OSError:
        return None
    return next((m for m in MODES if libbpf.attached_id(index, m)), None)


class Attachment:
    """One program on ``ifname`` (native mode) in namespace ``ns`` in place of what was there:
    ``inspect`` (NoXdp if it may not), ``attach``, ``swap`` (another instance of the same
    program), ``restore``; ``suspend``/``resume`` put the previous program back for a while.
    Subclasses say which programs they may replace (``check_replaceable``)."""

    def __init__(self, ifname: str, ns: Netns):
        self.ifname, self.ns = ifname, ns
        self.ifindex = 0
        self.old_fd: int | None = None
        self.old_name: str | None = None
        self.prog_fd: int | None = None
        self.suspended = False

    def check_replaceable(self, name: str, fd: int) -> None:
        """NoXdp unless the program ``name`` (its fd: ``fd``) on the interface may make way."""
        raise NoXdp(f"{self.ifname} runs another XDP program ({name!r})")

    def inspect(self) -> None:
        """What is on the interface now, and whether our program may take its place."""
        with self.ns:
            try:
                self.ifindex = socket.if_nametoindex(self.ifname)
            except OSError:
                raise NoXdp(f"no interface {self.ifname}") from None
            self.old_fd, self.old_name = self._current()
        try:
            if self.old_name is not None:
                self.check_replaceable(self.old_name, self.old_fd)
        except BaseException:
            self.close()
            raise

    def _current(self) -> tuple[int | None, str | None]:
        pid = libbpf.attached_id(self.ifindex)
        if not pid:
            return None, None
        fd = libbpf.prog_fd_by_id(pid)
        return fd, libbpf.prog_info(fd)[0]

    def attach(self, prog_fd: int) -> None:
        with self.ns:
            try:
                libbpf.xdp_attach(self.ifindex, prog_fd, self.old_fd)
            except OSError as exc:
                raise NoXdp(f"attaching to {self.ifname} failed: {exc}") from None
        self.prog_fd = prog_fd

    def swap(self, prog_fd: int) -> None:
        """Another instance of the program in place of the attached one."""
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
        """Put back the program that was there (or none)."""
        if self.prog_fd is not None and not self.suspended:
            self._put_back()
        self.prog_fd = None

    def suspend(self) -> None:
        if not self.suspended:
            self._put_back()
            self.suspended = True

    def resume(self) -> None:
        """Attach again, in place of whatever may stand in for us by now (checked as at
        first: a program that may not be replaced is left alone, RuntimeError)."""
        if not self.suspended:
            return
        with self.ns:
            old_fd, old_name = self._current()
        keep_fd, keep_name = self.old_fd, self.old_name
        self.old_fd, self.old_name = old_fd, old_name
        try:
            if old_name is not None:
                self.check_replaceable(old_name, old_fd)
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
