"""Trunk ports (issue 43) on crafted frames through BPF_PROG_TEST_RUN: a rack switch's uplink
takes replies from every pool node behind it, and a reply the switch above made from its cache
answers the rack switch's round (its held GETs get it, marked a replica); a pool-side switch's
downlink carries many hosts' GETs and no replies. Trunks are never bound to one source."""
import pytest
from scapy.layers.inet import UDP
from scapy.layers.l2 import Ether

from kvproto import Flag, Op
from kvproto.frames import XDP
from kvproto.scapy_layer import KV
from switchd.cache import Cache
from switchd.dataplane import ROLE_HOST, ROLE_POOL, DataPlane, Deployment, SwitchError
from switchd.ports import set_role, table
from testbed.lab.topology import scratch_ports
from xdp.libbpf import xdp_test_run
from xdp_fixtures import KEY, PAYLOAD, broadcast_of, get_frame, reply_frame, waiter_of

pytestmark = pytest.mark.bpf

PORTS = {}
HOST2_IP = "198.18.0.2"
POOL2_IP, POOL2_MAC = "198.18.0.102", "02:00:00:00:00:66"


@pytest.fixture(scope="module")
def dp():
    """One data plane with both kinds of trunk: an uplink and a downlink, beside
    two host ports and a pool port."""
    with scratch_ports(("host", "host2"), ("trunkup", "trunkdn"), ("pool", "spare"),
                       prefix="kvtrunk") as ends:
        PORTS.update(ends)
        d = DataPlane(Deployment(chunk_size=1024, cache_entries=4096, pin_dir=None))
        set_role(d, "trunkup", ROLE_POOL, trunk=True)
        set_role(d, "trunkdn", ROLE_HOST, trunk=True)
        set_role(d, "pool", ROLE_POOL)
        yield d


@pytest.fixture
def sw(dp):
    Cache(dp).flush()
    for t in (dp.admit, dp.pending, dp.waiters):
        t.clear()
    for name, value in (("coalesce", 1), ("spec_fill", 0), ("pending_ns", 10 ** 9)):
        dp.set(name, value)
    return dp


def run(dp, frame, port):
    return xdp_test_run(dp.ingress.fd, bytes(frame), ifindex=PORTS[port])


def switch_made(**kw):
    """A hit the switch above answered from its cache, as it leaves that switch."""
    return reply_frame(flags=Flag.FROM_SWITCH, **kw)


def kv_flags(out: bytes) -> int:
    return Ether(out)[KV].flags


def test_an_uplink_takes_replies_from_every_pool_node_behind_it(sw):
    cache = Cache(sw)
    cache.admit(5, KEY)
    for chunk, (src, mac) in enumerate([("198.18.0.101", "02:00:00:00:00:65"),
                                        (POOL2_IP, POOL2_MAC)]):
        run(sw, get_frame(chunk=chunk), "host")
        raw = bytes(reply_frame(chunk=chunk, src=src, src_mac=mac))
        assert run(sw, raw, "trunkup") == (XDP.PASS, raw)
        assert cache.get(5, KEY, chunk)[1] == PAYLOAD, f"learned from pool node {src}"


def test_a_reply_the_switch_above_made_releases_the_held_gets(sw):
    """The rack's first asker went upstream, the second was held; the switch above answered
    from its cache. Its reply closes the round and reaches both, marked a replica (it came at
    the network's pace), and is learned."""
    cache = Cache(sw)
    cache.admit(5, KEY)
    run(sw, get_frame(req_id=1), "host")
    assert run(sw, get_frame(req_id=2, src=HOST2_IP), "host2")[0] == XDP.DROP, "held"
    gen = list(sw.pending.values())[0].gen
    verdict, out = run(sw, switch_made(), "trunkup")
    made = Ether(bytes(switch_made()))
    made[KV].flags |= Flag.REPLICA
    made[UDP].chksum = 0
    made = bytes(made)
    assert verdict == XDP.REDIRECT and out == broadcast_of(made, gen), \
        "marked a replica, its UDP checksum cleared, the round's generation carried"
    assert len(sw.pending) == 0 and waiter_of(sw, PORTS["host2"]) is not None
    assert cache.get(5, KEY, 3)[1] == PAYLOAD
    assert run(sw, get_frame(req_id=3, src=HOST2_IP), "host2")[0] == XDP.TX, "now a hit"


