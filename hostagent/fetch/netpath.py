"""Where the engine's frames go and how they are addressed: entering the node's network namespace
cheaply and repeatedly (per thread), the interface's own MAC and IPv4 address, the route and the
next hop's MAC to each pool node (the engine writes whole Ethernet frames, so it needs what the
kernel's stack would have looked up), and the 42-byte Ethernet + IPv4 + UDP header of a GET to
each pool node, built by kvproto.frames (UDP checksum 0: the room of a GET sent from a recycled
live-frames page holds stale bytes, see docs/protocol.md)."""
from __future__ import annotations

import ctypes
import json
import os
import socket
import subprocess
import threading
import time

from kvproto import HEADER_LEN
from kvproto.frames import HDR_OFF, ipv4_frame

CLONE_NEWNET = 0x40000000
_libc = ctypes.CDLL(None, use_errno=True)


class NoXdp(RuntimeError):
    """The XDP fetch engine cannot run here; the message says why (the asyncio client can)."""


class Netns:
    """Repeated cheap entry into a named network namespace (its fd is kept open). Namespaces
    belong to threads, so the nesting depth is per thread; ``None``: stay where we are."""

    def __init__(self, name: str | None):
        self.name = name
        self.fd = os.open(f"/run/netns/{name}", os.O_RDONLY) if name else -1
        self._local = threading.local()

    def __enter__(self) -> Netns:
        if self.fd >= 0:
            st = self._local
            if getattr(st, "depth", 0) == 0:
                st.home = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
                if _libc.setns(self.fd, CLONE_NEWNET):
                    os.close(st.home)
                    raise OSError(ctypes.get_errno(), f"entering namespace {self.name}")
                st.depth = 0
            st.depth += 1
        return self

    def __exit__(self, *exc) -> None:
        if self.fd >= 0:
            st = self._local
            st.depth -= 1
            if st.depth == 0:
                try:
                    if _libc.setns(st.home, CLONE_NEWNET):
                        raise OSError(ctypes.get_errno(), f"returning from {self.name}")
                finally:
                    os.close(st.home)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def _ip_json(*args: str) -> list:
    r = subprocess.run(["ip", "-j", *args], capture_output=True, text=True)
    if r.returncode:
        raise NoXdp(f"ip {' '.join(args)}: {r.stderr.strip()}")
    return json.loads(r.stdout or "[]")


def link(ifname: str) -> tuple[str, str]:
    """(MAC, first IPv4 address) of an interface in this thread's namespace."""
    links = _ip_json("addr", "show", "dev", ifname)
    if not links:
        raise NoXdp(f"no interface {ifname}")
    addr = next((a["local"] for a in links[0].get("addr_info", []) if a["family"] == "inet"),
                None)
    if addr is None:
        raise NoXdp(f"{ifname} has no IPv4 address")
    return links[0]["address"], addr


def neighbour(ip: str, sock: socket.socket, timeout: float = 2.0) -> str | None:
    """The MAC of ``ip`` from this namespace's ARP table, resolving it first if it is not there
    (a datagram to the discard port makes the kernel ask)."""
    deadline, asked = time.monotonic() + timeout, False
    while True:
        with open("/proc/thread-self/net/arp") as f:
            for line in f.readlines()[1:]:
                parts = line.split()
                if parts[0] == ip and parts[2] != "0x0" and parts[3] != "00:00:00:00:00:00":
                    return parts[3]
        if time.monotonic() > deadline:
            return None
        if not asked:
            try:
                sock.sendto(b"", (ip, 9))
            except OSError:
                pass
            asked = True
        time.sleep(0.01)


def next_hop(host: str, ifname: str, sock: socket.socket, own_ip: str) -> tuple[str, str]:
    """(destination MAC, source IPv4) of frames to ``host``: its own MAC on our link, or its
    gateway's. NoXdp when it is reached through another interface or does not answer ARP."""
    routes = _ip_json("route", "get", host)
    r = routes[0] if routes else {}
    if r.get("dev") != ifname:
        raise NoXdp(f"pool {host} is reached through {r.get('dev')}, not {ifname}")
    hop = r.get("gateway", host)
    mac = neighbour(hop, sock)
    if mac is None:
        raise NoXdp(f"no MAC address for {hop} on {ifname}")
    return mac, r.get("prefsrc") or own_ip


def route_header(src_mac: str, dst_mac: str, src_ip: str, sport: int, dst_ip: str, dport: int,
                 chunk_size: int) -> bytes:
    """Ethernet + IPv4 (checksum set) + UDP (checksum 0) of a GET with room for a chunk."""
    return ipv4_frame(src_mac, dst_mac, src_ip, dst_ip, sport, dport,
                      bytes(HEADER_LEN + chunk_size), ip_id=0)[:HDR_OFF]
