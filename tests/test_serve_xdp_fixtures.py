"""A pool node's XDP server (xdp/kvserve.c) on single crafted frames, as a table in the manner of
the switch's (xdp_fixtures.CASES): one staged block, then per case the frame, the verdict, the
frame it must leave (None: unchanged) and the counters that move. Its cases are the ones issue 26
is about: XDP answers exactly what the node's kernel would let `hostagent serve` answer. A GET
whose UDP checksum is the bare pseudo-header sum (what a stack leaves for offload; crafted on a
raw socket, the kernel drops it) goes up to the stack, never answered here; a GET from UDP port
0 (the server's reply could not be sent) is dropped; checksums 0 (none) and 0xffff (a computed
0) are answered. No interface needed."""
from __future__ import annotations

import zlib
from array import array
from dataclasses import dataclass, field

import numpy as np
import pytest
from scapy.layers.inet import IP, UDP
from scapy.layers.l2 import Ether
from scapy.packet import Raw

from hostagent.pool.blockfmt import ObjectLayout, write_block
from hostagent.pool.staging import Staging
from hostagent.pool.xdpserve import SEG, ServeProgram, XdpArena
from kvproto import PORT, Op, checksum
from kvproto.frames import ETH_LEN, IPV4_LEN, XDP, ip_checksum
from kvproto.scapy_layer import KV
from xdp.libbpf import xdp_test_run
from xdp_fixtures import (HOST_IP, HOST_MAC, KEY, POOL_IP, POOL_MAC, get_frame,
                          get_with_zero_checksum)

pytestmark = pytest.mark.bpf

NS, CS, CHUNKS = 5, 1024, 4
DATA = bytes((i * 11 + i // 253) & 0xFF for i in range(CHUNKS * CS))
UDP_CHECK = ETH_LEN + IPV4_LEN + 6


def _chunk(i: int) -> bytes:
    return DATA[i * CS:(i + 1) * CS]


def served(chunk: int = 3, req_id: int = 0xABCD) -> bytes:
    """The reply kvserve makes of get_frame(chunk=...), byte for byte."""
    return bytes(Ether(src=POOL_MAC, dst=HOST_MAC) / IP(src=POOL_IP, dst=HOST_IP, id=77, ttl=64) /
                 UDP(sport=PORT, dport=40000, chksum=0) /
                 KV(op=Op.GET_REPLY, ns=NS, req_id=req_id, key=KEY, chunk=chunk,
                    nchunks=CHUNKS, flags=0, csum=checksum(_chunk(chunk))) / Raw(_chunk(chunk)))


def with_check(frame, value: int | None) -> bytes:
    """A frame with this UDP checksum; None: the bare pseudo-header sum (partial form)."""
    raw = bytearray(bytes(frame))
    if value is None:
        pseudo = bytes(raw[ETH_LEN + 12:ETH_LEN + 20]) + b"\0\x11" + bytes(
            raw[UDP_CHECK - 2:UDP_CHECK])
        value = ~ip_checksum(pseudo) & 0xFFFF
    raw[UDP_CHECK:UDP_CHECK + 2] = value.to_bytes(2, "big")
    return bytes(raw)


@dataclass
class Case:
    name: str
    frame: bytes
    verdict: int
    out: bytes | None = None
    counters: dict = field(default_factory=dict)


_ZERO = get_with_zero_checksum()              # get_frame() for chunk 3, checksum sent as 0xffff
CASES = [
    Case("a GET with a full checksum is answered", bytes(get_frame()), XDP.TX, served(),
         {"hit": 1}),
    Case("a GET without a checksum (0) is answered", with_check(get_frame(), 0), XDP.TX,
         served(), {"hit": 1}),
    Case("a GET whose full checksum is 0, sent as 0xffff, is answered", _ZERO, XDP.TX,
         served(req_id=int.from_bytes(_ZERO[42 + 12:42 + 16], "big")), {"hit": 1}),
    Case("a GET with the bare pseudo-header sum goes to the stack", with_check(get_frame(), None),
         XDP.PASS, None, {"bad_udp_csum": 1, "hit": 0}),
    Case("a GET with a wrong checksum goes to the stack", with_check(get_frame(), 0x1234),
         XDP.PASS, None, {"bad_udp_csum": 1, "hit": 0}),
    Case("a GET from UDP port 0 is dropped", bytes(get_frame(sport=0)), XDP.DROP, None,
         {"port_zero": 1, "hit": 0}),
    Case("a GET from UDP port 0 without a checksum is dropped",
         with_check(get_frame(sport=0), 0), XDP.DROP, None, {"port_zero": 1}),
    Case("a GET from UDP port 0 for a block not staged is dropped",
         bytes(get_frame(sport=0, key=bytes(16))), XDP.DROP, None, {"port_zero": 1, "passed": 0}),
    Case("a GET with room 0 goes to the stack", bytes(get_frame(room=0)), XDP.PASS, None,
         {"no_room": 1}),
]


@pytest.fixture(scope="module")
def prog():
    p = ServeProgram(2 * SEG)
    p.set_addrs([POOL_IP])
    p.slots[:] = np.zeros(1, p.slots.dtype)
    p.index.clear()
    staging = Staging(XdpArena(p, 2 * SEG))
    chunks = [_chunk(i) for i in range(CHUNKS)]
    crcs = [zlib.crc32(c) for c in chunks]
    layout = ObjectLayout.for_payload(NS, KEY, len(DATA), CS)
    run = staging.reserve(layout.size)
    write_block(run.view, layout, chunks, crcs)
    staging.commit(run, layout, array("I", crcs))
    yield p
    p.close()


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_fixture(prog, case: Case):
    before = prog.counters()
    verdict, out = xdp_test_run(prog.fd, case.frame)
    after = prog.counters()
    assert verdict == case.verdict
    if verdict != XDP.DROP:
        assert out == (case.frame if case.out is None else case.out), "wrong output frame"
    for counter, delta in case.counters.items():
        assert after[counter] - before[counter] == delta, counter
