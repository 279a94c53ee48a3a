"""Held GETs are answered (issue 25): the switch's rounds on crafted frames through
BPF_PROG_TEST_RUN. A round whose reply is late (a shaped link's queue) or lost keeps its waiters
when it is asked again; a NACK reaches every waiter; a waiting port asking again once the reply
is due goes upstream; the round timeout follows the replies' measured time (within a cap)."""
import socket
import time

import pytest

from kvproto import Op
from switchd.cache import Cache
from switchd.dataplane import ROLE_POOL, CONSTANTS, DataPlane, Deployment
from testbed.lab.topology import scratch_ports
from xdp_fixtures import broadcast_of, get_frame, reply_frame, waiter_of

from xdp.libbpf import xdp_test_run
from kvproto.frames import XDP

pytestmark = pytest.mark.bpf

PORTS = {}
HOST2_IP = "198.18.0.2"
HOST3_IP = "198.18.0.3"
CAP = CONSTANTS["KV_ROUND_CAP"]


@pytest.fixture(scope="module")
def dp():
    with scratch_ports(("hostport", "poolport"), ("host2port", "host3port"),
                       prefix="kvhold") as ends:
        PORTS.update({p: ends[f"{p}port"] for p in ("host", "host2", "host3", "pool")})
        d = DataPlane(Deployment(chunk_size=1024, cache_entries=4096, pin_dir=None))
        d.ports[d.ports.Key(PORTS["pool"])] = d.ports.Leaf(role=ROLE_POOL)
        yield d


@pytest.fixture
def sw(dp):
    Cache(dp).flush()
    for table in (dp.admit, dp.pending, dp.waiters):
        table.clear()
    for name, value in (("coalesce", 1), ("spec_fill", 0), ("pending_ns", 10 ** 9),
                        ("round_srtt_ns", 0), ("round_var_ns", 0)):
        dp.set(name, value)
    return dp


def run(dp, frame, port="host"):
    return xdp_test_run(dp.ingress.fd, bytes(frame), ifindex=PORTS[port])


def waiter(dp, port):
    return waiter_of(dp, PORTS[port])


def the_round(dp):
    rounds = list(dp.pending.values())
    assert len(rounds) == 1
    return rounds[0]


def moved(dp, before):
    after = dp.counters()
    return {k: after[k] - before[k] for k in after if after[k] != before[k]}


def test_a_late_reply_reaches_the_gets_held_before_the_round_expired(sw):
    """The shaped-link case: host's GET went upstream, host2 was held; the reply is queued
    longer than the round timeout, so host asks again. The round keeps its generation and
    host2's place in it, and the reply (the late one or the retry's) reaches both."""
    run(sw, get_frame(req_id=1))
    assert run(sw, get_frame(req_id=2, src=HOST2_IP), port="host2")[0] == XDP.DROP
    gen = the_round(sw).gen
    sw.set("pending_ns", 1)
    before = sw.counters()
    again = bytes(get_frame(req_id=3))
    assert run(sw, again) == (XDP.PASS, again), "the retry goes upstream"
    rnd = the_round(sw)
    assert rnd.gen == gen and rnd.waiters == 2 and rnd.sent > gen
    assert waiter(sw, "host2").gen == gen, "host2 still waits in the round"
    verdict, out = run(sw, reply_frame(), port="pool")
    assert verdict == XDP.REDIRECT and out == broadcast_of(bytes(reply_frame()), gen)
    assert len(sw.pending) == 0
    assert moved(sw, before).get("expired") == 1


def test_a_get_not_held_in_probation_still_gets_the_replicated_reply(sw):
    """On probation a GET goes upstream (not held) and its port is a waiter too: if the round's
    reply is broadcast, the copy for that port is this GET's answer, not dropped as nobody's."""
    run(sw, get_frame(req_id=1))
    run(sw, get_frame(req_id=2, src=HOST2_IP), port="host2")
    sw.set("pending_ns", 1)
    run(sw, get_frame(req_id=3))                                    # retried: probation
    frame = bytes(get_frame(req_id=4, src=HOST3_IP))
    assert run(sw, frame, port="host3") == (XDP.PASS, frame), "not held"
    w = waiter(sw, "host3")
    assert w is not None and w.gen == the_round(sw).gen and w.coalesced == 0
    assert the_round(sw).waiters == 3


def test_a_nack_reaches_every_waiter_and_is_never_learned(sw):
    """A block the pool lacks: before, only the first asker got the NACK and the held ones
    waited for the round to expire."""
    run(sw, get_frame(req_id=1))
    run(sw, get_frame(req_id=2, src=HOST2_IP), port="host2")
    gen = the_round(sw).gen
    before = sw.counters()
    nack = bytes(reply_frame(payload=b"", op=Op.NACK, status=1, nchunks=0))
    verdict, out = run(sw, nack, port="pool")
    assert verdict == XDP.REDIRECT and out == broadcast_of(nack, gen)
    assert len(sw.pending) == 0 and len(sw.blocks) == 0
    assert moved(sw, before).get("nack_closed") == 1


def test_a_nack_for_a_single_asker_goes_the_ordinary_way(sw):
    run(sw, get_frame(req_id=1))
    nack = bytes(reply_frame(payload=b"", op=Op.NACK, status=1, nchunks=0))
    assert run(sw, nack, port="pool") == (XDP.PASS, nack)
    assert len(sw.pending) == 0 and waiter(sw, "host") is None


