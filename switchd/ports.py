"""Ports as the control plane keeps them: a port's role and checks (``set_role``), which port
owns which source (the data plane's kv_src_macs and kv_src_ips, written here for bindings switchd
makes and by the data plane for the ones it learns), binding a port before any frame is seen (a
MAC and IPv4 address given, or the address alone, its MAC asked for by ARP out of that port and
nowhere else), the operator's relearn, and the port table `switchd port ls` prints.
docs/security.md explains the model."""
from __future__ import annotations

import ctypes
import logging
import select
import socket
import struct
import time

from .dataplane import PF, ROLE_POOL, DataPlane, SwitchError, _name, ifindex

log = logging.getLogger("switchd.ports")

ETH_P_ARP = 0x0806
ETH_P_ALL = 0x0003
ARP_TIMEOUT = 3.0          # seconds a port's node has to answer before switchd gives up
ARP_RESEND = 0.2


def mac_bytes(mac: str) -> bytes:
    raw = bytes.fromhex(mac.replace(":", "").replace("-", ""))
    if len(raw) != 6:
        raise ValueError(mac)
    return raw


def mac_str(raw: bytes) -> str:
    return ":".join(f"{b:02x}" for b in raw)


def ip_raw(ip: str) -> int:
    """An IPv4 address as the maps hold it: network-order bytes read as a host u32."""
    return int.from_bytes(socket.inet_aton(ip), "little")


def mac_raw(mac: str) -> int:
    """A MAC as kv_src_macs keys it: its 6 bytes in the low bytes of a u64 (memory order)."""
    return int.from_bytes(mac_bytes(mac) + b"\0\0", "little")


def resolve(ifname: str, ip: str, timeout: float = ARP_TIMEOUT) -> str:
    """The MAC of the node at ``ip`` behind port ``ifname``: an ARP probe (sender 0.0.0.0, so
    the node's neighbour table is left alone) sent out of that port alone, its answer read on
    that port alone, so no other port's node can answer in its place."""
    ifindex(ifname)
    # every protocol: a bridge port's handler takes frames before protocol-bound taps see them
    sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
    try:
        sock.bind((ifname, ETH_P_ALL))
        own = sock.getsockname()[4][:6]
        target = socket.inet_aton(ip)
        probe = (b"\xff" * 6 + own + struct.pack("!H", ETH_P_ARP) +
                 struct.pack("!HHBBH", 1, 0x0800, 6, 4, 1) + own + bytes(4) + bytes(6) + target)
        probe += bytes(60 - len(probe))
        end, next_send = time.monotonic() + timeout, 0.0
        while (now := time.monotonic()) < end:
            if now >= next_send:
                sock.send(probe)
                next_send = now + ARP_RESEND
            ready, _, _ = select.select([sock], [], [], min(next_send, end) - now)
            if not ready:
                continue
            frame = sock.recv(2048)
            if len(frame) < 42 or frame[12:14] != b"\x08\x06":
                continue
            op = struct.unpack("!H", frame[20:22])[0]
            sha, spa = frame[22:28], frame[28:32]
            if op == 2 and spa == target and frame[6:12] == sha and not sha[0] & 1:
                return mac_str(sha)
    finally:
        sock.close()
    raise SwitchError(f"nothing at {ip} answered ARP on port {ifname} within {timeout:g} s: is "
                      f"the node up? (or give its MAC: --port-bind {ifname}=MAC,{ip})")


def owners(dp: DataPlane) -> tuple[dict[int, int], dict[int, int]]:
    """(MAC key -> ifindex, IPv4 key -> ifindex) as the data plane holds them."""
    return ({k.value: v.value for k, v in dp.src_macs.items()},
            {k.value: v.value for k, v in dp.src_ips.items()})


def release(dp: DataPlane, index: int) -> None:
    """Forget every source owned by port ``index``."""
    for table in (dp.src_macs, dp.src_ips):
        for k, v in list(table.items()):
            if v.value == index:
                del table[k]


