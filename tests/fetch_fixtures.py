"""Single-frame cases for the fetch engine's receiver (xdp/kvfetch.c), as data (as
tests/xdp_fixtures.py has them for the switch): the state every case starts from (transfer IDX
of block (NS, KEY), NCHUNKS chunks at slot BASE, generation GEN, its GETs sent on route 0 from
NODE to POOL), a frame, the verdict, and the counter that must go up by one. Every case here
must leave the arena and the slot words untouched. tests/test_fetch_xdp.py runs them with one
parametrized test; sequences of frames are tests of their own there."""
from __future__ import annotations

from dataclasses import dataclass

from scapy.layers.inet import IP, TCP, UDP
from scapy.layers.l2 import ARP, Ether
from scapy.packet import Raw

from kvproto import PORT, Op, Status
from kvproto.frames import PAYLOAD_OFF, XDP
from kvproto.scapy_layer import KV

CS, SLOTS = 1024, 64
ENGINE_PORT = 40555
NODE_MAC, POOL_MAC = "02:00:00:00:00:01", "02:00:00:00:00:65"
NODE_IP, POOL_IP = "198.18.0.1", "198.18.0.101"
POOL2_MAC, POOL2_IP = "02:00:00:00:00:66", "198.18.0.102"   # route 1
TENANT_MAC, TENANT_IP = "02:00:00:00:00:02", "198.18.0.2"   # another inference node
KEY = bytes.fromhex("00112233445566778899aabbccddeeff")
NS, IDX, GEN, BASE, NCHUNKS = 5, 3, 0x123456, 10, 4
TAIL = 700


def chunk(i: int, n: int = CS) -> bytes:
    return bytes((i * 31 + j * 7) & 0xFF for j in range(n))


def reply(i=0, payload=None, ns=NS, key=KEY, req_id=(IDX << 24) | GEN, nchunks=NCHUNKS,
          op=Op.GET_REPLY, status=0, flags=0, dport=ENGINE_PORT, csum=None, src_mac=POOL_MAC,
          src_ip=POOL_IP, sport=PORT, dst_mac=NODE_MAC, dst_ip=NODE_IP) -> bytes:
    """A reply to the engine, by default from where route 0's GETs go (the pool node)."""
    if payload is None:
        payload = chunk(i, TAIL if i == NCHUNKS - 1 else CS)
    return bytes(Ether(src=src_mac, dst=dst_mac) / IP(src=src_ip, dst=dst_ip) /
                 UDP(sport=sport, dport=dport, chksum=0) /
                 KV(op=op, ns=ns, key=key, chunk=i, nchunks=nchunks, req_id=req_id,
                    flags=flags, status=status, csum=csum) / Raw(payload))


@dataclass
class Case:
    name: str
    frame: bytes
    verdict: int
    counter: str
    status: int = 0                 # the transfer's status bits afterwards (KV_FETCH_XS_*)
    route: int = 0                  # the route the transfer's GETs went on


def _cases():
    raw = reply(1)
    kv = PAYLOAD_OFF - 48
    yield Case("another transfer", reply(1, req_id=((IDX + 1) << 24) | GEN), XDP.DROP, "stale")
    yield Case("an old generation", reply(1, req_id=(IDX << 24) | (GEN - 1)), XDP.DROP, "stale")
    yield Case("generation zero", reply(1, req_id=IDX << 24), XDP.DROP, "stale")
    yield Case("another key", reply(1, key=KEY[:-1] + b"\x00"), XDP.DROP, "wrong_block")
    yield Case("another namespace", reply(1, ns=NS + 1), XDP.DROP, "wrong_block")
    yield Case("a chunk past the block", reply(NCHUNKS, payload=chunk(0)), XDP.DROP,
               "bad_chunk")
    yield Case("a chunk past the arena", reply(1 << 20, payload=chunk(0)), XDP.DROP,
               "bad_chunk")
    yield Case("another chunk count", reply(1, nchunks=NCHUNKS + 1), XDP.DROP, "bad_chunk",
               status=4)
    yield Case("a short middle chunk", reply(1, payload=chunk(1, CS - 8)), XDP.DROP, "bad_len")
    yield Case("a last chunk longer than a chunk", reply(NCHUNKS - 1, payload=chunk(0, CS + 8)),
               XDP.DROP, "bad_len")
    yield Case("a truncated frame", raw[:-100], XDP.DROP, "malformed")
    yield Case("truncated in the kv header", raw[:kv + 20], XDP.DROP, "malformed")
    yield Case("a bad ip checksum", raw[:24] + b"\x00\x00" + raw[26:], XDP.DROP, "malformed")
    yield Case("a GET_REPLY with a status", reply(1, status=Status.NOT_FOUND), XDP.DROP,
               "other_op")
    yield Case("another port", reply(1, dport=ENGINE_PORT + 1), XDP.PASS, "passed")
    yield Case("not UDP", bytes(Ether() / IP(src=POOL_IP, dst=NODE_IP) /
                                TCP(sport=PORT, dport=ENGINE_PORT) / Raw(raw[kv:])),
               XDP.PASS, "passed")
    yield Case("ARP", bytes(Ether() / ARP(pdst=NODE_IP)), XDP.PASS, "passed")
    # right request id, block and chunk, but not from where the GET went (issue 26)
    yield Case("from another host's IP", reply(1, src_ip=TENANT_IP), XDP.DROP, "wrong_source")
    yield Case("from another host's MAC", reply(1, src_mac=TENANT_MAC), XDP.DROP,
               "wrong_source")
    yield Case("from another host entirely", reply(1, src_mac=TENANT_MAC, src_ip=TENANT_IP),
               XDP.DROP, "wrong_source")
    # neither side on the KV port: not a KV frame at all (parse.h), to the engine's port: dropped
    yield Case("from another UDP port", reply(1, sport=PORT + 1), XDP.DROP, "malformed")
    yield Case("from UDP port 0", reply(1, sport=0), XDP.DROP, "malformed")
    yield Case("from another pool node", reply(1, src_mac=POOL2_MAC, src_ip=POOL2_IP),
               XDP.DROP, "wrong_source")
    yield Case("from the pool, for a transfer asking another", reply(1), XDP.DROP,
               "wrong_source", route=1)
    yield Case("to another host's MAC (flooded)", reply(1, dst_mac=TENANT_MAC), XDP.DROP,
               "wrong_source")
    yield Case("to another IP", reply(1, dst_ip=TENANT_IP), XDP.DROP, "wrong_source")
    yield Case("from the wrong source and a stale generation",
               reply(1, src_ip=TENANT_IP, req_id=(IDX << 24) | (GEN ^ 1)), XDP.DROP, "stale")


NEVER_WRITTEN = list(_cases())
