"""Failover through the XDP fetch engine on a veth testbed this module creates and always removes
(two pool nodes behind the switch): `hostagent put --replicas 2` leaves the block on both, and
with the block's first holder cut off (the switch's port towards it down: nothing comes back,
while the reader's own link is up) a fetch moves on to the other after one silence (the engine
of old waited for its deadline), byte-exact; the silent node is then left out, so the next
block it holds costs no silence at all."""
import os
import random
import time

import pytest

from conftest import leaves_no_namespaces
from hostagent.common.pools import Placement
from hostagent.common.transfer import BlockNotFound, NoAnswer, Silent
from hostagent.inference.fetch import FetchEngine
from testbed.lab import Lab
from testbed.lab.topology import ip

pytestmark = pytest.mark.e2e

NS, CS = 5, 3072


@pytest.fixture(scope="module")
def lab():
    with leaves_no_namespaces(f"fo{os.getpid() % 100000}") as prefix, \
            Lab(prefix, hosts=1, pools=2, chunk_size=CS, pool_capacity="256MiB",
                switchd_args=("--policy", "off")) as running:
        yield running


def _blocks(lab, place: Placement, first: str, n: int, seed: int) -> list[tuple[bytes, bytes]]:
    """``n`` blocks whose first holder is pool node ``first``, put on both holders."""
    rng, out = random.Random(seed), []
    while len(out) < n:
        key = rng.randbytes(16)
        if place.read_order(NS, key)[0][0] == first:
            data = rng.randbytes(300_000)
            lab.put("h1", NS, key, data, replicas=2)
            out.append((key, data))
    return out


def test_replicas_put_on_both_and_read_from_either(lab):
    place = Placement(lab.pool_addrs, replicas=2)
    [(key, data)] = _blocks(lab, place, lab.pool_addrs[0], 1, seed=1)
    for pool in ("p1", "p2"):                      # each node alone serves it
        _, got = lab.get("h1", NS, key, "--no-cache", pool=pool)
        assert got == data, pool


def test_a_silent_holder_costs_one_silence_then_none(lab):
    place = Placement(lab.pool_addrs, replicas=2, silence_s=1.0)
    hung, live = lab.pool_addrs
    on_live = _blocks(lab, place, live, 1, seed=2)
    on_hung = _blocks(lab, place, hung, 2, seed=3)
    with FetchEngine(place, CS, netns=lab.topo.node("h1").netns, deadline=20) as e:
        first = e.get_block(NS, on_live[0][0])            # the engine is answered
        assert first.tobytes() == on_live[0][1]
        first.release()
        ip("link", "set", "p1", "down", ns=lab.topo.switch_ns)       # p1's cable out
        try:
            t0 = time.monotonic()
            b = e.get_block(NS, on_hung[0][0], no_cache=True)
            moved_after = time.monotonic() - t0
            assert b.tobytes() == on_hung[0][1] and b.stats.from_pool == b.nchunks
            b.release()
            assert e.stats.moved == 1 and not place.usable((hung, 19286))
            t0 = time.monotonic()
            b = e.get_block(NS, on_hung[1][0], no_cache=True)    # asked of the live one
            straight = time.monotonic() - t0
            assert b.tobytes() == on_hung[1][1]
            b.release()
        finally:
            ip("link", "set", "p1", "up", ns=lab.topo.switch_ns)
    assert 1.0 <= moved_after < 4.0, moved_after         # one silence, not a 20 s deadline
    assert straight < 0.5 and e.stats.moved == 1, straight


def test_a_left_out_or_suspect_holder_never_holds_a_read_to_the_deadline(lab):
    """A block the live holder lacks, its other holder cut off: while that one is left out the
    live holder's NOT_FOUND is the answer at once; past its back-off it is asked again, but as a
    suspect only for one silence, though it is the last holder left (the deadline is 20 s)."""
    place = Placement(lab.pool_addrs, replicas=2, silence_s=0.5, retry_s=0.3)
    hung, live = lab.pool_addrs
    [(known, data)] = _blocks(lab, place, live, 1, seed=4)
    rng = random.Random(5)
    nowhere = next(k for k in iter(lambda: rng.randbytes(16), None)
                   if place.read_order(NS, k)[0][0] == live)      # asked of the live one first
    with FetchEngine(place, CS, netns=lab.topo.node("h1").netns, deadline=20) as e:
        b = e.get_block(NS, known)                                # the engine is answered
        assert b.tobytes() == data
        b.release()
        ip("link", "set", "p1", "down", ns=lab.topo.switch_ns)
        try:
            place.failed((hung, 19286), "read", NoAnswer("its cable is out"))
            t0 = time.monotonic()
            with pytest.raises(BlockNotFound):
                e.get_block(NS, nowhere, no_cache=True)
            left_out = time.monotonic() - t0
            time.sleep(0.35)                                      # its back-off is over
            t0 = time.monotonic()
            with pytest.raises(Silent):
                e.get_block(NS, nowhere, no_cache=True)
            suspect = time.monotonic() - t0
        finally:
            ip("link", "set", "p1", "up", ns=lab.topo.switch_ns)
    assert left_out < 0.4, left_out
    assert 0.5 <= suspect < 3.0, suspect
    assert place._down[(hung, 19286)][1] == pytest.approx(0.6)    # silent again: doubled
