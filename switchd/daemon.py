"""The switch daemon's lifetime: take the pin directory's lock, attach the data plane to the ports,
set their roles and checks, run the admission/eviction policy every interval (and the metrics
endpoint), stay up until SIGINT/SIGTERM, then detach cleanly. The maps stay pinned, so a
restarted daemon (even after SIGKILL, when nothing is detached) carries on with the same cache
and counters; a daemon that fails to start removes the maps it made and detaches what it
attached."""
from __future__ import annotations

import fcntl
import logging
import os
import signal
import threading
from dataclasses import dataclass, field

from .dataplane import (PINNED_MAPS, ROLE_HOST, ROLE_POOL, DataPlane, Deployment, SwitchError,
                        ifindex)
from .cache import Cache
from .manager import CacheManager
from .metrics import serve_metrics
from .ports import own, resolve, set_role, sync

log = logging.getLogger("switchd")
LOCK_DIR = "/run/kvswitch"


@dataclass
class Settings:
    """Everything `switchd run` is told (options or config file)."""
    ports: list[str]
    pool_ports: list[str] = field(default_factory=list)
    mode: str = "native"
    coalesce: bool = True
    pending_timeout: float = 0.05                 # seconds
    policy: str | None = "prefix"                 # None: admit by hand only
    interval: float = 1.0
    quotas: dict[int, int] = field(default_factory=dict)          # ns -> bytes
    metrics_port: int | None = None
    port_namespaces: dict[str, list[int]] = field(default_factory=dict)
    fill_headroom: int | None = None
    port_security: bool = False                   # every port bound to its first source
    # port -> (MAC, IP), bound before attaching; MAC None: asked for by ARP on that port
    port_bindings: dict[str, tuple[str | None, str]] = field(default_factory=dict)
    force: bool = False                           # take ports that run another program
    # links to other switches (never bound to a source): towards the pool nodes / a rack
    uplinks: list[str] = field(default_factory=list)
    downlinks: list[str] = field(default_factory=list)
    # uplink -> the pool nodes' IPv4 addresses behind it, owned by the uplink before any frame
    uplink_pools: dict[str, list[str]] = field(default_factory=dict)
    share: tuple[int, int] | None = None          # (K, N): cache only blocks in share K of N


class PinLock:
    """One daemon per pin directory: an flock on a file named after it under /run/kvswitch
    (bpffs holds no regular files), held for the daemon's life."""

    def __init__(self, pin_dir: str):
        os.makedirs(LOCK_DIR, exist_ok=True)
        self.path = os.path.join(LOCK_DIR, pin_dir.strip("/").replace("/", "-") + ".lock")
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            owner = os.pread(self.fd, 32, 0).decode(errors="replace").strip() or "?"
            os.close(self.fd)
            raise SwitchError(f"another switchd (pid {owner}) runs with the maps in {pin_dir}: "
                              "stop it first") from None
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, str(os.getpid()).encode(), 0)

    def release(self, remove: bool = False) -> None:
        if remove:                         # a start that failed: its lock file goes too
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
        os.close(self.fd)


class Daemon:
    def __init__(self, deployment: Deployment, settings: Settings):
        self.deployment, self.s = deployment, settings
        self.stop = threading.Event()

    def run(self) -> None:
        for port in self.s.ports:
            ifindex(port)                      # the plainest mistake is reported first
        pin_dir = self.deployment.pin_dir
        made_dir = bool(pin_dir) and not os.path.exists(pin_dir)
        lock = PinLock(pin_dir) if pin_dir else None
        fresh = bool(pin_dir) and not os.path.exists(os.path.join(pin_dir, "kv_cache"))
        dp = None
        try:
            dp = DataPlane(self.deployment)
            manager = self._start(dp)
        except BaseException:
            if dp:
                dp.detach_all()
            if fresh:                          # leave no maps behind that this run made
                for name in PINNED_MAPS:
                    try:
                        os.unlink(os.path.join(pin_dir, name))
                    except FileNotFoundError:
                        pass
            if made_dir:                       # nor the directory it made for them
                try:
                    os.rmdir(pin_dir)
                except OSError:
                    pass
            if lock:
                lock.release(remove=made_dir)
            raise
        try:
            self._serve(dp, manager)
        finally:
            dp.detach_all()
            if lock:
                lock.release()
            print("switchd: detached", flush=True)

    def _start(self, dp: DataPlane) -> CacheManager | None:
        s = self.s
        bindings = {}
        for port, (mac, ip) in s.port_bindings.items():   # before attaching: nothing else
            bindings[port] = (mac or resolve(port, ip), ip)   # answers on that port
        behind = {port: [(resolve(port, ip), ip) for ip in ips]    # the pool nodes an uplink
                  for port, ips in s.uplink_pools.items()}         # leads to, by ARP there
        for port in s.ports:
            trunk = port in s.uplinks or port in s.downlinks
            set_role(dp, port, ROLE_POOL if port in s.pool_ports + s.uplinks else ROLE_HOST,
                     s.port_namespaces.get(port), s.port_security and not trunk,
                     bindings.get(port), trunk, owns_sources=s.port_security and trunk)
        for port, sources in behind.items():
            for mac, ip in sources:
                own(dp, ifindex(port), mac, ip)
        sync(dp)
        dp.set_replication_ports(s.ports)
        dp.set("coalesce", int(s.coalesce))
        dp.set("pending_ns", int(s.pending_timeout * 1e9))
        dp.set("spec_fill", 0)           # until the policy says how much room it leaves
        k, n = s.share or (0, 1)
        dp.set("share_k", k)
        dp.set("share_n", n)
        manager = (CacheManager(dp, s.policy, s.quotas, s.fill_headroom, s.share)
                   if s.policy else None)
        # without a policy, blocks admitted by hand still get their slots: a fill region kept
        # open and a range for each once its size is known (the manager does both otherwise)
        self.hand_cache = None if manager else Cache(dp)
        if s.metrics_port:
            serve_metrics(s.metrics_port, dp, manager)
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: self.stop.set())
        for port in s.ports:
            dp.attach(port, s.mode, s.force)
        return manager

    def _serve(self, dp: DataPlane, manager: CacheManager | None) -> None:
        s = self.s
        secured = "all ports" if s.port_security else ",".join(s.port_bindings) or "off"
        trunks = "".join(f", {what} {','.join(ports)}" for what, ports in
                         (("uplinks", s.uplinks), ("downlinks", s.downlinks)) if ports)
        print(f"switchd: serving on {','.join(s.ports)} ({s.mode} XDP), pool ports "
              f"{','.join(s.pool_ports) or 'none'}{trunks}, "
              f"coalescing {'on' if s.coalesce else 'off'}, "
              f"policy {s.policy or 'off'}, port security {secured}, "
              f"maps in {self.deployment.pin_dir}", flush=True)
        bound = dp.port_sources()
        for port, (mac, ip) in sorted(bound.items()):   # after the line tools wait for
            if port in s.ports:
                print(f"switchd: port {port} bound to {mac} {ip}", flush=True)
        while not self.stop.wait(s.interval):
            try:
                if manager:
                    manager.step()
                elif self.hand_cache:
                    self.hand_cache.tend({})
            except Exception:  # the data plane keeps serving; say so and go on
                log.exception("policy step failed")
            if s.port_security or s.port_bindings:
                now = dp.port_sources()
                for port, (mac, ip) in now.items():
                    if bound.get(port) != (mac, ip):
                        print(f"switchd: port {port} bound to {mac} {ip}", flush=True)
                for port in bound.keys() - now.keys():
                    print(f"switchd: port {port} unbound (relearn)", flush=True)
                bound = now
