"""The switch's XDP program on crafted frames through BPF_PROG_TEST_RUN: exact replies for hits,
untouched frames for everything else, learning only what it should. No interface needed. The
single-frame cases are a table (xdp_fixtures.CASES) run by one test; sequences follow it."""
import socket

import pytest
from scapy.layers.l2 import Ether
from scapy.packet import Raw

from kvproto import Flag, checksum
from kvproto.scapy_layer import KV
from kvproto.frames import XDP
from switchd.cache import UNCHECKED
from switchd.ports import set_role
from switchd.dataplane import ROLE_HOST, ROLE_POOL, DataPlane, Deployment
from xdp_fixtures import (CASES, HOST_IP, KEY, OTHER_IP, PAYLOAD, POOL_IP,  # noqa: F401
                          Case, broadcast_of, get_frame, put_frame, reply_frame, waiter_of)
from xdp_switch import (HOST2_IP, PORTS, cache, dataplane, dp, hold_slot,  # noqa: F401
                        ports_namespace, run)

pytestmark = pytest.mark.bpf


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_fixture(dp, cache, case: Case):
    for ns, key, chunk, payload, nchunks in case.cached:
        cache.put(ns, key, chunk, payload, nchunks)
    for ns, key in case.admitted:
        cache.admit(ns, key)
    checked = [socket.if_indextoname(PORTS[p]) for p in {*case.port_ns, *case.secure}]
    for name in checked:
        port = next(p for p in PORTS if socket.if_indextoname(PORTS[p]) == name)
        set_role(dp, name, ROLE_POOL if port == "pool" else ROLE_HOST,
                 namespaces=case.port_ns.get(port), secured=port in case.secure,
                 source=case.secure.get(port))
    entries = cache.entries()
    for chunk in case.writing:
        hold_slot(dp, cache, *chunk)
    try:
        before = dp.counters()
        verdict, out = run(dp, case.frame, case.port)
        after = dp.counters()
    finally:
        for name in checked:
            set_role(dp, name, ROLE_POOL if name == "poolport" else ROLE_HOST)
        for chunk in case.writing:
            hold_slot(dp, cache, *chunk, held=False)
    assert verdict == case.verdict
    assert out == (case.frame if case.out is None else case.out), "wrong output frame"
    for counter, delta in case.counters.items():
        assert after[counter] - before[counter] == delta, counter
    if case.cache_unchanged:
        assert cache.entries() == entries, "the cache changed"


def test_a_hit_counts_on_its_entry(dp, cache):
    cache.put(5, KEY, 3, PAYLOAD, nchunks=9)
    assert run(dp, get_frame())[0] == XDP.TX
    assert cache.get(5, KEY, 3)[0].hits == 1


def test_admitted_reply_from_pool_port_is_learned_and_passed(dp, cache):
    cache.admit(5, KEY)
    run(dp, get_frame())                  # the request it answers
    frame = bytes(reply_frame())
    assert run(dp, frame, port="pool") == (XDP.PASS, frame)
    entry, payload = cache.get(5, KEY, 3)
    assert payload == PAYLOAD and entry.csum == checksum(PAYLOAD)
    assert entry.nchunks == 9 and entry.filled
    owner = dp.cache[dp.cache.Key(cache.slot_of(5, KEY, 3))].owner
    assert (owner.ns, owner.chunk, bytes(owner.key)) == (5, 3, KEY)
    # and the next GET for it is a hit carrying exactly those bytes
    verdict, out = run(dp, get_frame())
    assert verdict == XDP.TX and Ether(out)[Raw].load == PAYLOAD


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
    verdict = XDP.DROP if case == "host port" else XDP.PASS   # replies come from pool ports
    assert run(dp, raw, port="host" if case == "host port" else "pool") == (verdict, raw)
    assert cache.get(5, KEY, 3) is None
    if case == "host port":
        assert dp.counters()["not_from_pool"] - before["not_from_pool"] == 1
    if case == "unsolicited":
        assert dp.counters()["unsolicited"] - before["unsolicited"] == 1


