"""The switch's XDP program on crafted frames through BPF_PROG_TEST_RUN: exact replies for hits,
untouched frames for everything else, learning only what it should. No interface needed."""
import ctypes
import os
import socket
import zlib

import pytest
from scapy.layers.inet import IP, TCP, UDP
from scapy.layers.inet6 import IPv6
from scapy.layers.l2 import ARP, Dot1Q, Ether
from scapy.packet import Raw

from hostagent.protocol import PORT, Flag, Op
from switchd.cache import Cache
from switchd.dataplane import DataPlane, Deployment
from switchd import netns
from switchd.libbpf import xdp_test_run
from testbed.topology import ip
from testbed.kvscapy import KV

pytestmark = pytest.mark.bpf

XDP_DROP, XDP_PASS, XDP_TX = 1, 2, 3
HOST_MAC, POOL_MAC = "02:00:00:00:00:01", "02:00:00:00:00:65"
HOST_IP, POOL_IP = "198.18.0.1", "198.18.0.101"
KEY = bytes.fromhex("00112233445566778899aabbccddeeff")
PAYLOAD = bytes((i * 7) & 0xFF for i in range(700))
PORTS = {}  # "host", "host2", "pool" -> ifindex of a veth end in the test's own namespace


@pytest.fixture(scope="module", autouse=True)
def ports_namespace():
    """Frames are run as if received on real ports: a veth pair in a namespace of our own."""
    name = f"kvbpf{os.getpid()}"
    ip("netns", "add", name)
    try:
        ip("link", "add", "hostport", "type", "veth", "peer", "name", "poolport", ns=name)
        ip("link", "add", "host2port", "type", "veth", "peer", "name", "spare", ns=name)
        with netns.inside(name):
            PORTS.update({p: socket.if_nametoindex(f"{p}port")
                          for p in ("host", "host2", "pool")})
            yield
    finally:
        ip("netns", "del", name, check=False)


def dataplane(cache_entries: int) -> DataPlane:
    """The switch's programs and private maps, with the "pool" port a pool-node port."""
    dp = DataPlane(Deployment(chunk_size=1024, cache_entries=cache_entries, pin_dir=None))
    dp.ports[dp.ports.Key(PORTS["pool"])] = dp.ports.Leaf(role=1)
    return dp


@pytest.fixture(scope="module")
def dp(ports_namespace):
    return dataplane(4096)


@pytest.fixture
def cache(dp):
    c = Cache(dp)
    c.flush()
    for table in (dp.admit, dp.pending, dp.waiters):
        table.clear()
    dp.set("coalesce", 0)
    dp.set("spec_fill", 0)
    return c


def get_frame(key=KEY, chunk=3, room=1024, ns=5, kvflags=0, req_id=0xABCD, src=HOST_IP,
              sport=40000, **ip):
    return (Ether(src=HOST_MAC, dst=POOL_MAC) /
            IP(src=src, dst=POOL_IP, id=77, **ip) /
            UDP(sport=sport, dport=PORT) /
            KV(op=Op.GET, ns=ns, req_id=req_id, key=key, chunk=chunk, flags=kvflags) /
            Raw(bytes(room)))


def reply_frame(payload=PAYLOAD, key=KEY, chunk=3, ns=5, flags=0, nchunks=9):
    return (Ether(src=POOL_MAC, dst=HOST_MAC) / IP(src=POOL_IP, dst=HOST_IP) /
            UDP(sport=PORT, dport=40000) /
            KV(op=Op.GET_REPLY, ns=ns, key=key, chunk=chunk, nchunks=nchunks, flags=flags) /
            Raw(payload))


def run(dp, frame, port="host"):
    return xdp_test_run(dp.ingress.fd, bytes(frame), ifindex=PORTS[port])


