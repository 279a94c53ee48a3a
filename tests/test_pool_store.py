"""Pool-node stores without Mooncake: the block object format and key mapping (PUT assembly:
tests/test_assembly.py), the staging arena and its LRU, the in-memory default, and the Mooncake
store's logic (fills, writes, CRC checks, a master that goes away and comes back) against an
in-process stand-in for the Mooncake client, with real pool servers and clients over loopback
UDP."""
import asyncio
import contextlib
import ctypes
import os
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest

from hostagent.pool import blockfmt
from hostagent.pool.blockfmt import BlockFormatError, ObjectLayout, object_key
from hostagent.common.transfer import BlockNotFound, Refused
from hostagent.inference.client import KVClient
from hostagent.pool.mooncake_store import (MooncakeMissing, MooncakeStore, load_mooncake,
                                           parse_master)
from hostagent.pool.staging import Arena, StagingFull, Staging
from hostagent.pool.store import UNAVAILABLE
from kvproto import Status, checksum
from conftest import local_pool
from testbed.lab.topology import python_argv

KEY = bytes(range(16))


# ---- key mapping and object format --------------------------------------------------------------
def test_object_key_names_namespace_and_key():
    assert object_key(7, KEY) == "kvswitch/7/000102030405060708090a0b0c0d0e0f"
    assert object_key(7, KEY) != object_key(8, KEY) != object_key(7, KEY[::-1])
    assert blockfmt.parse_object_key(object_key(0xFFFFFFFF, KEY)) == (0xFFFFFFFF, KEY)
    for ns, key in ((-1, KEY), (1 << 32, KEY), (1, b"short")):
        with pytest.raises(ValueError):
            object_key(ns, key)
    assert parse_master("10.0.0.1") == ("10.0.0.1", 50051)
    assert parse_master("m:6000") == ("m", 6000)
    for bad in ("", "x:0", "x:port", "x:70000"):
        with pytest.raises(ValueError):
            parse_master(bad)


@pytest.mark.parametrize("chunk, total", [(3072, 2 << 20), (1024, 5000), (100, 100), (8, 17)])
def test_block_object_round_trips_with_aligned_payload(chunk, total):
    data = os.urandom(total)
    chunks = [data[i:i + chunk] for i in range(0, total, chunk)]
    obj = blockfmt.encode_block(3, KEY, chunks)
    layout = blockfmt.read_layout(obj, len(obj), 3, KEY)
    assert layout == ObjectLayout(3, KEY, len(chunks), chunk, layout.payload_off, total)
    assert layout.payload_off % chunk == 0 and layout.payload_off >= 64 + 4 * len(chunks)
    assert obj[layout.payload_off:] == data and layout.size == len(obj)
    crcs = blockfmt.read_crcs(obj, layout)
    assert list(crcs) == [checksum(c) for c in chunks]
    assert blockfmt.bad_chunks(obj, layout, crcs) == []
    off, ln = layout.chunk_span(len(chunks) - 1)
    assert obj[off:off + ln] == chunks[-1]


def test_block_object_corruption_is_caught():
    chunks = [os.urandom(1024) for _ in range(4)]
    obj = bytearray(blockfmt.encode_block(1, KEY, chunks))
    layout = blockfmt.read_layout(obj, len(obj))
    obj[layout.payload_off + 2 * 1024 + 5] ^= 1                  # a payload bit: chunk 2
    assert blockfmt.bad_chunks(obj, layout, blockfmt.read_crcs(obj, layout)) == [2]
    for at in (0, 20, 64 + 4):                                   # magic, ns, a chunk CRC
        bad = bytearray(obj)
        bad[at] ^= 1
        with pytest.raises(BlockFormatError):
            blockfmt.read_layout(bad, len(bad), 1, KEY)
    with pytest.raises(BlockFormatError, match="not the one asked for"):
        blockfmt.read_layout(obj, len(obj), 2, KEY)
    with pytest.raises(BlockFormatError):
        blockfmt.read_layout(obj, len(obj) - 1)                  # size disagrees with header


# ---- staging ----------------------------------------------------------------------------------
def test_arena_allocates_first_fit_and_merges_free_runs():
    arena = Arena(10 * 4096)
    a, b, c = arena.alloc(3), arena.alloc(3), arena.alloc(4)
    assert (a, b, c) == (0, 3, 6) and arena.alloc(1) is None
    arena.release(a, 3)
    arena.release(c, 4)
    assert arena.alloc(5) is None                                # free, but not contiguous
    arena.release(b, 3)
    assert arena.alloc(10) == 0 and arena.free_pages == 0
    arena.close()