def test_speculative_fill_learns_unadmitted_replies_while_the_budget_lasts(dp, cache):
    dp.set("spec_fill", 1)
    for chunk in (3, 4):
        run(dp, get_frame(chunk=chunk))
        raw = bytes(reply_frame(chunk=chunk))
        assert run(dp, raw, port="pool") == (XDP.PASS, raw)
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
    verdict = XDP.DROP if case == "host port" else XDP.PASS
    assert run(dp, raw, port="host" if case == "host port" else "pool") == (verdict, raw)
    assert cache.get(5, KEY, 3) is None and dp.get("spec_fill") == 100


def _pattern(length: int) -> bytes:
    return bytes((i * 13 + length) & 0xFF for i in range(length))


@pytest.mark.parametrize("length", [1, 15, 16, 17, 700, 1008, 1009, 1023, 1024])
def test_replies_of_every_length_are_learned_with_their_crc(dp, cache, length):
    """kv_crc_table's CRC takes 16-byte steps, then the rest a byte at a time: lengths around
    the step and the entry size (1024 here) all check."""
    cache.admit(5, KEY)
    data = _pattern(length)
    run(dp, get_frame())
    raw = bytes(reply_frame(payload=data))
    assert run(dp, raw, port="pool") == (XDP.PASS, raw)
    entry, payload = cache.get(5, KEY, 3)
    assert payload == data and entry.csum == checksum(data)


@pytest.mark.parametrize("length,at", [(1024, 0), (1024, 1023), (1024, 1008), (1023, 1015),
                                       (1009, 1008), (17, 16), (15, 14), (700, 350)])
def test_a_reply_failing_its_crc_in_any_byte_is_never_served(dp, cache, length, at):
    """Learning copies a reply's payload unchecked (off the reader's path); the slot's first hit
    checks its CRC and, when it fails, empties the slot and lets the GET go on to the pool."""
    cache.admit(5, KEY)
    data = _pattern(length)
    bad = bytearray(data)
    bad[at] ^= 0x40
    run(dp, get_frame())
    frame = reply_frame(payload=bytes(bad))
    frame[KV].csum = checksum(data)
    raw = bytes(frame)
    before = dp.counters()["fill_corrupt"]
    assert run(dp, raw, port="pool") == (XDP.PASS, raw)      # the reader checks it too
    assert cache.get(5, KEY, 3) is None, "switchd never reads unchecked bytes that fail"
    get = bytes(get_frame(req_id=2))
    assert run(dp, get) == (XDP.PASS, get), "not answered: on to the pool node"
    assert dp.counters()["fill_corrupt"] - before == 1
    assert run(dp, get) == (XDP.PASS, get) and dp.counters()["fill_corrupt"] - before == 1, \
        "the slot was emptied: a plain miss now"


def test_a_learned_chunk_is_checked_at_its_first_hit_then_served_as_it_is(dp, cache):
    cache.admit(5, KEY)
    run(dp, get_frame())
    assert run(dp, reply_frame(), port="pool")[0] == XDP.PASS
    slot = cache.slots.read(cache.slots.block(5, KEY).base + 3)
    assert slot.flags & UNCHECKED and slot.len == len(PAYLOAD)
    for req in (2, 3):
        verdict, out = run(dp, get_frame(req_id=req))
        assert verdict == XDP.TX and out.endswith(PAYLOAD)
        assert not cache.slots.read(cache.slots.block(5, KEY).base + 3).flags & UNCHECKED


def test_reply_larger_than_a_cache_entry_is_not_learned(dp, cache):
    cache.admit(5, KEY)
    run(dp, get_frame())
    raw = bytes(reply_frame(payload=bytes(1100)))
    assert run(dp, raw, port="pool") == (XDP.PASS, raw)
    assert cache.get(5, KEY, 3) is None


# ---- miss coalescing --------------------------------------------------------------------------


@pytest.fixture
def coalescing(dp, cache):
    dp.set("coalesce", 1)
    dp.set("pending_ns", 10 ** 9)
    return dp


def _waiter(dp, port):
    return waiter_of(dp, PORTS[port])


def test_first_miss_goes_upstream_later_ones_are_held(coalescing):
    dp = coalescing
    before = dp.counters()
    first = bytes(get_frame(req_id=1))
    assert run(dp, first) == (XDP.PASS, first)
    assert len(dp.pending) == 1
    assert run(dp, get_frame(req_id=2, src=HOST2_IP), port="host2")[0] == XDP.DROP
    assert run(dp, get_frame(req_id=3), port="host")[0] == XDP.DROP   # the first asker again
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
    assert run(dp, other) == (XDP.PASS, other)
    assert dp.counters()["uncoalesced"] >= 1


