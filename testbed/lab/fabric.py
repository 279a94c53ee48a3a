"""A fabric of switches on one machine (issue 43): ``racks`` rack switches, each a namespace
``<prefix>-r<k>`` whose bridge joins its inference nodes' ports (h1, h2, ...) and an uplink
``uplink``, and one pool-side (aggregation) switch ``<prefix>-agg`` whose bridge joins a downlink
``r<k>`` per rack and the pool nodes' ports (p1, ...). One L2 domain with the single switch's
addresses (hosts .1-.99, pool nodes .101-.199), so nodes, agents and tasks run as on a
``Topology``. With shaped links (testbed.lab.links) host links run at ``host_gbit``, pool links
at ``pool_gbit`` and each rack's uplink at its hosts' total over ``oversub`` (2:1 by default),
every one queued both ways in a link namespace of its own (``<prefix>-l<port>``, the uplink's
named after its downlink). Pins of each switch live under the testbed's pin directory, so
``down`` removes a fabric like any testbed."""
from __future__ import annotations

import os
import signal
import subprocess
from dataclasses import dataclass, field

from switchd.dataplane import CONSTANTS

from .lab import Lab
from .links import LinkSpec, build_link
from .topology import (BRIDGE, Node, TestbedError, Topology, _bridge_without_netfilter,
                       _quiet_namespace, attach_pass_programs, bridge_pass, ip, pass_program,
                       python_argv)

UPLINK = "uplink"                          # a rack switch's port towards the pool side
AGG = "agg"
MAX_PORTS = CONSTANTS["KV_DEVMAP_SLOTS"]   # ports one switch can replicate a reply to


@dataclass(frozen=True)
class SwitchBox:
    """One switch of the fabric: its name (r1.., agg), namespace, pin directory and ports by
    kind (``hosts`` and ``pools``: node ports; ``uplinks``/``downlinks``: trunks)."""
    name: str
    netns: str
    pin_dir: str
    hosts: tuple[str, ...] = ()
    pools: tuple[str, ...] = ()
    uplinks: tuple[str, ...] = ()
    downlinks: tuple[str, ...] = ()

    @property
    def ports(self) -> list[str]:
        return [*self.hosts, *self.uplinks, *self.downlinks, *self.pools]


@dataclass(frozen=True)
class _Side:
    """What testbed.lab.links needs of the switch a link ends on."""
    prefix: str
    switch_ns: str
    mtu: int


