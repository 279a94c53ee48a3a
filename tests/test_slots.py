"""The cache's slots (xdp/kvslot.h, switchd/slots.py) on crafted frames through
BPF_PROG_TEST_RUN: a slot is served only when it holds a finished write of the chunk asked for, for
the block's current allocation; writers exclude each other; a reader racing a writer never sends
torn bytes; the data plane carves what it learns before switchd placed it from the fill region,
which switchd's step grants again."""
import ctypes
import os
import signal
import time
import zlib

import pytest
from kvproto import HEADER_LEN, OFFSET
from kvproto.frames import HDR_OFF, XDP
from switchd.dataplane import SwitchError
from xdp.libbpf import xdp_test_run
from xdp_switch import cache, dp, hold_slot, ports_namespace, run  # noqa: F401
from xdp_fixtures import KEY, PAYLOAD, get_frame, reply_frame

pytestmark = pytest.mark.bpf


@pytest.mark.parametrize("owner", ["other chunk", "other namespace", "other key", "nobody",
                                   "other allocation"])
def test_an_entry_rewritten_for_another_chunk_is_never_served(dp, cache, owner):
    """The block index only says where to look: the hit path serves a slot only if it was
    written for the block's current allocation and names the very chunk asked for."""
    cache.put(5, KEY, 3, PAYLOAD, nchunks=9)
    k = dp.cache.Key(cache.slot_of(5, KEY, 3))
    v = dp.cache[k]
    if owner == "nobody":
        ctypes.memset(ctypes.addressof(v.owner), 0, ctypes.sizeof(v.owner))
    elif owner == "other allocation":
        v.gen ^= 1
    else:
        v.owner.chunk, v.owner.ns, v.owner.key[0] = {
            "other chunk": (4, 5, KEY[0]), "other namespace": (3, 6, KEY[0]),
            "other key": (3, 5, KEY[0] ^ 1)}[owner]
    dp.cache[k] = v
    frame = bytes(get_frame())
    before = dp.counters()
    assert run(dp, frame) == (XDP.PASS, frame)      # a miss: on to the pool node
    after = dp.counters()
    reused = 0 if owner == "other allocation" else 1   # stale slots are plain misses
    assert after["reused"] - before["reused"] == reused and after["get_hit"] == before["get_hit"]
    assert cache.get(5, KEY, 3) is None and cache.entries() == []


def test_the_writer_never_takes_a_slot_another_writer_holds(dp, cache):
    """switchd's writes go through the same claim as the data plane's fills: a slot held by a
    writer is neither rewritten nor filled until it is let go; then both work again."""
    cache.put(5, KEY, 3, PAYLOAD, nchunks=9)
    cache.admit(5, KEY)
    hold_slot(dp, cache, 5, KEY, 3)
    try:
        with pytest.raises(SwitchError, match="busy"):
            cache.slots.clear(cache.slot_of(5, KEY, 3))
        run(dp, get_frame())                       # a miss (the slot is mid-write): a round
        before = dp.counters()
        raw = bytes(reply_frame(payload=PAYLOAD[::-1]))
        assert run(dp, raw, port="pool") == (XDP.PASS, raw)
        assert dp.counters()["fill_fail"] - before["fill_fail"] == 1
    finally:
        hold_slot(dp, cache, 5, KEY, 3, held=False)
    assert cache.get(5, KEY, 3)[1] == PAYLOAD     # neither write landed
    cache.put(5, KEY, 3, PAYLOAD[::-1], nchunks=9)
    verdict, out = run(dp, get_frame())
    assert verdict == XDP.TX and out[HDR_OFF + HEADER_LEN:] == PAYLOAD[::-1]


def test_a_block_learned_before_it_was_placed_gets_a_prefix_of_what_the_region_has_left(dp,
                                                                                        cache):
    """An admitted block of unknown size is carved from the fill region when its first reply
    passes: its first chunks if the region cannot hold them all; switchd gives it its whole range
    once admitted with a known size (a new allocation: the carved chunks are not served again)."""
    start, _ = cache.slots.grant_region(4)
    cache.admit(5, KEY)
    for chunk in (0, 5):
        run(dp, get_frame(chunk=chunk))
        before = dp.counters()
        run(dp, bytes(reply_frame(chunk=chunk)), port="pool")
        learned = dp.counters()["fill"] - before["fill"]
        assert learned == (chunk < 4), chunk     # chunk 5 has no slot: not learned
    b = cache.slots.block(5, KEY)
    assert (b.base, b.nchunks, b.slots) == (start, 9, 4) and b.gen >= 1 << 31
    assert [e.chunk for e in cache.entries()] == [0]
    assert run(dp, get_frame(chunk=0))[0] == XDP.TX
    cache.place_admitted({(5, KEY): 9})
    b = cache.slots.block(5, KEY)
    assert b.slots == 9 and b.gen < 1 << 31 and cache.entries() == []
    run(dp, get_frame(chunk=5))
    run(dp, bytes(reply_frame(chunk=5)), port="pool")
    assert cache.get(5, KEY, 5)[1] == PAYLOAD


