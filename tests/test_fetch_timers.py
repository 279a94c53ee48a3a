"""The fetch engine's retransmission timeout (hostagent.inference.fetch.transfers): it follows
what the link has queued, and a transfer starved behind others never waits past MAX_RTO before
asking again (pure Python: no BPF)."""
from hostagent.inference.fetch.transfers import (DRAIN_GAIN, INITIAL_RTO, MAX_RTO, Route,
                                                 Transfer, _timers)

KEY = bytes(range(16))


def transfer(bw: float, inflight: int) -> Transfer:
    route = Route(0, ("198.18.0.101", 19286), 64)
    t = Transfer(route, 1, KEY, 2000, False, 30.0)
    t.rtt.sample(0.02, 0.001, 0.001)                 # a 20 ms round trip measured
    t.seen_received = 1
    t.next_new = inflight                            # asked for, none verified yet
    route.bw, route.inflight = bw, inflight
    return t


def test_the_timeout_covers_draining_what_is_in_flight_at_the_link_rate():
    rto = _timers(transfer(bw=2000.0, inflight=200))[1]
    assert rto == DRAIN_GAIN * 200 / 2000.0          # 0.2 s: above the round trip's own


def test_a_starved_transfer_waits_at_most_max_rto():
    # 16 readers on one shaped pool link: one of them measured a few chunks a second, and
    # 2 x 1,300 chunks / 3 per second made its timeout ~15 minutes, past its 30 s deadline
    assert _timers(transfer(bw=3.0, inflight=1300))[1] == MAX_RTO


def test_before_any_reply_the_initial_timeout_holds():
    t = transfer(bw=0.0, inflight=64)
    t.seen_received = 0
    assert _timers(t)[1] >= INITIAL_RTO
