"""A scapy layer for the KV block protocol, bound to its UDP port, for crafting frames (tests,
fuzzing, the traffic generator's templates) and for reading captures. Its fields are derived from
the codec's ``LAYOUT`` (kvproto.wire), the one Python declaration of the header."""
from __future__ import annotations

from scapy.fields import (ByteEnumField, ByteField, FlagsField, IntField, ShortEnumField,
                          ShortField, XIntField, XShortField, XStrFixedLenField)
from scapy.layers.inet import UDP
from scapy.packet import Packet, bind_layers

from .wire import (HEADER_LEN, KEY_LEN, LAYOUT, MAGIC, OFFSET, PORT, VERSION, Flag, Op, Status,
                   checksum)

_PLAIN = {"B": ByteField, "H": ShortField, "I": IntField}
_SHOWN_AS = {                        # fields with a default, names or hex display
    "magic": lambda: XShortField("magic", MAGIC),
    "version": lambda: ByteField("version", VERSION),
    "op": lambda: ByteEnumField("op", Op.GET, {o.value: o.name for o in Op}),
    "flags": lambda: FlagsField("flags", 0, 16, [f.name for f in sorted(Flag, key=int)]),
    "status": lambda: ShortEnumField("status", 0, {s.value: s.name for s in Status}),
    "key": lambda: XStrFixedLenField("key", bytes(KEY_LEN), KEY_LEN),
    "len": lambda: ShortField("len", None),      # None: the payload's length
    "csum": lambda: XIntField("csum", None),     # None: CRC-32 of the payload (0 for a GET)
}


class KV(Packet):
    name = "KV"
    fields_desc = [_SHOWN_AS[n]() if n in _SHOWN_AS else _PLAIN[code](n, 0)
                   for n, code in LAYOUT]

    def post_build(self, pkt: bytes, pay: bytes) -> bytes:
        if self.len is None:
            at = OFFSET["len"]
            pkt = pkt[:at] + len(pay).to_bytes(2, "big") + pkt[at + 2:]
        if self.csum is None:
            crc = 0 if self.op == Op.GET else checksum(pay)
            at = OFFSET["csum"]
            pkt = pkt[:at] + crc.to_bytes(4, "big") + pkt[at + 4:]
        return pkt + pay


if len(KV()) != HEADER_LEN:
    raise ImportError("the scapy layer and struct kvhdr disagree on the header size")
bind_layers(UDP, KV, dport=PORT)
bind_layers(UDP, KV, sport=PORT)
