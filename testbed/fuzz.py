"""`testbed fuzz`: random and mutated frames through the switch's XDP program (BPF_PROG_TEST_RUN,
populated cache, coalescing on), checked against a reference written independently in Python:

  * XDP_TX only for a valid GET of a cached chunk with room for it, from a UDP port a reply can
    reach, with no UDP checksum or a right one, and then exactly the reply the reference builds;
  * a KV frame that may be a reply (a reply op, or anything from the KV port) is dropped on every
    port but a pool node's, and changes no map;
  * a frame the reference calls invalid passes untouched and changes no map (cache, admit set,
    pending rounds, waiters, recent misses, per-namespace counters);
  * on a tenant port (limited to namespace 1 and bound to the host's source) every frame with
    another source, every frame the data plane cannot check and every request for another
    namespace is dropped, and changes no map.

Frames start from valid templates (GET hit, GET miss, pool reply for an admitted block, PUT,
other UDP, TCP, ARP) and are mutated in every header field, in length (truncated, extended,
lying length fields) or at random bytes. Pool replies are also sent from inference-node ports,
where they must be dropped.
"""
from __future__ import annotations

import random
import socket
import struct
import time
import zlib

from kvproto import (FIELDS, HEADER, HEADER_LEN, MAGIC, MAX_PAYLOAD, OFFSET, PORT, VERSION, Flag,
                     Op)
from kvproto.frames import ETH_LEN as ETH
from kvproto.frames import HDR_OFF as KV_OFF
from kvproto.frames import IPV4_LEN as IPH
from kvproto.frames import UDP_LEN as UDPH
from kvproto.frames import XDP, ip_checksum, ipv4_frame
from switchd.cache import Cache
from switchd.ports import set_role
from switchd.dataplane import ROLE_HOST, ROLE_POOL, DataPlane, Deployment
from xdp.libbpf import xdp_test_run

from .results import write_json
from .lab.topology import scratch_ports

CHUNK = 512
MACS = (bytes.fromhex("020000000001"), bytes.fromhex("020000000065"))
TENANT_NS = (1,)
HOST_IP, POOL_IP = socket.inet_aton("198.18.0.1"), socket.inet_aton("198.18.0.101")
STATE_MAPS = ("cache", "admit", "pending", "waiters", "recent", "ns_stats")


def build(src_mac, dst_mac, src_ip, dst_ip, sport, dport, payload, proto=17) -> bytes:
    return ipv4_frame(src_mac, dst_mac, src_ip, dst_ip, sport, dport, payload, proto)


def kv(op, ns, key, chunk, nchunks=0, flags=0, payload=b"", room=0, req_id=7) -> bytes:
    body = bytes(room) if op == Op.GET else payload
    csum = 0 if op == Op.GET else zlib.crc32(payload)
    return HEADER.pack(MAGIC, VERSION, op, flags, 0, ns, req_id, key, chunk, nchunks, len(body), 0,
                       csum) + body


# ---- the reference -----------------------------------------------------------------------------
def reference_parse(frame: bytes):
    """The fields of a valid KV frame per docs/protocol.md, or None."""
    if len(frame) < ETH + IPH or frame[12:14] != b"\x08\x00":
        return None
    iph = frame[ETH:ETH + IPH]
    if iph[0] != 0x45 or iph[9] != 17 or struct.unpack("!H", iph[6:8])[0] & 0x3FFF:
        return None
    if len(frame) < KV_OFF:
        return None
    sport, dport, ulen = struct.unpack("!HHH", frame[ETH + IPH:ETH + IPH + 6])
    if PORT not in (sport, dport):
        return None
    if len(frame) < KV_OFF + HEADER_LEN:
        return "bad"
    tot = struct.unpack("!H", iph[2:4])[0]
    f = dict(zip(FIELDS, HEADER.unpack_from(frame, KV_OFF)))
    want = IPH + UDPH + HEADER_LEN
    if (tot < want or tot > len(frame) - ETH or ip_checksum(iph) != 0 or ulen != tot - IPH or
            f["len"] != tot - want or f["len"] > MAX_PAYLOAD or f["magic"] != MAGIC or
            f["version"] != VERSION or f["reserved"] != 0):
        return "bad"
    f.update(sport=sport, dport=dport, udp_ok=reference_udp_ok(frame))
    return f