def test_hit_becomes_the_exact_reply(dp, cache):
    cache.put(5, KEY, 3, PAYLOAD, nchunks=9)
    before = dp.counters()
    verdict, out = run(dp, get_frame())
    assert verdict == XDP_TX
    expected = (Ether(src=POOL_MAC, dst=HOST_MAC) /
                IP(src=POOL_IP, dst=HOST_IP, id=77, ttl=64) /
                UDP(sport=PORT, dport=40000, chksum=0) /
                KV(op=Op.GET_REPLY, ns=5, req_id=0xABCD, key=KEY, chunk=3, nchunks=9,
                   flags=Flag.FROM_SWITCH, csum=zlib.crc32(PAYLOAD)) /
                Raw(PAYLOAD))
    assert out == bytes(expected)
    after = dp.counters()
    assert after["get_hit"] - before["get_hit"] == 1
    assert after["hit_bytes"] - before["hit_bytes"] == len(PAYLOAD)
    assert after["xdp_tx"] - before["xdp_tx"] == 1
    entry, _ = cache.get(5, KEY, 3)
    assert entry.hits == 1


def test_hit_with_exactly_enough_room(dp, cache):
    cache.put(5, KEY, 3, PAYLOAD, nchunks=9)
    verdict, out = run(dp, get_frame(room=len(PAYLOAD)))
    assert verdict == XDP_TX and Ether(out)[Raw].load == PAYLOAD


def test_miss_passes_unchanged(dp, cache):
    frame = bytes(get_frame())
    before = dp.counters()
    assert run(dp, frame) == (XDP_PASS, frame)
    assert dp.counters()["get_miss"] - before["get_miss"] == 1


@pytest.mark.parametrize("what", ["other ns", "other chunk", "other key"])
def test_near_misses_are_misses(dp, cache, what):
    cache.put(5, KEY, 3, PAYLOAD, nchunks=9)
    frame = bytes({"other ns": get_frame(ns=6), "other chunk": get_frame(chunk=4),
                   "other key": get_frame(key=KEY[:-1] + b"\x00")}[what])
    assert run(dp, frame) == (XDP_PASS, frame)


def test_too_little_room_or_no_cache_flag_is_forwarded(dp, cache):
    cache.put(5, KEY, 3, PAYLOAD, nchunks=9)
    for frame in (bytes(get_frame(room=len(PAYLOAD) - 1)),
                  bytes(get_frame(kvflags=Flag.NO_CACHE))):
        assert run(dp, frame) == (XDP_PASS, frame)


def _malformed_frames():
    good = get_frame()
    raw = bytes(good)
    kv_off = 14 + 20 + 8

    def patch(offset, value):
        return raw[:offset] + value + raw[offset + len(value):]

    yield "truncated in kv header", raw[:kv_off + 20]
    yield "truncated in udp header", raw[:14 + 20 + 4]
    yield "truncated in ip header", raw[:14 + 10]
    yield "truncated room", raw[:-100]
    yield "bad magic", patch(kv_off, b"\x4b\x57")
    yield "bad version", patch(kv_off + 2, b"\x02")
    yield "reserved set", patch(kv_off + 42, b"\x00\x01")
    yield "kv len too long", patch(kv_off + 40, (1025).to_bytes(2, "big"))
    yield "kv len too short", patch(kv_off + 40, (1023).to_bytes(2, "big"))
    yield "ip len beyond frame", bytes(get_frame(len=20 + 8 + 48 + 1024 + 10))
    yield "udp len lies", patch(14 + 20 + 4, (100).to_bytes(2, "big"))
    yield "bad ip checksum", patch(14 + 10, b"\x00\x00")
    yield "wrong port", patch(14 + 20 + 2, (PORT + 1).to_bytes(2, "big"))
    yield "ip options", bytes(Ether(src=HOST_MAC, dst=POOL_MAC) /
                              IP(src=HOST_IP, dst=POOL_IP, options=b"\x01\x01\x01\x01") /
                              good[UDP])
    yield "fragment (more fragments)", bytes(get_frame(flags="MF"))
    yield "fragment (offset)", bytes(get_frame(frag=8))
    yield "vlan tagged", bytes(Ether(src=HOST_MAC, dst=POOL_MAC) / Dot1Q(vlan=7) / good[IP])
    yield "ipv6", bytes(Ether(src=HOST_MAC, dst=POOL_MAC) /
                        IPv6(src="2001:db8::1", dst="2001:db8::2") / good[UDP])
    yield "tcp to kv port", bytes(Ether() / IP(src=HOST_IP, dst=POOL_IP) /
                                  TCP(dport=PORT) / Raw(raw[kv_off:]))


@pytest.mark.parametrize("name, frame", list(_malformed_frames()),
                         ids=[n for n, _ in _malformed_frames()])
