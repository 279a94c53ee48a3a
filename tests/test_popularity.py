"""Demand as the data plane records it and the daemon's policy step acts on it, driven by
crafted frames through BPF_PROG_TEST_RUN: the miss sketch, the candidates, admission, quotas."""
import pytest

from switchd.cache import Cache
from switchd.manager import CacheManager
from switchd.popularity import Popularity, sketch_x
from xdp_fixtures import get_frame, reply_frame
from xdp_switch import PORTS, dataplane, ports_namespace, run  # noqa: F401

pytestmark = pytest.mark.bpf

A, B = bytes.fromhex("aa" * 16), bytes.fromhex("bb" * 16)


@pytest.fixture(scope="module")
def loaded(ports_namespace):
    return dataplane(16)


@pytest.fixture
def dp(loaded):
    for table in (loaded.cache, loaded.blocks, loaded.admit, loaded.recent, loaded.ns_stats,
                  loaded.ns_low):
        table.clear()
    Popularity(loaded).read_sketch()  # zeroes it
    loaded.set("spec_fill", 0)
    return loaded


def miss(dp, key, chunk=0, ns=5, times=1):
    for _ in range(times):
        run(dp, get_frame(key=key, chunk=chunk, ns=ns))


def test_sketch_counts_one_miss_per_fetch_and_resets(dp):
    miss(dp, A, times=5)
    miss(dp, A, chunk=1, times=3)      # later chunks of a fetch are not extra demand
    miss(dp, B, times=2)
    pop = Popularity(dp)
    sketch = pop.read_sketch()
    assert sketch.estimate(sketch_x(5, A)) == 5 and sketch.estimate(sketch_x(5, B)) == 2
    assert sketch.estimate(sketch_x(6, A)) == 0, "the namespace is part of the hash"
    assert pop.read_sketch().estimate(sketch_x(5, A)) == 0, "reading resets the interval"
    assert pop.ns_counters()[5]["misses"] == 10
    recent = {(k.ns, bytes(k.key)) for k in dp.recent.keys()}
    assert recent == {(5, A), (5, B)}


def test_reply_tells_the_block_size(dp):
    miss(dp, A)
    run(dp, reply_frame(key=A, chunk=0), port="pool")   # reply_frame says nchunks=9
    assert [v.nchunks for v in dp.recent.values()] == [9]


def test_hot_block_is_admitted_then_learned(dp):
    manager = CacheManager(dp, "lru", fill_headroom=0)      # admitted first, learned after
    miss(dp, A, times=3)
    run(dp, reply_frame(key=A, chunk=0), port="pool")
    manager.step()
    assert Cache(dp).admit_entries() == {(5, A): (0, 0)}
    miss(dp, A, chunk=3)
    run(dp, reply_frame(key=A, chunk=3), port="pool")   # passing replies are now learned
    assert Cache(dp).get(5, A, 3) is not None
    assert manager.admissions == 1


def test_policy_evicts_to_stay_within_a_quota(dp):
    manager = CacheManager(dp, "lru", quotas={5: 9 * 1024}, fill_headroom=0)  # one 9-chunk block
    for key in (A, B):
        miss(dp, key, times=2)
        run(dp, reply_frame(key=key, chunk=0), port="pool")
        manager.step()
    admitted = Cache(dp).admit_entries()
    assert list(admitted) == [(5, B)] and manager.evictions == 1


def test_operator_pins_are_never_evicted(dp):
    cache = Cache(dp)
    cache.admit(5, A, pinned=True)
    manager = CacheManager(dp, "lru", quotas={5: 9 * 1024})
    miss(dp, B, times=4)
    run(dp, reply_frame(key=B, chunk=0), port="pool")
    manager.step()
    manager.step()
    assert (5, A) in cache.admit_entries()


def test_speculative_fills_are_kept_or_evicted_by_the_policy(dp):
    cache = Cache(dp)
    cache.admit(5, A, pinned=True)               # namespace 5 has no room left for B's 9 chunks
    manager = CacheManager(dp, "lru", quotas={5: 9 * 1024}, fill_headroom=2)
    manager.step()
    claimed = manager.loop.claimed
    assert dp.get("spec_fill") == 16 - claimed, "what the policies have not claimed"
    for ns, nchunks in ((5, 9), (6, 4)):         # a first miss each, learned at once
        miss(dp, B, ns=ns)
        run(dp, reply_frame(key=B, chunk=0, ns=ns, nchunks=nchunks), port="pool")
        assert cache.get(ns, B, 0)[0].speculative
    manager.step()
    assert cache.get(6, B, 0) is not None and (6, B) in cache.admit_entries()   # kept
    assert cache.get(5, B, 0) is None and (5, B) not in cache.admit_entries()   # evicted
    assert manager.rejected == 1 and manager.admissions == 1
    assert dp.get("spec_fill") == 16 - claimed - 4


@pytest.mark.parametrize("ns", [0, 255, 256, 0xFFFFFFFF])   # array slots and the hash beyond
def test_namespace_counters_at_every_namespace(dp, ns):
    Cache(dp).put(ns, A, 1, b"x" * 100, nchunks=2)
    miss(dp, A, ns=ns, times=2)
    run(dp, get_frame(key=A, chunk=1, ns=ns))
    assert Popularity(dp).ns_counters()[ns] == {"hits": 1, "misses": 2, "hit_bytes": 100}
