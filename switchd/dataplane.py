"""The switch's data plane as userspace sees it: xdp/kvswitch.c compiled for one deployment (chunk
size, cache entries, pin directory), attached to switch ports, and the BPF maps whose layouts BCC
reads from xdp/kvswitch.h. This module and the maps are the only meeting point of data plane and
control plane; loading, attaching and the libbpf calls are the xdp package's (``DataPlane`` is an
``xdp.program.Program``)."""
from __future__ import annotations

import ctypes
import logging
import os
import re
import socket
from dataclasses import dataclass

import xdp
from kvproto import DEFAULT_CHUNK, check_chunk_size
from xdp import NoXdp, libbpf, pin
from xdp.attach import attach_xdp, attached_program, detach_port
from xdp.loader import import_bcc, load_xdp
from xdp.program import Program, prefixed, program_map_ids

log = logging.getLogger("switchd")
CONSTANTS = xdp.constants("kvswitch.h")   # the wire format's and the switch's own
DEFAULT_PIN_DIR = "/sys/fs/bpf/kvswitch"
ROLE_HOST, ROLE_POOL = CONSTANTS["KV_ROLE_HOST"], CONSTANTS["KV_ROLE_POOL"]   # port roles
PF = {n[len("KV_PF_"):]: v for n, v in CONSTANTS.items() if n.startswith("KV_PF_")}
CACHE_VAL_HEADER = CONSTANTS["KV_CACHE_VAL_HEADER"]  # bytes of kv_cache_val before data[]
# The largest chunk a deployment can use: a frame's IPv4 + UDP + KV header and the chunk within
MAP_NAMES = ("kv_cache", "kv_blocks", "kv_admit", "kv_ports", "kv_stats", "kv_settings",
             "kv_pending", "kv_waiters", "kv_sketch", "kv_recent", "kv_ns_stats", "kv_port_ns",
             "kv_ns_low", "kv_src_macs", "kv_src_ips")
# every map kvmaps.h pins, read from its KV_MAP(...) lines: what a failed first start removes
PINNED_MAPS = tuple(re.findall(r"^KV_F?MAP\((?:[^,]*,){3}\s*(kv_\w+)\s*,",
                               xdp.source("kvmaps.h").read_text(), re.M))
SETTINGS = {name: v for v, name in prefixed(CONSTANTS, "KV_SET_").items()}


class SwitchError(Exception):
    """A problem the user can fix; its message is one line that says how."""


@dataclass(frozen=True)
class Deployment:
    chunk_size: int = DEFAULT_CHUNK
    cache_entries: int = 65536
    pin_dir: str | None = DEFAULT_PIN_DIR

    def __post_init__(self):
        try:
            check_chunk_size(self.chunk_size)
        except ValueError as exc:
            raise SwitchError(str(exc)) from None
        if not 1 <= self.cache_entries <= 1 << 24:
            raise SwitchError("cache entries must be between 1 and 16777216")

    def cflags(self) -> list[str]:
        flags = xdp.cflags(f"-DKV_CHUNK={self.chunk_size}",
                           f"-DKV_CACHE_ENTRIES={self.cache_entries}")
        if self.pin_dir:
            flags.append(pin.cflag(self.pin_dir))
        return flags


def crc32_tables(slices: int = CONSTANTS["KV_CRC_SLICES"]) -> list[int]:
    """The data plane's kv_crc_table: ``slices`` tables of CRC-32 (IEEE, reflected), 256 entries
    each, one after the other. Table 0 is the byte-at-a-time table; table k is table k-1 taken
    one zero byte further (slicing-by-N: N bytes a step)."""
    tables = [[]]
    for n in range(256):
        c = n
        for _ in range(8):
            c = (c >> 1) ^ (0xEDB88320 if c & 1 else 0)
        tables[0].append(c)
    for _ in range(1, slices):
        tables.append([(c >> 8) ^ tables[0][c & 0xFF] for c in tables[-1]])
    return [c for table in tables for c in table]


def pinned_deployment(pin_dir: str) -> Deployment:
    """The deployment the maps pinned in ``pin_dir`` were made for."""
    path = os.path.join(pin_dir, "kv_cache")
    if not os.path.exists(path):
        raise SwitchError(f"no switch maps pinned in {pin_dir}: is 'switchd run' started "
                          "(with the same --pin-dir / --netns)?")
    try:
        info = libbpf.pinned_map_info(path)
    except OSError as exc:
        raise SwitchError(str(exc)) from None
    return Deployment(info.value_size - CACHE_VAL_HEADER, info.max_entries, pin_dir)


def ifindex(name: str) -> int:
    try:
        return socket.if_nametoindex(name)
    except OSError:
        raise SwitchError(f"no interface named {name!r} in this network namespace") from None


def _name(index: int) -> str:
    try:
        return socket.if_indextoname(index)
    except OSError:
        return f"ifindex {index}"