def _unbind(dp: DataPlane, index: int) -> None:
    key = dp.ports.Key(index)
    try:
        cfg = dp.ports[key]
    except KeyError:
        return
    cfg.flags &= ~PF["BOUND"]
    cfg.ip = 0
    for i in range(6):
        cfg.mac[i] = 0
    dp.ports[key] = cfg
    release(dp, index)


def claim(dp: DataPlane, index: int, mac: str, ip: str) -> list[int]:
    """Make port ``index`` the owner of (mac, ip), as an operator's binding: a port that had
    either (a binding learned or given before) loses its binding. Returns those ports."""
    macs, ips = owners(dp)
    taken = {o for o in (macs.get(mac_raw(mac)), ips.get(ip_raw(ip))) if o and o != index}
    for k, v in dp.ports.items():          # bound ports whose owner entries were lost
        if (k.value != index and v.flags & PF["BOUND"] and
                (bytes(v.mac) == mac_bytes(mac) or v.ip == ip_raw(ip))):
            taken.add(k.value)
    for other in taken:
        _unbind(dp, other)
    release(dp, index)
    dp.src_macs[dp.src_macs.Key(mac_raw(mac))] = dp.src_macs.Leaf(index)
    dp.src_ips[dp.src_ips.Key(ip_raw(ip))] = dp.src_ips.Leaf(index)
    return sorted(taken)


def own(dp: DataPlane, index: int, mac: str, ip: str) -> None:
    """Make trunk ``index`` the owner of (mac, ip), one of the many sources it carries (a pool
    node behind an uplink), taking it from a port that had it (a node's port would have had it
    by mistake: it is unbound)."""
    macs, ips = owners(dp)
    for other in {o for o in (macs.get(mac_raw(mac)), ips.get(ip_raw(ip))) if o and o != index}:
        _unbind(dp, other)
    dp.src_macs[dp.src_macs.Key(mac_raw(mac))] = dp.src_macs.Leaf(index)
    dp.src_ips[dp.src_ips.Key(ip_raw(ip))] = dp.src_ips.Leaf(index)


def sync(dp: DataPlane) -> None:
    """Owner entries exactly for the bound ports (after a restart, or ports that went away):
    stale entries go, missing ones are written; a trunk's own (KV_PF_SOURCES: the sources it
    carries) stay while it owns sources."""
    want_macs, want_ips, trunks = {}, {}, set()
    for k, v in dp.ports.items():
        if v.flags & PF["BOUND"]:
            want_macs.setdefault(int.from_bytes(bytes(v.mac) + b"\0\0", "little"), k.value)
            want_ips.setdefault(v.ip, k.value)
        if v.flags & PF["SOURCES"]:
            trunks.add(k.value)
    for table, want in ((dp.src_macs, want_macs), (dp.src_ips, want_ips)):
        for k, v in list(table.items()):
            if want.get(k.value) != v.value and v.value not in trunks:
                del table[k]
        for key, index in want.items():
            table[table.Key(key)] = table.Leaf(index)


def relearn(dp: DataPlane, ifname: str) -> tuple[str, str] | None:
    """Unbind a secured port: it binds to the source of its next frame (one no other port
    owns). Returns the binding it had."""
    index = ifindex(ifname)
    try:
        cfg = dp.ports[dp.ports.Key(index)]
    except KeyError:
        raise SwitchError(f"port {ifname} is not a port of this switch") from None
    if not cfg.flags & PF["SECURED"]:
        raise SwitchError(f"port {ifname} is not secured: nothing to relearn")
    before = _source(cfg)
    _unbind(dp, index)
    return before


