"""Pool nodes on a real Mooncake Store cluster, end to end on a veth testbed: a mooncake_master
the lab starts in a namespace of its own, three pool nodes (``hostagent serve --store mooncake
--replicas 2``), an inference node driving them with the hostagent CLI. A block put through one
pool node is fetched byte-exact through another; a block survives kill -9 of the node that wrote
it; a restarted pool process serves what the cluster holds; a missing block is a quick NACK; a
master that is down is a clear error for clients by their deadline and a log line on the pool
nodes, which recover when it returns. The tests run in order on one testbed (the last one
restarts the master, which loses every object). Without Mooncake installed they fail and say
how to install it. Some waits are Mooncake's: a killed node's replicas stay listed for its client
TTL (10 s)."""
import os
import signal
import time

import pytest

from conftest import leaves_no_namespaces, need_mooncake
from hostagent.pool.store import UNAVAILABLE
from kvproto import Status
from testbed.lab import Lab
from testbed.lab.topology import TestbedError as LabError

pytestmark = pytest.mark.e2e

NS = 3
CHUNK = 3072


@pytest.fixture(scope="module")
def lab():
    need_mooncake()
    with leaves_no_namespaces(f"mc{os.getpid() % 100000}") as prefix, \
            Lab(prefix, hosts=1, pools=3, switch=False, chunk_size=CHUNK, store="mooncake",
                replicas=2, segment="128MiB", pool_capacity="64MiB") as running:
        yield running


def _block(size: int = 300_000) -> tuple[bytes, bytes]:
    return os.urandom(16), os.urandom(size)


def _refused(lab, what, *args, **kw) -> tuple[str, float]:
    t0 = time.monotonic()
    with pytest.raises(LabError) as e:
        what(*args, **kw)
    return str(e.value).splitlines()[-1], time.monotonic() - t0


def test_a_block_put_through_p1_is_fetched_through_p2_and_p3(lab):
    key, block = _block()
    assert lab.put("h1", NS, key, block, pool="p1")["chunks"] == 98
    for pool in ("p2", "p3"):
        stats, data = lab.get("h1", NS, key, pool=pool)
        assert data == block and stats["from_pool"] == 98
    stats, data = lab.get("h1", NS, key, pool="p2")              # now from p2's staging
    assert data == block
    assert lab.pool_counters(1)["fills"] == 1 and lab.pool_counters(0)["writes"] >= 1


def test_a_missing_block_is_a_quick_nack(lab):
    message, seconds = _refused(lab, lab.get, "h1", NS, os.urandom(16), pool="p2")
    assert "NOT_FOUND" in message
    assert seconds < 3.0                   # mostly the CLI's own start-up


def test_replicas_survive_kill_9_and_a_restarted_pool_serves_the_cluster(lab):
    blocks = dict(_block(200_000) for _ in range(4))
    for key, block in blocks.items():
        lab.put("h1", NS, key, block, pool="p1")                 # first copy in p1's segment
    lab.stop_pool(0, signal.SIGKILL)
    t0 = time.monotonic()
    for key, block in blocks.items():                            # the other copy answers
        assert lab.get("h1", NS, key, pool="p2")[1] == block
    survived_s = time.monotonic() - t0
    assert survived_s < 30                 # at most Mooncake's client TTL of waiting
    lab.start_pool(0)                      # a new p1 process: an empty staging area
    for key, block in blocks.items():
        assert lab.get("h1", NS, key, pool="p1")[1] == block
    assert lab.pool_counters(0)["fills"] == len(blocks)


def test_master_down_is_a_clear_error_and_the_pool_nodes_recover(lab):
    key, block = _block()
    lab.put("h1", NS, key, block, pool="p1")
    lab.stop_pool(2)                                             # p3 will start while it is down
    lab.master.stop(signal.SIGKILL)
    for i in (0, 1):
        lab.await_pool_log(i, "unreachable", timeout=10)
    assert lab.get("h1", NS, key, pool="p1")[1] == block        # staged on p1: still served
    name = Status(UNAVAILABLE).name
    # hostagent get asks again while refused UNAVAILABLE, until its deadline (a dead replica
    # stays listed for the master's client TTL); a master that stays down ends it, clearly
    message, seconds = _refused(lab, lab.get, "h1", NS, key, "--deadline", "1", pool="p2")
    assert f"refused with {name}" in message and seconds < 3.0
    message, seconds = _refused(lab, lab.put, "h1", NS, os.urandom(16), block, pool="p1")
    assert f"PUT of chunk 0: refused with {name}" in message and seconds < 3.0
    lab.start_pool(2, wait=False)
    assert "unreachable" in lab.await_pool_log(2, "unreachable", timeout=10)

    lab.master.start()                     # a new master: it has lost every object
    lab.await_pool_log(2, "ready", timeout=30)
    for i in (0, 1):
        lab.await_pool_log(i, "is back after", timeout=30)
    key2, block2 = _block()
    lab.put("h1", NS, key2, block2, pool="p1")
    assert lab.get("h1", NS, key2, pool="p3")[1] == block2
    assert "NOT_FOUND" in _refused(lab, lab.get, "h1", NS, key, pool="p3")[0]
