"""The storage tiers of issue #29 (the node DRAM tier's own rules: test_node_tier.py): a node
tier hit needs no network fetch, the pool disk tier (hostagent.pool.disk_tier:
blocks evicted from pool DRAM come back byte-exact through the server's GET path, survive a pool
process restart, a corrupt file is detected and dropped, a full or unwritable directory is one
log line and DRAM serving goes on) and the pool's eviction order (lru or value). Pure Python
with real pool servers and clients over loopback UDP; one e2e run of `hostagent serve
--disk-dir` in a testbed with XDP serving and the fetch engine."""
import asyncio
import logging
import os
import subprocess
import threading
import zlib

import numpy as np
import pytest

from hostagent.pool import blockfmt
from hostagent.common.transfer import BlockNotFound
from hostagent.inference.client import KVClient
from hostagent.pool.disk_tier import DiskTier, file_name
from hostagent.inference.node_tier import NodeTier, fetch
from hostagent.pool.store import MemoryStore
from kvproto import checksum
from testbed.lab.topology import python_argv

NS, CS, PAGE = 3, 1024, 4096


def key(i: int) -> bytes:
    return bytes([i]) * 16


def payload(n: int, seed: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


# ---- node DRAM tier ---------------------------------------------------------------------------
async def _with_pool(store, body):
    from conftest import local_pool      # here: this module also runs as a task in a testbed node
    async with local_pool(0, store) as proto:
        return await body(proto.sock.getsockname(), proto)


def test_a_node_tier_hit_needs_no_network_fetch():
    data = payload(20_000, 7)

    async def body(addr, proto):
        tier = NodeTier(1 << 20)
        async with KVClient([addr], chunk_size=CS, deadline=10) as c:
            await c.put_block(NS, key(1), data)
            first = await fetch(tier, c, NS, key(1))
            gets = proto.counters["rx_get"]
            with first, await fetch(tier, c, NS, key(1)) as again:
                assert proto.counters["rx_get"] == gets          # nothing went to the pool
                return first, again, gets

    first, again, gets = asyncio.run(_with_pool(MemoryStore(1 << 20), body))
    assert first.source == "fetch" and first.held and gets >= 20     # 20 chunks
    assert again.source == "node" and again.stats is None and again.data is first.data
    assert bytes(again.view) == data


# ---- pool disk tier ---------------------------------------------------------------------------
def _put(store, i: int, n: int = 3000) -> bytes:
    data = payload(n, i)
    chunks = [data[o:o + CS] for o in range(0, n, CS)]
    for c, chunk in enumerate(chunks):
        done = store.put_chunk(NS, key(i), c, len(chunks), chunk, checksum(chunk))
    assert done is True
    return data


def _disk_store(path, capacity=3 * PAGE, disk_bytes=1 << 20, **kw):
    return MemoryStore(capacity, disk=DiskTier(path, disk_bytes), **kw)


async def _get_all(addr, keys, chunk_size=CS):
    async with KVClient([addr], chunk_size=chunk_size, deadline=10) as c:
        return [(await c.get_block(NS, key(i)))[0] for i in keys]


def test_blocks_evicted_from_pool_dram_come_back_byte_exact_from_disk(tmp_path):
    store = _disk_store(tmp_path)
    blocks = {i: _put(store, i) for i in range(6)}                 # one page each, 3 fit
    store.disk.drain()                                             # written by a worker

    async def body(addr, proto):
        assert set(os.listdir(tmp_path)) == {file_name(NS, key(i)) for i in range(3)}
        got = await _get_all(addr, range(6))
        return got, proto.stats()

    got, stats = asyncio.run(_with_pool(store, body))
    assert got == [blocks[i] for i in range(6)]
    # 0-2 staged back from disk push 3-5 out (to disk), which come back from it in turn
    assert stats["disk_staged"] == 6 and stats["disk_writes"] == 6
    assert stats["disk_corrupt"] == 0 and stats["disk_ok"] == 1


def test_writes_land_in_the_background_and_a_pending_block_is_served_from_its_copy(tmp_path):
    disk = DiskTier(tmp_path, 1 << 20)
    objs = {i: blockfmt.encode_block(NS, key(i), [payload(3000, i)]) for i in range(3)}
    assert disk.write(NS, key(0), objs[0])
    disk.drain()
    gate = threading.Event()
    disk._writer.submit(gate.wait)                   # the writer is busy for now
    try:
        buf = bytearray(objs[1])
        assert disk.write(NS, key(1), memoryview(buf)) and disk.write(NS, key(2), objs[2])
        buf[:] = bytes(len(buf))                      # the caller's buffer is free at once
        assert disk.stats()["disk_pending"] == 2 and disk.size(NS, key(1)) == len(objs[1])
        out = bytearray(len(objs[1]))
        layout, crcs = disk.read_into(NS, key(1), out)
        assert bytes(out) == objs[1] and layout.nchunks == 1
        assert disk.remove(NS, key(1))               # removed before it landed
    finally:
        gate.set()
    disk.drain()
    assert sorted(os.listdir(tmp_path)) == sorted(file_name(NS, key(i)) for i in (0, 2))
    assert disk.used == len(objs[0]) + len(objs[2]) and disk.pending_bytes == 0
    disk.close()


def test_the_disk_tier_survives_a_pool_process_restart(tmp_path):
    """Blocks on disk are served by a new pool process (a real `hostagent serve`) started on
    the same directory, byte-exact, and an oversized tier keeps only its newest blocks; the
    blocks only in DRAM go to disk at a clean stop, but not when the process is killed."""
    first = _disk_store(tmp_path, capacity=2 * PAGE)
    blocks = {i: _put(first, i) for i in range(5)}                 # 0, 1, 2 go to disk
    assert len(first.disk) == 3
    asyncio.run(first.close())                                     # 3, 4 at the clean stop
    assert len(first.disk) == 5
    port = 20000 + os.getpid() % 20000
    proc = subprocess.Popen(python_argv("hostagent", "serve", "--bind", "127.0.0.1",
                                        "--port", str(port), "--capacity", "64KiB",
                                        "--disk-dir", str(tmp_path), "--disk-bytes", "1MiB"),
                            stderr=subprocess.PIPE, text=True, env={**os.environ,
                                                                    "HOSTAGENT_XDP_SERVE": "0"})
    try:
        for line in proc.stderr:
            if "ready" in line or "error" in line:
                break
        assert "ready" in line and "disk tier" in line, line

        got = asyncio.run(_get_all(("127.0.0.1", port), range(5)))
        assert got == [blocks[i] for i in range(5)]
        _put_by_client(("127.0.0.1", port), 9, blocks)             # only in its DRAM
    finally:
        proc.kill()                                                # no clean stop
        proc.wait(10)
    assert (NS, key(9)) not in DiskTier(tmp_path, 1 << 20)
    small = DiskTier(tmp_path, 2 * 4 * CS)             # room for two 4 KiB objects: oldest go
    assert len(small) == 2 and small.stats()["disk_dropped"] == 3


def _put_by_client(addr, i, blocks):
    async def go():
        async with KVClient([addr], chunk_size=CS, deadline=10) as c:
            await c.put_block(NS, key(i), payload(3000, i))
    asyncio.run(go())
    blocks[i] = payload(3000, i)


def test_a_corrupt_file_is_detected_and_dropped(tmp_path, caplog):
    store = _disk_store(tmp_path)
    blocks = {i: _put(store, i) for i in range(5)}                 # 0 and 1 on disk
    store.disk.drain()
    f0, f1 = tmp_path / file_name(NS, key(0)), tmp_path / file_name(NS, key(1))
    raw = bytearray(f0.read_bytes())
    raw[-10] ^= 0x40                                               # a payload byte
    f0.write_bytes(raw)
    caplog.set_level(logging.WARNING, "hostagent.disk")

    async def body(addr, proto):
        with pytest.raises(BlockNotFound):
            await _get_all(addr, [0])
        return await _get_all(addr, [1]), proto.stats()

    got, stats = asyncio.run(_with_pool(store, body))
    assert got == [blocks[1]] and stats["disk_corrupt"] == 1 and not f0.exists()
    lines = [r.getMessage() for r in caplog.records if "corrupt" in r.getMessage()]
    assert len(lines) == 1 and file_name(NS, key(0)) in lines[0] and "CRC" in lines[0]
    # at start: a header that does not check out (or names another block) is dropped too
    head = bytearray(f1.read_bytes())
    head[20] ^= 1
    f1.write_bytes(head)
    (tmp_path / file_name(NS, key(7))).write_bytes(f1.read_bytes()[:100])
    (tmp_path / ".tmp.1.x.kvb").write_bytes(b"half")
    caplog.clear()
    again = DiskTier(tmp_path, 1 << 20)     # 2 went to disk when 1 was staged back, 3 and 4
    left = [2, 3, 4]                        # at the stop; 1 was there already
    assert sorted(again.index) == [(NS, key(i)) for i in left]
    assert again.stats()["disk_corrupt"] == 2
    assert sorted(os.listdir(tmp_path)) == [file_name(NS, key(i)) for i in left]
    assert len([r for r in caplog.records if "corrupt" in r.getMessage()]) == 2


def _mount_tmpfs(where, *opts):
    where.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", ",".join(("size=64k",) + opts), "tmpfs",
                        str(where)], capture_output=True, text=True)
    if r.returncode:
        pytest.fail(f"cannot mount a tmpfs for the test (needs root and mount(8)): {r.stderr}")


