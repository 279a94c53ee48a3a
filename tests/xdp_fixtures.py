"""Single-frame cases for the switch's ingress program, as data (in the manner of katran's
KatranTestFixtures.h): what the maps hold before, the frame and the port it arrives on, the
verdict, the frame the program must leave (None: unchanged), counter deltas, and whether the
cache must stay as it was. tests/test_xdp.py runs every case with one parametrized test;
sequences of frames (learning, coalescing) are tests of their own there."""
from __future__ import annotations

import ctypes
from dataclasses import dataclass, field

from scapy.layers.inet import IP, TCP, UDP
from scapy.layers.inet6 import IPv6, ICMPv6EchoRequest
from scapy.layers.l2 import ARP, Dot1Q, Ether
from scapy.packet import Raw

from kvproto import OFFSET, PORT, Flag, Op, checksum
from kvproto.frames import HDR_OFF, IPV4_LEN, XDP, ip_checksum
from kvproto.frames import ETH_LEN as ETH
from kvproto.scapy_layer import KV

HOST_MAC, POOL_MAC = "02:00:00:00:00:01", "02:00:00:00:00:65"
HOST_IP, POOL_IP = "198.18.0.1", "198.18.0.101"
KEY = bytes.fromhex("00112233445566778899aabbccddeeff")
PAYLOAD = bytes((i * 7) & 0xFF for i in range(700))
CACHED = ((5, KEY, 3, PAYLOAD, 9),)          # (ns, key, chunk, payload, nchunks) preloaded


def waiter_of(dp, ifindex: int, ns=5, key=KEY, chunk=3):
    """The kv_waiters entry of chunk (ns, key, chunk) on port ``ifindex``, or None."""
    k = dp.waiters.Key()
    k.chunk.ns, k.chunk.chunk, k.ifindex = ns, chunk, ifindex
    ctypes.memmove(ctypes.addressof(k.chunk.key), key, 16)
    try:
        return dp.waiters[k]
    except KeyError:
        return None


def get_frame(key=KEY, chunk=3, room=1024, ns=5, kvflags=0, req_id=0xABCD, src=HOST_IP,
              sport=40000, dst=POOL_IP, dst_mac=POOL_MAC, src_mac=HOST_MAC, **ip):
    return (Ether(src=src_mac, dst=dst_mac) /
            IP(src=src, dst=dst, id=77, **ip) /
            UDP(sport=sport, dport=PORT) /
            KV(op=Op.GET, ns=ns, req_id=req_id, key=key, chunk=chunk, flags=kvflags) /
            Raw(bytes(room)))


def reply_frame(payload=PAYLOAD, key=KEY, chunk=3, ns=5, flags=0, nchunks=9, op=Op.GET_REPLY,
                sport=PORT, status=0, src=POOL_IP, src_mac=POOL_MAC):
    return (Ether(src=src_mac, dst=HOST_MAC) / IP(src=src, dst=HOST_IP) /
            UDP(sport=sport, dport=40000) /
            KV(op=op, ns=ns, key=key, chunk=chunk, nchunks=nchunks, flags=flags, status=status) /
            Raw(payload))


def broadcast_of(reply: bytes, gen: int) -> bytes:
    """``reply`` as the switch broadcasts it to a round's waiters: the round's generation in the
    two fields kv_egress rewrites for every copy (IPv4 destination: high 32 bits, request id:
    low 32), the IPv4 checksum made right again; nothing else changed."""
    out = bytearray(reply)
    out[ETH + 16:ETH + 20] = (gen >> 32).to_bytes(4, "big")
    out[HDR_OFF + 12:HDR_OFF + 16] = (gen & 0xFFFFFFFF).to_bytes(4, "big")
    out[ETH + 10:ETH + 12] = bytes(2)
    out[ETH + 10:ETH + 12] = ip_checksum(bytes(out[ETH:ETH + IPV4_LEN])).to_bytes(2, "big")
    return bytes(out)


def put_frame(ns=5, payload=PAYLOAD, chunk=3):
    return (Ether(src=HOST_MAC, dst=POOL_MAC) / IP(src=HOST_IP, dst=POOL_IP) /
            UDP(sport=40000, dport=PORT) /
            KV(op=Op.PUT, ns=ns, key=KEY, chunk=chunk, nchunks=9, csum=checksum(payload)) /
            Raw(payload))