def test_malformed_or_foreign_frames_are_never_answered(dp, cache, name, frame):
    cache.put(5, KEY, 3, PAYLOAD, nchunks=9)
    entries = cache.entries()
    verdict, out = run(dp, frame)
    assert verdict == XDP_PASS, name
    assert out == frame, f"{name}: frame was altered"
    assert cache.entries() == entries, f"{name}: cache changed"


def test_non_kv_traffic_is_untouched(dp, cache):
    before = dp.counters()
    for frame in (bytes(Ether() / ARP(pdst=POOL_IP)),
                  bytes(Ether() / IP(src=HOST_IP, dst=POOL_IP) / TCP(dport=5201) / Raw(b"x" * 99)),
                  bytes(Ether() / IP() / UDP(dport=53) / Raw(b"q"))):
        assert run(dp, frame) == (XDP_PASS, frame)
    assert dp.counters()["non_kv"] - before["non_kv"] == 3


@pytest.mark.parametrize("owner", ["other chunk", "other namespace", "other key", "nobody"])
def test_an_entry_rewritten_for_another_chunk_is_never_served(dp, cache, owner):
    """A hash map hands a deleted element to the next insert at once, even while another CPU
    still reads it: the hit path serves an entry only if it still holds the chunk asked for."""
    cache.put(5, KEY, 3, PAYLOAD, nchunks=9)
    k = cache._chunk_key(5, KEY, 3)
    v = dp.cache[k]
    if owner == "nobody":
        ctypes.memset(ctypes.addressof(v.owner), 0, ctypes.sizeof(v.owner))
    else:
        v.owner.chunk, v.owner.ns, v.owner.key[0] = {
            "other chunk": (4, 5, KEY[0]), "other namespace": (3, 6, KEY[0]),
            "other key": (3, 5, KEY[0] ^ 1)}[owner]
    dp.cache[k] = v
    frame = bytes(get_frame())
    before = dp.counters()
    assert run(dp, frame) == (XDP_PASS, frame)      # a miss: on to the pool node
    after = dp.counters()
    assert after["reused"] - before["reused"] == 1 and after["get_hit"] == before["get_hit"]


def test_admitted_reply_from_pool_port_is_learned_and_passed(dp, cache):
    cache.admit(5, KEY)
    run(dp, get_frame())                  # the request it answers
    frame = bytes(reply_frame())
    assert run(dp, frame, port="pool") == (XDP_PASS, frame)
    entry, payload = cache.get(5, KEY, 3)
    assert payload == PAYLOAD and entry.csum == zlib.crc32(PAYLOAD)
    assert entry.nchunks == 9 and entry.filled
    owner = dp.cache[cache._chunk_key(5, KEY, 3)].owner
    assert (owner.ns, owner.chunk, bytes(owner.key)) == (5, 3, KEY)
    # and the next GET for it is a hit carrying exactly those bytes
    verdict, out = run(dp, get_frame())
    assert verdict == XDP_TX and Ether(out)[Raw].load == PAYLOAD


@pytest.mark.parametrize("case", ["not admitted", "host port", "switch-made", "error status",
                                  "unsolicited"])
def test_replies_that_must_not_be_learned(dp, cache, case):
    if case != "not admitted":
        cache.admit(5, KEY)
    if case != "unsolicited":
        run(dp, get_frame())              # an outstanding request for the chunk
    frame = reply_frame(flags=Flag.FROM_SWITCH if case == "switch-made" else 0)
    if case == "error status":
        frame[KV].status = 1
    before = dp.counters()
    raw = bytes(frame)
    assert run(dp, raw, port="host" if case == "host port" else "pool") == (XDP_PASS, raw)
    assert cache.get(5, KEY, 3) is None
    if case == "host port":
        assert dp.counters()["forged"] - before["forged"] == 1
    if case == "unsolicited":
        assert dp.counters()["unsolicited"] - before["unsolicited"] == 1


