"""Pool-node blocks in a Mooncake Store cluster (``hostagent serve --store mooncake``).

Every pool node is a Mooncake client with a segment of its own DRAM mounted in the cluster.
A whole block is one Mooncake object, keyed ``kvswitch/<ns>/<key hex>`` and laid out as
``hostagent.pool.blockfmt`` stores it (header and the writer's chunk CRCs before the payload), so a
block PUT through any pool node is served by any other. The node's staging arena (registered
with the transfer engine once, so reads and writes are zero-copy) holds the blocks it serves:
a completed PUT is laid out there and written to the cluster from it (``put_from``, first copy in
this node's segment, ``--replicas`` copies on distinct segments; the last chunk's PUT_ACK waits
for the write), a GET for a block not staged reads the object into a run of the arena
(``get_size`` then ``get_into``: a missing object answers NOT_FOUND at once) and checks the
header and every chunk's CRC before serving it. A read Mooncake sends to a replica on a node that
died answers UNAVAILABLE at once (readers fail over to another pool node) rather than waiting
out the master's client TTL.

Mooncake calls block, so they run in worker threads. Failures are return codes, never
exceptions, and a data call on a client that is not set up crashes the process: calls are made
only on a client whose ``setup`` succeeded and that is not being closed. A supervisor probes the
master (a TCP connect to its RPC and metadata ports, then ``health_check``) every half second:
while it is unreachable the node serves what it has staged, answers everything else with
ERROR (``store.UNAVAILABLE``) at once and logs one line; it logs another when the master is
back (a restarted master has lost every object, the clients remount by themselves).

``mooncake`` is imported only when this store is used; ``master_argv`` is how the testbed (and
the README) start ``mooncake_master``.
"""
from __future__ import annotations

import asyncio
import logging
import os
import shutil
import socket
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from urllib.parse import urlsplit

from kvproto import Status
from .blockfmt import BlockFormatError, bad_chunks, object_key, read_crcs, read_layout
from .staging import StagedBlock, StagingFull
from .store import UNAVAILABLE, PoolStore, StoreError

log = logging.getLogger("hostagent.mooncake")

INSTALL_HINT = "run 'make setup' or pip install 'kvswitch[mooncake]'"
RPC_PORT, HTTP_PORT, METRICS_PORT = 50051, 8080, 9003
# Mooncake Store return codes
OBJECT_NOT_FOUND, NO_SPACE, INVALID_PARAMS, TRANSFER_FAIL, RPC_FAIL = -704, -200, -600, -800, -900
_RC_NAMES = {OBJECT_NOT_FOUND: "OBJECT_NOT_FOUND", NO_SPACE: "NO_AVAILABLE_HANDLE",
             INVALID_PARAMS: "INVALID_PARAMS", TRANSFER_FAIL: "TRANSFER_FAIL",
             RPC_FAIL: "RPC_FAIL"}
# fail fast rather than block ~90 s in setup(), quiet logs (a user's environment wins)
CLIENT_ENV = {"MC_LOG_LEVEL": "ERROR", "MC_STORE_CLIENT_SETUP_RETRIES": "2",
              "MC_RPC_CONNECT_TIMEOUT_MS": "1000"}


_ABANDONED: list = []             # clients not closed (master down): kept till the process ends


class MooncakeMissing(RuntimeError):
    pass


def load_mooncake():
    """The ``mooncake.store`` module, or MooncakeMissing saying how to install it."""
    for name, value in CLIENT_ENV.items():
        os.environ.setdefault(name, value)
    try:
        from mooncake import store
    except ImportError as exc:
        raise MooncakeMissing(f"Mooncake Store is not installed ({exc}): {INSTALL_HINT}") \
            from None
    return store


def parse_master(text: str) -> tuple[str, int]:
    """'HOST' or 'HOST:PORT' (the master's RPC port, 50051 by default)."""
    host, sep, port = text.strip().rpartition(":")
    if not sep:
        host, port = text.strip(), str(RPC_PORT)
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{text!r} is not HOST[:PORT] of a Mooncake master")
    return host, int(port)


def master_binary() -> str:
    """Where ``mooncake_master`` is: next to this interpreter, in the wheel, or on PATH."""
    for candidate in (Path(sys.executable).parent / "mooncake_master",):
        if candidate.exists():
            return str(candidate)
    try:
        import mooncake
        inside = Path(mooncake.__file__).parent / "mooncake_master"
        if inside.exists():
            return str(inside)
    except ImportError:
        pass
    found = shutil.which("mooncake_master")
    if not found:
        raise MooncakeMissing(f"mooncake_master is not installed: {INSTALL_HINT}")
    return found


