"""The fetch engine's XDP program (xdp/kvfetch.c) on crafted frames through BPF_PROG_TEST_RUN: a
reply for the active transfer lands in its slot; nothing else is ever written or accepted
(another transfer, an old generation, another key or namespace, a chunk past the block, a
truncated frame; a bad CRC is written but never accepted); no frame makes it transmit. The send
ring turns queued entries into exact GETs with UDP checksum 0 and a zeroed room, which the switch
serves. Loaded from the compiled-bytecode cache as the engine loads it."""
import zlib

import numpy as np
import pytest
from scapy.layers.inet import IP, UDP
from scapy.layers.l2 import ARP, Ether

from hostagent.inference.fetch.crcfold import Folder
from hostagent.inference.fetch.netpath import route_header
from hostagent.inference.fetch.program import C, GEN_MASK, SENDQ, FetchProgram
from hostagent.inference.fetch.sendring import SendRing
from hostagent.inference.fetch.transfers import Route, Transfer
from hostagent.inference.fetch.verify import verify
from kvproto import PORT, Flag, Op, Status
from kvproto.frames import PAYLOAD_OFF, XDP
from kvproto.scapy_layer import KV
from xdp.libbpf import xdp_test_run

from fetch_fixtures import (BASE, CS, ENGINE_PORT, GEN, IDX, KEY, NCHUNKS, NEVER_WRITTEN, NODE_IP,
                            NODE_MAC, NS, POOL2_IP, POOL2_MAC, POOL_IP, POOL_MAC, SLOTS,
                            TAIL, chunk, reply)

pytestmark = pytest.mark.bpf


@pytest.fixture(scope="module")
def prog():
    p = FetchProgram(CS, SLOTS)
    yield p
    p.close()


@pytest.fixture
def fp(prog):
    """A fresh state: transfer IDX active for block (NS, KEY) of NCHUNKS chunks at BASE."""
    prog.arena[:] = 0
    prog.meta[:] = 0
    prog.xfers[:] = np.zeros(1, prog.xfers.dtype)
    ctl = prog.ctl[0]
    ctl["port"] = int.from_bytes(ENGINE_PORT.to_bytes(2, "big"), "little")
    ctl["loss_ppm"] = 0
    prog.set_route(0, route_header(NODE_MAC, POOL_MAC, NODE_IP, ENGINE_PORT, POOL_IP, PORT, CS))
    prog.set_route(1, route_header(NODE_MAC, POOL2_MAC, NODE_IP, ENGINE_PORT, POOL2_IP, PORT, CS))
    prog.set_transfer(IDX, GEN, NS, KEY, NCHUNKS, BASE, NCHUNKS)
    return prog


def run(prog, frame, meta=b""):
    return xdp_test_run(prog.fd, frame, meta=meta)


def landed(prog) -> dict[int, tuple[int, int, int]]:
    """Slots with a word: slot -> (crc, generation, flags)."""
    out = {}
    for s in np.flatnonzero(prog.meta).tolist():
        w = int(prog.meta[s])
        out[s] = (w & 0xFFFFFFFF, (w >> 32) & GEN_MASK, w >> 56)
    return out


def test_a_reply_for_the_active_transfer_lands_in_its_slot(fp):
    before = fp.counters()
    assert run(fp, reply(1, flags=Flag.FROM_SWITCH))[0] == XDP.DROP
    slot = BASE + 1
    assert bytes(fp.arena[slot * CS:(slot + 1) * CS]) == chunk(1)
    assert landed(fp) == {slot: (zlib.crc32(chunk(1)), GEN, int(Flag.FROM_SWITCH))}
    x = fp.xfers[IDX]
    assert x["received"] == 1 and x["status"] == 0 and x["bad"] == 0
    assert fp.counters()["accepted"] - before["accepted"] == 1
    rest = np.concatenate([fp.arena[:slot * CS], fp.arena[(slot + 1) * CS:]])
    assert not rest.any(), "another byte of the arena was written"
    # the whole block, in any order, lands contiguously; the short last chunk's length is kept
    for i in (3, 0, 2):
        assert run(fp, reply(i))[0] == XDP.DROP
    expect = b"".join(chunk(i, TAIL if i == NCHUNKS - 1 else CS) for i in range(NCHUNKS))
    assert bytes(fp.arena[BASE * CS:BASE * CS + len(expect)]) == expect
    assert x["received"] == NCHUNKS and x["tail_len"] == TAIL


