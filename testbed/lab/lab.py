"""A running testbed: the topology plus a pool server on every pool node and switchd on the switch,
with helpers to drive the host agents and switchd as a user would (their CLIs, in namespaces)
and to run Python tasks in the nodes (testbed.lab.tasks). With ``store="mooncake"`` the pool
nodes keep blocks in a Mooncake Store cluster whose master (testbed.lab.mooncake) the lab starts
in a namespace of its own. With ``link_gbit``/``pool_link_gbit`` every inference/pool node's link
queues at that rate both ways (testbed.lab.links); with ``pool_disk`` every pool node has a
disk tier of that size in a directory of its own. Used by the demos, the end-to-end tests and
the benchmarks; always tears down what it started."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import tempfile
import time

from kvproto import DEFAULT_CHUNK

from .links import LinkSpec
from .mooncake import MooncakeMaster
from .tasks import Task, run_task, start_task
from .topology import (Topology, TestbedError, plain_bridge_ports, python_argv,
                       tearing_down)

STORES = ("memory", "mooncake")


def await_log_line(proc: subprocess.Popen, path: str, offset: int, marker: str,
                   timeout: float, what: str) -> str:
    """Wait for a line containing ``marker`` written to ``path`` after ``offset``."""
    return _await_log_line(proc, path, offset, marker, timeout, what)[0]


def _await_log_line(proc, path, offset, marker, timeout, what) -> tuple[str, int]:
    """The line (and the offset past it) as ``await_log_line`` finds it."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with open(path, "rb") as f:
            f.seek(offset)
            for line in iter(f.readline, b""):
                if line.endswith(b"\n") and marker.encode() in line:
                    return line.decode(errors="replace").strip(), f.tell()
        if proc.poll() is not None:
            break
        time.sleep(0.05)
    if proc.poll() is None:
        proc.kill()
        proc.wait(5)
    with open(path, errors="replace") as f:
        f.seek(offset)
        raise TestbedError(f"{what}: no {marker!r} line: {f.read().strip()[-800:]}")