def test_reply_to_several_waiters_is_broadcast(coalescing):
    dp = coalescing
    run(dp, get_frame(req_id=1))
    run(dp, get_frame(req_id=2, src=HOST2_IP), port="host2")
    gen = list(dp.pending.values())[0].gen
    reply = bytes(reply_frame())
    verdict, out = run(dp, reply, port="pool")
    assert verdict == XDP.REDIRECT
    # the round's generation rides in the two fields kv_egress rewrites for every copy (no XDP
    # metadata), the IPv4 header kept valid; everything else is the reply as it came
    assert out == broadcast_of(reply, gen)
    assert len(dp.pending) == 0, "the round is closed"
    assert _waiter(dp, "host2") is not None, "waiters are consumed by the egress copies"


def test_reply_to_a_single_waiter_goes_the_ordinary_way(coalescing):
    dp = coalescing
    run(dp, get_frame(req_id=1))
    reply = bytes(reply_frame())
    assert run(dp, reply, port="pool") == (XDP.PASS, reply)
    assert len(dp.pending) == 0 and _waiter(dp, "host") is None


def test_forged_reply_from_a_host_port_releases_nobody(coalescing):
    dp = coalescing
    run(dp, get_frame(req_id=1))
    run(dp, get_frame(req_id=2, src=HOST2_IP), port="host2")
    reply = bytes(reply_frame())
    assert run(dp, reply, port="host2") == (XDP.DROP, reply)
    assert len(dp.pending) == 1 and list(dp.pending.values())[0].waiters == 2


def test_stale_round_is_retried_upstream(coalescing):
    dp = coalescing
    dp.set("pending_ns", 1)                 # every round is stale at once
    run(dp, get_frame(req_id=1))
    before = dp.counters()
    again = bytes(get_frame(req_id=2, src=HOST2_IP))
    assert run(dp, again, port="host2") == (XDP.PASS, again)
    after = dp.counters()
    assert after["expired"] - before["expired"] == 1
    rnd = list(dp.pending.values())[0]      # the same round, asked again: its waiters stay
    assert rnd.first_ifindex == PORTS["host"] and rnd.waiters == 2


@pytest.mark.parametrize("elsewhere", [dict(dst="198.18.0.250"), dict(dst_mac="02:00:00:00:00:fa"),
                                       dict(dst="198.18.0.250", dst_mac="02:00:00:00:00:fa")])
def test_a_round_holds_only_gets_addressed_where_it_went(coalescing, elsewhere):
    """A round sent where nobody answers (to stall others) must not capture the GETs of the
    chunk's real pool node; and a round to the pool does not capture GETs sent elsewhere."""
    dp = coalescing
    stall = bytes(get_frame(req_id=1, src=HOST2_IP, **elsewhere))
    assert run(dp, stall, port="host2") == (XDP.PASS, stall)
    before = dp.counters()
    real = bytes(get_frame(req_id=2))
    assert run(dp, real) == (XDP.PASS, real), "the real GET goes on to the pool node"
    after = dp.counters()
    assert after["other_dest"] - before["other_dest"] == 1
    assert after["coalesced"] == before["coalesced"]
    assert list(dp.pending.values())[0].waiters == 1