def _refill(dp, cache) -> int:
    """Drop the block, admit it again and pass every chunk's GET and pool reply: chunks learned."""
    cache.evict(5, KEY)
    cache.admit(5, KEY)
    before = dp.counters()["fill"]
    for chunk in range(9):
        run(dp, get_frame(chunk=chunk))
        run(dp, bytes(reply_frame(chunk=chunk)), port="pool")
    return dp.counters()["fill"] - before


def test_switchds_step_gives_a_dropped_blocks_slots_back_to_the_data_plane(dp, cache):
    """Each refill of a dropped block is carved from the fill region anew, so refills between
    two of switchd's steps use it up and the next goes unlearned (`bench fetch` once refilled a
    64 MiB block five times within a second); switchd's step (``tend``) grants a region again,
    over the dropped block's slots, and the block is learned whole."""
    cache.slots.grant_region(18)                    # room for two refills of 9 chunks
    assert [_refill(dp, cache) for _ in range(3)] == [9, 9, 0]
    cache.tend({})
    assert _refill(dp, cache) == 9
    assert all(run(dp, get_frame(chunk=c))[0] == XDP.TX for c in range(9))


def _put_command(cache, monkeypatch, payload: bytes) -> bytes:
    """The writer program's command putting chunk 3 of (5, KEY) with ``payload`` (what a put
    would run, kept instead of run)."""
    made = []
    with monkeypatch.context() as m:
        m.setattr(cache.slots, "_run", made.append)
        cache.put(5, KEY, 3, payload, nchunks=9)
    return made[0]


def test_a_reader_racing_a_writer_never_sends_torn_bytes(dp, cache, monkeypatch):
    """The writer program rewrites one chunk over and over, alternating two payloads of the same
    length, in a process of its own on one CPU while GETs for it run here on the other: every
    reply carries one payload whole, with its CRC; the GETs that met the slot mid-write are
    misses or dropped half-made replies (counter `reused`), never a mix."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:        # on one CPU a program run is never cut by another: no race to see
        pytest.fail(f"this test races a writer on one CPU against GETs on another: it needs 2 "
                    f"CPUs, and this process may run on {len(cpus)} (os.sched_getaffinity; "
                    "give it more with taskset or a bigger machine)", pytrace=False)
    a, b = bytes(range(256)) * 4, bytes(255 - i for i in range(256)) * 4
    cache.put(5, KEY, 3, a, nchunks=9)
    commands = [_put_command(cache, monkeypatch, a), _put_command(cache, monkeypatch, b)]
    crcs = {a: zlib.crc32(a), b: zlib.crc32(b)}
    frame, at, csum = bytes(get_frame(room=1024)), HDR_OFF + HEADER_LEN, HDR_OFF + OFFSET["csum"]
    before = dp.counters()
    child = os.fork()
    if not child:                      # the writer
        try:
            os.sched_setaffinity(0, {cpus[1]})
            while True:
                for command in commands:
                    xdp_test_run(dp.writer.fd, command, repeat=1000)
        finally:
            os._exit(0)
    os.sched_setaffinity(0, {cpus[0]})
    served, raced, start = {a: 0, b: 0}, 0, time.monotonic()
    try:           # 3 s at least (a torn copy is rarer than a read meeting a write), 10 at most
        while (time.monotonic() < start + 3 or not (raced and min(served.values()))) and \
                time.monotonic() < start + 10:
            for _ in range(10000):
                verdict, out = run(dp, frame)
                if verdict == XDP.TX:
                    payload = out[at:at + 1024]
                    assert payload in crcs, "torn reply"
                    assert int.from_bytes(out[csum:csum + 4], "big") == crcs[payload]
                    served[payload] += 1
            raced = dp.counters()["reused"] - before["reused"]
    finally:
        os.kill(child, signal.SIGKILL)
        os.waitpid(child, 0)
        os.sched_setaffinity(0, set(cpus))
    assert raced and min(served.values()), (raced, served)