def test_a_reply_the_switch_above_made_for_one_asker_goes_the_ordinary_way(sw):
    run(sw, get_frame(req_id=1), "host")
    verdict, out = run(sw, switch_made(), "trunkup")
    assert verdict == XDP.PASS and kv_flags(out) & Flag.REPLICA
    assert out.endswith(PAYLOAD)
    assert len(sw.pending) == 0


def test_a_switch_made_reply_on_a_pool_port_that_is_no_trunk_answers_nothing(sw):
    """A pool node never sends one; on a single switch it is passed, never learned, and the
    round stays open."""
    cache = Cache(sw)
    cache.admit(5, KEY)
    run(sw, get_frame(req_id=1), "host")
    raw = bytes(switch_made())
    assert run(sw, raw, "pool") == (XDP.PASS, raw)
    assert len(sw.pending) == 1 and cache.get(5, KEY, 3) is None


@pytest.mark.parametrize("op", [Op.GET_REPLY, Op.NACK, Op.PUT_ACK])
def test_a_downlink_sends_no_replies(sw, op):
    """A rack's hosts reach the pool-side switch through its downlink: requests only."""
    run(sw, get_frame(req_id=1), "trunkdn")
    before = sw.counters()["not_from_pool"]
    assert run(sw, reply_frame(op=op), "trunkdn")[0] == XDP.DROP
    assert sw.counters()["not_from_pool"] == before + 1
    assert len(sw.pending) == 1


def test_gets_from_two_racks_reach_the_pool_once_and_both_get_the_reply(sw):
    """The pool-side switch: the first rack's GET goes on to the pool node, the second rack's
    is held on its downlink, and the pool node's one reply is replicated to both."""
    assert run(sw, get_frame(req_id=1), "trunkdn")[0] == XDP.PASS
    assert run(sw, get_frame(req_id=2, src=HOST2_IP), "host2")[0] == XDP.DROP
    gen = list(sw.pending.values())[0].gen
    verdict, out = run(sw, reply_frame(), "pool")
    assert verdict == XDP.REDIRECT and out == broadcast_of(bytes(reply_frame()), gen), \
        "the pool node's reply as sent"
    assert len(sw.pending) == 0


def test_a_trunk_is_never_bound_and_checks_nothing(sw):
    with pytest.raises(SwitchError, match="trunk"):
        set_role(sw, "trunkup", ROLE_POOL, secured=True, trunk=True)
    roles = {row["port"]: (row["role"], row["secured"]) for row in table(sw)}
    assert roles["trunkup"] == ("uplink", False) and roles["trunkdn"] == ("downlink", False)
    assert sw.get("port_checks") == 0, "no port lookups on the hit path for trunks"


def test_a_switch_with_a_share_learns_speculatively_only_its_share(sw):
    """A split placement: with share 0 of 2, a reply for a block not admitted is learned only if
    its key's first 8 bytes (little-endian) are even; an admitted block is learned either way."""
    cache = Cache(sw)
    sw.set("spec_fill", 100)
    sw.set("share_n", 2)
    try:
        odd = (1).to_bytes(8, "little") + KEY[8:]
        for key, learned in ((bytes(8) + KEY[8:], True), (odd, False)):
            run(sw, get_frame(key=key), "host")
            run(sw, reply_frame(key=key), "trunkup")
            assert (cache.get(5, key, 3) is not None) == learned, key.hex()
        cache.admit(5, odd)
        run(sw, get_frame(key=odd, chunk=4), "host")
        run(sw, reply_frame(key=odd, chunk=4), "trunkup")
        assert cache.get(5, odd, 4) is not None, "admitted: switchd's own decision"
    finally:
        sw.set("share_n", 0)
