"""veth/network-namespace testbeds: a switch namespace whose Linux bridge joins one veth port per
node, inference-node namespaces (h1, h2, ...) and pool-node namespaces (p1, ...), and with
``master=True`` a namespace m1 for the Mooncake master the pool nodes share (its bridge port is
not a switch port: switchd never attaches to it, its traffic is plain TCP).

Every object a testbed makes is named from its prefix: namespaces ``<prefix>-sw``,
``<prefix>-h<i>``, ``<prefix>-p<j>``, ``<prefix>-m1``, with shaped links (testbed.lab.links) a
link namespace ``<prefix>-l<node>`` per node, and the pin directory
``/sys/fs/bpf/kvswitch-<prefix>``, so ``down`` finds and removes all of it (and any processes
left in it), also after a crash. Addresses come from 198.18.0.0/24, the range RFC 2544 sets
aside for benchmark networks: hosts .1-.99, pool nodes .101-.199, the master .200.
"""
from __future__ import annotations

import contextlib
import fcntl
import functools
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from xdp import libbpf, netns
from xdp.attach import attach_mode, attach_xdp, attached_program, detach_port
from xdp.loader import cached_bytecode, load_bytecode

from .links import LinkSpec, build_link
from .shell import TestbedError, ip, sh  # noqa: F401 (TestbedError: the lab's one error)

SUBNET = "198.18.0"
LOCK_DIR = "/run/kvswitch"                       # shared with switchd's locks
BRIDGE = "br0"
HERE = Path(__file__).resolve().parent            # pass.c and lossy.c


@dataclass(frozen=True)
class Node:
    name: str          # h1, p1: also the name of its switch port
    netns: str
    ip: str
    role: str          # "host", "pool" or "master"