@pytest.mark.parametrize("case", NEVER_WRITTEN, ids=[c.name for c in NEVER_WRITTEN])
def test_nothing_else_is_ever_written(fp, case):
    if case.route:
        fp.set_transfer(IDX, GEN, NS, KEY, NCHUNKS, BASE, NCHUNKS, route=case.route)
    before = fp.counters()
    assert run(fp, case.frame)[0] == case.verdict, case.name
    assert not fp.arena.any(), f"{case.name}: arena written"
    assert not fp.meta.any(), f"{case.name}: slot word written"
    x = fp.xfers[IDX]
    assert x["received"] == 0 and x["gen"] == GEN
    # a reply saying the block has another size fails the transfer (the engine raises)
    assert x["status"] == case.status
    assert fp.counters()[case.counter] - before[case.counter] == 1, case.name


def test_a_forged_reply_from_the_wrong_source_loses_no_real_one(fp):
    """A forger that guessed the request id gets nothing written, and the pool's real reply
    for the same chunk then lands (it is not dropped as a duplicate)."""
    assert run(fp, reply(1, payload=chunk(9), src_ip="198.18.0.2"))[0] == XDP.DROP
    assert not fp.meta.any()
    assert run(fp, reply(1))[0] == XDP.DROP
    assert bytes(fp.arena[(BASE + 1) * CS:(BASE + 2) * CS]) == chunk(1)


def test_a_late_reply_of_the_previous_transfer_in_the_entry_never_lands(fp):
    """The stale-generation rule: an entry reused by a new transfer (new generation, other
    slots) takes no reply addressed to the transfer that had it before."""
    run(fp, reply(1))
    fp.set_transfer(IDX, GEN + 1, NS, KEY, NCHUNKS, BASE + 20, NCHUNKS)   # the entry reused
    before = fp.counters()["stale"]
    assert run(fp, reply(2))[0] == XDP.DROP                                # GEN's reply
    assert fp.counters()["stale"] == before + 1
    assert list(landed(fp)) == [BASE + 1], "only the old transfer's own slot holds a word"
    assert run(fp, reply(2, req_id=(IDX << 24) | (GEN + 1)))[0] == XDP.DROP
    assert list(landed(fp)) == [BASE + 1, BASE + 22]


def test_a_duplicate_never_rewrites_a_held_chunk(fp):
    run(fp, reply(1))
    before = fp.counters()
    assert run(fp, reply(1, payload=chunk(9)))[0] == XDP.DROP   # other bytes, their own CRC
    assert bytes(fp.arena[(BASE + 1) * CS:(BASE + 2) * CS]) == chunk(1)
    assert fp.counters()["duplicate"] - before["duplicate"] == 1
    assert fp.xfers[IDX]["received"] == 1


class _Ring:
    cons = prod = 0
    done_time = np.full(SENDQ, np.inf)              # no call has ended

    def sent_time(self, seq, queued):
        return queued