def reference_udp_ok(frame: bytes) -> bool:
    """A GET's UDP checksum is absent or right with its room taken as the zeros it must be (the
    pseudo-header's sum alone, which a local stack leaves for offload, is not: a receiving
    kernel drops it unless the skb says so, which XDP cannot see)."""
    udp = frame[ETH + IPH:KV_OFF]
    if udp[6:8] == b"\0\0":
        return True
    pseudo = frame[ETH + 12:ETH + 20] + b"\0\x11" + udp[4:6]
    return ip_checksum(pseudo + udp + frame[KV_OFF:KV_OFF + HEADER_LEN]) == 0


def reference_source_ok(frame: bytes, mac: bytes, addr: bytes) -> bool:
    """A secured port's frame carries its bound source: Ethernet source; IPv4 source, or ARP
    sender (0.0.0.0 for a probe) whose hardware address is the frame's; no VLAN tag."""
    proto, sip = frame[12:14], None
    if proto == b"\x08\x00":
        if len(frame) < ETH + IPH:
            return False
        sip = frame[ETH + 12:ETH + 16]
    elif proto == b"\x08\x06":
        if len(frame) < ETH + 18 or frame[18] != 6 or frame[19] != 4 or frame[22:28] != frame[6:12]:
            return False
        sip = frame[28:32]
    elif proto in (b"\x81\x00", b"\x88\xa8"):
        return False
    if frame[6:12] != mac:
        return False
    return sip is None or sip == addr or (proto == b"\x08\x06" and sip == bytes(4))


def reference_limited_may_pass(frame: bytes) -> bool:
    """What a limited port may send besides valid KV: ARP, IPv4 without options unfragmented,
    IPv6 with TCP, ICMPv6 or UDP not to the KV port next."""
    proto = frame[12:14]
    if proto == b"\x08\x06":
        return True
    if proto == b"\x08\x00":
        return (len(frame) >= ETH + IPH and frame[ETH] & 0xF == 5 and
                not struct.unpack("!H", frame[ETH + 6:ETH + 8])[0] & 0x3FFF)
    if proto != b"\x86\xdd" or len(frame) < ETH + 40:
        return False
    nexthdr = frame[ETH + 6]
    return nexthdr in (6, 58) or (nexthdr == 17 and len(frame) >= ETH + 48 and
                                  struct.unpack("!H", frame[ETH + 42:ETH + 44])[0] != PORT)


REPLY_OPS = (Op.GET_REPLY, Op.PUT_ACK, Op.NACK, Op.ERROR)


def reference_not_from_pool(frame: bytes, ref) -> bool:
    """Whether ``frame`` (``ref``: reference_parse's) may be a KV reply, which only a pool node's
    port may carry: a reply op, or any KV frame from the KV port."""
    if ref is None:
        return False
    sport = struct.unpack("!H", frame[ETH + IPH:ETH + IPH + 2])[0]
    return sport == PORT or (isinstance(ref, dict) and ref["op"] in REPLY_OPS)


def reference_port_drops(frame: bytes, ref) -> bool:
    """Whether the tenant port's checks must drop ``frame`` (``ref``: reference_parse's)."""
    if not reference_source_ok(frame, MACS[0], HOST_IP):
        return True
    if not isinstance(ref, dict):
        return not (ref is None and reference_limited_may_pass(frame))
    return ref["dport"] == PORT and ref["ns"] not in TENANT_NS