@dataclass
class Topology:
    prefix: str = "kv"
    hosts: int = 2
    pools: int = 1
    mtu: int = 1500
    master: bool = False
    links: LinkSpec | None = None               # shaped links (testbed.lab.links), None: veths
    nodes: list[Node] = field(init=False)       # the switch's ports: hosts and pool nodes
    master_node: Node | None = field(init=False)
    _lock: int | None = field(default=None, init=False, repr=False)   # held while up

    def __post_init__(self):
        if not (1 <= self.hosts <= 99 and 1 <= self.pools <= 99):
            raise TestbedError("a testbed has 1..99 hosts and 1..99 pool nodes")
        if not 1 <= len(self.prefix) <= 8 or not self.prefix.replace("-", "").isalnum():
            raise TestbedError("testbed name must be 1-8 letters, digits or '-'")
        self.nodes = ([Node(f"h{i}", f"{self.prefix}-h{i}", f"{SUBNET}.{i}", "host")
                       for i in range(1, self.hosts + 1)] +
                      [Node(f"p{j}", f"{self.prefix}-p{j}", f"{SUBNET}.{100 + j}", "pool")
                       for j in range(1, self.pools + 1)])
        self.master_node = (Node("m1", f"{self.prefix}-m1", f"{SUBNET}.200", "master")
                            if self.master else None)

    # ---- names ---------------------------------------------------------------------------
    @property
    def switch_ns(self) -> str:
        return f"{self.prefix}-sw"

    @property
    def pin_dir(self) -> str:
        return f"/sys/fs/bpf/kvswitch-{self.prefix}"

    def node(self, name: str) -> Node:
        return next(n for n in self.all_nodes if n.name == name)

    @property
    def all_nodes(self) -> list[Node]:
        """Every node with a namespace of its own: the switch's ports and the master."""
        return self.nodes + ([self.master_node] if self.master_node else [])

    @property
    def host_nodes(self) -> list[Node]:
        return [n for n in self.nodes if n.role == "host"]

    @property
    def pool_nodes(self) -> list[Node]:
        return [n for n in self.nodes if n.role == "pool"]

    @property
    def ports(self) -> list[str]:
        return [n.name for n in self.nodes]

    def switch_ports(self) -> list[tuple[str, list[str]]]:
        """(namespace, ports) of every switch: here the one switch and all its ports."""
        return [(self.switch_ns, self.ports)]

    # ---- lifecycle -----------------------------------------------------------------------
    def up(self) -> Topology:
        """Build the topology from scratch (removing leftovers of the same name first). While
        it is up, SIGTERM unwinds the program (``_StopSignals``) so its ``with`` blocks
        remove it, and its name is locked: a second program building the same testbed stops
        with one line instead of removing the first one's namespaces under it."""
        if self._lock is None:
            self._lock = _lock_name(self.prefix)
        try:
            down(self.prefix)
            _SIGNALS.hold(self)
            self._build()
        except BaseException:                   # removes what was built, lets go of the name
            self.down()
            raise
        return self

    def _build(self) -> None:
        sw = self.switch_ns
        ip("netns", "add", sw)
        _quiet_namespace(sw)
        _bridge_without_netfilter(sw)
        ip("link", "set", "lo", "up", ns=sw)
        ip("link", "add", BRIDGE, "type", "bridge", ns=sw)
        ip("link", "set", BRIDGE, "up", ns=sw)
        for n in self.all_nodes:
            ip("netns", "add", n.netns)
            _quiet_namespace(n.netns)
            gbit = self.links.rate(n.role) if self.links else None
            if gbit:
                build_link(self, n, gbit, self.links, pass_program(), ip, _quiet_namespace)
            else:
                ip("link", "add", n.name, "type", "veth", "peer", "name", "eth0", "netns",
                   n.netns, ns=sw)
            ip("link", "set", n.name, "mtu", str(self.mtu), "master", BRIDGE, "up", ns=sw)
            ip("link", "set", "eth0", "mtu", str(self.mtu), "up", ns=n.netns)
            ip("link", "set", "lo", "up", ns=n.netns)
            ip("addr", "add", f"{n.ip}/24", "dev", "eth0", ns=n.netns)
        attach_pass_programs([n.netns for n in self.all_nodes])

    def down(self) -> None:
        with tearing_down():
            down(self.prefix)
            _SIGNALS.release(self)
            if self._lock is not None:
                _unlock_name(self.prefix, self._lock)
                self._lock = None

    def __enter__(self) -> Topology:
        return self.up()

    def __exit__(self, *exc) -> None:
        self.down()

    # ---- running things in nodes ---------------------------------------------------------
    def exec_argv(self, node: str, argv: list[str]) -> list[str]:
        ns = self.switch_ns if node == "sw" else self.node(node).netns
        return ["ip", "netns", "exec", ns, *argv]

    def popen(self, node: str, argv: list[str], **kw) -> subprocess.Popen:
        return subprocess.Popen(self.exec_argv(node, argv), **kw)

    def run(self, node: str, argv: list[str], timeout: float = 120,
            check: bool = True) -> subprocess.CompletedProcess:
        r = subprocess.run(self.exec_argv(node, argv), capture_output=True, text=True,
                           timeout=timeout)
        if check and r.returncode:
            raise TestbedError(f"{node}: {' '.join(argv)} exited {r.returncode}: "
                               f"{r.stderr.strip()[-800:]}")
        return r


def _quiet_namespace(ns: str) -> None:
    """No IPv6 (router solicitations and DAD would add frames to every count)."""
    sh("ip", "netns", "exec", ns, "sysctl", "-qw", "net.ipv6.conf.all.disable_ipv6=1",
       "net.ipv6.conf.default.disable_ipv6=1")


def _bridge_without_netfilter(ns: str) -> None:
    """The switch's bridge forwards without calling iptables/arptables hooks (br_netfilter is
    built in here and on by default in every namespace; no rule is ever loaded, yet with them off
    a pool node behind the switch answered 1.24x the GETs per second: docs/throughput.md)."""
    sh("ip", "netns", "exec", ns, "sysctl", "-qw", "net.bridge.bridge-nf-call-iptables=0",
       "net.bridge.bridge-nf-call-ip6tables=0", "net.bridge.bridge-nf-call-arptables=0")


@functools.lru_cache(maxsize=None)
def pass_program() -> int:
    """fd of the XDP_PASS program (pass.c): compiled once per kernel (xdp.loader's bytecode
    cache; BCC took 0.6-3 s for each of the 2-3 loads a testbed made), loaded once per process."""
    return load_bytecode(cached_bytecode(HERE / "pass.c", "xdp_pass", [], ()), "xdp_pass")[0]


def attach_pass_programs(namespaces: list[str], ifname: str = "eth0") -> None:
    """The XDP_PASS program on each node's veth end: frames the switch sends with XDP_TX (or
    redirects) are dropped by a veth whose peer has no XDP program."""
    for ns in _without_xdp_server(namespaces, ifname):
        with netns.inside(ns):
            attach_xdp(ifname, pass_program())