@pytest.mark.parametrize("kind", ["full", "unwritable"])
def test_a_full_or_unwritable_disk_is_one_log_line_and_dram_serving_goes_on(tmp_path, caplog,
                                                                            kind):
    where = tmp_path / "disk"
    _mount_tmpfs(where, *(("ro",) if kind == "unwritable" else ()))
    try:
        caplog.set_level(logging.WARNING, "hostagent.disk")
        store = _disk_store(where, capacity=3 * 7 * PAGE, disk_bytes=1 << 30)   # > the tmpfs
        blocks = {i: _put(store, i, 24 * CS) for i in range(40)}   # 25 KiB objects, 7 pages
        store.disk.drain()

        async def body(addr, proto):
            return await _get_all(addr, [37, 38, 39]), proto.stats()

        got, stats = asyncio.run(_with_pool(store, body))
        assert got == [blocks[i] for i in (37, 38, 39)]           # DRAM still serves
        assert stats["disk_write_errors"] > 1 and stats["disk_ok"] == 0
        assert stats["disk_writes"] == (2 if kind == "full" else 0)   # 2 x 25 KiB fit 64 KiB
        lines = [r.getMessage() for r in caplog.records if r.name == "hostagent.disk"]
        why = "disk full" if kind == "full" else "Read-only file system"
        assert len(lines) == 1 and why in lines[0] and "keeps serving from DRAM" in lines[0]
        assert not [n for n in os.listdir(where) if n.startswith(".tmp")]
    finally:
        subprocess.run(["umount", str(where)], check=True)