def reference_reply(frame: bytes, f: dict, payload: bytes, nchunks: int) -> bytes:
    head = HEADER.pack(MAGIC, VERSION, Op.GET_REPLY, f["flags"] | Flag.FROM_SWITCH, 0, f["ns"],
                       f["req_id"], f["key"], f["chunk"], nchunks, len(payload), 0,
                       zlib.crc32(payload))
    iph = bytearray(frame[ETH:ETH + IPH])
    iph[12:16], iph[16:20] = frame[ETH + 16:ETH + 20], frame[ETH + 12:ETH + 16]
    iph[8] = 64
    iph[2:4] = struct.pack("!H", IPH + UDPH + HEADER_LEN + len(payload))
    iph[10:12] = b"\0\0"
    iph[10:12] = struct.pack("!H", ip_checksum(bytes(iph)))
    udp = struct.pack("!HHHH", f["dport"], f["sport"], UDPH + HEADER_LEN + len(payload), 0)
    return frame[6:12] + frame[0:6] + frame[12:14] + bytes(iph) + udp + head + payload


# ---- frames ------------------------------------------------------------------------------------
class Corpus:
    def __init__(self, rng: random.Random, blocks: int = 4, nchunks: int = 4):
        self.rng = rng
        self.keys = [rng.randbytes(16) for _ in range(blocks)]
        self.payloads = {(k, c): rng.randbytes(rng.randint(1, CHUNK))
                         for k in self.keys for c in range(nchunks)}
        self.nchunks = nchunks

    def template(self) -> tuple[bytes, str]:
        r, rng = self.rng.random(), self.rng
        key = rng.choice(self.keys)
        chunk = rng.randrange(self.nchunks + 1)  # the last index is never cached: a miss
        host = (MACS[0], MACS[1], HOST_IP, POOL_IP, rng.randrange(32768, 61000), PORT)
        if r < 0.45:
            get = kv(Op.GET, 1, key, chunk, room=CHUNK, req_id=rng.getrandbits(32))
            return build(*host, get), rng.choice(("host", "tenant"))
        if r < 0.7:
            payload = self.payloads.get((key, chunk), rng.randbytes(100))
            pool = (MACS[1], MACS[0], POOL_IP, HOST_IP, PORT, rng.randrange(32768, 61000))
            return build(*pool, kv(Op.GET_REPLY, 1, key, chunk, self.nchunks,
                                   payload=payload)), rng.choice(("pool", "host"))
        if r < 0.8:
            return build(*host, kv(Op.PUT, 1, key, 0, 1, payload=b"x" * 40)), \
                rng.choice(("host", "tenant"))
        if r < 0.9:
            return build(*host[:4], 53, 53, rng.randbytes(rng.randrange(0, 200))), \
                rng.choice(("host", "tenant"))
        return build(*host[:4], 5201, PORT, rng.randbytes(60), proto=6), "host"

    def mutate(self, frame: bytes) -> bytes:
        rng, b = self.rng, bytearray(frame)
        choice = rng.random()
        if choice < 0.15:
            return bytes(b[:rng.randrange(ETH, len(b))])   # truncated (no NIC delivers < 14 B)
        if choice < 0.25:
            return bytes(b) + rng.randbytes(rng.randrange(1, 64))        # extended
        if choice < 0.35:                                                # a length field lies
            off = rng.choice((ETH + 2, ETH + IPH + 4, KV_OFF + OFFSET["len"]))
            b[off:off + 2] = struct.pack("!H", rng.randrange(65536))
            return bytes(b)
        for _ in range(rng.randint(1, 4)):                              # header fields / bytes
            off = rng.randrange(min(len(b), KV_OFF + HEADER_LEN)) if rng.random() < 0.85 \
                else rng.randrange(len(b))
            b[off] = rng.randrange(256)
        return bytes(b)


# ---- the run -----------------------------------------------------------------------------------
def _state(dp) -> tuple:
    """Every key and value (per-CPU values whole) of the maps a frame may change."""
    return tuple(sorted((bytes(k), bytes(v)) for k, v in getattr(dp, name).items())
                 for name in STATE_MAPS)


