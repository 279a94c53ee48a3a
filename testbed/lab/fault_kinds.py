"""The faults `testbed bench faults` injects into a running testbed (testbed.lab.Lab), each as
``inject`` (at a moment amid a burst's held GETs) and ``heal`` (``seconds`` later), doing what
an operator or a failing machine does, through the same commands:

  switchd-kill   switchd killed with SIGKILL, then started again: the program stays attached and
                 serves from its pinned maps meanwhile; the new daemon adopts them.
  detach         the switch's XDP program detached from every port (`switchd detach`; a plain
                 bridge carries everything), then switchd restarted to attach it again (its
                 programs replace the bridge's: on veths a port without a program drops what
                 a node's XDP sends, which a NIC does not).
  flush          the switch's cache flushed while GETs are held (`switchd cache flush`).
  pool-kill      a pool server killed with SIGKILL, started again ``seconds`` later.
  pool-hang      a pool server stopped with SIGSTOP (hung, not dead: its node still has its
                 link and its address), continued with SIGCONT ``seconds`` later.
  flap-host      an inference node's link down for ``seconds``, then up.
  flap-pool      a pool node's link down for ``seconds``, then up.
  loss           20 % of the KV frames lost both ways on every pool link for ``seconds``.
  memory-limit   switchd moved into a memory cgroup with a limit far below its working set, then
                 the limit lifted; a daemon the kernel killed for it is started again, as a
                 service manager would.
"""
from __future__ import annotations

import os
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path

from ..errors import TestbedError
from .links import link_netns
from .topology import attach_loss, ip, namespaces_of, plain_bridge_ports

FAULTS = ("switchd-kill", "detach", "flush", "pool-kill", "pool-hang", "flap-host", "flap-pool",
          "loss", "memory-limit")
SWITCH_FAULTS = ("switchd-kill", "detach", "flush", "memory-limit")   # need the switch running
SECONDS = {"switchd-kill": 0.0, "detach": 3.0, "flush": 0.0, "pool-kill": 2.0, "pool-hang": 2.0,
           "flap-host": 2.0, "flap-pool": 2.0, "loss": 5.0, "memory-limit": 5.0}
LOSS = 0.2
MEMORY_LIMIT = 64 << 10           # bytes of new charges; switchd holds ~400 MiB (Python, BCC)


@dataclass
class Target:
    """Where a fault strikes: the inference node and the pool node it names."""
    host: str = "h1"
    pool: str = "p1"


def inject(lab, fault: str, target: Target) -> dict:
    """Start ``fault``; what it did (to say in the JSON)."""
    if fault == "switchd-kill":
        return {"switchd_exit": lab.stop_switch(signal.SIGKILL)}
    if fault == "detach":
        ports = [n.name for n in lab.topo.nodes]
        lab.switchd("detach", *[a for p in ports for a in ("--port", p)])
        plain_bridge_ports(lab.topo, True)       # what a NIC does without a program: forward
        return {"ports": ports}
    if fault == "flush":
        return {"said": lab.switchd("cache", "flush").stdout.strip()}
    if fault == "pool-kill":
        index = _pool_index(lab, target)
        return {"pool": target.pool, "exit": lab.stop_pool(index, signal.SIGKILL)}
    if fault == "pool-hang":
        index = _pool_index(lab, target)
        lab.pools[index].send_signal(signal.SIGSTOP)
        return {"pool": target.pool, "pid": lab.pools[index].pid}
    if fault in ("flap-host", "flap-pool"):
        node = target.host if fault == "flap-host" else target.pool
        _link(lab, node, "down")
        return {"node": node}
    if fault == "loss":
        spaces = [link_netns(lab.topo.prefix, n.name) for n in lab.topo.pool_nodes]
        for end in ("sw", "node"):
            attach_loss(spaces, LOSS, end)
        return {"loss": LOSS, "links": [n.name for n in lab.topo.pool_nodes]}
    if fault == "memory-limit":
        return MemoryLimit(lab.topo.prefix).apply(lab.switch.pid)
    raise TestbedError(f"unknown fault {fault!r}: choose from {', '.join(FAULTS)}")


