"""The switch daemon's lifetime: attach the data plane to the ports, mark pool-node ports, run the
admission/eviction policy every interval (and the metrics endpoint), stay up until
SIGINT/SIGTERM, then detach cleanly. The maps stay pinned, so a restarted daemon (even
after SIGKILL, when nothing is detached) carries on with the same cache and counters."""
from __future__ import annotations

import logging
import signal
import threading



from .dataplane import ROLE_HOST, ROLE_POOL, DataPlane, Deployment
from .manager import CacheManager
from .metrics import serve_metrics

log = logging.getLogger("switchd")


class Daemon:
    def __init__(self, deployment: Deployment, ports: list[str], pool_ports: list[str],
                 mode: str = "native", coalesce: bool = True, pending_timeout: float = 0.05,
                 policy: str | None = "prefix", interval: float = 1.0,
                 quotas: dict[int, int] | None = None, metrics_port: int | None = None,
                 port_namespaces: dict[str, list[int]] | None = None,
                 fill_headroom: int | None = None):
        self.deployment, self.ports, self.pool_ports, self.mode = (
            deployment, ports, pool_ports, mode)
        self.coalesce, self.pending_timeout = coalesce, pending_timeout
        self.policy, self.interval, self.quotas = policy, interval, quotas or {}
        self.metrics_port = metrics_port
        self.port_namespaces = port_namespaces or {}
        self.fill_headroom = fill_headroom
        self.stop = threading.Event()

    def run(self) -> None:
        dp = DataPlane(self.deployment)
        for port in self.ports:
            role = ROLE_POOL if port in self.pool_ports else ROLE_HOST
            dp.set_port_role(port, role, self.port_namespaces.get(port))
        dp.set_replication_ports(self.ports)
        dp.set("coalesce", int(self.coalesce))
        dp.set("pending_ns", int(self.pending_timeout * 1e9))
        dp.set("spec_fill", 0)           # until the policy says how much room it leaves
        manager = (CacheManager(dp, self.policy, self.quotas, self.fill_headroom)
                   if self.policy else None)
        if self.metrics_port:
            serve_metrics(self.metrics_port, dp, manager)
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: self.stop.set())
        try:
            for port in self.ports:
                dp.attach(port, self.mode)
            print(f"switchd: serving on {','.join(self.ports)} ({self.mode} XDP), pool ports "
                  f"{','.join(self.pool_ports) or 'none'}, coalescing "
                  f"{'on' if self.coalesce else 'off'}, policy {self.policy or 'off'}, "
                  f"maps in {self.deployment.pin_dir}", flush=True)
            while not self.stop.wait(self.interval):
                if manager:
                    try:
                        manager.step()
                    except Exception:  # the data plane keeps serving; say so and go on
                        log.exception("policy step failed")
        finally:
            dp.detach_all()
            print("switchd: detached", flush=True)