def run_fuzz(frames: int, seed: int = 1, json_path: str | None = None, log=print) -> dict:
    rng = random.Random(seed)
    corpus = Corpus(rng)
    violations, kinds = [], {"valid": 0, "invalid": 0, "not_kv": 0, "tx": 0, "port_drops": 0,
                             "reply_drops": 0}
    start = time.monotonic()
    with scratch_ports(("host", "pool"), ("tenant", "spare"), prefix="kvfz") as ports:
        dp = DataPlane(Deployment(chunk_size=CHUNK, cache_entries=256, pin_dir=None))
        dp.ports[dp.ports.Key(ports["pool"])] = dp.ports.Leaf(role=ROLE_POOL)
        set_role(dp, "tenant", ROLE_HOST, namespaces=list(TENANT_NS),   # we are in its netns
                 source=(MACS[0].hex(":"), socket.inet_ntoa(HOST_IP)))
        dp.set("coalesce", 1)
        dp.set("pending_ns", 10 ** 8)
        cache = Cache(dp)
        for (key, chunk), payload in corpus.payloads.items():
            if chunk % 2 == 0 or key == corpus.keys[0]:
                cache.put(1, key, chunk, payload, corpus.nchunks)
        cache.admit(1, corpus.keys[1])
        done = 0
        while done < frames:
            batch = []
            for _ in range(min(256, frames - done)):
                frame, port = corpus.template()
                if rng.random() < 0.8:
                    frame = corpus.mutate(frame)
                ref = reference_parse(frame)
                # in the data plane's order: the source check, replies, then the port's limits
                tenant = port == "tenant"
                if tenant and not reference_source_ok(frame, MACS[0], HOST_IP):
                    ref = "drop"
                elif port != "pool" and reference_not_from_pool(frame, ref):
                    ref = "reply"
                elif tenant and reference_port_drops(frame, ref):
                    ref = "drop"
                batch.append((frame, port, ref))
            # frames the reference rejects or the port must drop first, with the state compared
            # around them
            invalid = [x for x in batch if not isinstance(x[2], dict)]
            before = _state(dp)
            for frame, port, ref in invalid:
                kinds[{"drop": "port_drops", "reply": "reply_drops", None: "not_kv"}.get(
                    ref, "invalid")] += 1
                want = XDP.DROP if ref in ("drop", "reply") else XDP.PASS
                verdict, out = xdp_test_run(dp.ingress.fd, frame, ifindex=ports[port])
                if verdict != want or out != frame:
                    violations.append({"what": f"frame not left untouched with {want.name}",
                                       "port": port, "verdict": verdict, "frame": frame.hex()})
            if _state(dp) != before:
                violations.append({"what": "invalid or dropped frames changed map state",
                                   "frames": [f.hex() for f, _, _ in invalid][:8]})
            for frame, port, ref in (x for x in batch if isinstance(x[2], dict)):
                kinds["valid"] += 1
                got = cache.get(ref["ns"], ref["key"], ref["chunk"])
                verdict, out = xdp_test_run(dp.ingress.fd, frame, ifindex=ports[port])
                if verdict == XDP.TX:
                    kinds["tx"] += 1
                    ok = (ref["op"] == Op.GET and ref["dport"] == PORT and ref["sport"] != 0 and
                          got is not None and
                          not ref["flags"] & Flag.NO_CACHE and got[0].len <= ref["len"] and
                          ref["udp_ok"] and
                          out == reference_reply(frame, ref, got[1], got[0].nchunks))
                    if not ok:
                        violations.append({"what": "XDP_TX that is not the exact reply",
                                           "frame": frame.hex(), "out": out.hex()})
                elif verdict not in (XDP.PASS, XDP.DROP, XDP.REDIRECT):
                    violations.append({"what": f"verdict {verdict}", "frame": frame.hex()})
            done += len(batch)
    result = {"frames": frames, "seed": seed, "violations": len(violations),
              "examples": violations[:5], **kinds,
              "seconds": round(time.monotonic() - start, 2), "counters": dp.counters()}
    log(f"fuzz: {frames} frames ({kinds['valid']} valid KV, {kinds['invalid']} invalid KV, "
        f"{kinds['not_kv']} not KV, {kinds['port_drops']} dropped by the tenant port's checks, "
        f"{kinds['reply_drops']} replies dropped on inference-node ports, "
        f"{kinds['tx']} answered), {len(violations)} violation(s), {result['seconds']}s")
    write_json(json_path, result)
    return result
