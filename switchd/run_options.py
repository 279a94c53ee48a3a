"""The parsing and checks of `switchd run`'s options (and `switchd port bind`'s source): each
bad value is one SwitchError line naming the option, before anything is loaded."""
from __future__ import annotations

import ipaddress

import click

from kvproto.cli import parse_size

from .dataplane import SwitchError


def parse_share(spec: str | None) -> tuple[int, int] | None:
    if spec is None:
        return None
    k, sep, n = spec.partition("/")
    if not (sep and k.isdigit() and n.isdigit() and 0 <= int(k) < int(n)):
        raise SwitchError(f"--cache-share {spec!r} is not K/N with 0 <= K < N (e.g. 0/2)")
    return (int(k), int(n)) if int(n) > 1 else None


def check_trunks(hosts, uplinks, downlinks, pool_ports, bindings) -> None:
    """A trunk is one kind of port (a node's port bound to one source is another: a port both
    would be trusted as a trunk and never bound), and never bound to one source."""
    for port in uplinks + downlinks:
        kinds = [k for k, ps in (("--port", hosts), ("--uplink", uplinks),
                                 ("--downlink", downlinks), ("--pool-port", pool_ports))
                 if port in ps]
        if len(kinds) > 1:
            raise SwitchError(f"port {port} is given as {' and '.join(kinds)}: one kind each")
        if port in bindings:
            raise SwitchError(f"port {port} is a trunk ({kinds[0]}): it carries many nodes' "
                              "frames and cannot be bound to one source")


def _port_items(items, ports: list[str], what: str, form: str):
    for item in items:
        port, sep, spec = item.partition("=")
        if not sep or port not in ports:
            raise SwitchError(f"{what} {item!r} is not {form} for one of the ports")
        yield port, spec


def parse_port_ns(items, ports: list[str]) -> dict[str, list[int]]:
    limits = {}
    for port, spec in _port_items(items, ports, "--port-ns", "PORT=NS[,NS...]"):
        try:
            namespaces = [int(n) for n in spec.split(",") if n.strip()]
        except ValueError:
            namespaces = []
        if not namespaces or not all(0 <= n <= 0xFFFFFFFF for n in namespaces):
            raise SwitchError(f"--port-ns {port}={spec}: give namespaces 0..4294967295")
        limits[port] = namespaces
    return limits


def parse_uplinks(items) -> tuple[list[str], dict[str, list[str]]]:
    names, pools = [], {}
    for item in items:
        port, sep, addrs = item.partition("=")
        ips = [a.strip() for a in addrs.split(",")] if sep else []
        if not port or (sep and not all(_is_ipv4(a) for a in ips)):
            raise SwitchError(f"--uplink {item!r} is not IF or IF=IP[,IP...] (the pool nodes "
                              "behind it, e.g. uplink=198.18.0.101,198.18.0.102)")
        names.append(port)
        if ips:
            pools.setdefault(port, []).extend(ips)
    return names, pools


def parse_pool_ports(items) -> tuple[list[str], dict[str, str]]:
    names, addrs = [], {}
    for item in items:
        port, sep, addr = item.partition("=")
        if not port or (sep and not _is_ipv4(addr)):
            raise SwitchError(f"--pool-port {item!r} is not IF or IF=IP (the pool node's IPv4 "
                              "address, e.g. p1=198.18.0.101)")
        names.append(port)
        if sep:
            addrs[port] = addr
    return names, addrs


def _is_ipv4(text: str) -> bool:
    try:
        ipaddress.IPv4Address(text)
    except ValueError:
        return False
    return True


def parse_source(spec: str, what: str) -> tuple[str | None, str]:
    """'MAC,IP' or 'IP' (MAC None: asked for by ARP) as (MAC, IP), or one clear error."""
    mac, sep, addr = spec.rpartition(",")
    try:
        if sep and len(bytes.fromhex(mac.replace(":", "").replace("-", ""))) != 6:
            raise ValueError
        if not _is_ipv4(addr):
            raise ValueError
    except ValueError:
        raise SwitchError(f"{what}: give [MAC,]IPv4, e.g. 02:00:00:00:00:01,198.18.0.1 or "
                          "198.18.0.1") from None
    return (mac.lower().replace("-", ":") if sep else None), addr


def parse_bindings(items, ports: list[str]) -> dict[str, tuple[str | None, str]]:
    return {port: parse_source(spec, f"--port-bind {port}={spec}")
            for port, spec in _port_items(items, ports, "--port-bind", "PORT=[MAC,]IP")}


def parse_quotas(items) -> dict[int, int]:
    quotas = {}
    for item in items:
        ns, sep, size = item.partition("=")
        if not sep or not ns.strip().isdigit() or int(ns) > 0xFFFFFFFF:
            raise SwitchError(f"quota {item!r} is not NS=SIZE (e.g. 3=64MiB)")
        try:
            quotas[int(ns)] = parse_size(size)
        except click.BadParameter as exc:
            raise SwitchError(f"quota {item!r}: {exc.message}") from None
    return quotas