def test_a_requester_re_arming_an_unanswered_round_holds_others_one_timeout_at_most(coalescing):
    """The stall of issue 26: a requester whose GETs the pool never answers asks again as soon
    as its round expires. Once a round has expired unanswered, nobody is held for the chunk
    until a reply for it passes; then coalescing resumes."""
    dp = coalescing
    attacker, victim = (dict(req_id=1, src=HOST2_IP), "host2"), (dict(req_id=2), "host")
    assert run(dp, get_frame(**attacker[0]), port=attacker[1])[0] == XDP.PASS   # opens a round
    assert run(dp, get_frame(**victim[0]), port=victim[1])[0] == XDP.DROP       # held in it
    dp.set("pending_ns", 1)                        # the round's pending timeout passes
    before = dp.counters()
    assert run(dp, get_frame(**attacker[0]), port=attacker[1])[0] == XDP.PASS   # re-armed
    dp.set("pending_ns", 10 ** 9)
    for _ in range(3):                             # however often it re-arms ...
        assert run(dp, get_frame(**attacker[0]), port=attacker[1])[0] == XDP.PASS
        frame = bytes(get_frame(**victim[0]))
        assert run(dp, frame, port=victim[1]) == (XDP.PASS, frame), "the victim is not held"
    after = dp.counters()
    assert after["expired"] - before["expired"] == 1
    assert after["unheld"] - before["unheld"] == 6 and after["coalesced"] == before["coalesced"]
    reply = bytes(reply_frame())                   # the pool answers the victim's GET
    gen = list(dp.pending.values())[0].gen
    verdict, out = run(dp, reply, port="pool")     # to both: the victim was held in the round
    assert verdict == XDP.REDIRECT and out == broadcast_of(reply, gen)
    assert len(dp.pending) == 0, "a reply closes the probation"
    assert run(dp, get_frame(**victim[0]), port=victim[1])[0] == XDP.PASS
    assert run(dp, get_frame(**attacker[0]), port=attacker[1])[0] == XDP.DROP, "held again"


@pytest.mark.parametrize("bad", ["pseudo-header checksum", "wrong checksum", "port 0"])
def test_a_get_the_pool_would_not_answer_opens_no_round(coalescing, bad):
    dp = coalescing
    if bad == "port 0":
        frame, verdict = bytes(get_frame(sport=0, src=HOST2_IP)), XDP.DROP
    else:
        frame = bytearray(bytes(get_frame(src=HOST2_IP)))
        frame[40:42] = (_pseudo_sum(frame) if bad == "pseudo-header checksum" else
                        (int.from_bytes(frame[40:42], "big") ^ 0x0101).to_bytes(2, "big"))
        frame, verdict = bytes(frame), XDP.PASS
    for _ in range(3):
        assert run(dp, frame, port="host2") == (verdict, frame)
    assert len(dp.pending) == 0 and len(dp.waiters) == 0, "no round, nobody waiting"
    victim = bytes(get_frame(req_id=2))
    assert run(dp, victim) == (XDP.PASS, victim), "the victim's GET goes upstream"
    assert list(dp.pending.values())[0].first_ifindex == PORTS["host"]


def _pseudo_sum(frame: bytes) -> bytes:
    """The partial form a stack leaves for offload: the pseudo-header's folded sum."""
    from kvproto.frames import ip_checksum
    pseudo = bytes(frame[26:34]) + b"\0\x11" + bytes(frame[38:40])
    return (~ip_checksum(pseudo) & 0xFFFF).to_bytes(2, "big")


def test_coalescing_off_forwards_every_miss(dp, cache):
    for port, req in (("host", 1), ("host2", 2)):
        frame = bytes(get_frame(req_id=req))
        assert run(dp, frame, port=port) == (XDP.PASS, frame)
    assert len(dp.pending) == 1, "the request is outstanding (its reply may be learned)"
    assert len(dp.waiters) == 0, "but nobody is held"


# ---- port security ---------------------------------------------------------------------------
@pytest.mark.parametrize("port", ["host", "pool"])
def test_puts_are_never_learned(dp, cache, port):
    cache.admit(5, KEY)
    run(dp, get_frame())                  # even with a request for the chunk outstanding
    raw = bytes(put_frame(payload=b"planted"))
    assert run(dp, raw, port=port) == (XDP.PASS, raw)
    assert cache.get(5, KEY, 3) is None


# ---- the verifier accepts every deployment --------------------------------------------------
@pytest.mark.parametrize("chunk_size", [8, 3072, 3424])
def test_the_verifier_accepts_the_program_at_every_chunk_size(chunk_size):
    """The CRC loop runs KV_CHUNK / 16 times: the largest chunk is the verifier's hardest case."""
    from kvproto import MAX_CHUNK
    assert chunk_size <= MAX_CHUNK
    dp = DataPlane(Deployment(chunk_size=chunk_size, cache_entries=64, pin_dir=None))
    assert dp.ingress.fd > 0 and dp.egress.fd > 0
    dp.bpf.cleanup()