def switch_reply(payload=PAYLOAD, ns=5, chunk=3, nchunks=9, req_id=0xABCD) -> bytes:
    """The reply the switch must make of get_frame() for a cached chunk, byte for byte."""
    return bytes(Ether(src=POOL_MAC, dst=HOST_MAC) /
                 IP(src=POOL_IP, dst=HOST_IP, id=77, ttl=64) /
                 UDP(sport=PORT, dport=40000, chksum=0) /
                 KV(op=Op.GET_REPLY, ns=ns, req_id=req_id, key=KEY, chunk=chunk,
                    nchunks=nchunks, flags=Flag.FROM_SWITCH, csum=checksum(payload)) /
                 Raw(payload))


@dataclass
class Case:
    name: str
    frame: bytes
    verdict: int
    out: bytes | None = None          # None: the frame leaves unchanged
    port: str = "host"                # "host", "host2" or "pool"
    cached: tuple = CACHED
    admitted: tuple = ()              # (ns, key) of blocks in the admit set
    port_ns: dict = field(default_factory=dict)   # port -> namespaces it is limited to
    # port -> (MAC, IP) it is bound to (None: secured, bound to nothing yet)
    secure: dict = field(default_factory=dict)
    counters: dict = field(default_factory=dict)  # counter -> expected increase
    cache_unchanged: bool = True
    # (ns, key, chunk) of cached chunks whose slot a writer holds (sequence word odd, kvslot.h)
    # as the frame arrives
    writing: tuple = ()


def _with_udp_checksum(value: int | None) -> bytes:
    """get_frame() with this UDP checksum; None: the partial one a stack leaves for offload
    (the pseudo-header's folded sum, not complemented)."""
    frame = bytearray(bytes(get_frame()))
    at = ETH + IPV4_LEN + 6
    if value is None:
        pseudo = bytes(frame[ETH + 12:ETH + 20]) + b"\0\x11" + bytes(frame[at - 2:at])
        value = ~ip_checksum(pseudo) & 0xFFFF
    frame[at:at + 2] = value.to_bytes(2, "big")
    return bytes(frame)


def get_with_zero_checksum() -> bytes:
    """get_frame() with a request id making its full UDP checksum compute to 0, which the sender
    writes as 0xffff (RFC 768): valid for the kernel and for XDP alike, not "no checksum"."""
    frame = bytearray(bytes(get_frame(req_id=0)))
    at = ETH + IPV4_LEN + 6
    frame[at:at + 2] = b"\0\0"
    pseudo = bytes(frame[ETH + 12:ETH + 20]) + b"\0\x11" + bytes(frame[at - 2:at])
    folded = ~ip_checksum(pseudo + bytes(frame[ETH + IPV4_LEN:])) & 0xFFFF   # the sum, folded
    rid = HDR_OFF + OFFSET["req_id"] + 2                  # the request id's low word
    frame[rid:rid + 2] = ((0xFFFF - folded) % 0xFFFF).to_bytes(2, "big")
    frame[at:at + 2] = b"\xff\xff"
    assert ip_checksum(pseudo + bytes(frame[ETH + IPV4_LEN:])) == 0
    return bytes(frame)


def _malformed() -> list[tuple[str, bytes]]:
    good = get_frame()
    raw = bytes(good)

    def patch(offset, value):
        return raw[:offset] + value + raw[offset + len(value):]

    kv_len = HDR_OFF + OFFSET["len"]
    return [
        ("truncated in kv header", raw[:HDR_OFF + 20]),
        ("truncated in udp header", raw[:ETH + IPV4_LEN + 4]),
        ("truncated in ip header", raw[:ETH + 10]),
        ("truncated room", raw[:-100]),
        ("bad magic", patch(HDR_OFF + OFFSET["magic"], b"\x4b\x57")),
        ("bad version", patch(HDR_OFF + OFFSET["version"], b"\x02")),
        ("reserved set", patch(HDR_OFF + OFFSET["reserved"], b"\x00\x01")),
        ("kv len too long", patch(kv_len, (1025).to_bytes(2, "big"))),
        ("kv len too short", patch(kv_len, (1023).to_bytes(2, "big"))),
        ("ip len beyond frame", bytes(get_frame(len=20 + 8 + 48 + 1024 + 10))),
        ("udp len lies", patch(ETH + IPV4_LEN + 4, (100).to_bytes(2, "big"))),
        ("bad ip checksum", patch(ETH + 10, b"\x00\x00")),
        ("wrong port", patch(ETH + IPV4_LEN + 2, (PORT + 1).to_bytes(2, "big"))),
        ("ip options", bytes(Ether(src=HOST_MAC, dst=POOL_MAC) /
                             IP(src=HOST_IP, dst=POOL_IP, options=b"\x01\x01\x01\x01") /
                             good[UDP])),
        ("fragment (more fragments)", bytes(get_frame(flags="MF"))),
        ("fragment (offset)", bytes(get_frame(frag=8))),
        ("vlan tagged", bytes(Ether(src=HOST_MAC, dst=POOL_MAC) / Dot1Q(vlan=7) / good[IP])),
        ("ipv6", bytes(Ether(src=HOST_MAC, dst=POOL_MAC) /
                       IPv6(src="2001:db8::1", dst="2001:db8::2") / good[UDP])),
        ("tcp to kv port", bytes(Ether() / IP(src=HOST_IP, dst=POOL_IP) / TCP(dport=PORT) /
                                 Raw(raw[HDR_OFF:]))),
    ]