def set_role(dp: DataPlane, ifname: str, role: int, namespaces: list[int] | None = None,
             secured: bool = False, source: tuple[str, str] | None = None,
             trunk: bool = False, owns_sources: bool = False) -> None:
    """A port's role and checks. ``namespaces``: the only ones it may ask for (and only
    frames the data plane can check pass). ``secured``: its frames must carry one source,
    ``source`` (MAC, IPv4) if given (a port that had it loses it), else the first one it
    sends that no other port owns (sticky; a binding learned before is kept). ``trunk``: a
    link to another switch, many nodes' frames (never secured): with the pool role an
    uplink, whose replies made by the switch above answer rounds too; else a downlink.
    ``owns_sources`` (a trunk): every source it carries becomes its own when first seen,
    and a frame claiming another port's is dropped (KV_PF_SOURCES)."""
    if trunk and (secured or source):
        raise SwitchError(f"{ifname} is a trunk: it carries many nodes' frames and cannot "
                          "be bound to one source")
    if owns_sources and not trunk:
        raise SwitchError(f"{ifname} is not a trunk: a node's port is bound to one source")
    index = ifindex(ifname)
    for k in [k for k in dp.port_ns.keys() if k.ifindex == index]:
        del dp.port_ns[k]
    for ns in namespaces or []:
        dp.port_ns[dp.port_ns.Key(index, ns)] = dp.port_ns.Leaf(1)
    key = dp.ports.Key(index)
    try:
        cfg = dp.ports[key]
    except KeyError:
        cfg = dp.ports.Leaf()
    bound = cfg.flags & PF["BOUND"] if secured and not source else 0
    if source:
        ctypes.memmove(cfg.mac, bytes.fromhex(source[0].replace(":", "")), 6)
        cfg.ip = int.from_bytes(socket.inet_aton(source[1]), "little")
        bound = PF["BOUND"]
    elif not bound:
        ctypes.memset(ctypes.addressof(cfg.mac), 0, 6)
        cfg.ip = 0
    cfg.role = role
    inline = len(cfg.ns)
    ns_list = sorted(set(namespaces or []))
    cfg.nns = len(ns_list) if len(ns_list) <= inline else inline + 1   # more: kv_port_ns
    for i in range(inline):
        cfg.ns[i] = ns_list[i] if i < len(ns_list) else 0
    cfg.flags = ((PF["NS_LIMITED"] if namespaces else 0) |
                 (PF["SECURED"] if secured or source else 0) | bound |
                 (PF["TRUNK"] if trunk else 0) | (PF["SOURCES"] if owns_sources else 0))
    checked = PF["NS_LIMITED"] | PF["SECURED"] | PF["SOURCES"]
    checks = bool(cfg.flags & checked)
    if checks:
        dp.mark_clear(index, False)    # before the checks exist: never skipped
    if source:
        for other in claim(dp, index, *source):
            log.warning("%s lost its binding: %s is bound to %s %s", _name(other), ifname,
                        *source)
    elif not bound and not owns_sources:
        release(dp, index)
    dp.ports[key] = cfg
    if not checks:
        dp.mark_clear(index, True)     # after they are gone
    if bound and not source:
        sync(dp)
    # a trunk that does not own its sources has nothing to check
    dp.set("port_checks", int(any(v.flags & checked for v in dp.ports.values())))


def _source(cfg) -> tuple[str, str] | None:
    if not cfg.flags & PF["BOUND"]:
        return None
    return mac_str(bytes(cfg.mac)), socket.inet_ntoa(int(cfg.ip).to_bytes(4, "little"))


def _role_name(cfg) -> str:
    if cfg.flags & PF["TRUNK"]:
        return "uplink" if cfg.role == ROLE_POOL else "downlink"
    return "pool" if cfg.role == ROLE_POOL else "host"


def table(dp: DataPlane) -> list[dict]:
    """Every port the maps know: name, role, checks, binding, namespaces."""
    rows = []
    for k, v in sorted(dp.ports.items(), key=lambda kv: kv[0].value):
        try:
            name = socket.if_indextoname(k.value)
        except OSError:
            name = f"ifindex {k.value} (gone)"
        src = _source(v)
        if v.nns <= len(v.ns):
            namespaces = [int(v.ns[i]) for i in range(v.nns)]
        else:
            namespaces = sorted(pk.ns for pk in dp.port_ns.keys() if pk.ifindex == k.value)
        rows.append({"port": name, "ifindex": k.value,
                     "role": _role_name(v),
                     "secured": bool(v.flags & PF["SECURED"]),
                     "mac": src[0] if src else None, "ip": src[1] if src else None,
                     "namespaces": namespaces if v.flags & PF["NS_LIMITED"] else None})
    return rows