class Lab:
    def __init__(self, prefix: str = "kv", hosts: int = 2, pools: int = 1,
                 chunk_size: int = DEFAULT_CHUNK, cache_entries: int = 65536,
                 pool_capacity: str = "512MiB", switch: bool = True,
                 switchd_args: tuple[str, ...] = (), store: str = "memory", replicas: int = 1,
                 segment: str = "256MiB", pool_args: tuple[str, ...] = (),
                 link_gbit: float | None = None, pool_link_gbit: float | None = None,
                 link_delay_us: float = 0.0, link_buffer_ms: float = 50.0,
                 pool_disk: str | None = None, master_args: tuple[str, ...] = ()):
        if store not in STORES:
            raise TestbedError(f"store must be one of {', '.join(STORES)}, not {store!r}")
        # the MTU fits the chunk (IPv4 + UDP + KV header = 76 bytes), never below Ethernet's 1500
        links = (LinkSpec(link_gbit, pool_link_gbit, link_delay_us, link_buffer_ms)
                 if (link_gbit, pool_link_gbit) != (None, None) or link_delay_us else None)
        self.topo = Topology(prefix, hosts, pools, mtu=max(1500, chunk_size + 76),
                             master=store == "mooncake", links=links)
        self.chunk_size, self.cache_entries = chunk_size, cache_entries
        self.pool_capacity, self.want_switch = pool_capacity, switch
        self.switchd_args = switchd_args
        self.store, self.replicas, self.segment = store, replicas, segment
        self.pool_args, self.pool_disk = pool_args, pool_disk
        self.master_args = master_args      # mooncake_master's own flags (store "mooncake")
        self.pools: list[subprocess.Popen | None] = [None] * pools
        self._log_offsets = [0] * pools
        self.switch: subprocess.Popen | None = None
        self._switch_seen = 0                  # switchd's log read up to here
        self.master: MooncakeMaster | None = None
        self.tmp = tempfile.TemporaryDirectory(prefix=f"kvlab-{prefix}-")

    # ---- lifecycle -----------------------------------------------------------------------
    def __enter__(self) -> Lab:
        self.topo.up()
        try:
            if self.store == "mooncake":
                self.master = MooncakeMaster(self.topo, os.path.join(self.tmp.name,
                                                                     "mooncake-master.log"),
                                             *self.master_args)
                self.master.start()
            self.start_pools()
            if self.want_switch:
                self.start_switch()
            else:
                plain_bridge_ports(self.topo, True)
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc) -> None:
        with tearing_down():            # a SIGTERM now waits for the namespaces to go
            procs = [p for p in self.pools if p] + self.switch_procs()
            for p in procs:
                if p.poll() is None:
                    p.terminate()
            for p in procs:
                try:
                    p.wait(30)             # a loaded switch: seconds to detach every port
                except subprocess.TimeoutExpired:
                    p.kill()
            if self.master is not None:
                self.master.stop()
            self.topo.down()
            self.tmp.cleanup()

    # ---- pool nodes ----------------------------------------------------------------------
    def pool_argv(self, index: int) -> list[str]:
        node = self.topo.pool_nodes[index]
        argv = ["serve", "--capacity", self.pool_capacity,
                "--stats-file", self._pool_stats_path(node.name)]
        if self.store == "mooncake":
            argv += ["--store", "mooncake", "--mooncake-master", self.master.address,
                     "--replicas", str(self.replicas), "--segment", self.segment]
        if self.pool_disk:           # a pool disk tier of its own, kept across restarts
            disk = os.path.join(self.tmp.name, f"disk-{node.name}")
            os.makedirs(disk, exist_ok=True)
            argv += ["--disk-dir", disk, "--disk-bytes", self.pool_disk]
        return python_argv("hostagent", *argv, *self.pool_args)

    def pool_log_path(self, index: int) -> str:
        return os.path.join(self.tmp.name, f"pool-{self.topo.pool_nodes[index].name}.log")

    def pool_log(self, index: int) -> str:
        """What a pool server has logged (every run of it, appended)."""
        with open(self.pool_log_path(index), errors="replace") as f:
            return f.read()

    def start_pool(self, index: int, timeout: float = 60, wait: bool = True) -> str:
        """Start the pool server of pool node ``index`` (0 for p1); its ready line (``wait``;
        else see ``await_pool_log``)."""
        if self.pools[index] is not None and self.pools[index].poll() is None:
            raise TestbedError(f"pool server {index} is running")
        node, path = self.topo.pool_nodes[index], self.pool_log_path(index)
        with open(path, "ab") as log:
            self._log_offsets[index] = log.tell()
            self.pools[index] = self.topo.popen(node.name, self.pool_argv(index),
                                                stdout=subprocess.DEVNULL, stderr=log,
                                                stdin=subprocess.DEVNULL)
        return self.await_pool_log(index, "ready", timeout) if wait else ""

    def start_pools(self, timeout: float = 60) -> None:
        """Start every pool server, side by side (each compiles its XDP server: seconds), and
        wait for their ready lines."""
        for i in range(len(self.pools)):
            self.start_pool(i, wait=False)
        for i in range(len(self.pools)):
            self.await_pool_log(i, "ready", timeout)

    def await_pool_log(self, index: int, marker: str, timeout: float = 60) -> str:
        """The first line with ``marker`` the running pool server ``index`` has logged (it
        is killed and TestbedError raised if none comes in ``timeout`` seconds)."""
        return await_log_line(self.pools[index], self.pool_log_path(index),
                              self._log_offsets[index], marker, timeout,
                              f"pool server on {self.topo.pool_nodes[index].name}")

    def stop_pool(self, index: int, sig: int = signal.SIGTERM, timeout: float = 20) -> int:
        """Signal a pool server (SIGKILL: as if its node died) and wait for it to end."""
        p, self.pools[index] = self.pools[index], None
        p.send_signal(sig)
        return p.wait(timeout)

    def switchd_argv(self, *args: str) -> list[str]:
        return python_argv("switchd", "--netns", self.topo.switch_ns,
                           "--pin-dir", self.topo.pin_dir, *args)

    def start_switch(self, *extra: str, replace: bool = False) -> str:
        """Start switchd on every port; with ``replace`` the programs the ports run now (the
        plain bridge's) stay until switchd's replace them (``--force``): no moment without one,
        as a real NIC forwards with or without a program."""
        if replace:
            extra = (*extra, "--force")
        else:
            plain_bridge_ports(self.topo, False)
        argv = self.switchd_run_argv()
        for n in self.topo.nodes:   # a pool port is bound to its node before any frame
            argv += (self.pool_port_argv(n.name) if n.role == "pool" else ["--port", n.name])
        self.switch, line, self._switch_seen = self.launch_switchd(
            self.switchd_argv(*argv, *self.switchd_args, *extra), self.switch_log_path(),
            "switchd")
        return line

    def switchd_run_argv(self) -> list[str]:
        """``switchd run`` with the lab's chunk size and cache size (ports are added to it)."""
        return ["run", "--chunk-size", str(self.chunk_size),
                "--cache-entries", str(self.cache_entries)]

    def pool_port_argv(self, node: str) -> list[str]:
        """switchd's options for pool node ``node``'s port, bound to the node."""
        ip = self.topo.node(node).ip
        return ["--pool-port", f"{node}={ip}", "--port-bind", f"{node}={self.mac(node)},{ip}"]

    @staticmethod
    def launch_switchd(argv: list[str], log_path: str,
                       what: str) -> tuple[subprocess.Popen, str, int]:
        """Start switchd (``argv``) and wait for its serving line: the process, that line and
        the log offset past it. Its output goes to a file: a pipe nobody reads while it serves
        fills up with its log lines, and a daemon blocked writing one never stops."""
        with open(log_path, "ab") as log:
            seen = log.tell()
            proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL)
        line, seen = _await_log_line(proc, log_path, seen, "switchd: serving", 60, what)
        return proc, line, seen

    def switch_procs(self) -> list[subprocess.Popen]:
        """The switchd processes this lab started and has not stopped."""
        return [self.switch] if self.switch else []

    def switch_log_path(self) -> str:
        return os.path.join(self.tmp.name, "switchd.log")

    def await_switch_line(self, marker: str, timeout: float = 60) -> str:
        """The next line with ``marker`` the running switchd prints (it is killed and
        TestbedError raised if none comes in ``timeout`` seconds)."""
        line, self._switch_seen = _await_log_line(self.switch, self.switch_log_path(),
                                                  self._switch_seen, marker, timeout, "switchd")
        return line

    def stop_switch(self, sig: int = signal.SIGTERM, timeout: float = 60) -> int:
        self.switch.send_signal(sig)
        code = self.switch.wait(timeout)       # a loaded box: seconds to detach every port
        self.switch = None
        return code

    def _pool_stats_path(self, node: str) -> str:
        return os.path.join(self.tmp.name, f"pool-{node}.json")

    def pool_counters(self, index: int = 0) -> dict:
        """The request counters of a pool server, as it reports them (SIGUSR1)."""
        path = self._pool_stats_path(self.topo.pool_nodes[index].name)
        if os.path.exists(path):
            os.unlink(path)
        self.pools[index].send_signal(signal.SIGUSR1)
        deadline = time.monotonic() + 10
        while not os.path.exists(path) and time.monotonic() < deadline:
            time.sleep(0.02)
        return self.pool_final_counters(index)

    def pool_final_counters(self, index: int = 0) -> dict:
        """The counters a pool server wrote last (on SIGUSR1, SIGTERM or SIGINT; whole files)."""
        with open(self._pool_stats_path(self.topo.pool_nodes[index].name)) as f:
            return json.load(f)

    def mac(self, node: str) -> str:
        """The MAC address of a node's interface."""
        return self.topo.run(node, ["cat", "/sys/class/net/eth0/address"]).stdout.strip()

    def link_bytes(self, node: str, direction: str = "tx") -> int:
        """Bytes the node's interface has sent (tx) or received (rx), from the kernel."""
        r = self.topo.run(node, ["cat", f"/sys/class/net/eth0/statistics/{direction}_bytes"])
        return int(r.stdout)

    # ---- driving it ----------------------------------------------------------------------
    def task(self, node: str, target: str, *args, timeout: float | None = 3600):
        """``target`` ("module:function") called with ``args`` inside ``node``; its result."""
        return run_task(self.topo, node, target, *args, timeout=timeout)

    def start_task(self, node: str, target: str, *args) -> Task:
        return start_task(self.topo, node, target, *args)

    def switchd(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        r = subprocess.run(self.switchd_argv(*args), capture_output=True, text=True, timeout=120)
        if check and r.returncode:
            raise TestbedError(f"switchd {' '.join(args)}: {r.stderr.strip()}")
        return r

    def stats(self) -> dict:
        return json.loads(self.switchd("stats", "--json").stdout)["counters"]

    def counters(self, pin_dir: str | None = None) -> dict:
        """The counters ``stats`` gives, read from the pinned map with bpftool: for benchmarks
        (`switchd stats` first compiles its map reader with BCC, 1.5-3 s). ``pin_dir``: of
        another switch than the testbed's (a fabric's)."""
        from switchd.dataplane import STAT_NAMES
        path = os.path.join(pin_dir or self.topo.pin_dir, "kv_stats")
        r = subprocess.run(["bpftool", "-j", "map", "dump", "pinned", path],
                           capture_output=True, text=True)
        if r.returncode:
            raise TestbedError(f"bpftool map dump pinned {path}: {r.stderr.strip()}")
        num = lambda hexes: int.from_bytes(bytes(int(b, 16) for b in hexes), "little")  # noqa
        per = {num(e["key"]): sum(num(v["value"]) for v in e["values"])
               for e in json.loads(r.stdout)}
        return {name: per.get(i, 0) for i, name in sorted(STAT_NAMES.items())}

    @property
    def pool_addrs(self) -> list[str]:
        return [n.ip for n in self.topo.pool_nodes]

    def _agent(self, node: str, *args: str, timeout: float = 120,
               pool: str | None = None) -> dict:
        """``hostagent`` run in ``node`` against every pool node, or only ``pool`` ("p2")."""
        addrs = [self.topo.node(pool).ip] if pool else self.pool_addrs
        pools = [a for ip in addrs for a in ("--pool", ip)]
        r = self.topo.run(node, python_argv("hostagent", *args[:1], *pools,
                                            "--chunk-size", str(self.chunk_size), *args[1:]),
                          timeout=timeout)
        return json.loads(r.stdout.strip().splitlines()[-1])

    def put(self, node: str, ns: int, key: bytes, data: bytes, pool: str | None = None,
            replicas: int = 1) -> dict:
        """`hostagent put` of a block from ``node``: to its owner (``pool``: that node only),
        or to ``replicas`` nodes of its rendezvous order."""
        path = os.path.join(self.tmp.name, f"put-{key.hex()}")
        with open(path, "wb") as f:
            f.write(data)
        return self._agent(node, "put", "--ns", str(ns), "--key", key.hex(), "--file", path,
                           "--replicas", str(replicas), pool=pool)

    def get(self, node: str, ns: int, key: bytes, *flags: str,
            pool: str | None = None) -> tuple[dict, bytes]:
        path = os.path.join(self.tmp.name, f"get-{node}-{key.hex()}")
        result = self._agent(node, "get", "--ns", str(ns), "--key", key.hex(), "--out", path,
                             *flags, pool=pool)
        with open(path, "rb") as f:
            return result, f.read()

    def get_many(self, nodes: list[str], ns: int, key: bytes, *flags: str,
                 start_delay: float = 2.0, timeout: float = 180) -> list[tuple[dict, bytes]]:
        """The same block fetched by several nodes starting at the same instant."""
        start_at = f"{time.time() + start_delay:.6f}"
        pools = [a for ip in self.pool_addrs for a in ("--pool", ip)]
        procs, outs = [], []
        for node in nodes:
            out = os.path.join(self.tmp.name, f"many-{node}-{key.hex()}")
            argv = python_argv("hostagent", "get", *pools, "--chunk-size", str(self.chunk_size),
                               "--ns", str(ns), "--key", key.hex(), "--out", out,
                               "--start-at", start_at, *flags)
            procs.append(self.topo.popen(node, argv, stdout=subprocess.PIPE,
                                         stderr=subprocess.PIPE, text=True))
            outs.append(out)
        results = []
        for node, p, out in zip(nodes, procs, outs):
            stdout, stderr = p.communicate(timeout=timeout)
            if p.returncode:
                raise TestbedError(f"{node}: get failed: {stderr.strip()[-500:]}")
            with open(out, "rb") as f:
                results.append((json.loads(stdout.strip().splitlines()[-1]), f.read()))
        return results