def test_with_mooncake_the_pool_nodes_own_disk_tier_keeps_what_the_cluster_dropped(tmp_path):
    """--store mooncake: blocks leaving the node's staging DRAM go to its disk tier; one the
    cluster has since evicted, and any while the master is down, is served from there."""
    from hostagent.common.transfer import Refused
    from hostagent.pool.mooncake_store import MooncakeStore
    from hostagent.pool.store import UNAVAILABLE
    from test_pool_store import FakeCluster, FakeMaster

    async def run():
        cluster, master = FakeCluster(), FakeMaster()
        await master.start()
        store = MooncakeStore(3 * PAGE, f"127.0.0.1:{master.port}",
                              metadata=f"http://127.0.0.1:{master.port}/metadata",
                              module=cluster.module, disk=DiskTier(tmp_path, 1 << 20))
        store.PROBE_INTERVAL = 0.05

        async def body(addr, proto):
            data = {i: payload(3000, i) for i in range(6)}
            async with KVClient([addr], chunk_size=CS, deadline=5) as c:
                for i in range(6):
                    await c.put_block(NS, key(i), data[i])
                assert len(store.disk) == 3 and len(cluster.objects) == 6
                for i in range(3):                  # Mooncake evicted them: gone but on disk
                    del cluster.objects[blockfmt.object_key(NS, key(i))]
                back = [(await c.get_block(NS, key(i)))[0] for i in range(3)]
                await master.stop()
                while store.available:
                    await asyncio.sleep(0.02)
                down = (await c.get_block(NS, key(0)))[0]      # staged: served
                store.staging.remove(NS, key(1))
                from_disk = (await c.get_block(NS, key(1)))[0]  # on disk: served
                with pytest.raises(Refused) as refused:         # neither: UNAVAILABLE
                    await c.get_block(NS, key(9))
            return ([data[i] for i in range(3)], back, data[0], down, data[1], from_disk,
                    refused.value.status, proto.stats())

        try:
            return await _with_pool(store, body)
        finally:
            await master.stop() if master.server.is_serving() else None

    want, back, d0, down, d1, from_disk, status, stats = asyncio.run(run())
    assert back == want and down == d0 and from_disk == d1 and status == UNAVAILABLE
    assert stats["disk_staged"] == 4 and stats.get("fills", 0) == 0


