"""A running testbed: the topology plus a pool server on every pool node and switchd on the switch,
with helpers to drive the host agents and switchd as a user would (their CLIs, in namespaces)
and to run Python tasks in the nodes (testbed.lab.tasks). Used by the demos, the end-to-end tests
and the benchmarks; always tears down what it started."""
from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import tempfile
import time

from .tasks import Task, run_task, start_task
from .topology import Topology, TestbedError, python_argv


def _await_line(proc: subprocess.Popen, stream, marker: str, timeout: float, what: str) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([stream], [], [], max(0.0, deadline - time.monotonic()))
        if not ready:
            break
        line = stream.readline()
        if not line:
            break
        if marker in line:
            return line.strip()
    proc.kill()
    out, err = proc.communicate(timeout=5)
    raise TestbedError(f"{what} did not start: {(err or out or '').strip()[-800:]}")


class Lab:
    def __init__(self, prefix: str = "kv", hosts: int = 2, pools: int = 1,
                 chunk_size: int = 1024, cache_entries: int = 65536,
                 pool_capacity: str = "512MiB", switch: bool = True,
                 switchd_args: tuple[str, ...] = ()):
        # the MTU fits the chunk (IPv4 + UDP + KV header = 76 bytes), never below Ethernet's 1500
        self.topo = Topology(prefix, hosts, pools, mtu=max(1500, chunk_size + 76))
        self.chunk_size, self.cache_entries = chunk_size, cache_entries
        self.pool_capacity, self.want_switch = pool_capacity, switch
        self.switchd_args = switchd_args
        self.pools: list[subprocess.Popen] = []
        self.switch: subprocess.Popen | None = None
        self.tmp = tempfile.TemporaryDirectory(prefix=f"kvlab-{prefix}-")

    # ---- lifecycle -----------------------------------------------------------------------
    def __enter__(self) -> Lab:
        self.topo.up()
        try:
            for node in self.topo.pool_nodes:
                p = self.topo.popen(node.name, python_argv(
                    "hostagent", "serve", "--capacity", self.pool_capacity,
                    "--stats-file", self._pool_stats_path(node.name)),
                    stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
                self.pools.append(p)
                _await_line(p, p.stderr, "ready", 30, f"pool server on {node.name}")
            if self.want_switch:
                self.start_switch()
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc) -> None:
        procs = self.pools + ([self.switch] if self.switch else [])
        for p in procs:
            if p.poll() is None:
                p.terminate()
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
        self.topo.down()
        self.tmp.cleanup()

    def switchd_argv(self, *args: str) -> list[str]:
        return python_argv("switchd", "--netns", self.topo.switch_ns,
                           "--pin-dir", self.topo.pin_dir, *args)

    def start_switch(self, *extra: str) -> str:
        argv = ["run", "--chunk-size", str(self.chunk_size),
                "--cache-entries", str(self.cache_entries)]
        for n in self.topo.nodes:
            argv += ["--pool-port" if n.role == "pool" else "--port", n.name]
        self.switch = subprocess.Popen(self.switchd_argv(*argv, *self.switchd_args, *extra),
                                       stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                       text=True)
        return _await_line(self.switch, self.switch.stdout, "switchd: serving", 60, "switchd")

    def stop_switch(self, sig: int = signal.SIGTERM) -> int:
        self.switch.send_signal(sig)
        code = self.switch.wait(20)
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
        time.sleep(0.05)  # let the writer finish
        with open(path) as f:
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

    @property
    def pool_addrs(self) -> list[str]:
        return [n.ip for n in self.topo.pool_nodes]

    def _agent(self, node: str, *args: str, timeout: float = 120) -> dict:
        pools = [a for ip in self.pool_addrs for a in ("--pool", ip)]
        r = self.topo.run(node, python_argv("hostagent", *args[:1], *pools,
                                            "--chunk-size", str(self.chunk_size), *args[1:]),
                          timeout=timeout)
        return json.loads(r.stdout.strip().splitlines()[-1])

    def put(self, node: str, ns: int, key: bytes, data: bytes) -> dict:
        path = os.path.join(self.tmp.name, f"put-{key.hex()}")
        with open(path, "wb") as f:
            f.write(data)
        return self._agent(node, "put", "--ns", str(ns), "--key", key.hex(), "--file", path)

    def get(self, node: str, ns: int, key: bytes, *flags: str) -> tuple[dict, bytes]:
        path = os.path.join(self.tmp.name, f"get-{node}-{key.hex()}")
        result = self._agent(node, "get", "--ns", str(ns), "--key", key.hex(), "--out", path,
                             *flags)
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
