"""A chunk queued behind other transfers' chunks is not presumed lost while those still come
back (hostagent.inference.fetch.transfers): every route's replies share the engine's interface
and the link queues behind it, so a transfer asked behind a window of another route's chunks
hears nothing for as long as they take. Its timeout waits until what was in flight ahead of
the ask settled (answered or presumed lost) and a margin more, or until all of it settled and
the interface paused. Before, a fresh engine's first fetch of 32 blocks from two pool nodes
over one idle 25 Mbit/s link asked again 59-79 of its 160 chunks. Pure Python: the send ring
over a plain array, no BPF."""
from types import SimpleNamespace

import numpy as np
import pytest

from hostagent.inference.fetch.sendring import SendRing
from hostagent.inference.fetch.transfers import (REORDER_ASKS, Interface, Route, Transfer,
                                                 fill)

NOW = 100.0
RTO = 0.05                     # seconds: the waiting transfer's retransmission timeout
BW = 1000.0                    # chunks/s a route delivers: a 25 Mbit/s link's 3 KiB chunks
AHEAD = 64                     # the other route's chunks asked first


def scene() -> tuple[Transfer, SendRing, Interface]:
    """Two pool nodes behind one interface: a transfer of ``AHEAD`` chunks from the first,
    then one of 4 from the second, all asked ``2 * RTO`` ago; nothing of the second came back
    since (its chunks queue behind the first's)."""
    iface = Interface()
    first, second = (Route(i, (f"198.18.0.{101 + i}", 19286), 64, iface) for i in range(2))
    ahead = Transfer(first, 1, bytes(16), AHEAD, False, 30.0)
    behind = Transfer(second, 1, bytes(range(16)), 4, False, 30.0)
    for i, t in enumerate((ahead, behind)):
        t.idx, t.gen, t.base = i, 1, i * AHEAD
        t.route.bw, t.route.cwnd = BW, float(AHEAD)   # the first route's whole window out
    ring = SendRing(SimpleNamespace(), None, 1024)
    meta = np.zeros(2 * AHEAD, np.uint64)
    asked = NOW - 2 * RTO
    fill([ahead, behind], ring, meta, asked, burst=1024, tail_wait=0.0002, max_ahead=1024)
    ring.pos_time[:ring.prod], ring.done_time[:ring.prod], ring.cons = asked, asked, ring.prod
    behind.rtt.rto, behind.last_delivery = RTO, asked
    behind.seen_received = 1
    return behind, ring, iface


def presumed_lost(t: Transfer, ring: SendRing, settled: int, idle: float) -> list[int]:
    """What the next scan asks again of ``t`` once the interface settled ``settled`` asks
    since and its last delivery was ``idle`` seconds ago."""
    t.route.iface.settled += settled
    t.route.iface.last_delivery = NOW - idle
    before = ring.prod
    fill([t], ring, np.zeros(2 * AHEAD, np.uint64), NOW, burst=1024, tail_wait=0.0002,
         max_ahead=1024)
    return [int(e) & 0xFFFFFFFF for e in ring.entries[before:ring.prod]]


def test_the_asks_record_what_was_in_flight_ahead_of_them():
    t, _, iface = scene()
    assert list(t.ahead) == [AHEAD, AHEAD + 1, AHEAD + 2, AHEAD + 3]
    assert list(t.asked_at) == [iface.settled] * 4


@pytest.mark.parametrize("settled", [0, AHEAD // 2, AHEAD - 1])
def test_no_timeout_while_what_was_ahead_still_comes_back(settled):
    # older than its timeout, and its own transfer quiet as long: it is waiting its turn
    t, ring, _ = scene()
    assert presumed_lost(t, ring, settled, idle=0.001) == []


def test_all_that_was_ahead_and_a_margin_more_settled_it_times_out():
    t, ring, _ = scene()
    margin = (AHEAD + 3) // 4 + REORDER_ASKS + 3          # the last chunk's
    assert presumed_lost(t, ring, AHEAD + margin, idle=0.001) == [0, 1, 2, 3]


def test_within_the_margin_another_route_may_still_overtake():
    t, ring, _ = scene()
    assert presumed_lost(t, ring, AHEAD + 3, idle=0.001) == []


def test_all_that_was_ahead_settled_and_the_interface_paused_it_times_out():
    # the last asks of a fetch: nothing comes after them to fill the margin
    t, ring, _ = scene()
    pause = 8 / BW                                         # eight deliveries' gaps
    assert presumed_lost(t, ring, AHEAD + 3, idle=2 * pause) == [0, 1, 2, 3]


def test_an_interface_quiet_for_the_timeout_times_out_whatever_was_ahead():
    # what was ahead was lost too and not presumed so yet: the timer still runs
    t, ring, _ = scene()
    assert presumed_lost(t, ring, 0, idle=2 * RTO) == [0, 1, 2, 3]


def test_asks_presumed_lost_settle_for_those_behind_them():
    t, ring, iface = scene()
    before = iface.settled
    assert presumed_lost(t, ring, AHEAD + 3, idle=1.0) == [0, 1, 2, 3]
    assert iface.settled == before + AHEAD + 3 + 4