def test_pool_dram_gives_way_by_value_and_the_policy_decides_what_goes_to_disk(tmp_path):
    values = {i: float(10 - i) for i in range(10)}                 # older blocks worth more
    store = _disk_store(tmp_path, evict="value", value_fn=lambda ns, k, n: values[k[0]],
                        demote_fn=lambda ns, k, n: values[k[0]] > 7)
    for i in range(5):
        _put(store, i)
    store.disk.drain()
    # by value the lowest-valued block leaves: 2 (for 3; worth more than 7: to disk), then 3
    # (for 4; worth 7: dropped)
    assert sorted(k[0] for _, k in store.staging.blocks) == [0, 1, 4]
    assert list(store.disk.index) == [(NS, key(2))] and store.stats()["disk_not_demoted"] == 1
    store.set_policy("lru", demote_fn=None)
    _put(store, 5)
    assert (NS, key(0)) in store.disk                              # LRU again: the oldest
    store.disk.drain()
    assert (NS, key(0)) in store.disk.index
    with pytest.raises(ValueError):
        store.set_policy("value")
    asyncio.run(store.close())


def test_the_policy_hears_of_every_fetch_the_pool_process_sees(tmp_path):
    store = _disk_store(tmp_path)
    blocks = {i: _put(store, i) for i in range(4)}               # 0 on disk, 1-3 in DRAM
    seen = []
    store.on_get = lambda ns, k: seen.append(k[0])

    async def body(addr, proto):
        return await _get_all(addr, [3, 0, 3])

    assert asyncio.run(_with_pool(store, body)) == [blocks[3], blocks[0], blocks[3]]
    fetches = [k for i, k in enumerate(seen) if not i or seen[i - 1] != k]
    assert fetches == [3, 0, 3]         # chunk 0 of each fetch (and of a GET sent again)


