"""A pool node's XDP GET path (xdp/kvserve.c, loaded by hostagent.pool.xdpserve) on crafted frames
through BPF_PROG_TEST_RUN: a GET for a chunk of a block staged in the XDP arena becomes the exact
GET_REPLY (the writer's CRC, not FROM_SWITCH); everything else passes untouched (another chunk,
block or namespace, a stale generation, too little room, a bad UDP checksum, another address,
PUTs, malformed and foreign frames); the arena is the staging memory (no copy), retracting a
block stops serving it, and the counters say what happened. No interface needed."""
import zlib

import numpy as np
import pytest
from scapy.layers.inet import IP, UDP
from scapy.layers.l2 import Ether
from scapy.packet import Raw

from hostagent.pool.blockfmt import ObjectLayout, write_block
from hostagent.pool.staging import Staging
from hostagent.pool.xdpserve import SEG, ServeProgram, XdpArena
from kvproto import PORT, Op, checksum
from kvproto.frames import XDP
from kvproto.scapy_layer import KV
from xdp.libbpf import xdp_test_run
from xdp_fixtures import (HOST_IP, HOST_MAC, KEY, POOL_IP, POOL_MAC, _malformed, get_frame,
                          put_frame)

pytestmark = pytest.mark.bpf

NS, CS = 5, 1024
ARENA = 2 * SEG                  # two segments: room to place a chunk at a segment's end


