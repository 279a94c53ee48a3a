"""How many chunks the fetch engine keeps in flight towards a pool node
(hostagent.inference.fetch.transfers): held to the bandwidth-delay product only where a link's
queue is in the way; a pool node answering within its base round trip, or a switch sending most
replies, gets the queue bound alone; the round trips and the rate those bounds use (pure
Python: the send ring over a plain array, no BPF)."""
import time
from types import SimpleNamespace

import numpy as np

from hostagent.inference.fetch.program import SENDQ
from hostagent.inference.fetch.sendring import SendRing
from hostagent.inference.fetch.transfers import (BDP_GAIN, BDP_HEADROOM, COPIED_HEADROOM,
                                                 QUEUE_MAX, QUEUE_SIGNAL, RATE_SPAN, Route,
                                                 Transfer, fill, queue_free)

KEY = bytes(range(16))
BW, BASE = 300_000.0, 0.0003          # chunks/s and seconds: an unshaped pool node's path


def transfer(srtt: float | None) -> Transfer:
    route = Route(0, ("198.18.0.101", 19286), 64)
    route.cwnd = 16384.0
    route.bw, route.min_rtt, route.base_rtt = BW, BASE, BASE
    t = Transfer(route, 1, KEY, 20_000, False, 30.0)
    t.idx = 0                                        # its transfer table entry
    if srtt is not None:
        t.rtt.srtt, t.rtt.late = srtt, 1.0           # replies after their call: a pool node
        t.seen_received = 1
    return t


def queued(t: Transfer) -> int:
    ring = SendRing(SimpleNamespace(), None, 1024)
    meta = np.zeros(t.nchunks, np.uint64)
    return fill([t], ring, meta, 0.0, burst=SENDQ, tail_wait=0.001, max_ahead=SENDQ)


def test_a_pool_node_without_a_queue_is_held_by_the_queue_bound_only():
    t = transfer(srtt=BASE * 2)
    assert queue_free(t)
    assert queued(t) == int(BW * (BDP_GAIN * BASE + QUEUE_MAX) + BDP_HEADROOM)   # 4,744


def test_a_queue_on_the_way_brings_back_the_bandwidth_delay_bound():
    t = transfer(srtt=BASE + QUEUE_SIGNAL * 2)       # a shaped link's queue
    assert not queue_free(t)
    assert queued(t) == int(BDP_GAIN * BW * BASE + BDP_HEADROOM)                 # 244


def test_before_a_round_trip_is_measured_the_bandwidth_delay_bound_holds():
    t = transfer(srtt=None)
    assert not queue_free(t)
    assert queued(t) == int(BDP_GAIN * BW * BASE + BDP_HEADROOM)


def test_a_transfer_the_switch_answers_is_held_by_the_queue_bound_only():
    """16 readers of one block: most replies are the switch's copies of another reader's, whose
    round trips (0.1-0.3 ms) held the bandwidth-delay bound to its headroom."""
    t = transfer(srtt=BASE + QUEUE_SIGNAL * 2)
    t.copied = True
    assert queued(t) == int(BW * (BDP_GAIN * BASE + QUEUE_MAX) + COPIED_HEADROOM)


def test_once_the_pool_node_answered_the_switchs_round_trips_set_no_window():
    route = Route(0, ("198.18.0.101", 19286), 64)
    route.rtt_sample(0.0002, 0.0002, own=False)      # copies first: the best there is
    assert route.min_rtt == 0.0002
    route.rtt_sample(0.005, 0.004, own=True)         # the pool node's own reply: the path's
    assert route.min_rtt == 0.005
    route.rtt_sample(0.0001, 0.0001, own=False)
    assert route.min_rtt == 0.005
    assert route.base_rtt == 0.0001                  # the queue bound's floor: any reply's


def test_what_came_during_a_pause_is_no_delivery_rate():
    route = Route(0, ("198.18.0.101", 19286), 64)
    route.min_rtt = BASE
    route._t0 = time.monotonic() - 1.0               # nothing for a second
    route.acked(500, 16384)                          # then a reader's backlog at once
    assert route.bw == 0.0
    route._t0 -= RATE_SPAN                           # 100 chunks over one span after it
    route.acked(100, 16384)
    assert 0 < route.bw <= 100 / RATE_SPAN