def test_a_bad_crc_is_never_accepted_and_its_chunk_is_taken_again(fp):
    """The program does not check CRCs (the engine does, ISA-L over runs of chunks): a reply
    whose bytes fail their CRC lands, verification rejects it and clears its slot word, the
    chunk is due again past the switch, and the good reply then takes the slot."""
    t = Transfer(Route(0, (POOL_IP, PORT), 64), NS, KEY, NCHUNKS, False, 5.0)
    t.idx, t.gen, t.base = IDX, GEN, BASE
    t.next_new, t.tries[:] = NCHUNKS, 1
    for i in range(NCHUNKS):
        bad = i == 1
        run(fp, reply(i, payload=chunk(9) if bad else None, csum=zlib.crc32(chunk(1)) if bad
                      else None))
    ok = verify(t, fp.xfers[IDX], fp.meta, fp.arena_mv, CS, Folder(CS), _Ring(), 0.001,
                0.0001, 1024)
    assert ok == NCHUNKS - 1 and t.stats.checksum_errors == 1
    assert t.verified.tolist() == [True, False, True, True] and t.bypass[1]
    assert fp.meta[BASE + 1] == 0, "the bad chunk's slot word is cleared"
    assert run(fp, reply(1))[0] == XDP.DROP
    assert verify(t, fp.xfers[IDX], fp.meta, fp.arena_mv, CS, Folder(CS), _Ring(), 0.001,
                  0.0001, 1024) == 1
    assert bytes(fp.arena[BASE * CS:(BASE + 4) * CS - CS + TAIL]) == b"".join(
        chunk(i, TAIL if i == 3 else CS) for i in range(4))


def test_a_nack_or_error_sets_the_status_only_for_its_block(fp):
    run(fp, reply(0, op=Op.NACK, status=Status.NOT_FOUND, payload=b"", ns=NS + 1))
    assert fp.xfers[IDX]["status"] == 0
    assert run(fp, reply(0, op=Op.NACK, status=Status.NOT_FOUND, payload=b""))[0] == XDP.DROP
    assert fp.xfers[IDX]["status"] == C["KV_FETCH_XS_NACK"]
    assert fp.xfers[IDX]["err"] == Status.NOT_FOUND
    run(fp, reply(0, op=Op.ERROR, status=Status.BAD_REQUEST, payload=b""))
    assert fp.xfers[IDX]["status"] & C["KV_FETCH_XS_ERROR"]
    assert not fp.meta.any()


def test_unknown_size_takes_chunk_zero_only_and_learns_the_count(fp):
    fp.set_transfer(IDX, GEN, NS, KEY, 0, BASE, 1)
    assert run(fp, reply(1, nchunks=7))[0] == XDP.DROP
    assert not fp.meta.any()
    assert run(fp, reply(0, nchunks=7))[0] == XDP.DROP
    assert fp.xfers[IDX]["seen_nchunks"] == 7
    assert bytes(fp.arena[BASE * CS:(BASE + 1) * CS]) == chunk(0)


def test_the_loss_stand_in_drops_kv_frames_only(fp):
    fp.ctl[0]["loss_ppm"] = 1_000_000
    assert run(fp, reply(1))[0] == XDP.DROP and not fp.meta.any()
    assert run(fp, reply(1, dport=ENGINE_PORT + 1))[0] == XDP.DROP   # KV, not ours: dropped too
    assert run(fp, bytes(Ether() / ARP(pdst=NODE_IP)))[0] == XDP.PASS


# ---- what the engine sends --------------------------------------------------------------------
def sent_frames(prog, entries) -> list[bytes]:
    """The GET frames the engine's send ring makes of send-queue ``entries`` ((chunk, flags) of
    transfer IDX): its headers, then the zeroed room its packet ring's frames hold."""
    ring = SendRing(prog, None, CS)
    ring.set_route(0, route_header(NODE_MAC, POOL_MAC, NODE_IP, ENGINE_PORT, POOL_IP, PORT, CS))
    q = np.array([i | (IDX << 32) | (flags << 48) for i, flags in entries], np.uint64)
    h = ring.headers(q)
    h = h[h["op"] != 0]
    return [bytes(row) + bytes(CS) for row in h.view(np.uint8).reshape(h.size, PAYLOAD_OFF)]