def test_an_error_is_not_replicated(sw):
    """An ERROR may answer one request's own fault: the held ones are not told."""
    run(sw, get_frame(req_id=1))
    run(sw, get_frame(req_id=2, src=HOST2_IP), port="host2")
    err = bytes(reply_frame(payload=b"", op=Op.ERROR, status=2, nchunks=0))
    assert run(sw, err, port="pool") == (XDP.PASS, err)
    assert the_round(sw).waiters == 2


def test_a_lone_readers_round_writes_no_waiter_until_another_port_waits(sw):
    """Issue 62: a lone reader's round is one kv_pending entry, its asker kept inline; a second
    port's GET moves the first asker into kv_waiters and is held; the reply reaches both."""
    run(sw, get_frame(req_id=1))
    assert len(sw.waiters) == 0 and the_round(sw).first.req_id == socket.htonl(1)
    assert run(sw, get_frame(req_id=2, src=HOST2_IP), port="host2")[0] == XDP.DROP
    assert waiter(sw, "host").req_id == socket.htonl(1) and waiter(sw, "host2").coalesced == 1
    gen = the_round(sw).gen
    verdict, out = run(sw, reply_frame(), port="pool")
    assert verdict == XDP.REDIRECT and out == broadcast_of(bytes(reply_frame()), gen)
    run(sw, get_frame(req_id=3))                   # alone again: its reply goes the plain way
    reply = bytes(reply_frame())
    assert run(sw, reply, port="pool") == (XDP.PASS, reply) and len(sw.waiters) == 2, \
        "only the two copies' waiters (left to the egress program) remain"


def test_a_waiting_port_asking_again_once_the_reply_is_due_goes_upstream(sw):
    """Its GET or the reply may be lost on a link: asking again after the reply was due (the
    estimate, at least half the pending timeout) is let through; the round keeps its timers
    (asking again never prolongs a hold) and its waiters."""
    run(sw, get_frame(req_id=1))
    run(sw, get_frame(req_id=2, src=HOST2_IP), port="host2")
    assert run(sw, get_frame(req_id=3, src=HOST2_IP), port="host2")[0] == XDP.DROP, \
        "not yet due: held"
    sent = the_round(sw).sent
    time.sleep(0.55)                 # past 0.5 s (due), before 1 s (the round's timeout)
    before = sw.counters()
    frame = bytes(get_frame(req_id=4, src=HOST2_IP))
    assert run(sw, frame, port="host2") == (XDP.PASS, frame)
    assert moved(sw, before) == {"reasked": 1, "get_miss": 1, "packets": 1, "xdp_pass": 1}
    assert waiter(sw, "host2").req_id == socket.htonl(4), "answered at its latest request id"
    rnd = the_round(sw)
    assert rnd.sent == sent and rnd.waiters == 2 and rnd.flags == CONSTANTS["KV_RF_SHARED"]


def test_the_round_timeout_follows_the_measured_reply_time(sw):
    """A round older than the pending timeout but younger than SRTT + 4 RTTVAR is late, not
    lost: nobody asks again for it and the held stay held."""
    sw.set("pending_ns", 1)
    sw.set("round_srtt_ns", 10 ** 9)     # replies take a second lately
    run(sw, get_frame(req_id=1))
    before = sw.counters()
    assert run(sw, get_frame(req_id=2, src=HOST2_IP), port="host2")[0] == XDP.PASS, \
        "the cap: at most KV_ROUND_CAP pending timeouts (8 ns here)"
    assert moved(sw, before).get("expired") == 1
    sw.pending.clear()
    sw.waiters.clear()
    sw.set("pending_ns", 10 ** 8)        # cap 0.8 s
    run(sw, get_frame(req_id=1))
    sw.set("pending_ns", 10 ** 7)        # 10 ms: stale by the setting, not by the estimate
    sw.set("round_srtt_ns", 10 ** 7 * CAP)
    before = sw.counters()
    assert run(sw, get_frame(req_id=2, src=HOST2_IP), port="host2")[0] == XDP.DROP
    assert "expired" not in moved(sw, before)


def test_the_data_plane_measures_rounds_asked_once_only(sw):
    """A round holding others is sampled; a lone reader's one chunk in KV_ROUND_SAMPLE (the
    estimate is every CPU's: a sample per reply kept its line bouncing between them)."""
    run(sw, get_frame(req_id=1))
    run(sw, reply_frame(), port="pool")          # chunk 3, alone: no sample
    assert sw.get("round_srtt_ns") == 0
    sample = CONSTANTS["KV_ROUND_SAMPLE"]
    run(sw, get_frame(req_id=1, chunk=sample))
    run(sw, reply_frame(chunk=sample), port="pool")
    first = sw.get("round_srtt_ns")
    assert 0 < first < 10 ** 9 and sw.get("round_var_ns") == first // 2
    run(sw, get_frame(req_id=1, chunk=sample))
    sw.set("pending_ns", 1)
    run(sw, get_frame(req_id=2, chunk=sample))   # a retry: which GET a reply answers is unknown
    sw.set("pending_ns", 10 ** 9)
    run(sw, reply_frame(chunk=sample), port="pool")
    assert sw.get("round_srtt_ns") == first, "Karn: no sample from a retried round"
    run(sw, get_frame(req_id=1))
    run(sw, get_frame(req_id=2, src=HOST2_IP), port="host2")
    run(sw, reply_frame(), port="pool")          # chunk 3, holding another: sampled
    assert sw.get("round_srtt_ns") != first
