"""Whole KV frames as the data plane sees them: the frame geometry (from xdp/kvproto.h), the XDP
verdict numbers (from the kernel's uapi header), and a raw Ethernet + IPv4 + UDP builder, so the
fuzzer, the traffic generator and the tests build frames one way (scapy_layer is for reading and
crafting them field by field)."""
from __future__ import annotations

import re
import socket
import struct
from enum import IntEnum
from pathlib import Path

from .wire import CONSTANTS

ETH_LEN, IPV4_LEN, UDP_LEN = (CONSTANTS[f"KV_{n}_LEN"] for n in ("ETH", "IPV4", "UDP"))
HDR_OFF = CONSTANTS["KV_HDR_OFF"]            # the KV header's offset in a frame
PAYLOAD_OFF = CONSTANTS["KV_PAYLOAD_OFF"]    # the payload's; also the per-chunk frame overhead
UAPI_BPF_H = Path("/usr/include/linux/bpf.h")


def _xdp_actions(path: Path = UAPI_BPF_H) -> dict[str, int]:
    """The members of ``enum xdp_action`` in the kernel's uapi header (linux-libc-dev)."""
    try:
        body = re.search(r"enum xdp_action\s*{([^}]*)}", path.read_text()).group(1)
    except (OSError, AttributeError):
        raise RuntimeError(f"cannot read enum xdp_action from {path}: install linux-libc-dev "
                           "('make setup' does)") from None
    out, value = {}, -1
    for name, explicit in re.findall(r"XDP_(\w+)\s*(?:=\s*(\d+))?", body):
        value = int(explicit) if explicit else value + 1
        out[name] = value
    return out


XDP = IntEnum("XDP", _xdp_actions())         # XDP.ABORTED, XDP.DROP, XDP.PASS, XDP.TX, ...


def _mac(addr: str | bytes) -> bytes:
    return addr if isinstance(addr, bytes) else bytes.fromhex(addr.replace(":", ""))


def _ip(addr: str | bytes) -> bytes:
    return addr if isinstance(addr, bytes) else socket.inet_aton(addr)


def ip_checksum(header: bytes) -> int:
    """RFC 1071 checksum of an IPv4 header (0 when the header's own checksum is right)."""
    s = sum(struct.unpack(f"!{len(header) // 2}H", header))
    s = (s & 0xFFFF) + (s >> 16)
    s = (s & 0xFFFF) + (s >> 16)
    return ~s & 0xFFFF


def ipv4_frame(src_mac, dst_mac, src_ip, dst_ip, sport: int, dport: int, payload: bytes,
               proto: int = socket.IPPROTO_UDP, ip_id: int = 1, ttl: int = 64) -> bytes:
    """An Ethernet + IPv4 (no options, right checksum) + UDP frame (UDP checksum 0: none) around
    ``payload``; with ``proto`` other than UDP the same 8 bytes stand in front of the payload."""
    l4 = struct.pack("!HHHH", sport, dport, UDP_LEN + len(payload), 0) + payload
    iph = struct.pack("!BBHHHBBH4s4s", 0x45, 0, IPV4_LEN + len(l4), ip_id, 0, ttl, proto, 0,
                      _ip(src_ip), _ip(dst_ip))
    iph = iph[:10] + struct.pack("!H", ip_checksum(iph)) + iph[12:]
    return _mac(dst_mac) + _mac(src_mac) + b"\x08\x00" + iph + l4