def test_queued_entries_become_exact_gets_with_udp_checksum_zero(fp):
    frames = sent_frames(fp, [(2, 0), (3, int(Flag.NO_CACHE))])
    assert len(frames) == 2
    for out, (i, flags) in zip(frames, ((2, 0), (3, Flag.NO_CACHE))):
        get = Ether(out)
        assert len(out) == PAYLOAD_OFF + CS and get[IP].chksum == IP(bytes(get[IP]))[IP].chksum
        assert get[UDP].chksum == 0 and get[UDP].sport == ENGINE_PORT
        assert get[IP].src == NODE_IP and get[Ether].src == NODE_MAC and get[IP].dst == POOL_IP
        assert (get[KV].op, get[KV].ns, get[KV].key, get[KV].chunk, get[KV].len) == (
            Op.GET, NS, KEY, i, CS)
        assert get[KV].req_id == (IDX << 24) | GEN and int(get[KV].flags) == int(flags)
        assert out[PAYLOAD_OFF:] == bytes(CS)                        # the room is zero


def test_transfer_flags_ride_on_every_get_queued_for_it(fp):
    """A transfer restarted past the switch's cache (set_transfer flags=NO_CACHE) sends its
    GETs queued before the restart with NO_CACHE too: the sender reads the table at send time."""
    fp.set_transfer(IDX, GEN, NS, KEY, NCHUNKS, BASE, NCHUNKS, flags=int(Flag.NO_CACHE))
    (out,) = sent_frames(fp, [(2, 0)])
    assert int(Ether(out)[KV].flags) == int(Flag.NO_CACHE) and Ether(out)[IP].dst == POOL_IP


def test_gets_of_a_transfer_no_longer_active_are_not_sent(fp):
    assert len(sent_frames(fp, [(NCHUNKS + 100, 0), (1, 0)])) == 1, "past its slots"
    fp.xfers[IDX]["gen"] = 0
    assert sent_frames(fp, [(1, 0)]) == []


def test_no_frame_that_arrives_makes_the_program_transmit(fp):
    """The program never sends: whatever arrives (every fixture case, replies, GETs to the
    engine, the generator frames of the engine before (a template with 8 bytes of XDP metadata)
    and random bytes) gets XDP_PASS or XDP_DROP, so a frame from the wire cannot make it send."""
    rng = np.random.default_rng(7)
    frames = [c.frame for c in NEVER_WRITTEN] + [reply(i) for i in range(NCHUNKS)]
    frames += sent_frames(fp, [(1, 0), (2, 0)])
    frames += [bytes(rng.integers(0, 256, int(n), np.uint8)) for n in rng.integers(14, 1200, 64)]
    for frame in frames:
        for meta in (b"", (0x1122334455667788).to_bytes(8, "little")):
            assert run(fp, frame, meta)[0] in (XDP.PASS, XDP.DROP)


def test_the_switch_serves_a_sent_get(fp):
    """GETs leave with UDP checksum 0 and a zeroed room; the switch's checksum rule accepts a
    checksum of 0, so it answers them from its cache."""
    from switchd.cache import Cache
    from switchd.dataplane import ROLE_POOL, DataPlane, Deployment
    from testbed.lab.topology import scratch_ports
    (get,) = sent_frames(fp, [(2, 0)])
    with scratch_ports(("ffhost", "ffpool"), prefix="ffbpf") as ports:
        dp = DataPlane(Deployment(chunk_size=CS, cache_entries=64, pin_dir=None))
        try:
            dp.ports[dp.ports.Key(ports["ffpool"])] = dp.ports.Leaf(role=ROLE_POOL)
            Cache(dp).put(NS, KEY, 2, chunk(2), nchunks=NCHUNKS)
            before = dp.counters()
            verdict, out = xdp_test_run(dp.ingress.fd, get, ifindex=ports["ffhost"])
            after = dp.counters()
        finally:
            dp.bpf.cleanup()
    assert verdict == XDP.TX and after["bad_udp_csum"] == before["bad_udp_csum"]
    assert after["get_hit"] - before["get_hit"] == 1
    # the switch's reply, received by the engine, lands in the transfer's slot
    assert run(fp, out)[0] == XDP.DROP
    assert bytes(fp.arena[(BASE + 2) * CS:(BASE + 3) * CS]) == chunk(2)


@pytest.mark.parametrize("chunk_size", [8, 3072, 3424])
def test_the_verifier_accepts_the_program_at_these_chunk_sizes(chunk_size):
    FetchProgram(chunk_size, 16).close()
