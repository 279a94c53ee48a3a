"""Held chunks over shaped links, end to end (issue 25): readers whose GETs the switch holds
behind an outstanding miss get the replicated replies without asking again, and the pool node
sends the block about once. The pool's link is slower than the readers' (10 vs 100 Mbit/s), so
its replies queue longer than switchd's pending timeout (50 ms): before the fix such rounds
expired, the GETs held in them were never answered, and readers recovered by timeouts."""
import os

import pytest

from conftest import leaves_no_namespaces
from testbed.lab import Lab

pytestmark = pytest.mark.e2e

NS = 9
CHUNK = 3072
CHUNKS = 320                       # ~0.94 MiB: 0.8 s over the pool's 10 Mbit/s link
READERS = 4


def test_held_gets_are_answered_without_retransmissions():
    key, block = os.urandom(16), os.urandom(CHUNKS * CHUNK)
    with leaves_no_namespaces(f"hd{os.getpid() % 100000}") as prefix, \
            Lab(prefix, hosts=READERS, pools=1, chunk_size=CHUNK, link_gbit=0.1,
                pool_link_gbit=0.01) as lab:
        lab.put("h1", NS, key, block)
        lab.switchd("cache", "admit", "--ns", str(NS), "--key", key.hex())
        before, gets = lab.stats(), lab.pool_counters().get("rx_get", 0)
        results = lab.get_many([f"h{i}" for i in range(1, READERS + 1)], NS, key,
                               start_delay=3.0 + 0.5 * READERS)
        after, upstream = lab.stats(), lab.pool_counters()["rx_get"] - gets
    moved = {k: after[k] - before[k] for k in after if after[k] != before[k]}
    assert all(data == block for _, data in results), "every reader byte-exact"
    stats = [r for r, _ in results]
    assert [r["from_pool"] + r["replicas"] + r["from_switch"] for r in stats] == \
        [CHUNKS] * READERS
    retransmits = sum(r["retransmits"] for r in stats)
    # held chunks are answered: before the fix 795 of 1,280 chunks (62 %) were asked again. A
    # reader's first timeout was once ~1 ms when two hits came back before the route had a
    # delivery rate: 16 held chunks asked again (82 in a CI run); now 0 in 12 runs beside three
    # busy loops (issue 25's goal is <= 2 %)
    assert retransmits <= 0.05 * READERS * CHUNKS, (retransmits, stats, moved)
    assert moved.get("coalesced", 0) > 0 and moved.get("replicas", 0) > 0, moved
    # the pool node is asked for the block about once, however many read it
    assert upstream <= 1.05 * CHUNKS, (upstream, moved)