def plain_bridge_ports(topo: Topology, on: bool) -> None:
    """The XDP_PASS program on the switch's side of every port while no switchd runs there
    (``on``), or off again before one starts (only where it is still the program). A veth
    whose peer has no XDP program drops what a node's XDP program transmits into it (the fetch
    engine's GETs), which a real NIC does not; with this, a plain bridge carries them."""
    for ns, ports in topo.switch_ports():
        bridge_pass(ns, ports, on)


def bridge_pass(ns: str, ports: list[str], on: bool) -> None:
    """``plain_bridge_ports`` for one switch: namespace ``ns``, its ``ports``."""
    with netns.inside(ns):
        for port in ports:
            prog = attached_program(port)[0]
            if on and prog is None:
                attach_xdp(port, pass_program())
            elif not on and prog == "xdp_pass":
                detach_port(port)


def _without_xdp_server(namespaces: list[str], ifname: str) -> list[str]:
    """The namespaces whose ``ifname`` carries no generic-mode program: a pool node's XDP GET
    server (hostagent.pool.xdpserve) runs in that mode, and a native program cannot join it."""
    keep = []
    for ns in namespaces:
        with netns.inside(ns):
            if attach_mode(ifname) != "generic":
                keep.append(ns)
    return keep


def attach_loss(namespaces: list[str], loss: float, ifname: str = "eth0",
                unsummed: bool = False) -> None:
    """Replace the pass program on each node's veth end by one that drops ``loss`` (0..1) of
    the KV frames it receives (this kernel has no netem) and, if ``unsummed``, every KV frame
    without a UDP checksum (a middlebox's rule); neither restores plain passing."""
    if not 0 <= loss < 1:
        raise TestbedError("loss must be in [0, 1)")
    if loss == 0 and not unsummed:
        attach_pass_programs(namespaces, ifname)
        return
    # compiled once per kernel (the bytecode cache): a fault that starts loss mid-run starts it
    # at once, not after seconds of BCC
    fd, maps = load_bytecode(cached_bytecode(HERE / "lossy.c", "xdp_lossy", [],
                                             ("loss_ppm", "loss_unsummed", "loss_dropped")),
                             "xdp_lossy")
    libbpf.map_update(maps["loss_ppm"], 0, int(loss * 1_000_000).to_bytes(4, "little"))
    libbpf.map_update(maps["loss_unsummed"], 0, int(unsummed).to_bytes(4, "little"))
    for ns in _without_xdp_server(namespaces, ifname):
        with netns.inside(ns):
            attach_xdp(ifname, fd)


@contextlib.contextmanager
def scratch_ports(*pairs: tuple[str, str], prefix: str = "kvports"):
    """A namespace of its own holding these veth pairs, entered for the block: ports to run XDP
    programs on with BPF_PROG_TEST_RUN as if frames arrived on them. Yields {name: ifindex}
    of every end; the namespace is removed afterwards."""
    name = f"{prefix}{os.getpid()}"
    ip("netns", "add", name)
    try:
        for a, b in pairs:
            ip("link", "add", a, "type", "veth", "peer", "name", b, ns=name)
        with netns.inside(name):
            yield {end: socket.if_nametoindex(end) for pair in pairs for end in pair}
    finally:
        ip("netns", "del", name, check=False)


def namespaces_of(prefix: str) -> list[str]:
    """The namespaces of testbed ``prefix`` (every namespace: "")."""
    r = sh("ip", "netns", "list", check=False)
    names = [line.split()[0] for line in r.stdout.splitlines() if line.strip()]
    return [n for n in names if not prefix or n.startswith(f"{prefix}-")]