@dataclass
class Fabric(Topology):
    racks: int = 2
    hosts_per_rack: int = 2
    oversub: float = 2.0
    boxes: list[SwitchBox] = field(init=False)

    def __post_init__(self):
        if self.racks < 1:
            raise TestbedError(f"--racks must be at least 1, got {self.racks}")
        if self.hosts_per_rack < 1:
            raise TestbedError(f"--hosts-per-rack must be at least 1, got {self.hosts_per_rack}")
        if not self.oversub > 0:
            raise TestbedError(f"--oversub must be > 0 (hosts' total : uplink), "
                               f"got {self.oversub:g}")
        if self.hosts_per_rack + 1 > MAX_PORTS or self.racks + self.pools > MAX_PORTS:
            raise TestbedError(f"a switch has at most {MAX_PORTS} ports: {self.hosts_per_rack} "
                               f"hosts and an uplink a rack, {self.racks} racks and "
                               f"{self.pools} pool nodes on the pool side")
        if self.racks * self.hosts_per_rack > 99:
            raise TestbedError(f"{self.racks} racks x {self.hosts_per_rack} hosts is "
                               f"{self.racks * self.hosts_per_rack} hosts: a testbed holds 99")
        self.hosts = self.racks * self.hosts_per_rack
        super().__post_init__()
        hosts = [n.name for n in self.host_nodes]
        self.boxes = [SwitchBox(f"r{k}", f"{self.prefix}-r{k}", f"{self.pin_dir}/r{k}",
                                hosts=tuple(hosts[(k - 1) * self.hosts_per_rack:
                                                  k * self.hosts_per_rack]),
                                uplinks=(UPLINK,))
                      for k in range(1, self.racks + 1)]
        self.boxes.append(SwitchBox(AGG, f"{self.prefix}-{AGG}", f"{self.pin_dir}/{AGG}",
                                    pools=tuple(n.name for n in self.pool_nodes),
                                    downlinks=tuple(f"r{k}" for k in range(1, self.racks + 1))))

    # ---- names ---------------------------------------------------------------------------
    @property
    def switch_ns(self) -> str:
        return self.box(AGG).netns

    def box(self, name: str) -> SwitchBox:
        return next(b for b in self.boxes if b.name == name)

    @property
    def rack_boxes(self) -> list[SwitchBox]:
        return [b for b in self.boxes if b.name != AGG]

    def rack_of(self, host: str) -> SwitchBox:
        return next(b for b in self.rack_boxes if host in b.hosts)

    def switch_ports(self) -> list[tuple[str, list[str]]]:
        return [(b.netns, b.ports) for b in self.boxes]

    def uplink_gbit(self) -> float | None:
        rate = self.links.host_gbit if self.links else None
        return rate * self.hosts_per_rack / self.oversub if rate else None

    def exec_argv(self, node: str, argv: list[str]) -> list[str]:
        names = {b.name: b.netns for b in self.boxes}
        if node in names:
            return ["ip", "netns", "exec", names[node], *argv]
        return super().exec_argv(node, argv)

    def as_dict(self) -> dict:
        return {"racks": self.racks, "hosts_per_rack": self.hosts_per_rack,
                "pools": self.pools, "oversub": self.oversub,
                "uplink_gbit": self.uplink_gbit(),
                **(self.links.as_dict() if self.links else {})}

    # ---- building it ---------------------------------------------------------------------
    def _build(self) -> None:
        for b in self.boxes:
            ip("netns", "add", b.netns)
            _quiet_namespace(b.netns)
            _bridge_without_netfilter(b.netns)
            ip("link", "set", "lo", "up", ns=b.netns)
            ip("link", "add", BRIDGE, "type", "bridge", ns=b.netns)
            ip("link", "set", BRIDGE, "up", ns=b.netns)
        for n in self.all_nodes:
            ip("netns", "add", n.netns)
            _quiet_namespace(n.netns)
            side = self.rack_of(n.name) if n.role == "host" else self.box(AGG)
            self._link(side, n, "eth0", self.links.rate(n.role) if self.links else None)
            ip("link", "set", "lo", "up", ns=n.netns)
            ip("addr", "add", f"{n.ip}/24", "dev", "eth0", ns=n.netns)
        for rack in self.rack_boxes:        # agg's port r<k> to the rack's uplink
            self._link(self.box(AGG), Node(rack.name, rack.netns, "", "trunk"), UPLINK,
                       self.uplink_gbit())
        for b in self.boxes:
            for port in b.ports:
                ip("link", "set", port, "mtu", str(self.mtu), "master", BRIDGE, "up",
                   ns=b.netns)
        attach_pass_programs([n.netns for n in self.all_nodes])

    def _link(self, box: SwitchBox, far: Node, far_end: str, gbit: float | None) -> None:
        """Switch ``box``'s port ``far.name`` to interface ``far_end`` in ``far.netns``."""
        if gbit:
            build_link(_Side(self.prefix, box.netns, self.mtu), far, gbit,
                       self.links or LinkSpec(), pass_program(), ip, _quiet_namespace)
            if far_end != "eth0":
                ip("link", "set", "eth0", "name", far_end, ns=far.netns)
        else:
            ip("link", "add", far.name, "type", "veth", "peer", "name", far_end, "netns",
               far.netns, ns=box.netns)
        ip("link", "set", far_end, "mtu", str(self.mtu), "up", ns=far.netns)