OTHER_MAC, OTHER_IP = "02:00:00:00:00:02", "198.18.0.2"    # another host's source
BOUND = {"host": (HOST_MAC, HOST_IP)}
POOL_BOUND = {"pool": (POOL_MAC, POOL_IP), "host": None}    # host secured, not bound yet
OTHER_BOUND = {"host2": (OTHER_MAC, OTHER_IP), "host": None}
LIMITED = {"host": [5]}


def kv_get_over(l3) -> bytes:
    """get_frame()'s UDP datagram in other wrappings (IP options, fragments, tags, IPv6)."""
    return bytes(l3 / get_frame()[UDP])


CASES = [
    Case("hit becomes the exact reply", bytes(get_frame()), XDP.TX, switch_reply(),
         counters={"get_hit": 1, "hit_bytes": len(PAYLOAD), "xdp_tx": 1},
         cache_unchanged=False),            # the entry's hit counter moves
    Case("hit with exactly enough room", bytes(get_frame(room=len(PAYLOAD))), XDP.TX,
         switch_reply(), cache_unchanged=False),
    Case("miss passes unchanged", bytes(get_frame()), XDP.PASS, cached=(),
         counters={"get_miss": 1}),
    Case("a slot mid-write is not served", bytes(get_frame()), XDP.PASS,
         writing=((5, KEY, 3),), counters={"reused": 1, "get_miss": 1, "get_hit": 0}),
    Case("a neighbour's slot mid-write does not stop a hit", bytes(get_frame()), XDP.TX,
         switch_reply(), cached=CACHED + ((5, KEY, 4, PAYLOAD, 9),), writing=((5, KEY, 4),),
         counters={"get_hit": 1, "reused": 0}, cache_unchanged=False),
    Case("other namespace is a miss", bytes(get_frame(ns=6)), XDP.PASS),
    Case("other chunk is a miss", bytes(get_frame(chunk=4)), XDP.PASS),
    Case("other key is a miss", bytes(get_frame(key=KEY[:-1] + b"\x00")), XDP.PASS),
    Case("too little room is forwarded", bytes(get_frame(room=len(PAYLOAD) - 1)), XDP.PASS,
         counters={"no_room": 1}),
    Case("NO_CACHE is forwarded", bytes(get_frame(kvflags=Flag.NO_CACHE)), XDP.PASS),
    *[Case(f"malformed or foreign: {name}", frame, XDP.PASS) for name, frame in _malformed()],
    Case("arp is untouched", bytes(Ether() / ARP(pdst=POOL_IP)), XDP.PASS,
         counters={"non_kv": 1}),
    Case("tcp is untouched", bytes(Ether() / IP(src=HOST_IP, dst=POOL_IP) / TCP(dport=5201) /
                                   Raw(b"x" * 99)), XDP.PASS, counters={"non_kv": 1}),
    Case("other udp is untouched", bytes(Ether() / IP() / UDP(dport=53) / Raw(b"q")), XDP.PASS,
         counters={"non_kv": 1}),
    Case("a limited port gets nothing of another tenant", bytes(get_frame(ns=5)), XDP.DROP,
         port_ns={"host": [6]}, counters={"denied": 1}),
    Case("a limited port gets its own tenant's chunks", bytes(get_frame(ns=6)), XDP.TX,
         switch_reply(b"other tenant", ns=6), cached=CACHED + ((6, KEY, 3, b"other tenant", 9),),
         port_ns={"host": [6]}, cache_unchanged=False),
    Case("a limited port cannot write into another tenant", bytes(put_frame(ns=5)), XDP.DROP,
         port_ns={"host": [6]}, counters={"denied": 1}),
    Case("a limited port may write into its own tenant", bytes(put_frame(ns=6)), XDP.PASS,
         port_ns={"host": [6]}, counters={"other_kv": 1}),
    Case("a port with more tenants than its config holds: one of them is served",
         bytes(get_frame(ns=6)), XDP.TX, switch_reply(b"other tenant", ns=6),
         cached=CACHED + ((6, KEY, 3, b"other tenant", 9),),
         port_ns={"host": [20, 21, 22, 23, 24, 25, 26, 27, 28, 6]}, cache_unchanged=False),
    Case("a port with more tenants than its config holds: another is denied",
         bytes(get_frame(ns=5)), XDP.DROP,
         port_ns={"host": [20, 21, 22, 23, 24, 25, 26, 27, 28, 6]},
         counters={"denied": 1}),
    Case("a port with eight tenants (all its config holds): one is served",
         bytes(get_frame(ns=6)), XDP.TX,
         switch_reply(b"other tenant", ns=6), cached=CACHED + ((6, KEY, 3, b"other tenant", 9),),
         port_ns={"host": [1, 2, 3, 4, 7, 8, 9, 6]}, cache_unchanged=False),

    # port security: a secured port's frames carry its bound source
    Case("secured port: its own source is served", bytes(get_frame()), XDP.TX, switch_reply(),
         secure=BOUND, cache_unchanged=False),
    Case("secured port: another source MAC", bytes(Ether(src=OTHER_MAC, dst=POOL_MAC) /
                                                   get_frame()[IP]), XDP.DROP,
         secure=BOUND, counters={"spoofed": 1}),
    Case("secured port: another source IP", bytes(get_frame(src=OTHER_IP)), XDP.DROP,
         secure=BOUND, counters={"spoofed": 1}),
    Case("secured port: ARP claiming another address",
         bytes(Ether(src=HOST_MAC, dst="ff:ff:ff:ff:ff:ff") /
               ARP(op=2, hwsrc=HOST_MAC, psrc=OTHER_IP, pdst=POOL_IP)), XDP.DROP, secure=BOUND),
    Case("secured port: ARP with another sender MAC",
         bytes(Ether(src=HOST_MAC, dst="ff:ff:ff:ff:ff:ff") /
               ARP(hwsrc=OTHER_MAC, psrc=HOST_IP, pdst=POOL_IP)), XDP.DROP, secure=BOUND),
    Case("secured port: its own ARP passes", bytes(Ether(src=HOST_MAC, dst="ff:ff:ff:ff:ff:ff") /
                                                   ARP(hwsrc=HOST_MAC, psrc=HOST_IP,
                                                       pdst=POOL_IP)), XDP.PASS, secure=BOUND),
    Case("secured port: an address probe passes",
         bytes(Ether(src=HOST_MAC, dst="ff:ff:ff:ff:ff:ff") /
               ARP(hwsrc=HOST_MAC, psrc="0.0.0.0", pdst=HOST_IP)), XDP.PASS, secure=BOUND),
    Case("secured port: a VLAN tag hides the source", bytes(
        Ether(src=HOST_MAC, dst=POOL_MAC) / Dot1Q(vlan=0) / get_frame()[IP]), XDP.DROP,
        secure=BOUND),
    Case("secured port: IPv6 from its MAC passes", bytes(
        Ether(src=HOST_MAC, dst=POOL_MAC) / IPv6(src="fe80::1", dst="fe80::2") /
        ICMPv6EchoRequest()), XDP.PASS, secure=BOUND),
    # a limited port sends only what the data plane can check
    Case("limited port: a GET with IP options", kv_get_over(
        Ether(src=HOST_MAC, dst=POOL_MAC) / IP(src=HOST_IP, dst=POOL_IP, options=b"\x01" * 4)),
        XDP.DROP, port_ns=LIMITED, counters={"unchecked": 1}),
    Case("limited port: a GET's first fragment", kv_get_over(
        Ether(src=HOST_MAC, dst=POOL_MAC) / IP(src=HOST_IP, dst=POOL_IP, flags="MF")),
        XDP.DROP, port_ns=LIMITED, counters={"unchecked": 1}),
    Case("limited port: a later fragment", bytes(Ether(src=HOST_MAC, dst=POOL_MAC) /
                                                 IP(src=HOST_IP, dst=POOL_IP, frag=100, proto=17) /
                                                 Raw(b"x" * 64)), XDP.DROP, port_ns=LIMITED),
    Case("limited port: a VLAN-tagged GET", kv_get_over(
        Ether(src=HOST_MAC, dst=POOL_MAC) / Dot1Q(vlan=0) / IP(src=HOST_IP, dst=POOL_IP)),
        XDP.DROP, port_ns=LIMITED),
    Case("limited port: a GET over IPv6", kv_get_over(
        Ether(src=HOST_MAC, dst=POOL_MAC) / IPv6(src="fe80::1", dst="fe80::2")),
        XDP.DROP, port_ns=LIMITED),
    Case("limited port: an invalid KV frame", _malformed()[4][1], XDP.DROP, port_ns=LIMITED),
    Case("limited port: another protocol", bytes(Ether(src=HOST_MAC, type=0x88CC) /
                                                 Raw(b"lldp" * 16)), XDP.DROP, port_ns=LIMITED),
    Case("limited port: IPv6 UDP elsewhere passes", bytes(
        Ether(src=HOST_MAC, dst=POOL_MAC) / IPv6(src="fe80::1", dst="fe80::2") /
        UDP(dport=53) / Raw(b"q")), XDP.PASS, port_ns=LIMITED),
    Case("limited port: IPv6 TCP passes", bytes(
        Ether(src=HOST_MAC, dst=POOL_MAC) / IPv6(src="fe80::1", dst="fe80::2") / TCP()),
        XDP.PASS, port_ns=LIMITED),
    Case("limited port: IPv4 TCP passes", bytes(
        Ether(src=HOST_MAC, dst=POOL_MAC) / IP(src=HOST_IP, dst=POOL_IP) / TCP(dport=5201)),
        XDP.PASS, port_ns=LIMITED, counters={"non_kv": 1}),
    Case("limited port: ARP passes", bytes(Ether(src=HOST_MAC, dst="ff:ff:ff:ff:ff:ff") /
                                           ARP(pdst=POOL_IP)), XDP.PASS,
         port_ns=LIMITED),
    Case("limited port: its own namespace's GET is served", bytes(get_frame()), XDP.TX,
         switch_reply(), port_ns=LIMITED, cache_unchanged=False),
    # a GET's UDP checksum, when it has one
    Case("a GET with a right UDP checksum is answered", bytes(get_frame()), XDP.TX,
         switch_reply(), cache_unchanged=False),
    Case("a GET with a wrong UDP checksum is forwarded", _with_udp_checksum(0x1234), XDP.PASS,
         counters={"bad_udp_csum": 1}),
    Case("a GET with a right UDP checksum over a room that is not zero", bytes(
        get_frame(room=0) / Raw(b"\x01" * 1024)), XDP.PASS, counters={"bad_udp_csum": 1}),
    Case("a GET without UDP checksum is answered", _with_udp_checksum(0), XDP.TX,
         switch_reply(), cache_unchanged=False),
    # what the pool's kernel would drop is neither answered nor held (issue 26): the
    # pseudo-header-only form is accepted by a kernel only from an skb still marked
    # CHECKSUM_PARTIAL, which XDP cannot see; crafted on a raw socket, the pool's stack drops it
    Case("a GET whose checksum is the bare pseudo-header sum is forwarded, not answered",
         _with_udp_checksum(None), XDP.PASS, counters={"bad_udp_csum": 1, "get_hit": 0}),
    Case("a GET whose full checksum is 0, sent as 0xffff, is answered", get_with_zero_checksum(),
         XDP.TX, switch_reply(req_id=int.from_bytes(
             get_with_zero_checksum()[HDR_OFF + OFFSET["req_id"]:][:4], "big")),
         cache_unchanged=False),
    Case("a GET from UDP port 0 is dropped, not answered", bytes(get_frame(sport=0)), XDP.DROP,
         counters={"port_zero": 1, "get_hit": 0}),
    Case("a GET from UDP port 0 for a chunk not cached is dropped", bytes(get_frame(sport=0)),
         XDP.DROP, cached=(), counters={"port_zero": 1, "get_miss": 0}),

    # replies come from pool ports only
    *[Case(f"a {name} from a host port is dropped", bytes(reply_frame(op=op, status=st)),
           XDP.DROP, counters={"not_from_pool": 1})
      for name, op, st in (("GET_REPLY", Op.GET_REPLY, 0), ("PUT_ACK", Op.PUT_ACK, 0),
                           ("NACK", Op.NACK, 1), ("ERROR", Op.ERROR, 2))],
    Case("a GET_REPLY from a host port with the pool's source is dropped",
         bytes(reply_frame()), XDP.DROP, port="host2", counters={"not_from_pool": 1}),
    Case("a reply op to the KV port from a host port is dropped",
         bytes(Ether(src=HOST_MAC, dst=POOL_MAC) / IP(src=HOST_IP, dst=POOL_IP) /
               UDP(sport=40000, dport=PORT) / KV(op=Op.GET_REPLY, ns=5, key=KEY, chunk=3,
                                                 nchunks=9) / Raw(PAYLOAD)),
         XDP.DROP, counters={"not_from_pool": 1}),
    Case("a malformed frame from the KV port on a host port is dropped",
         bytes(Ether(src=POOL_MAC, dst=HOST_MAC) / IP(src=POOL_IP, dst=HOST_IP) /
               UDP(sport=PORT, dport=40000) / Raw(b"\x4b\x56\x01\x02")),
         XDP.DROP, counters={"not_from_pool": 1, "malformed": 0}),
    Case("a GET_REPLY from the pool port passes", bytes(reply_frame()), XDP.PASS, port="pool",
         counters={"not_from_pool": 0, "unsolicited": 1}),
    Case("a NACK from the pool port passes", bytes(reply_frame(op=Op.NACK, status=1)), XDP.PASS,
         port="pool", counters={"not_from_pool": 0}),

    # port security cannot be captured: a source bound to another port (the pool's, bound
    # before any frame is seen) is neither passed nor learned, whatever the frame type
    *[Case(f"unbound port: {name} does not bind", frame, XDP.DROP, secure=sec,
           counters={"spoofed": 1, "src_taken": 1, "src_learned": 0})
      for name, frame, sec in (
          ("an ARP reply with the pool's MAC and address",
           bytes(Ether(src=POOL_MAC, dst="ff:ff:ff:ff:ff:ff") /
                 ARP(op=2, hwsrc=POOL_MAC, psrc=POOL_IP, pdst=POOL_IP)), POOL_BOUND),
          ("a KV GET from the pool's source",
           bytes(get_frame(src=POOL_IP, src_mac=POOL_MAC, dst=HOST_IP)), POOL_BOUND),
          ("a GET_REPLY from the pool's source", bytes(reply_frame()), POOL_BOUND),
          ("an ARP reply with its own MAC and the pool's address",
           bytes(Ether(src=HOST_MAC, dst="ff:ff:ff:ff:ff:ff") /
                 ARP(op=2, hwsrc=HOST_MAC, psrc=POOL_IP, pdst=POOL_IP)), POOL_BOUND),
          ("an ARP reply with another host's MAC and address",
           bytes(Ether(src=OTHER_MAC, dst="ff:ff:ff:ff:ff:ff") /
                 ARP(op=2, hwsrc=OTHER_MAC, psrc=OTHER_IP, pdst=OTHER_IP)), OTHER_BOUND),
          ("a GET with its own MAC and another host's address",
           bytes(get_frame(src=OTHER_IP)), OTHER_BOUND),
          ("IPv6 from another host's MAC", bytes(
              Ether(src=OTHER_MAC, dst=POOL_MAC) / IPv6(src="fe80::1", dst="fe80::2") /
              ICMPv6EchoRequest()), OTHER_BOUND),
          ("an address probe from another host's MAC", bytes(
              Ether(src=OTHER_MAC, dst="ff:ff:ff:ff:ff:ff") /
              ARP(hwsrc=OTHER_MAC, psrc="0.0.0.0", pdst=HOST_IP)), OTHER_BOUND))],
    Case("unbound port: its own ARP binds it", bytes(
        Ether(src=HOST_MAC, dst="ff:ff:ff:ff:ff:ff") /
        ARP(op=2, hwsrc=HOST_MAC, psrc=HOST_IP, pdst=HOST_IP)), XDP.PASS, secure=OTHER_BOUND,
        counters={"src_learned": 1, "spoofed": 0}),
    Case("unbound port: IPv6 from a MAC nobody owns passes unbound", bytes(
        Ether(src=HOST_MAC, dst=POOL_MAC) / IPv6(src="fe80::1", dst="fe80::2") /
        ICMPv6EchoRequest()), XDP.PASS, secure=OTHER_BOUND, counters={"src_learned": 0}),
    Case("secured port: a group source MAC", bytes(
        Ether(src="03:00:00:00:00:01", dst=POOL_MAC) / IPv6(src="fe80::1", dst="fe80::2") /
        ICMPv6EchoRequest()), XDP.DROP, secure=OTHER_BOUND, counters={"spoofed": 1}),
]
