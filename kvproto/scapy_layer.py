"""A scapy layer for the KV block protocol, bound to its UDP port, for crafting frames (tests,
fuzzing, the traffic generator's templates) and for reading captures."""
from __future__ import annotations

from scapy.fields import (ByteEnumField, ByteField, FlagsField, IntField, ShortEnumField,
                          ShortField, XIntField, XShortField, XStrFixedLenField)
from scapy.layers.inet import UDP
from scapy.packet import Packet, bind_layers

from .wire import MAGIC, OFFSET, PORT, VERSION, Flag, Op, Status, checksum


class KV(Packet):
    name = "KV"
    fields_desc = [
        XShortField("magic", MAGIC),
        ByteField("version", VERSION),
        ByteEnumField("op", Op.GET, {o.value: o.name for o in Op}),
        FlagsField("flags", 0, 16, [f.name for f in sorted(Flag, key=int)]),
        ShortEnumField("status", 0, {s.value: s.name for s in Status}),
        IntField("ns", 0),
        IntField("req_id", 0),
        XStrFixedLenField("key", bytes(16), 16),
        IntField("chunk", 0),
        IntField("nchunks", 0),
        ShortField("len", None),      # None: the payload's length
        ShortField("reserved", 0),
        XIntField("csum", None),      # None: CRC-32 of the payload (0 for a GET)
    ]

    def post_build(self, pkt: bytes, pay: bytes) -> bytes:
        if self.len is None:
            at = OFFSET["len"]
            pkt = pkt[:at] + len(pay).to_bytes(2, "big") + pkt[at + 2:]
        if self.csum is None:
            crc = 0 if self.op == Op.GET else checksum(pay)
            at = OFFSET["csum"]
            pkt = pkt[:at] + crc.to_bytes(4, "big") + pkt[at + 4:]
        return pkt + pay


bind_layers(UDP, KV, dport=PORT)
bind_layers(UDP, KV, sport=PORT)