def payload(n: int, seed: int = 1) -> bytes:
    return bytes((i * 7 + seed * 13 + i // 251) & 0xFF for i in range(n))


@pytest.fixture(scope="module")
def prog():
    p = ServeProgram(ARENA)
    p.set_addrs([POOL_IP])
    yield p
    p.close()


@pytest.fixture
def staging(prog):
    """An empty staging area over the program's memory, its slots and index cleared."""
    prog.slots[:] = np.zeros(1, prog.slots.dtype)
    prog.index.clear()
    return Staging(XdpArena(prog, ARENA))


def stage(staging, data: bytes, ns=NS, key=KEY, cs=CS, crcs=None, source=None):
    chunks = [data[i:i + cs] for i in range(0, len(data), cs)]
    crcs = crcs or [zlib.crc32(c) for c in chunks]
    layout = ObjectLayout.for_payload(ns, key, len(data), cs)
    run = staging.reserve(layout.size)
    write_block(run.view, layout, chunks, crcs)          # straight into the program's memory
    from array import array
    return staging.commit(run, layout, array("I", crcs),
                          meta=None if source is None else {"source": source})


def reply(data: bytes, chunk: int, nchunks: int, crc=None, ns=NS, req_id=0xABCD) -> bytes:
    """The reply `hostagent serve` would send for get_frame(chunk=...), byte for byte (UDP
    checksum 0 as the switch's replies, flags 0: not from the switch)."""
    return bytes(Ether(src=POOL_MAC, dst=HOST_MAC) / IP(src=POOL_IP, dst=HOST_IP, id=77, ttl=64) /
                 UDP(sport=PORT, dport=40000, chksum=0) /
                 KV(op=Op.GET_REPLY, ns=ns, req_id=req_id, key=KEY, chunk=chunk,
                    nchunks=nchunks, flags=0, csum=checksum(data) if crc is None else crc) /
                 Raw(data))


def run(prog, frame):
    before = prog.counters()
    verdict, out = xdp_test_run(prog.fd, bytes(frame))
    after = prog.counters()
    return verdict, out, {k: after[k] - before[k] for k in after if after[k] != before[k]}


def test_every_chunk_is_served_byte_exact(prog, staging):
    data = payload(3 * CS + 700)                        # the last chunk is shorter
    stage(staging, data)
    for i in range(4):
        chunk = data[i * CS:(i + 1) * CS]
        verdict, out, delta = run(prog, get_frame(chunk=i, room=CS))
        assert verdict == XDP.TX and out == reply(chunk, i, 4)
        assert delta == {"packets": 1, "hit": 1, "hit_bytes": len(chunk)}
        assert not out[46] & 1                          # kvhdr flags: no FROM_SWITCH


def test_exact_room_and_other_chunk_sizes(prog, staging):
    data = payload(2 * 3072 + 5, seed=2)
    stage(staging, data, cs=3072)
    verdict, out, _ = run(prog, get_frame(chunk=1, room=3072))
    assert verdict == XDP.TX and out == reply(data[3072:6144], 1, 3)
    verdict, out, _ = run(prog, get_frame(chunk=2, room=5))
    assert verdict == XDP.TX and out == reply(data[6144:], 2, 3)


def test_the_writers_crc_is_sent(prog, staging):
    """The reply carries the CRC the writer sent, as `hostagent serve` answers."""
    data = payload(CS)
    stage(staging, data, crcs=[0x12345678])
    verdict, out, _ = run(prog, get_frame(chunk=0))
    assert verdict == XDP.TX and out == reply(data, 0, 1, crc=0x12345678)


def test_the_arena_is_the_staging_memory(prog, staging):
    """Bytes written where a staged chunk lies are what XDP sends: no copy in between."""
    block = stage(staging, payload(2 * CS))
    view, _ = block.chunk(1)
    view[:4] = b"ZERO"
    verdict, out, _ = run(prog, get_frame(chunk=1))
    assert verdict == XDP.TX and out[90:94] == b"ZERO"


def _passes(prog, frame, counter):
    frame = bytes(frame)
    verdict, out, delta = run(prog, frame)
    assert verdict == XDP.PASS and out == frame, counter
    assert delta.get(counter) == 1 and "hit" not in delta, (counter, delta)


@pytest.mark.parametrize("frame, counter", [
    (get_frame(chunk=4), "bad_chunk"),                       # past the block's last chunk
    (get_frame(ns=6, chunk=0), "passed"),                    # another namespace
    (get_frame(key=KEY[:-1] + b"\x01", chunk=0), "passed"),  # another block
    (get_frame(chunk=0, room=CS - 1), "no_room"),
    (get_frame(chunk=3, room=699), "no_room"),               # the short last chunk, one short
    (get_frame(chunk=0, dst="198.18.0.102"), "not_mine"),
    (get_frame(chunk=0, dst_mac="ff:ff:ff:ff:ff:ff"), "not_mine"),
    (put_frame(), "other_kv"),
    (Ether() / IP() / UDP(dport=53) / Raw(b"q"), "non_kv"),
], ids=["chunk past the end", "other namespace", "other key", "too little room",
        "last chunk too little room", "another address", "broadcast", "put", "not kv"])
def test_what_is_not_served_passes_untouched(prog, staging, frame, counter):
    stage(staging, payload(3 * CS + 700))
    _passes(prog, frame, counter)


def test_a_bad_udp_checksum_passes(prog, staging):
    stage(staging, payload(CS))
    frame = bytearray(bytes(get_frame(chunk=0)))
    frame[40:42] = (int.from_bytes(frame[40:42], "big") ^ 0x0101).to_bytes(2, "big")
    _passes(prog, frame, "bad_udp_csum")
    frame = get_frame(chunk=0)
    frame[Raw].load = bytes(CS - 1) + b"\x01"            # room that is not zeros (checksummed)
    _passes(prog, frame, "bad_udp_csum")


@pytest.mark.parametrize("name, frame", _malformed(), ids=[n for n, _ in _malformed()])
def test_malformed_and_foreign_frames_pass(prog, staging, name, frame):
    stage(staging, payload(9 * CS))
    verdict, out, delta = run(prog, frame)
    assert verdict == XDP.PASS and out == frame and "hit" not in delta


def test_a_stale_generation_is_not_served(prog, staging):
    block = stage(staging, payload(2 * CS))
    first = block.meta["xdp_slots"]
    prog.slots["gen"][first + 1] = 0                       # as retract leaves it
    _passes(prog, get_frame(chunk=1), "reused")
    assert run(prog, get_frame(chunk=0))[0] == XDP.TX


def test_a_slot_naming_another_chunk_is_not_served(prog, staging):
    block = stage(staging, payload(2 * CS))
    first = block.meta["xdp_slots"]
    prog.slots["chunk"][first + 1] = 0                     # an index pointing at a wrong slot
    _passes(prog, get_frame(chunk=1), "reused")


def test_a_retracted_block_is_not_served_and_its_slots_are_reused(prog, staging):
    block = stage(staging, payload(2 * CS))
    first = block.meta["xdp_slots"]
    assert staging.remove(NS, KEY)
    assert not prog.slots["gen"][first:first + 2].any() and len(prog.index) == 0
    _passes(prog, get_frame(chunk=0), "passed")
    data = payload(2 * CS, seed=3)
    again = stage(staging, data)
    assert again.meta["xdp_slots"] == first                # slots and pages reused
    verdict, out, _ = run(prog, get_frame(chunk=1))
    assert verdict == XDP.TX and out == reply(data[CS:], 1, 2)


def test_a_replaced_block_serves_the_new_bytes(prog, staging):
    stage(staging, payload(CS, seed=4))
    new = payload(CS, seed=5)
    stage(staging, new)
    verdict, out, _ = run(prog, get_frame(chunk=0))
    assert verdict == XDP.TX and out == reply(new, 0, 1)
    assert len(prog.index) == 1


def test_a_chunk_at_a_segments_end_is_left_to_the_server(prog, staging):
    """The verifier sees every copy inside one segment: a chunk starting in the last
    KV_MAX_PAYLOAD bytes of one passes (the server answers it); its neighbours are served."""
    page = staging.arena.page
    filler = staging.reserve(SEG - page)                   # the next run starts a page before
    data = payload(8 * CS, seed=6)                         # the segment's end
    block = stage(staging, data)
    offs = prog.slots["off"][block.meta["xdp_slots"]:][:8]
    straddle = [i for i in range(8) if offs[i] % SEG > SEG - 3444]
    assert straddle
    for i in range(8):
        frame = get_frame(chunk=i)
        if i in straddle:
            _passes(prog, frame, "seg_end")
        else:
            verdict, out, _ = run(prog, frame)
            assert verdict == XDP.TX and out == reply(data[i * CS:(i + 1) * CS], i, 8)
    staging.release(filler)


def test_recency_from_xdp_hits_orders_eviction(prog, staging):
    """Blocks XDP served are evicted after blocks nobody asked for, though Python never saw
    the GETs."""
    arena = staging.arena
    nblocks = 4
    size = (arena.size // nblocks) - 2 * arena.page
    keys = [bytes([k]) * 16 for k in range(1, nblocks + 1)]
    for k in keys:
        stage(staging, payload(size - 4096, seed=k[0]), key=k)
    assert run(prog, get_frame(key=keys[0], chunk=0))[0] == XDP.TX   # the oldest, but served
    stage(staging, payload(size - 4096, seed=9), key=b"\x09" * 16)   # evicts one
    assert staging.get(NS, keys[0], touch=False) is not None
    assert staging.get(NS, keys[1], touch=False) is None


def test_a_blocks_slots_come_with_its_pages(prog, staging):
    """Slots are where the block's run is (arena offset / 1 KiB): no allocator to exhaust."""
    arena = staging.arena
    first = stage(staging, payload(3 * CS), key=b"\x01" * 16)
    second = stage(staging, payload(8 * CS), key=b"\x02" * 16)
    for b in (first, second):
        assert b.meta["xdp_slots"] == -(-b.run.start * arena.page // 1024)
        assert not b.meta["xdp_dense"]


def test_tiny_chunks_take_dense_slots_within_a_namespaces_share(prog, staging):
    """A block of 64,000 one-byte chunks (issue #26 took 64,000 of 65,536 slots with one) gets
    no slots: it is answered by the server process; small-chunk blocks take dense slots up to a
    namespace's share; another namespace's blocks are still served from XDP."""
    arena = staging.arena
    share = arena.dense_per_ns
    assert share == (prog.nslots - prog.mapped_slots) // 4
    hog = stage(staging, payload(64_000), ns=2, key=b"\x0a" * 16, cs=1)
    assert "xdp_slots" not in hog.meta and arena.counters["xdp_dense_refused"] == 1
    small = share // 2 + 1                             # two of these do not fit one share
    tiny = stage(staging, payload(small * 8), ns=2, key=b"\x0b" * 16, cs=8)
    assert tiny.meta["xdp_dense"] and arena.ns_dense[2] == small
    verdict, out, _ = run(prog, get_frame(ns=2, key=b"\x0b" * 16, chunk=small - 1, room=8))
    assert verdict == XDP.TX and out[-8:] == payload(small * 8)[-8:]
    again = stage(staging, payload(small * 8, seed=2), ns=2, key=b"\x0c" * 16, cs=8)
    assert "xdp_slots" not in again.meta and arena.counters["xdp_dense_refused"] == 2
    theirs = stage(staging, payload(small * 8, seed=3), ns=NS, key=b"\x0d" * 16, cs=8)
    assert theirs.meta["xdp_dense"]                    # another namespace: its own share
    data = payload(300 * CS, seed=4)
    block = stage(staging, data)                       # full-size chunks: slots of its own
    assert not block.meta["xdp_dense"]
    for i in (0, 150, 299):
        verdict, out, _ = run(prog, get_frame(chunk=i))
        assert verdict == XDP.TX and out == reply(data[i * CS:(i + 1) * CS], i, 300)
    assert staging.remove(2, b"\x0b" * 16) and 2 not in arena.ns_dense   # given back


def test_one_source_gets_one_share_of_dense_slots_whatever_its_namespaces(prog, staging):
    arena = staging.arena
    small = arena.dense_per_ns // 2 + 1
    first = stage(staging, payload(small * 8), ns=2, key=b"\x0b" * 16, cs=8, source="h2")
    assert first.meta["xdp_dense"] and arena.src_dense["h2"] == small
    other_ns = stage(staging, payload(small * 8), ns=3, key=b"\x0c" * 16, cs=8, source="h2")
    assert "xdp_slots" not in other_ns.meta                       # h2's share is spent
    other_src = stage(staging, payload(small * 8), ns=4, key=b"\x0d" * 16, cs=8, source="h4")
    assert other_src.meta["xdp_dense"]
    assert staging.remove(2, b"\x0b" * 16) and "h2" not in arena.src_dense


@pytest.mark.e2e
def test_a_pool_node_serves_gets_from_xdp_and_a_restarted_one_too():
    """`hostagent serve` in a testbed: GETs are answered by its XDP program (its hit counter),
    byte-exact, with no switch in the way; SIGTERM stops it cleanly (exit 0, its last counters
    written); a restarted server attaches again and serves."""
    import os
    from testbed.lab import Lab
    from testbed.lab.topology import namespaces_of
    prefix = f"sv{os.getpid() % 100000}"
    with Lab(prefix, hosts=1, pools=1, switch=False, chunk_size=3072) as lab:
        assert "answered by XDP on eth0" in lab.pool_log(0)
        key, block = os.urandom(16), os.urandom(3072 * 300 + 1000)
        lab.put("h1", NS, key, block)
        for _ in range(2):
            stats, data = lab.get("h1", NS, key)
            assert data == block and stats["from_pool"] == 301
        counters = lab.pool_counters()
        assert counters["xdp_hit"] >= 2 * 301 - counters["xdp_seg_end"] * 2
        assert counters["xdp_hit_bytes"] >= 2 * (len(block) - 2 * 3072 * counters["xdp_seg_end"])
        hits = lab.pool_counters()["xdp_hit"]
        # a clean stop: exit 0, nothing logged as an error, the last counters written
        assert lab.stop_pool(0) == 0
        assert "error" not in lab.pool_log(0)
        assert lab.pool_final_counters()["xdp_hit"] == hits
        lab.start_pool(0)
        lab.put("h1", NS, key, block)
        stats, data = lab.get("h1", NS, key)
        assert data == block and lab.pool_counters()["xdp_hit"] > 0
    assert not namespaces_of(prefix)


@pytest.mark.e2e
def test_a_put_hog_in_one_namespace_leaves_another_its_puts_and_xdp_serving():
    """Issue #26's PUT abuse from h2 (namespace 2) against a pool node with small budgets, while
    h1 (namespace 1) PUTs and GETs: h1's PUTs all succeed, byte-exact, its chunks are answered by
    the pool's XDP program; the hog is refused past its budgets, its slot-hogging block is left
    to the server process, its re-sent chunk 0s keep nothing alive, and the pool's memory grows
    by about what the assembler charges."""
    import os
    from pool_abuse import run_scenario
    from testbed.lab.topology import namespaces_of
    prefix = f"pa{os.getpid() % 100000}"
    r = run_scenario(prefix, ("--assembly", "96MiB", "--assembly-per-ns", "48MiB",
                              "--assembly-per-source", "48MiB", "--assembly-timeout", "6"),
                     seconds=10, bulk_blocks=4, bulk_chunks=16384, incomplete=400,
                     tiny=50_000, rounds=3)
    assert not namespaces_of(prefix)
    other, end = r["other_tenant"], r["end"]
    assert other["puts"] == other["gets"] == other["byte_exact"] == 3, r
    assert other["xdp_share"] >= 0.98, r                  # (a chunk at a segment's end: Python)
    assert end["refused_ns"] > 0 and end["xdp_dense_refused"] >= 1, r
    assert r["peak"]["assembling_bytes"] <= 48 << 20, r
    # every block the hog held at its peak expired (how many its budgets let in varies)
    assert end["resent_chunks"] > 0 and end["expired_blocks"] >= r["peak"]["assembling_blocks"], r
    assert end["assembling_payload_bytes"] < 1 << 20, r  # re-sent chunk 0s kept nothing alive
    # (an upper bound: the heap BCC's compile left behind is reused first)
    assert r["rss_per_charged_byte"] < 1.5, r