class _StopSignals:
    """SIGTERM's default action ends a process at once, without its ``finally`` blocks: a
    benchmark stopped by ``timeout`` or a cancelled CI job left its namespaces behind. While any
    topology of this process is up, SIGTERM raises SystemExit(143) in the main thread instead,
    so every ``with Topology``/``with Lab`` around it tears down, and the process still exits
    143. During a teardown (``tearing_down``) SIGTERM and Ctrl-C wait for the teardown's end:
    raised in its middle, they skipped the rest (a bench stopped between two runs left 18
    namespaces). Only where the signal had its default action (a program's own handler is left
    alone), and only from the main thread (the one Python delivers signals to)."""

    def __init__(self):
        self.holders: set[int] = set()
        self.installed = False
        self.teardowns = 0              # teardowns under way (nested: a Lab's, its topology's)
        self.pending: set[int] = set()  # the signals that came during one
        self.int_deferred = False

    def _raise(self, signum, frame):
        if self.teardowns:
            self.pending.add(signum)
            return
        raise SystemExit(128 + signum)

    @contextlib.contextmanager
    def tearing_down(self):
        """SIGTERM and SIGINT inside wait: once the outermost teardown is done, SIGTERM exits
        (143) and SIGINT raises KeyboardInterrupt. Only the main thread's teardowns: signals
        are raised there, and one held for another thread's would end that thread alone."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        if (not self.teardowns
                and signal.getsignal(signal.SIGINT) is signal.default_int_handler):
            signal.signal(signal.SIGINT, self._raise)
            self.int_deferred = True
        self.teardowns += 1
        try:
            yield
        finally:
            self.teardowns -= 1
            if not self.teardowns:
                self._default_if_free()
                if self.int_deferred:
                    signal.signal(signal.SIGINT, signal.default_int_handler)
                    self.int_deferred = False
                pending, self.pending = self.pending, set()
                if signal.SIGTERM in pending:
                    raise SystemExit(128 + signal.SIGTERM)
                if signal.SIGINT in pending:
                    raise KeyboardInterrupt

    def hold(self, topo: Topology) -> None:
        self.holders.add(id(topo))
        if (not self.installed and threading.current_thread() is threading.main_thread()
                and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL):
            signal.signal(signal.SIGTERM, self._raise)
            self.installed = True

    def release(self, topo: Topology) -> None:
        self.holders.discard(id(topo))
        if not self.teardowns:          # else when the teardown ends (it may still get one)
            self._default_if_free()

    def _default_if_free(self) -> None:
        if (self.installed and not self.holders
                and threading.current_thread() is threading.main_thread()):
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            self.installed = False


_SIGNALS = _StopSignals()
tearing_down = _SIGNALS.tearing_down


def _lock_name(prefix: str) -> int:
    """An flock on /run/kvswitch/testbed-PREFIX.lock naming its holder (gone with the process:
    a crashed program's leftovers are removed by the next one, a live program's are not). The
    holder removes the file when it is done (``_unlock_name``), so a lock taken on a file that
    was removed meanwhile is taken again on the new one."""
    os.makedirs(LOCK_DIR, exist_ok=True)
    path = _lock_path(prefix)
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            owner = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise TestbedError(f"testbed {prefix!r} is in use by process {owner}: give another "
                               "name, or stop that one (testbed down removes it)") from None
        try:
            if os.stat(path).st_ino == os.fstat(fd).st_ino:
                break
        except FileNotFoundError:
            pass
        os.close(fd)                            # its holder removed it: lock the new one
    os.ftruncate(fd, 0)
    os.pwrite(fd, str(os.getpid()).encode(), 0)
    return fd


def _unlock_name(prefix: str, fd: int) -> None:
    """Remove the lock file while still holding it, then let go."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(_lock_path(prefix))
    os.close(fd)


def _lock_path(prefix: str) -> str:
    return os.path.join(LOCK_DIR, f"testbed-{prefix}.lock")


def down(prefix: str) -> list[str]:
    """Remove every namespace of testbed ``prefix``, the processes in them and its pins."""
    removed = namespaces_of(prefix)
    for ns in removed:
        _kill_processes(ns)
    for ns in removed:
        ip("netns", "del", ns, check=False)
    shutil.rmtree(f"/sys/fs/bpf/kvswitch-{prefix}", ignore_errors=True)
    return removed


def _kill_processes(ns: str) -> None:
    pids = [int(p) for p in sh("ip", "netns", "pids", ns, check=False).stdout.split()]
    pids = [p for p in pids if p != os.getpid()]
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 3
        while pids and time.monotonic() < deadline:
            pids = [p for p in pids if os.path.exists(f"/proc/{p}")]
            time.sleep(0.05)


def python_argv(module: str, *args: str) -> list[str]:
    """Run one of our console programs with this interpreter (works without the venv on PATH)."""
    return [sys.executable, "-m", module, *args]
