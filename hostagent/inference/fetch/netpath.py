"""Where the engine's frames go and how they are addressed: the interface's own MAC and IPv4
address, the route and the next hop's MAC to each pool node (the engine writes whole Ethernet
frames, so it needs what the kernel's stack would have looked up), and the 42-byte Ethernet +
IPv4 + UDP header of a GET to each pool node, built by kvproto.frames (UDP checksum 0: the room
of a GET sent from a recycled live-frames page holds stale bytes, see docs/protocol.md).
Entering the node's namespace is xdp.netns's."""
from __future__ import annotations

import json
import socket
import subprocess
import time

from kvproto import HEADER_LEN
from kvproto.frames import HDR_OFF, ipv4_frame
from xdp import NoXdp


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