def test_speculative_fill_learns_unadmitted_replies_while_the_budget_lasts(dp, cache):
    dp.set("spec_fill", 1)
    for chunk in (3, 4):
        run(dp, get_frame(chunk=chunk))
        raw = bytes(reply_frame(chunk=chunk))
        assert run(dp, raw, port="pool") == (XDP_PASS, raw)
    entry, payload = cache.get(5, KEY, 3)
    assert payload == PAYLOAD and entry.speculative and entry.filled
    assert cache.get(5, KEY, 4) is None, "the budget was one chunk"
    assert dp.get("spec_fill") <= 0 and dp.counters()["spec_fill"] >= 1


@pytest.mark.parametrize("case", ["host port", "unsolicited"])
def test_speculative_fill_still_learns_only_solicited_pool_replies(dp, cache, case):
    dp.set("spec_fill", 100)
    if case != "unsolicited":
        run(dp, get_frame())
    raw = bytes(reply_frame())
    assert run(dp, raw, port="host" if case == "host port" else "pool") == (XDP_PASS, raw)
    assert cache.get(5, KEY, 3) is None and dp.get("spec_fill") == 100


def test_reply_larger_than_a_cache_entry_is_not_learned(dp, cache):
    cache.admit(5, KEY)
    run(dp, get_frame())
    raw = bytes(reply_frame(payload=bytes(1100)))
    assert run(dp, raw, port="pool") == (XDP_PASS, raw)
    assert cache.get(5, KEY, 3) is None


# ---- miss coalescing --------------------------------------------------------------------------
XDP_REDIRECT = 4
HOST2_IP = "198.18.0.2"


@pytest.fixture
def coalescing(dp, cache):
    dp.set("coalesce", 1)
    dp.set("pending_ns", 10 ** 9)
    return dp


def _waiter(dp, port):
    k = dp.waiters.Key()
    k.chunk.ns, k.chunk.chunk, k.ifindex = 5, 3, PORTS[port]
    ctypes.memmove(ctypes.addressof(k.chunk.key), KEY, 16)
    try:
        return dp.waiters[k]
    except KeyError:
        return None


def test_first_miss_goes_upstream_later_ones_are_held(coalescing):
    dp = coalescing
    before = dp.counters()
    first = bytes(get_frame(req_id=1))
    assert run(dp, first) == (XDP_PASS, first)
    assert len(dp.pending) == 1
    assert run(dp, get_frame(req_id=2, src=HOST2_IP), port="host2")[0] == XDP_DROP
    assert run(dp, get_frame(req_id=3), port="host")[0] == XDP_DROP   # the first asker again
    pending = list(dp.pending.values())[0]
    assert pending.waiters == 2 and pending.first_ifindex == PORTS["host"]
    w1, w2 = _waiter(dp, "host"), _waiter(dp, "host2")
    assert (w1.req_id, w1.coalesced) == (socket.htonl(3), 0)
    assert (w2.req_id, w2.coalesced, w2.ip) == (socket.htonl(2), 1, socket.htonl(0xC6120002))
    after = dp.counters()
    assert after["get_miss"] - before["get_miss"] == 1
    assert after["coalesced"] - before["coalesced"] == 2


def test_a_second_client_behind_a_waiting_port_is_not_held(coalescing):
    dp = coalescing
    run(dp, get_frame(req_id=1))
    other = bytes(get_frame(req_id=9, sport=40001))
    assert run(dp, other) == (XDP_PASS, other)
    assert dp.counters()["uncoalesced"] >= 1


def test_reply_to_several_waiters_is_broadcast(coalescing):
    dp = coalescing
    run(dp, get_frame(req_id=1))
    run(dp, get_frame(req_id=2, src=HOST2_IP), port="host2")
    gen = list(dp.pending.values())[0].gen
    reply = bytes(reply_frame())
    verdict, out = run(dp, reply, port="pool")
    assert verdict == XDP_REDIRECT
    # test-run output starts at the metadata: the round's generation, then the untouched reply
    assert out[8:] == reply and int.from_bytes(out[:8], "little") == gen
    assert len(dp.pending) == 0, "the round is closed"
    assert _waiter(dp, "host2") is not None, "waiters are consumed by the egress copies"


def test_reply_to_a_single_waiter_goes_the_ordinary_way(coalescing):
    dp = coalescing
    run(dp, get_frame(req_id=1))
    reply = bytes(reply_frame())
    assert run(dp, reply, port="pool") == (XDP_PASS, reply)
    assert len(dp.pending) == 0 and _waiter(dp, "host") is None