class DataPlane(Program, source="kvswitch.c", header="kvswitch.h", stats="KV_STAT_"):
    """The compiled programs and their maps. ``programs=False`` opens just the maps (pinned ones
    when the deployment has a pin directory) and the cache's slot writer (xdp/kvwrite.c), for
    tools that only read or edit them."""

    def __init__(self, deployment: Deployment, programs: bool = True):
        try:
            self._open(deployment, programs)
        except NoXdp as exc:
            raise SwitchError(str(exc)) from None

    def _open(self, deployment: Deployment, programs: bool) -> None:
        bcc = import_bcc()
        self.bcc, self.deployment = bcc, deployment
        if deployment.pin_dir:
            os.makedirs(deployment.pin_dir, exist_ok=True)
            self._check_pins_match(deployment)
        self.ingress = self.egress = self.devmap = None
        if programs:
            self.bpf, fns = load_xdp(xdp.source("kvswitch.c"), ("kv_ingress", "kv_write"),
                                     deployment.cflags(), devmap_egress=("kv_egress",),
                                     append=(xdp.source("kvwrite.c"),))
            self.ingress, self.egress = fns["kv_ingress"], fns["kv_egress"]
            self.writer = fns["kv_write"]
            crc, table = crc32_tables(), self.bpf.get_table(b"kv_crc_table")
            table[table.Key(0)] = table.Leaf((ctypes.c_uint32 * len(crc))(*crc))
            self.devmap = self.bpf.get_table(b"kv_devmap")
        else:
            self.bpf, fns = load_xdp(xdp.source("kvwrite.c"), ("kv_write",), deployment.cflags())
            self.writer = fns["kv_write"]
        (self.cache, self.blocks, self.admit, self.ports, self.stats, self.settings,
         self.pending, self.waiters, self.sketch, self.recent, self.ns_stats, self.port_ns,
         self.ns_low, self.src_macs, self.src_ips) = (self.bpf.get_table(n.encode())
                                                      for n in MAP_NAMES)
        self.attached: dict[str, int] = {}

    @staticmethod
    def _check_pins_match(dep: Deployment) -> None:
        if os.path.exists(os.path.join(dep.pin_dir, "kv_cache")):
            pinned = pinned_deployment(dep.pin_dir)
            if (pinned.chunk_size, pinned.cache_entries) != (dep.chunk_size, dep.cache_entries):
                raise SwitchError(
                    f"maps pinned in {dep.pin_dir} hold {pinned.cache_entries} chunks of "
                    f"{pinned.chunk_size} bytes; start with those settings or remove the pins "
                    f"('switchd reset')")

    def attach(self, ifname: str, mode: str = "native", force: bool = False) -> None:
        """Attach the ingress program. A port running a program that is not ours, or ours on
        another switch's maps, is refused unless ``force``; ours on these maps (left by a
        crashed daemon) is simply replaced."""
        ifindex(ifname)
        other, prog_id = attached_program(ifname)
        if other and not force:
            if other != "kv_ingress":
                raise SwitchError(f"{ifname} already runs XDP program {other!r}: remove it "
                                  f"first ('switchd detach --port {ifname}') or start with "
                                  "--force")
            if self.map_id("kv_cache") not in program_map_ids(prog_id):
                raise SwitchError(f"{ifname} is served by another switch (with maps of its "
                                  "own): stop it first or start with --force")
        try:
            attach_xdp(ifname, self.ingress, mode)
        except Exception as exc:
            raise SwitchError(f"attaching to {ifname} ({mode} mode) failed: {exc}") from None
        self.attached[ifname] = mode

    def detach(self, ifname: str) -> None:
        ifindex(ifname)
        detach_port(ifname, self.attached.pop(ifname, "native"))

    def detach_all(self) -> None:
        for name in list(self.attached):
            self.detach(name)

    def set_replication_ports(self, ifnames: list[str]) -> None:
        """The ports a reply can be replicated to, each with the egress program."""
        slots = CONSTANTS["KV_DEVMAP_SLOTS"]
        if len(ifnames) > slots:
            raise SwitchError(f"at most {slots} ports can share replicated replies")
        for i, name in enumerate(ifnames):
            self.devmap[self.devmap.Key(i)] = self.devmap.Leaf(ifindex(name), self.egress.fd)

    def set(self, name: str, value: int) -> None:
        """Write one data-plane setting (KV_SET_<NAME>)."""
        self.settings[self.settings.Key(SETTINGS[name])] = self.settings.Leaf(value)

    def get(self, name: str) -> int:
        return int(self.settings[self.settings.Key(SETTINGS[name])].value)

    def map_id(self, name: str) -> int:
        """The kernel's id of one of the switch's maps."""
        return libbpf.map_info(self.bpf.get_table(name.encode()).get_fd()).id

    def mark_clear(self, index: int, clear: bool) -> None:
        """Say whether port ``index`` has no checks (kv_port_clear; ports past its slots are
        always looked up)."""
        if index < CONSTANTS["KV_PORT_CLEAR_SLOTS"]:
            table = self.bpf.get_table(b"kv_port_clear")
            table[table.Key(index)] = table.Leaf(int(clear))

    def port_sources(self) -> dict[str, tuple[str, str]]:
        """The bound (MAC, IPv4) source of each secured port, by interface name."""
        out = {}
        for k, v in self.ports.items():
            if not v.flags & PF["BOUND"]:
                continue
            try:
                name = socket.if_indextoname(k.value)
            except OSError:
                continue
            out[name] = (":".join(f"{b:02x}" for b in bytes(v.mac)),
                         socket.inet_ntoa(int(v.ip).to_bytes(4, "little")))
        return out

    def stats_fd(self) -> int:
        return self.stats.get_fd()


STAT_NAMES = DataPlane.STAT_NAMES