class FabricLab(Lab):
    """A running fabric: a pool server on every pool node and switchd on each switch named in
    ``switches`` (default: every one; the others forward as plain bridges). Pool servers,
    agents and tasks are the single-switch Lab's."""

    def __init__(self, prefix: str = "kf", racks: int = 2, hosts_per_rack: int = 2,
                 pools: int = 1, oversub: float = 2.0, switches: list[str] | None = None,
                 box_args: dict[str, tuple[str, ...]] | None = None, **kw):
        super().__init__(prefix, racks * hosts_per_rack, pools, switch=False, **kw)
        t = self.topo
        self.topo = Fabric(prefix, t.hosts, pools, t.mtu, t.master, t.links, racks=racks,
                           hosts_per_rack=hosts_per_rack, oversub=oversub)
        names = [b.name for b in self.topo.boxes]
        unknown = [s for s in switches or [] if s not in names]
        if unknown:
            raise TestbedError(f"no switch {unknown[0]!r} in this fabric ({', '.join(names)})")
        self.want_boxes = names if switches is None else list(switches)
        self.box_args = dict(box_args or {})      # switchd's options for one switch alone
        self.boxes: dict[str, subprocess.Popen] = {}

    def __enter__(self) -> FabricLab:
        super().__enter__()
        try:
            for name in self.want_boxes:
                self.start_box(name)
        except BaseException:
            self.__exit__()
            raise
        return self

    def switch_procs(self) -> list[subprocess.Popen]:
        return list(self.boxes.values())

    # ---- the switches --------------------------------------------------------------------
    def box_argv(self, name: str, *args: str) -> list[str]:
        b = self.topo.box(name)
        return python_argv("switchd", "--netns", b.netns, "--pin-dir", b.pin_dir, *args)

    def switchd_argv(self, *args: str) -> list[str]:
        """``switchd`` on the pool-side switch (``Lab.switchd``, ``stats``, ``counters``)."""
        return self.box_argv(AGG, *args)

    def box_switchd(self, name: str, *args: str) -> subprocess.CompletedProcess:
        """``switchd ARGS`` against switch ``name``'s maps, in its namespace."""
        r = subprocess.run(self.box_argv(name, *args), capture_output=True, text=True,
                           timeout=120)
        if r.returncode:
            raise TestbedError(f"switchd {' '.join(args)} on {name}: {r.stderr.strip()}")
        return r

    def box_log_path(self, name: str) -> str:
        return os.path.join(self.tmp.name, f"switchd-{name}.log")

    def start_box(self, name: str, replace: bool = False) -> str:
        """switchd on switch ``name``: hosts as ports, trunks as uplinks (with the pool nodes
        behind them) and downlinks, pool ports bound to their nodes. With ``replace`` the plain
        bridge's programs stay until its own replace them (``--force``)."""
        b = self.topo.box(name)
        if not replace:
            bridge_pass(b.netns, b.ports, False)
        argv = self.switchd_run_argv()
        argv += [a for h in b.hosts for a in ("--port", h)]
        # an uplink declares the pool nodes behind it: their identities are its own at once
        argv += [a for u in b.uplinks for a in ("--uplink", f"{u}={','.join(self.pool_addrs)}")]
        argv += [a for d in b.downlinks for a in ("--downlink", d)]
        argv += [a for p in b.pools for a in self.pool_port_argv(p)]
        self.boxes[name], line, _ = self.launch_switchd(
            self.box_argv(name, *argv, *self.switchd_args, *self.box_args.get(name, ()),
                          *(["--force"] if replace else [])),
            self.box_log_path(name), f"switchd on {name}")
        return line

    def stop_box(self, name: str, sig: int = signal.SIGTERM, timeout: float = 60) -> int:
        p = self.boxes.pop(name)
        p.send_signal(sig)
        return p.wait(timeout)

    def box_counters(self, name: str) -> dict:
        return self.counters(self.topo.box(name).pin_dir)

    def counters(self, pin_dir: str | None = None) -> dict:
        return super().counters(pin_dir or self.topo.box(AGG).pin_dir)

    # ---- what crossed the fabric ---------------------------------------------------------
    def uplink_bytes(self, rack: str) -> int:
        """Bytes a rack's uplink has delivered into the rack (towards its hosts)."""
        r = self.topo.run(rack, ["cat", f"/sys/class/net/{UPLINK}/statistics/rx_bytes"])
        return int(r.stdout)