def test_forged_reply_from_a_host_port_releases_nobody(coalescing):
    dp = coalescing
    run(dp, get_frame(req_id=1))
    run(dp, get_frame(req_id=2, src=HOST2_IP), port="host2")
    reply = bytes(reply_frame())
    assert run(dp, reply, port="host2") == (XDP_PASS, reply)
    assert len(dp.pending) == 1 and list(dp.pending.values())[0].waiters == 2


def test_stale_round_is_retried_upstream(coalescing):
    dp = coalescing
    dp.set("pending_ns", 1)                 # every round is stale at once
    run(dp, get_frame(req_id=1))
    before = dp.counters()
    again = bytes(get_frame(req_id=2, src=HOST2_IP))
    assert run(dp, again, port="host2") == (XDP_PASS, again)
    after = dp.counters()
    assert after["expired"] - before["expired"] == 1
    assert list(dp.pending.values())[0].first_ifindex == PORTS["host2"]


def test_coalescing_off_forwards_every_miss(dp, cache):
    for port, req in (("host", 1), ("host2", 2)):
        frame = bytes(get_frame(req_id=req))
        assert run(dp, frame, port=port) == (XDP_PASS, frame)
    assert len(dp.pending) == 1, "the request is outstanding (its reply may be learned)"
    assert len(dp.waiters) == 0, "but nobody is held"


# ---- tenant isolation -------------------------------------------------------------------------
def test_a_port_limited_to_other_namespaces_gets_nothing(dp, cache):
    cache.put(5, KEY, 3, PAYLOAD, nchunks=9)
    cache.put(6, KEY, 3, b"other tenant", nchunks=9)
    host = socket.if_indextoname(PORTS["host"])
    dp.set_port_role(host, 0, namespaces=[6])
    try:
        before = dp.counters()
        assert run(dp, get_frame(ns=5))[0] == XDP_DROP          # same key, other tenant
        assert dp.counters()["denied"] - before["denied"] == 1
        verdict, out = run(dp, get_frame(ns=6))
        assert verdict == XDP_TX and Ether(out)[Raw].load == b"other tenant"
    finally:
        dp.set_port_role(host, 0)
    assert run(dp, get_frame(ns=5))[0] == XDP_TX


def put_frame(ns=5, payload=PAYLOAD, chunk=3):
    return (Ether(src=HOST_MAC, dst=POOL_MAC) / IP(src=HOST_IP, dst=POOL_IP) /
            UDP(sport=40000, dport=PORT) /
            KV(op=Op.PUT, ns=ns, key=KEY, chunk=chunk, nchunks=9, csum=zlib.crc32(payload)) /
            Raw(payload))


def test_a_port_limited_to_other_namespaces_cannot_write_into_them(dp, cache):
    host = socket.if_indextoname(PORTS["host"])
    dp.set_port_role(host, 0, namespaces=[6])
    try:
        before = dp.counters()
        assert run(dp, put_frame(ns=5))[0] == XDP_DROP   # would plant a block in tenant 5
        assert dp.counters()["denied"] - before["denied"] == 1
        raw = bytes(put_frame(ns=6))
        assert run(dp, raw) == (XDP_PASS, raw)
    finally:
        dp.set_port_role(host, 0)


@pytest.mark.parametrize("port", ["host", "pool"])
def test_puts_are_never_learned(dp, cache, port):
    cache.admit(5, KEY)
    run(dp, get_frame())                  # even with a request for the chunk outstanding
    raw = bytes(put_frame(payload=b"planted"))
    assert run(dp, raw, port=port) == (XDP_PASS, raw)
    assert cache.get(5, KEY, 3) is None


# ---- the verifier accepts every deployment --------------------------------------------------
@pytest.mark.parametrize("chunk_size", [8, 3072, 3424])
def test_the_verifier_accepts_the_program_at_every_chunk_size(chunk_size):
    """The CRC loop runs KV_CHUNK_MAX times: the largest chunk is the verifier's hardest case."""
    from switchd.dataplane import MAX_CHUNK
    assert chunk_size <= MAX_CHUNK
    dp = DataPlane(Deployment(chunk_size=chunk_size, cache_entries=64, pin_dir=None))
    assert dp.ingress.fd > 0 and dp.egress.fd > 0
    dp.bpf.cleanup()