def heal(lab, fault: str, target: Target) -> dict:
    """End ``fault``; what that took."""
    if fault == "switchd-kill":
        return {"restarted": lab.start_switch()}
    if fault == "detach":
        # the daemon is restarted; the old one is killed, not stopped: stopping detaches every
        # port's program, the bridge's too, and on veths a port without one drops what a
        # node's XDP sends (a NIC forwards) until the new daemon's programs replace them
        lab.stop_switch(signal.SIGKILL)
        return {"restarted": lab.start_switch(replace=True)}
    if fault == "pool-kill":
        index = _pool_index(lab, target)
        return {"restarted": lab.start_pool(index)}
    if fault == "pool-hang":
        index = _pool_index(lab, target)
        lab.pools[index].send_signal(signal.SIGCONT)
        return {}
    if fault in ("flap-host", "flap-pool"):
        _link(lab, target.host if fault == "flap-host" else target.pool, "up")
        return {}
    if fault == "loss":
        spaces = [link_netns(lab.topo.prefix, n.name) for n in lab.topo.pool_nodes]
        for end in ("sw", "node"):
            attach_loss(spaces, 0, end)
        return {}
    if fault == "memory-limit":
        out = MemoryLimit(lab.topo.prefix).lift()
        if lab.switch.poll() is not None:        # killed for it: a service manager restarts
            out["switchd_exit"] = lab.switch.returncode
            lab.switch = None
            out["restarted"] = lab.start_switch()
        return out
    return {}


def _pool_index(lab, target: Target) -> int:
    """The index of the pool node ``target`` names in ``lab.pools``."""
    return [n.name for n in lab.topo.pool_nodes].index(target.pool)


def _link(lab, node: str, state: str) -> None:
    """The switch's port towards ``node`` down or up (the cable pulled, put back)."""
    ip("link", "set", node, state, ns=lab.topo.switch_ns)


class MemoryLimit:
    """A memory cgroup of its own for a process (cgroup v1 or v2, under this process's own),
    with a limit far below what the process uses; ``lift`` moves it back and removes it."""

    def __init__(self, prefix: str):
        self.v2, base = _memory_cgroup()
        self.home = base
        self.path = base / f"kvfault-{prefix}"

    def apply(self, pid: int) -> dict:
        self.path.mkdir(exist_ok=True)
        limit = "memory.max" if self.v2 else "memory.limit_in_bytes"
        (self.path / limit).write_text(str(MEMORY_LIMIT))
        (self.path / "cgroup.procs").write_text(str(pid))
        return {"cgroup": str(self.path), "limit_bytes": MEMORY_LIMIT, "pid": pid}

    def lift(self) -> dict:
        out = {"limit_hit": self._hits()}
        for pid in (self.path / "cgroup.procs").read_text().split():
            try:
                (self.home / "cgroup.procs").write_text(pid)
            except OSError:
                pass                                 # it ended meanwhile
        self.path.rmdir()
        return out

    def _hits(self) -> int:
        if self.v2:
            events = dict(ln.split() for ln in (self.path / "memory.events").read_text()
                          .splitlines())
            return int(events.get("max", 0)) + int(events.get("oom_kill", 0))
        return int((self.path / "memory.failcnt").read_text())

    def left_behind(self) -> list[str]:
        return [str(self.path)] if self.path.exists() else []


def _memory_cgroup() -> tuple[bool, Path]:
    """(cgroup v2?, this process's memory cgroup directory), or one clear error."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            where = Path("/sys/fs/cgroup/memory") / path.lstrip("/")
            if where.is_dir():
                return False, where
        if controllers == "" and Path("/sys/fs/cgroup/cgroup.controllers").exists():
            where = Path("/sys/fs/cgroup") / path.lstrip("/")
            if "memory" in (where / "cgroup.controllers").read_text().split() or \
                    (where / "memory.max").exists():
                return True, where
    raise TestbedError("the memory-limit fault needs a memory cgroup (v1's memory controller "
                       "or v2's memory.max) this process may create groups under")


def leftover_processes(lab, expected: set[int]) -> list[str]:
    """Processes in the testbed's namespaces other than its pool servers and switchd."""
    out = []
    for ns in namespaces_of(lab.topo.prefix):
        r = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True)
        for pid in map(int, r.stdout.split()):
            if pid not in expected and pid != os.getpid():
                try:
                    cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
                except OSError:
                    continue
                out.append(f"process {pid} in {ns}: {cmd.decode(errors='replace')[:120]}")
    return out