def _stage(staging, ns, nbytes, pins=0):
    layout = ObjectLayout.for_payload(ns, KEY, nbytes, 1024)
    run = staging.reserve(layout.size)
    blockfmt.write_block(run.view, layout, [bytes(1024)] * (nbytes // 1024),
                         [checksum(bytes(1024))] * (nbytes // 1024))
    return staging.commit(run, layout, blockfmt.read_crcs(run.view, layout), pins)


def test_staging_evicts_least_recently_used_and_never_pinned_blocks():
    staging = Staging(Arena(8 * 4096))
    for ns in range(4):                                          # 2 pages each: full
        _stage(staging, ns, 4096, pins=1 if ns == 1 else 0)
    staging.get(0, KEY)                                          # 0 used again
    _stage(staging, 9, 4096)                                     # 2 is the LRU unpinned one
    assert staging.get(2, KEY) is None and staging.evicted_blocks == 1
    assert {ns for ns, _ in staging.blocks} == {0, 1, 3, 9}
    assert staging.used == staging.capacity
    with pytest.raises(StagingFull):
        staging.reserve(9 * 4096)
    run = staging.reserve(4 * 4096 - 100)                        # all but the pinned one go
    assert set(staging.blocks) == {(1, KEY)}
    staging.release(run)
    payload, crc = staging.get(1, KEY).chunk(3)
    assert bytes(payload) == bytes(1024) and crc == checksum(bytes(1024))


def test_the_arena_hears_of_every_block_served_and_retracted():
    events = []

    class Recording(Arena):
        def publish(self, block):
            events.append(("publish", block.layout.ns, block.run.start))

        def retract(self, block):
            events.append(("retract", block.layout.ns, self.free_pages))

    staging = Staging(Recording(4 * 4096))
    _stage(staging, 1, 4096)
    _stage(staging, 2, 4096)
    _stage(staging, 3, 4096)                                     # evicts 1 (LRU)
    staging.remove(2, KEY)
    assert events == [("publish", 1, 0), ("publish", 2, 2), ("retract", 1, 0),
                      ("publish", 3, 0), ("retract", 2, 0)]     # retracted before freed


def test_memory_store_is_the_default_and_holds_whole_blocks():
    async def body():
        data = os.urandom(10_000)
        async with local_pool(1 << 20) as proto, \
                KVClient([proto.sock.getsockname()], chunk_size=3000) as c:
            await c.put_block(1, KEY, data)
            got, _ = await c.get_block(1, KEY)
            return got == data, proto.stats()

    exact, stats = asyncio.run(body())
    assert exact and stats["store"] == "memory" and stats["staged_blocks"] == 1
    assert stats["staged_bytes"] == 4 * 4096       # header padded to one chunk + 10,000 bytes


# ---- the Mooncake store, against a stand-in client --------------------------------------------
class FakeCluster:
    """What a Mooncake cluster keeps: objects by key, shared by every client made from it."""

    def __init__(self):
        self.objects: dict[str, bytes] = {}
        self.put_rc = 0
        self.clients = 0
        self.dead: set[str] = set()         # keys whose replica read from sits on a dead node
        cluster = self

        class Client:
            def setup(self, local, metadata, segment, buf, proto, device, master):
                cluster.clients += 1
                self.name = f"{local}:{12000 + cluster.clients}"
                return 0

            def register_buffer(self, addr, size):
                return 0

            def unregister_buffer(self, addr):
                return 0

            def get_hostname(self):
                return self.name

            def health_check(self):
                return 0

            def get_size(self, key):
                return len(cluster.objects[key]) if key in cluster.objects else -704

            def get_into(self, key, addr, size):
                obj = cluster.objects.get(key)
                if obj is None:
                    return -704
                if key in cluster.dead:
                    return -800                     # TRANSFER_FAIL
                ctypes.memmove(addr, obj, len(obj))
                return len(obj)

            def put_from(self, key, addr, size, config):
                if cluster.put_rc:
                    return cluster.put_rc
                cluster.objects.setdefault(key, ctypes.string_at(addr, size))
                return 0

            def close(self):
                return 0

        self.module = SimpleNamespace(MooncakeDistributedStore=Client,
                                      ReplicateConfig=lambda: SimpleNamespace())


class FakeMaster:
    """A TCP listener standing for the master's RPC and metadata ports."""

    async def start(self, port: int = 0) -> int:
        self.server = await asyncio.start_server(lambda r, w: w.close(), "127.0.0.1", port)
        self.port = self.server.sockets[0].getsockname()[1]
        return self.port

    async def stop(self) -> None:
        self.server.close()
        await self.server.wait_closed()


def _store(cluster, master) -> MooncakeStore:
    store = MooncakeStore(8 << 20, f"127.0.0.1:{master.port}",
                          metadata=f"http://127.0.0.1:{master.port}/metadata",
                          module=cluster.module)
    store.PROBE_INTERVAL = 0.05
    return store


def _with_pools(body, n=2):
    """``body(cluster, master, pools)``, pools: n (store, address, protocol) of pool nodes on
    Mooncake stores of one cluster."""
    async def run():
        cluster, master = FakeCluster(), FakeMaster()
        await master.start()
        async with contextlib.AsyncExitStack() as stack:
            pools = []
            for _ in range(n):
                store = _store(cluster, master)
                proto = await stack.enter_async_context(local_pool(0, store, ready_within=5))
                pools.append((store, proto.sock.getsockname(), proto))
            return await body(cluster, master, pools)
    return asyncio.run(run())


def test_a_block_put_through_one_pool_node_is_served_by_another():
    data = os.urandom(200_000)

    async def body(cluster, master, pools):
        (a, a_addr, _), (b, b_addr, b_proto) = pools
        async with KVClient([a_addr], chunk_size=3072) as c:
            await c.put_block(5, KEY, data)
        assert list(cluster.objects) == [object_key(5, KEY)]     # one object per block
        async with KVClient([b_addr], chunk_size=3072) as c:
            got, stats = await c.get_block(5, KEY)
            again, _ = await c.get_block(5, KEY)
        return got, again, stats, b.counters, b_proto.stats()

    got, again, stats, counters, b_stats = _with_pools(body)
    assert got == data and again == data and stats.from_pool == stats.chunks == 66
    assert counters["fills"] == 1 and b_stats["staged_blocks"] == 1


def test_missing_blocks_nack_quickly_and_corrupt_ones_are_refused():
    chunks = [os.urandom(1000) for _ in range(3)]

    async def body(cluster, master, pools):
        _, addr, _ = pools[0]
        async with KVClient([addr], deadline=5) as c:
            t0 = time.monotonic()
            with pytest.raises(BlockNotFound):
                await c.get_block(1, KEY)
            missing_s = time.monotonic() - t0
            obj = bytearray(blockfmt.encode_block(1, KEY, chunks))
            obj[-1] ^= 0xFF                                      # last chunk's bytes
            cluster.objects[object_key(1, KEY)] = bytes(obj)
            with pytest.raises(Refused) as e:
                await c.get_block(1, KEY)
        return missing_s, e.value.status, pools[0][0].counters

    missing_s, status, counters = _with_pools(body, n=1)
    assert missing_s < 0.5 and status == Status.CHECKSUM and counters["corrupt_blocks"] == 1


def test_failed_writes_are_reported_and_not_kept():
    async def body(cluster, master, pools):
        store, addr, _ = pools[0]
        cluster.put_rc = -200
        async with KVClient([addr], chunk_size=1000, deadline=5) as c:
            with pytest.raises(Refused) as e:
                await c.put_block(1, KEY, os.urandom(5000))
        return e.value.status, len(store.staging), cluster.objects

    status, staged, objects = _with_pools(body, n=1)
    assert status == Status.NO_SPACE and staged == 0 and not objects


def test_a_read_meeting_a_dead_replica_is_refused_at_once_not_retried(caplog):
    data = os.urandom(20_000)

    async def body(cluster, master, pools):
        store, addr, _ = pools[0]
        async with KVClient([addr], chunk_size=1000, deadline=5) as c:
            await c.put_block(1, KEY, data)
            store.staging.remove(1, KEY)                       # not staged: read from Mooncake
            cluster.dead.add(object_key(1, KEY))
            t0 = time.monotonic()
            with pytest.raises(Refused) as e:
                await c.get_block(1, KEY)
            refused_s = time.monotonic() - t0
            cluster.dead.clear()                               # the master dropped the dead node
            back, _ = await c.get_block(1, KEY)
        return e.value.status, refused_s, back, store.counters

    status, refused_s, back, counters = _with_pools(body, n=1)
    assert status == UNAVAILABLE and refused_s < 0.5 and back == data
    assert counters["dead_replica_reads"] == 1 and counters["fills"] == 1
    lines = [r.getMessage() for r in caplog.records if r.name == "hostagent.mooncake"]
    assert sum("TRANSFER_FAIL" in m and "another pool node" in m for m in lines) == 1


def test_master_down_answers_at_once_and_the_node_recovers(caplog):
    data = os.urandom(50_000)

    async def until(cond, timeout=5):
        deadline = time.monotonic() + timeout
        while not cond():
            assert time.monotonic() < deadline
            await asyncio.sleep(0.02)

    async def body(cluster, master, pools):
        (a, a_addr, _), (b, b_addr, _) = pools
        async with KVClient([a_addr], chunk_size=1000, deadline=5) as ca, \
                KVClient([b_addr], chunk_size=1000, deadline=5) as cb:
            await ca.put_block(1, KEY, data)
            await master.stop()
            await until(lambda: not a.available and not b.available)
            staged, _ = await ca.get_block(1, KEY)               # a has it staged: served
            t0 = time.monotonic()
            with pytest.raises(Refused) as get_refused:          # b would have to fetch it
                await cb.get_block(1, KEY)
            with pytest.raises(Refused) as put_refused:
                await cb.put_block(1, bytes(16), data)
            refused_s = time.monotonic() - t0
            await master.start(master.port)
            await until(lambda: a.available and b.available)
            back, _ = await cb.get_block(1, KEY)
        return staged, back, get_refused.value.status, put_refused.value.status, refused_s

    staged, back, get_status, put_status, refused_s = _with_pools(body)
    assert staged == data and back == data
    assert get_status == put_status == UNAVAILABLE and refused_s < 1.0
    lines = [r.getMessage() for r in caplog.records if r.name == "hostagent.mooncake"]
    assert any("unreachable" in m and "serving staged blocks only" in m for m in lines)
    assert any("is back after" in m for m in lines)


# ---- command line -----------------------------------------------------------------------------
def test_mooncake_missing_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "mooncake", None)
    with pytest.raises(MooncakeMissing, match=r"make setup.*kvswitch\[mooncake\]"):
        load_mooncake()


@pytest.mark.parametrize("args, config, message", [
    (["--store", "mooncake"], None, "--store mooncake needs --mooncake-master HOST[:PORT]"),
    (["--mooncake-master", "10.0.0.1"], None, "--mooncake-master needs --store mooncake"),
    (["--replicas", "2"], None, "--replicas needs --store mooncake"),
    (["--store", "mooncake", "--mooncake-master", "10.0.0.1:99999"], None, "is not HOST[:PORT]"),
    (["--store", "mooncake", "--mooncake-master", "m", "--segment", "4KiB"], None,
     "a segment is at least 1MiB"),
    (["--replicas", "0"], None, "0 is not in the range"),
    ([], 'store = "disk"', "store: 'disk' is not one of"),
    ([], 'store = "mooncake"', "--store mooncake needs --mooncake-master"),
    ([], "bogus = 1", "unknown key 'bogus'"),
    ([], 'capacity = "lots"', "capacity: 'lots' is not a size"),
    (["--chunk-size", "1001"], None, "1001 is not a multiple of 8"),
    ([], "chunk_size = 1001", "1001 is not a multiple of 8"),
    (["--assembly-per-source", "0"], None, "--assembly-per-source: must be positive"),
    (["--incomplete-per-ns", "0"], None, "0 is not in the range"),
    (["--assembly-timeout", "inf"], None, "is not in the range"),
])
def test_serve_option_and_config_errors(tmp_path, args, config, message):
    if config is not None:
        (tmp_path / "pool.toml").write_text(config + "\n")
        args = [*args, "--config", str(tmp_path / "pool.toml")]
    r = subprocess.run(python_argv("hostagent", "serve", *args), capture_output=True, text=True,
                       timeout=60)
    lines = r.stderr.strip().splitlines()
    assert r.returncode != 0 and len(lines) == 1, r.stderr
    assert lines[0].startswith("hostagent: error:") and message in lines[0], lines[0]
