"""The switch's data plane on scratch ports, for the XDP tier's tests (tests/test_xdp.py,
tests/test_xdp_ports.py, tests/test_slots.py, tests/test_popularity.py): veth pairs in a
namespace of the tests' own, the programs and private maps loaded once per module, a cache
emptied for each test, and frames run through BPF_PROG_TEST_RUN as if received on a port."""
import pytest

from switchd.cache import Cache
from switchd.dataplane import ROLE_POOL, DataPlane, Deployment
from xdp.libbpf import xdp_test_run
from testbed.lab.topology import scratch_ports

HOST2_IP = "198.18.0.2"         # the second host port's node
PORTS = {}  # "host", "host2", "pool" -> ifindex of a veth end in the test's own namespace


@pytest.fixture(scope="module", autouse=True)
def ports_namespace():
    """Frames are run as if received on real ports: veth pairs in a namespace of our own."""
    with scratch_ports(("hostport", "poolport"), ("host2port", "spare"), prefix="kvbpf") as ends:
        PORTS.update({p: ends[f"{p}port"] for p in ("host", "host2", "pool")})
        yield


def dataplane(cache_entries: int) -> DataPlane:
    """The switch's programs and private maps, with the "pool" port a pool-node port."""
    dp = DataPlane(Deployment(chunk_size=1024, cache_entries=cache_entries, pin_dir=None))
    dp.ports[dp.ports.Key(PORTS["pool"])] = dp.ports.Leaf(role=ROLE_POOL)
    return dp


@pytest.fixture(scope="module")
def dp(ports_namespace):
    return dataplane(4096)


@pytest.fixture
def cache(dp):
    c = Cache(dp)
    c.flush()
    for table in (dp.admit, dp.pending, dp.waiters):
        table.clear()
    dp.set("coalesce", 0)
    dp.set("spec_fill", 0)
    return c


def run(dp, frame, port="host"):
    return xdp_test_run(dp.ingress.fd, bytes(frame), ifindex=PORTS[port])


def hold_slot(dp, cache, ns, key, chunk, held=True):
    """Stand for a writer holding a chunk's slot (its sequence word odd, kvslot.h), or letting it
    go: written with a syscall, as nothing else runs in a test."""
    idx = dp.cache.Key(cache.slot_of(ns, key, chunk))
    v = dp.cache[idx]
    v.seq += 1 if bool(v.seq & 1) != held else 0
    dp.cache[idx] = v
