"""When the fetch engine presumes a chunk lost on a transfer the switch answers from its cache
within the sending call (hostagent.inference.fetch.transfers): a hole behind a later hit, in a
call that ended before the engine last looked, is asked again at once for the first
``FAST_TRIES`` asks, and only after a growing wait beyond them (a miss the switch holds for a
pool node's reply is not asked again at every scan). Pure Python: the send ring over a plain
array, no BPF."""
from types import SimpleNamespace

import numpy as np
import pytest

from hostagent.inference.fetch.program import SENDQ
from hostagent.inference.fetch.sendring import SendRing
from hostagent.inference.fetch.transfers import FAST_TRIES, Route, Transfer, fill

KEY = bytes(range(16))
NOW = 100.0
TAIL_WAIT = 0.0002


def lossy_round(tries: int) -> tuple[Transfer, SendRing]:
    """Four chunks asked in one call that ended 10 us ago; chunks 0, 2 and 3 came back from the
    switch's cache and were verified 5 us ago, chunk 1 (asked ``tries`` times) did not."""
    route = Route(0, ("198.18.0.101", 19286), 64)
    route.bw, route.min_rtt, route.base_rtt = 300_000.0, 0.0003, 0.0003
    t = Transfer(route, 1, KEY, 4, False, 30.0)
    t.idx, t.gen, t.base = 0, 1, 0
    t.rtt.srtt, t.rtt.late = 0.0003, 0.0                 # answered within the call
    t.seen_received, t.switched = 3, True
    ring = SendRing(SimpleNamespace(sendq=np.zeros(SENDQ, np.uint64)))
    ring.prod = ring.cons = 4
    ring.pos_time[:4], ring.done_time[:4] = NOW - 20e-6, NOW - 10e-6
    t.sent_seq[:], t.sent_t[:], t.tries[:] = np.arange(4), NOW - 20e-6, 1
    t.tries[1] = tries
    t.verified[:] = [True, False, True, True]
    t.nverified, t.next_new, t.lo, t.max_hit_seq = 3, 4, 1, 3
    t.looked = t.last_delivery = NOW - 5e-6
    return t, ring


def retransmitted(t: Transfer, ring: SendRing, now: float) -> list[int]:
    before = ring.prod
    fill([t], ring, np.zeros(4, np.uint64), now, burst=64, tail_wait=TAIL_WAIT, max_ahead=64)
    return [int(e) & 0xFFFFFFFF for e in ring.prog.sendq[before:ring.prod]]


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