def test_serve_disk_options_refuse_bad_values(tmp_path):
    (tmp_path / "file").write_text("x")
    for args, message in (
            (["--disk-bytes", "1MiB"], "--disk-bytes needs --disk-dir"),
            (["--disk-dir", str(tmp_path), "--disk-bytes", "0"], "--disk-bytes: must be positive"),
            (["--disk-dir", str(tmp_path), "--disk-bytes", "lots"], "is not a size"),
            (["--disk-dir", str(tmp_path / "file")], "is a file")):
        r = subprocess.run(python_argv("hostagent", "serve", *args), capture_output=True,
                           text=True, timeout=60)
        lines = r.stderr.strip().splitlines()
        assert r.returncode != 0 and len(lines) == 1, r.stderr
        assert lines[0].startswith("hostagent: error:") and message in lines[0], lines[0]
    (tmp_path / "pool.toml").write_text('disk_bytes = "1MiB"\n')     # the config file too
    r = subprocess.run(python_argv("hostagent", "serve", "--config", str(tmp_path / "pool.toml")),
                       capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "--disk-bytes needs --disk-dir" in r.stderr


# ---- e2e: hostagent serve --disk-dir, XDP serving, the fetch engine through a node tier ---------
def node_tier_probe(pool: str, ns: int, key_hex: str, chunk_size: int) -> dict:
    """Run in an inference node: fetch a block twice through a node tier (the fetch engine
    where it runs); what the second fetch was and whether it is the first one's memory."""
    from hostagent.inference.fetch import open_client

    async def go():
        tier = NodeTier(64 << 20)
        async with open_client([pool], chunk_size, arena_bytes=16 << 20) as c:
            first = await fetch(tier, c, ns, bytes.fromhex(key_hex))
            again = await fetch(tier, c, ns, bytes.fromhex(key_hex))
            a, b = np.asarray(first.view), np.asarray(again.view)
            out = {"first": first.source, "again": again.source, "same": again.data is first.data,
                   "same_memory": bool(np.shares_memory(a, b)), "engine": type(c).__name__,
                   "sha": zlib.crc32(again.view), "stats": tier.stats()}
            first.release()
            again.release()
            tier.clear()
            return out

    return go()


@pytest.mark.e2e
def test_hostagent_serve_disk_tier_with_xdp_serving_restart_and_a_node_tier(tmp_path):
    from testbed.lab import Lab
    from testbed.lab.topology import namespaces_of
    prefix = f"td{os.getpid() % 100000}"
    cs, n = 3072, 3072 * 300 + 1000                               # ~0.9 MiB blocks
    with Lab(prefix, hosts=1, pools=1, switch=False, chunk_size=cs, pool_capacity="4MiB",
             pool_args=("--disk-dir", str(tmp_path), "--disk-bytes", "64MiB")) as lab:
        assert "answered by XDP on eth0" in lab.pool_log(0)
        keys = [os.urandom(16) for _ in range(8)]                  # 4 fit in DRAM
        blocks = {k: os.urandom(n) for k in keys}
        for k in keys:
            lab.put("h1", NS, k, blocks[k])
        c = lab.pool_counters()
        assert c["disk_writes"] + c["disk_pending"] >= 4 and c["evicted_blocks"] >= 4
        for k in keys[:3]:                                         # from disk, then from XDP
            for _ in range(2):
                stats, data = lab.get("h1", NS, k)
                assert data == blocks[k]
        c = lab.pool_counters()
        assert c["disk_staged"] >= 3 and c["xdp_hit"] > 0
        lab.stop_pool(0)                                           # restart: disk survives
        lab.start_pool(0)
        for k in keys[:3]:
            stats, data = lab.get("h1", NS, k)
            assert data == blocks[k]
        assert lab.pool_counters()["disk_staged"] == 3
        probe = lab.task("h1", "tests.test_tiers_store:node_tier_probe", lab.pool_addrs[0], NS,
                         keys[0].hex(), cs)
        assert probe["engine"] == "AsyncFetchClient", probe          # the XDP fetch engine
        assert probe["first"] == "fetch" and probe["again"] == "node"
        assert probe["same"] and probe["same_memory"], probe
        assert probe["sha"] == zlib.crc32(blocks[keys[0]])
        assert probe["stats"]["hits"] == 1 and probe["stats"]["misses"] == 1
    assert not namespaces_of(prefix)
