"""The Mooncake master of a testbed: ``mooncake_master`` (from the venv's Mooncake wheel) run in
the topology's master namespace (``<prefix>-m1``, 198.18.0.200, a plain port on the bridge),
with its HTTP metadata server, started and stopped by the testbed (``Lab``, ``testbed up
--store mooncake``). It is ready when its RPC and metadata ports accept connections (about a
second after start). Its log goes to a file. A master keeps object metadata in memory only: a
restarted master has lost every object, though the pool nodes' clients remount by themselves.
"""
from __future__ import annotations

import signal
import socket
import subprocess
import time

from xdp import netns

from .topology import TestbedError, Topology

RPC_PORT, HTTP_PORT = 50051, 8080


def port_open(ns: str, ip: str, port: int, timeout: float = 0.2) -> bool:
    """Whether ``ip:port`` accepts TCP connections, as seen from namespace ``ns``."""
    with netns.inside(ns):
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.settimeout(timeout)
        return sock.connect_ex((ip, port)) == 0
    finally:
        sock.close()


class MooncakeMaster:
    def __init__(self, topo: Topology, log_path: str, *extra: str):
        if topo.master_node is None:
            raise TestbedError("this topology has no master node (Topology(master=True))")
        self.topo, self.node, self.log_path, self.extra = topo, topo.master_node, log_path, extra
        self.proc: subprocess.Popen | None = None

    @property
    def address(self) -> str:
        """HOST:PORT of the master's RPC server, what pool nodes take as --mooncake-master."""
        return f"{self.node.ip}:{RPC_PORT}"

    def argv(self) -> list[str]:
        from hostagent.pool.mooncake_store import MooncakeMissing, master_argv
        try:
            return master_argv(self.node.ip, RPC_PORT, HTTP_PORT, 9003, *self.extra)
        except MooncakeMissing as exc:
            raise TestbedError(str(exc)) from None

    def start(self, timeout: float = 30.0, detach: bool = False) -> MooncakeMaster:
        """Start the master and wait until it serves; ``detach``: let it outlive this process
        (``testbed down`` removes it with its namespace)."""
        with open(self.log_path, "ab") as log:
            self.proc = self.topo.popen(self.node.name, self.argv(), stdout=log,
                                        stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                        start_new_session=detach)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                break
            if all(port_open(self.node.netns, self.node.ip, p) for p in (RPC_PORT, HTTP_PORT)):
                return self
            time.sleep(0.05)
        self.stop(signal.SIGKILL)
        raise TestbedError(f"mooncake_master did not start: {self.log_tail()}")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 10.0) -> None:
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(sig)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)

    def log_tail(self, nbytes: int = 800) -> str:
        try:
            with open(self.log_path, "rb") as f:
                return f.read()[-nbytes:].decode(errors="replace").strip()
        except OSError:
            return "(no log)"
