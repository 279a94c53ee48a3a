"""When the fetch engine presumes a chunk lost (hostagent.inference.fetch.transfers): on a
transfer the switch answers from its cache within the sending call, a hole behind a later hit,
in a call that ended before the engine last looked, is asked again at once for the first
``FAST_TRIES`` asks, and after a growing wait beyond them; once a reply of the transfer came on
the pool's path (the switch forwards its misses, so a hole may be a miss it holds), or while
most of the chunks asked are missing, the tail rule stops at ``FAST_TRIES`` asks (the timeout
still applies) and keeps at most ``FAST_OUT`` asks out at once; and before a route has a
delivery rate the timeout is at least ``ACTIVE_FIRST_RTO``. Pure Python: the send ring over a
plain array, no BPF."""
from types import SimpleNamespace

import numpy as np
import pytest

from hostagent.inference.fetch.program import SENDQ
from hostagent.inference.fetch.sendring import SendRing
from hostagent.inference.fetch.transfers import (ACTIVE_FIRST_RTO, FAST_OUT, FAST_TRIES,
                                                 TIMEOUT_BATCH, Route, Transfer, fill)

KEY = bytes(range(16))
NOW = 100.0
TAIL_WAIT = 0.0002


def lossy_round(tries: int, n: int = 4, hits: tuple[int, ...] = (0, 2, 3),
                bw: float = 300_000.0) -> tuple[Transfer, SendRing]:
    """``n`` chunks asked in one call that ended 10 us ago; chunks ``hits`` came back from the
    switch's cache and were verified 5 us ago, the others (asked ``tries`` times) did not."""
    route = Route(0, ("198.18.0.101", 19286), 64)
    route.bw, route.min_rtt, route.base_rtt = bw, 0.0003, 0.0003
    t = Transfer(route, 1, KEY, n, False, 30.0)
    t.idx, t.gen, t.base = 0, 1, 0
    t.rtt.srtt, t.rtt.late = 0.0003, 0.0                 # answered within the call
    t.seen_received, t.switched = len(hits), True
    ring = SendRing(SimpleNamespace(), None, 1024)
    ring.prod = ring.cons = n
    ring.pos_time[:n], ring.done_time[:n] = NOW - 20e-6, NOW - 10e-6
    t.sent_seq[:], t.sent_t[:], t.tries[:] = np.arange(n), NOW - 20e-6, tries
    t.verified[list(hits)] = True
    t.tries[list(hits)] = 1
    t.nverified, t.next_new, t.max_hit_seq = len(hits), n, max(hits)
    t.lo = int(np.argmin(t.verified))
    t.looked = t.last_delivery = NOW - 5e-6
    t.ahead[:] = np.arange(n)                            # each ask behind the ones before it
    route.iface.settled, route.iface.last_delivery = len(hits), t.last_delivery
    return t, ring


def retransmitted(t: Transfer, ring: SendRing, now: float) -> list[int]:
    before = ring.prod
    fill([t], ring, np.zeros(t.nchunks, np.uint64), now, burst=1024, tail_wait=TAIL_WAIT,
         max_ahead=1024)
    asked = [int(e) & 0xFFFFFFFF for e in ring.entries[before:ring.prod]]
    seqs = np.arange(ring.cons, ring.prod) % SENDQ        # sent in a call that ended at once
    ring.pos_time[seqs], ring.done_time[seqs], ring.cons = now, now, ring.prod
    return asked


@pytest.mark.parametrize("tries", range(1, FAST_TRIES + 1))
def test_a_hole_behind_a_later_hit_is_asked_again_at_the_next_look(tries):
    t, ring = lossy_round(tries)
    assert retransmitted(t, ring, NOW) == [1]
    assert t.tries[1] == tries + 1 and t.stats.retransmits == 1


def test_past_the_fast_tries_a_hole_waits_for_the_backed_off_tail_wait():
    tries = FAST_TRIES + 1
    t, ring = lossy_round(tries)
    assert retransmitted(t, ring, NOW) == []
    wait = TAIL_WAIT * 2.0 ** (tries - 1)                # HIT_BACKOFF per try
    t.next_scan = 0.0
    assert retransmitted(t, ring, NOW - 10e-6 + wait * 1.1) == [1]


def test_where_misses_go_to_the_pool_a_hole_past_the_fast_tries_waits_for_the_timeout():
    t, ring = lossy_round(FAST_TRIES + 1)
    t.pool_path, t.rtt.rto = True, 0.002
    backoff = 2.0 ** FAST_TRIES                          # per try, past the first
    for later in (0.0, 0.001, 0.002 * backoff * 0.9):    # replies kept coming until NOW
        t.next_scan = 0.0
        assert retransmitted(t, ring, NOW + later) == [], later
    t.next_scan = 0.0
    assert retransmitted(t, ring, NOW + 0.002 * backoff * 1.1) == [1]


def test_where_misses_go_to_the_pool_at_most_fast_out_asks_again_are_out_at_once():
    n = 3 * FAST_OUT                # a block the switch is learning: its first chunks held
    t, ring = lossy_round(1, n=n, hits=(n - 1,))
    t.pool_path = True
    assert retransmitted(t, ring, NOW) == list(range(FAST_OUT))
    t.next_scan = 0.0
    assert retransmitted(t, ring, NOW + 0.0001) == []    # none of them back yet
    t.verified[:16] = True                               # 16 came back
    t.nverified, t.lo = 17, 16
    t.next_scan = 0.0
    assert retransmitted(t, ring, NOW + 0.0002) == list(range(FAST_OUT, FAST_OUT + 16))


def test_where_only_hits_came_back_every_hole_is_asked_again_at_once():
    n = 8 * FAST_OUT                # loss on the hit path: a quarter of the chunks
    holes = list(range(0, n, 4))
    t, ring = lossy_round(1, n=n, hits=tuple(sorted(set(range(n)) - set(holes))))
    assert retransmitted(t, ring, NOW) == holes


def test_where_most_of_the_asked_chunks_are_missing_they_are_taken_for_held():
    """Before any reply on the pool's path: a later reader of a block the switch is learning
    gets hits for the chunks others asked for first, while its own wait in the pool's queue."""
    n = 3 * FAST_OUT
    t, ring = lossy_round(1, n=n, hits=(n - 1,))
    assert retransmitted(t, ring, NOW) == list(range(FAST_OUT))


def test_before_a_delivery_rate_the_timeout_waits_for_the_rest_of_the_window():
    """Two hits came back at once, 64 chunks wait behind a slow link: not timed out after
    1.5 ms (the round trip of the two was 0.3 ms), only after ``ACTIVE_FIRST_RTO``."""
    t, ring = lossy_round(1, n=66, hits=(0, 1), bw=0.0)
    t.rtt.rto, t.switched = 0.001, False
    assert retransmitted(t, ring, NOW + 0.0015) == []
    t.next_scan = 0.0
    assert retransmitted(t, ring, NOW + ACTIVE_FIRST_RTO * 1.1) == list(range(2, 2 + TIMEOUT_BATCH))