def master_argv(host: str, rpc_port: int = RPC_PORT, http_port: int = HTTP_PORT,
                metrics_port: int = METRICS_PORT, *extra: str) -> list[str]:
    """A master with its HTTP metadata server (it binds every address whatever ``host`` is)."""
    return [master_binary(), "--enable_http_metadata_server=true",
            f"--http_metadata_server_port={http_port}", f"--rpc_address={host}",
            f"--rpc_port={rpc_port}", f"--metrics_host={host}",
            f"--metrics_port={metrics_port}", *extra]


async def tcp_probe(host: str, port: int, timeout: float = 1.0) -> str | None:
    """None if ``host:port`` accepts a TCP connection, else why not."""
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout)
    except asyncio.TimeoutError:
        return f"no answer from {host}:{port} in {timeout:g} s"
    except OSError as exc:
        return f"{host}:{port}: {exc.strerror or exc}"
    writer.close()
    return None


def _local_address(host: str, port: int) -> str:
    """This node's address on the way to ``host`` (what the cluster reaches our segment at)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, port))
        return s.getsockname()[0]


def _check_block(view, size: int, ns: int, key: bytes):
    """Layout and CRCs of a block just read (in a worker thread: the CRCs take a while)."""
    layout = read_layout(view, size, ns, key)
    crcs = read_crcs(view, layout)
    bad = bad_chunks(view, layout, crcs)
    if bad:
        raise BlockFormatError(f"{len(bad)} chunk(s) do not match their CRC (first: {bad[0]})")
    return layout, crcs


class MooncakeStore(PoolStore):
    kind = "mooncake"
    PROBE_INTERVAL = 0.5
    TRANSFER_RETRY_S = 20.0

    def __init__(self, capacity: int, master: str, replicas: int = 1,
                 segment: int = 512 << 20, metadata: str | None = None,
                 local_buffer: int = 16 << 20, workers: int = 4, module=None, **kw):
        super().__init__(capacity, **kw)
        if replicas < 1 or segment < 1 << 20:
            raise ValueError("replicas must be at least 1 and the segment at least 1 MiB")
        self.master_host, self.master_port = parse_master(master)
        self.master = f"{self.master_host}:{self.master_port}"
        self.metadata = metadata or f"http://{self.master_host}:{HTTP_PORT}/metadata"
        meta = urlsplit(self.metadata)
        if meta.scheme != "http" or not meta.hostname:
            raise ValueError(f"{self.metadata!r} is not an http://HOST:PORT/metadata URL")
        self._meta_addr = (meta.hostname, meta.port or 80)
        self.replicas, self.segment, self.local_buffer = replicas, segment, local_buffer
        self.hostname = ""                 # our segment's name in the cluster, once set up
        self.available = False
        self._mc = module                 # mooncake.store (tests pass a stand-in)
        self._client = None
        self._closing = False
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="mooncake")
        self._fills: dict[tuple[int, bytes], asyncio.Future] = {}
        self._tasks: set[asyncio.Task] = set()
        self._connected = asyncio.Event()
        self._wake = asyncio.Event()
        self._supervisor: asyncio.Task | None = None
        self._down_since: float | None = None
        self._down_reason = ""
        self.abandoned = False            # closed without telling the master (it was down)
        self._dead_logged = -1e9          # when a read from a dead replica was last logged

    # ---- lifecycle -----------------------------------------------------------------------
    async def start(self) -> None:
        """Import Mooncake (MooncakeMissing if it is not installed), then wait until the
        cluster has taken this node's segment; the supervisor keeps trying and logging."""
        if self._mc is None:
            self._mc = load_mooncake()
        self._supervisor = asyncio.create_task(self._supervise())
        await self._connected.wait()

    async def close(self) -> None:
        self._closing = True
        if self._supervisor is not None:
            self._supervisor.cancel()
            await asyncio.gather(self._supervisor, return_exceptions=True)
        if self._tasks:                    # fills and writes under way: let them end
            await asyncio.wait(list(self._tasks), timeout=10)
            for task in list(self._tasks):
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, self._pool.shutdown, True)
        client, self._client = self._client, None
        if client is not None:
            await loop.run_in_executor(None, self._shutdown_client, client)
        await super().close()

    def _shutdown_client(self, client) -> None:
        if not self.available:
            # close() (and the client's destructor) would spend ~10 s failing to tell an absent
            # master; the master drops this client's segment when its TTL ends anyway
            _ABANDONED.append(client)
            self.abandoned = True
            return
        client.unregister_buffer(self.staging.arena.addr)
        client.close()

    def describe(self) -> str:
        return (f"mooncake, master {self.master}, segment {self.hostname} "
                f"({self.segment >> 20} MiB), replicas {self.replicas}")

    def stats(self) -> dict:
        return {**super().stats(), "mooncake_available": int(self.available),
                "mooncake_segment": self.hostname}

    # ---- supervision ---------------------------------------------------------------------
    async def _supervise(self) -> None:
        while True:
            try:
                if self._client is None:
                    await self._connect()
                else:
                    await self._check()
            except Exception:             # never let the supervisor die
                log.exception("mooncake supervisor")
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), self.PROBE_INTERVAL)
            except asyncio.TimeoutError:
                pass

    async def _probe(self) -> str | None:
        return (await tcp_probe(self.master_host, self.master_port) or
                await tcp_probe(*self._meta_addr))

    async def _connect(self) -> None:
        reason = await self._probe()
        if reason:
            self._down(f"unreachable ({reason})")
            return
        local = _local_address(self.master_host, self.master_port)
        client = self._mc.MooncakeDistributedStore()
        rc = await asyncio.get_running_loop().run_in_executor(
            self._pool, client.setup, local, self.metadata, self.segment, self.local_buffer,
            "tcp", "", self.master)
        if rc != 0:
            self._down(f"refused this client (setup returned {rc})")
            return
        rc = client.register_buffer(self.staging.arena.addr, self.staging.arena.size)
        if rc != 0:
            log.warning("mooncake: could not register the staging area (%d): copies are slower",
                        rc)
        self._client, self.hostname = client, client.get_hostname()
        self._up()
        self._connected.set()

    async def _check(self) -> None:
        reason = await tcp_probe(self.master_host, self.master_port)
        if reason:
            self._down(f"unreachable ({reason})")
            return
        health = self._client.health_check()
        if health != 0:
            self._down(f"back but this client is not mounted yet (health {health})")
            return
        self._up()

    def _down(self, reason: str) -> None:
        if self.available or self._down_since is None or reason != self._down_reason:
            log.warning("mooncake master %s %s: serving staged blocks only, answering other "
                        "requests with ERROR %s until it returns", self.master, reason,
                        Status(UNAVAILABLE).name)
        if self._down_since is None or self.available:
            self._down_since = time.monotonic()
        self.available, self._down_reason = False, reason

    def _up(self) -> None:
        if not self.available:
            if self._down_since is not None:
                log.warning("mooncake master %s is back after %.1f s (segment %s)", self.master,
                            time.monotonic() - self._down_since, self.hostname)
            else:
                log.info("mooncake: connected to master %s, segment %s", self.master,
                         self.hostname)
        self.available, self._down_since, self._down_reason = True, None, ""

    # ---- store hooks ---------------------------------------------------------------------
    def _accepting(self) -> None:
        if not self.available:
            raise StoreError(UNAVAILABLE, f"the Mooncake master {self.master} is unreachable")

    def _miss(self, ns: int, key: bytes) -> asyncio.Future:
        fill = self._fills.get((ns, key))
        if fill is not None:
            return fill
        self._accepting()
        fill = self._fills[(ns, key)] = asyncio.get_running_loop().create_future()
        self._spawn(self._fill(ns, key, fill))
        return fill

    def _persist(self, block: StagedBlock) -> asyncio.Future:
        name = (block.layout.ns, block.layout.key)
        block.pins += 1
        done = self._writing[name] = asyncio.get_running_loop().create_future()
        self._spawn(self._write(block, done))
        return done

    # ---- Mooncake calls ------------------------------------------------------------------
    def _spawn(self, coro) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _call(self, method: str, *args):
        client = self._client
        if client is None or self._closing:
            raise StoreError(UNAVAILABLE, "not connected to the Mooncake cluster")
        return await asyncio.get_running_loop().run_in_executor(
            self._pool, getattr(client, method), *args)

    def _failed(self, rc: int, doing: str) -> StoreError:
        if rc == OBJECT_NOT_FOUND:
            return StoreError(Status.NOT_FOUND, "no such block")
        what = f"Mooncake {_RC_NAMES.get(rc, 'error')} ({rc}) {doing}"
        self.counters["mooncake_errors"] += 1
        if rc == NO_SPACE:
            log.warning("%s: the cluster has no room", what)
            return StoreError(Status.NO_SPACE, what)
        if rc == RPC_FAIL:
            self._down(f"did not answer ({what})")
            self._wake.set()
        else:
            log.warning("%s", what)
        return StoreError(UNAVAILABLE, what)

    async def _fill(self, ns: int, key: bytes, fill: asyncio.Future) -> None:
        name, okey = (ns, key), object_key(ns, key)
        t0 = time.monotonic()
        try:
            size = await self._call("get_size", okey)
            if size < 0:
                raise self._failed(size, f"looking up {okey}")
            try:
                run = self.staging.reserve(size)
            except StagingFull as exc:
                raise StoreError(Status.NO_SPACE, str(exc)) from None
            try:
                t1 = time.monotonic()
                rc = await self._call("get_into", okey, run.addr, size)
                t2 = time.monotonic()
                if rc == TRANSFER_FAIL:
                    raise self._dead_replica(okey)
                if rc != size:
                    raise self._failed(rc, f"reading {okey}")
                try:
                    layout, crcs = await asyncio.get_running_loop().run_in_executor(
                        self._pool, _check_block, run.view, size, ns, key)
                except BlockFormatError as exc:
                    log.error("mooncake object %s is corrupt: %s", okey, exc)
                    self.counters["corrupt_blocks"] += 1
                    raise StoreError(Status.CHECKSUM, f"{okey}: {exc}") from None
                block = self.staging.commit(run, layout, crcs)
            except BaseException:
                self.staging.release(run)
                raise
            self.counters["fills"] += 1
            self.counters["fill_bytes"] += size
            t3 = time.monotonic()
            self.counters["fill_us"] += int((t3 - t0) * 1e6)          # the whole fill
            self.counters["fill_read_us"] += int((t2 - t1) * 1e6)     # get_into
            self.counters["fill_check_us"] += int((t3 - t2) * 1e6)    # header and CRCs
            fill.set_result(block)
        except StoreError as exc:
            self.counters["fill_" + Status(exc.status).name.lower()] += 1
            fill.set_exception(exc)
        except BaseException as exc:
            fill.set_exception(StoreError(UNAVAILABLE, f"reading {okey}: {exc!r}"))
            raise
        finally:
            self._fills.pop(name, None)

    def _dead_replica(self, okey: str) -> StoreError:
        """``get_into`` failed with TRANSFER_FAIL: the node holding the replica Mooncake reads
        from (the first, unless one is in our own segment) has died, and the master lists its
        replicas until the node's client TTL (10 s by default) ends. The read is not retried:
        the reader is answered UNAVAILABLE at once and asks another pool node, which reads its
        own replica (or finds the object gone once the master has dropped the dead node)."""
        self.counters["dead_replica_reads"] += 1
        now = time.monotonic()
        if now - self._dead_logged > 10.0:
            self._dead_logged = now
            log.warning("mooncake: the node holding %s does not answer (TRANSFER_FAIL): "
                        "answering UNAVAILABLE so the reader asks another pool node (%d such "
                        "reads so far)", okey, self.counters["dead_replica_reads"])
        return StoreError(UNAVAILABLE, f"the node holding {okey}'s replica does not answer")

    async def _write(self, block: StagedBlock, done: asyncio.Future) -> None:
        layout = block.layout
        name, okey = (layout.ns, layout.key), object_key(layout.ns, layout.key)
        try:
            config = self._mc.ReplicateConfig()
            config.replica_num = self.replicas
            config.preferred_segment = self.hostname
            deadline = time.monotonic() + self.TRANSFER_RETRY_S
            while True:      # a replica placed on a node that died and is still listed fails
                rc = await self._call("put_from", okey, block.run.addr, layout.size, config)
                if rc != TRANSFER_FAIL or time.monotonic() > deadline:
                    break
                self.counters["transfer_retries"] += 1
                await asyncio.sleep(0.5)
            if rc != 0:
                raise self._failed(rc, f"writing {okey}")
            self.counters["writes"] += 1
            done.set_result(True)
        except BaseException as exc:
            done.set_exception(exc if isinstance(exc, StoreError) else
                               StoreError(UNAVAILABLE, f"writing {okey}: {exc!r}"))
            if self.staging.get(*name, touch=False) is block:
                self.staging.remove(*name)     # the writer is told it failed: keep no copy
            if not isinstance(exc, Exception):
                raise
        finally:
            block.pins -= 1
            self._writing.pop(name, None)
