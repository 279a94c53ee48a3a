"""What a tenant can try from its own port, crafted frame by frame with scapy inside a testbed node
(these functions run as tasks, testbed.lab.tasks): KV requests for another tenant's namespace in
wrappings a parser may decline (IP options, IP fragments, an 802.1Q priority tag), frames with
another node's source, a pool node's included (to move the bridge's forwarding entry or bind its
port to that identity and capture its traffic), forged replies sprayed at another host, GETs
that open rounds toward an address nobody answers, and GETs the pool cannot answer (a checksum
its kernel drops, UDP source port 0) sent over and over to keep rounds open (to stall another
host's fetch). Each returns what came back or what it did, so a test can require that nothing
got through; `sniff_marked` counts on the victim what reached it."""
from __future__ import annotations

import socket
import time

from kvproto import DEFAULT_CHUNK, PORT, Message, Op, ProtocolError

WRAPPINGS = ("plain", "ip-options", "fragments", "vlan")


def _frames(kind: str, mac: str, dst_mac: str, src: str, dst: str, sport: int,
            payload: bytes) -> list:
    from scapy.layers.inet import IP, UDP, fragment
    from scapy.layers.l2 import Dot1Q, Ether
    ip = IP(src=src, dst=dst, options=b"\x01\x01\x01\x01" if kind == "ip-options" else [])
    datagram = ip / UDP(sport=sport, dport=PORT) / payload
    if kind == "fragments":
        return [Ether(src=mac, dst=dst_mac) / f for f in fragment(datagram, fragsize=256)]
    if kind == "vlan":
        return [Ether(src=mac, dst=dst_mac) / Dot1Q(vlan=0) / datagram]
    return [Ether(src=mac, dst=dst_mac) / datagram]


def _received(sock: socket.socket, seconds: float):
    """What reaches ``sock`` within ``seconds``, a datagram (or frame) at a time."""
    end = time.monotonic() + seconds
    while (left := end - time.monotonic()) > 0:
        sock.settimeout(left)
        try:
            yield sock.recv(65536)
        except socket.timeout:
            return


def _answers(sock: socket.socket, seconds: float, ns: int) -> list[Message]:
    """The KV messages for namespace ``ns`` that reach ``sock`` within ``seconds``."""
    out = []
    for data in _received(sock, seconds):
        try:
            msg = Message.decode(data)
        except ProtocolError:
            continue
        if msg.ns == ns:
            out.append(msg)
    return out


def _node() -> tuple[str, str]:
    """This node's eth0 MAC and IPv4 address."""
    import json
    import subprocess
    link = json.loads(subprocess.run(["ip", "-j", "addr", "show", "eth0"], capture_output=True,
                                     text=True, check=True).stdout)[0]
    return link["address"], next(a["local"] for a in link["addr_info"] if a["family"] == "inet")


def foreign_requests(kind: str, op: str, pool_ip: str, pool_mac: str, ns: int, key_hex: str,
                     chunks: int, room: int, wait: float = 1.0,
                     source: tuple[str, str] | None = None) -> dict:
    """Task: GETs (or PUTs) for chunks 0..chunks-1 of a block of namespace ``ns`` in one of the
    WRAPPINGS, from this node's source or from ``source`` (another host's MAC and IP); how many
    answers (GET_REPLY with payload, PUT_ACK) came back here."""
    from scapy.sendrecv import sendp
    mac, me = _node()
    key = bytes.fromhex(key_hex)
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind((me, 0))
    sport = sock.getsockname()[1]
    frames = []
    src_mac, src_ip = source or (mac, me)
    for chunk in range(chunks):
        msg = (Message(Op.GET, ns, key, chunk, req_id=chunk, room=room) if op == "get" else
               Message(Op.PUT, ns, key, chunk, chunks, req_id=chunk, payload=b"planted" * 8))
        frames += _frames(kind, src_mac, pool_mac, src_ip, pool_ip, sport, msg.encode())
    sendp(frames, iface="eth0", verbose=False)
    answers = _answers(sock, wait, ns)
    sock.close()
    return {"sent": len(frames),
            "replies": sum(m.op == Op.GET_REPLY and len(m.payload) > 0 for m in answers),
            "acks": sum(m.op == Op.PUT_ACK for m in answers)}


def impersonate(victim_mac: str, victim_ip: str, seconds: float, period: float = 0.005) -> dict:
    """Task: keep sending frames with the victim's source (ARP replies and UDP; the first frame
    this port sends is the ARP reply) so that a switch binds this port to the victim's identity,
    or a bridge learns the victim's MAC here; count the frames for the victim that arrive here
    (``captured_kv``: KV frames to or from the KV port: a host's replies, a pool's GETs)."""
    from scapy.layers.inet import IP, UDP
    from scapy.layers.l2 import ARP, Ether
    from scapy.sendrecv import AsyncSniffer, sendp
    bait = [Ether(src=victim_mac, dst="ff:ff:ff:ff:ff:ff") /
            ARP(op=2, hwsrc=victim_mac, psrc=victim_ip, pdst=victim_ip),
            Ether(src=victim_mac, dst="ff:ff:ff:ff:ff:ff") /
            IP(src=victim_ip, dst="255.255.255.255") / UDP(sport=PORT, dport=9) / b"x"]
    sniffer = AsyncSniffer(iface="eth0", store=True,
                           lfilter=lambda p: p.haslayer("Ether") and p["Ether"].dst == victim_mac)
    sniffer.start()
    end = time.monotonic() + seconds
    sent = 0
    while time.monotonic() < end:
        sendp(bait, iface="eth0", verbose=False)
        sent += len(bait)
        time.sleep(period)
    time.sleep(0.3)
    captured = sniffer.stop() or []
    kv = sum(1 for p in captured if p.haslayer("UDP") and PORT in (p["UDP"].sport,
                                                                   p["UDP"].dport))
    return {"sent": sent, "captured": len(captured), "captured_kv": kv}


def _flood(raw: list[bytes], seconds: float, period: float) -> int:
    """Send every frame of ``raw`` out of eth0, a pass every ``period`` seconds for ``seconds``;
    the number of passes."""
    sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW)
    sock.bind(("eth0", 0))
    end, passes = time.monotonic() + seconds, 0
    while time.monotonic() < end:
        for frame in raw:
            sock.send(frame)
        passes += 1
        time.sleep(period)
    sock.close()
    return passes


def stall_rounds(ip: str, mac: str, ns: int, key_hex: str, chunks: int, room: int,
                 seconds: float, period: float = 0.01) -> dict:
    """Task: every ``period`` seconds, GETs for every chunk of a block addressed to ``ip`` /
    ``mac`` (where nobody answers), keeping rounds open for all of them."""
    my_mac, me = _node()
    key = bytes.fromhex(key_hex)
    frames = [f for chunk in range(chunks) for f in _frames(
        "plain", my_mac, mac, me, ip, 40404,
        Message(Op.GET, ns, key, chunk, req_id=chunk, room=room).encode())]
    raw = [bytes(f) for f in frames]
    rounds = _flood(raw, seconds, period)
    return {"rounds": rounds, "frames": rounds * len(raw)}


MARKER = b"FORGED-BY-A-TENANT"


def forge_replies(dst_ip: str, dst_mac: str, ns: int, key_hex: str, chunks: int, rounds: int,
                  source: tuple[str, str] | None = None, ports: tuple[int, int] = (32768, 61000)
                  ) -> dict:
    """Task: GET_REPLY frames for chunks 0..chunks-1 of a block, each a payload with a right
    CRC that starts with MARKER, from this node's source or ``source`` (MAC, IP: the pool's),
    sprayed at ``dst_ip`` over a range of UDP ports (the fetcher's is unknown), ``rounds``
    passes; what a reader accepting them would store as chunks of the block."""
    my_mac, me = _node()
    src_mac, src_ip = source or (my_mac, me)
    key = bytes.fromhex(key_hex)
    lo, hi = ports
    step = max(1, (hi - lo) // 64)
    from kvproto.frames import ipv4_frame
    raw = []
    for chunk in range(chunks):
        payload = MARKER + bytes(DEFAULT_CHUNK - len(MARKER))   # a chunk the reader expects
        msg = Message(Op.GET_REPLY, ns, key, chunk, chunks, req_id=chunk, payload=payload)
        for dport in range(lo, hi, step):
            raw.append(ipv4_frame(src_mac, dst_mac, src_ip, dst_ip, PORT, dport, msg.encode()))
    sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW)
    sock.bind(("eth0", 0))
    for _ in range(rounds):
        for frame in raw:
            sock.send(frame)
    sock.close()
    return {"sent": rounds * len(raw)}


def sniff_marked(seconds: float) -> dict:
    """Task: the KV replies carrying MARKER that reach this node's eth0 within ``seconds``
    (seen by a packet tap, behind the node's own XDP program)."""
    sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(0x0003))
    sock.bind(("eth0", 0))
    frames = sum(MARKER in data for data in _received(sock, seconds))
    sock.close()
    return {"marked": frames}


def unanswerable_gets(pool_ip: str, pool_mac: str, ns: int, key_hex: str, chunks: int,
                      how: str, seconds: float, period: float = 0.001) -> dict:
    """Task (issue 26's stall): GETs with room 0 for every chunk of a block, every ``period``
    seconds, that the pool cannot answer: ``how`` "csum" (the UDP checksum is the bare
    pseudo-header sum: the pool's XDP and the switch used to take it, its kernel drops it) or
    "port0" (UDP source port 0: the pool's reply cannot be sent)."""
    from kvproto.frames import ip_checksum, ipv4_frame
    my_mac, me = _node()
    key = bytes.fromhex(key_hex)
    raw = []
    for chunk in range(chunks):
        msg = Message(Op.GET, ns, key, chunk, req_id=chunk, room=0).encode()
        frame = bytearray(ipv4_frame(my_mac, pool_mac, me, pool_ip,
                                     0 if how == "port0" else 40405, PORT, msg))
        if how == "csum":
            pseudo = bytes(frame[26:34]) + b"\0\x11" + bytes(frame[38:40])
            frame[40:42] = (~ip_checksum(pseudo) & 0xFFFF).to_bytes(2, "big")
        elif how != "port0":
            raise ValueError(how)
        raw.append(bytes(frame))
    passes = _flood(raw, seconds, period)
    return {"passes": passes, "frames": passes * len(raw)}


def measure_stall(how: str, chunks: int = 1024, fetches: int = 3) -> dict:
    """Issue 26's stall, measured on a testbed of its own: h1 fetches a block of ``chunks`` chunks
    ``fetches`` times quiet, then while h3 sends it unanswerable_gets(how) (no policy, so every
    fetch goes to the pool). ``python -m testbed.security csum|port0`` prints the JSON."""
    import os
    from testbed.lab import Lab
    out: dict = {"how": how, "chunks": chunks}
    with Lab(f"stall{os.getpid() % 10000}", hosts=3, pools=1, switch=False) as lab:
        lab.start_switch("--policy", "off")
        key, data = os.urandom(16), os.urandom(chunks * lab.chunk_size)
        lab.put("h1", 1, key, data)
        out["quiet"] = [lab.get("h1", 1, key)[0]["seconds"] for _ in range(fetches)]
        before = lab.stats()
        staller = lab.start_task("h3", "testbed.security:unanswerable_gets", lab.pool_addrs[0],
                                 lab.mac("p1"), 1, key.hex(), chunks, how, 60.0, 0.002)
        time.sleep(8)
        runs = []
        for _ in range(fetches):
            try:
                got, fetched = lab.get("h1", 1, key, "--deadline", "20")
                runs.append({"seconds": got["seconds"], "retransmits": got["retransmits"],
                             "ok": fetched == data})
            except Exception as exc:         # a stalled fetch fails: record how
                runs.append({"failed": str(exc).strip().splitlines()[-1]})
        after = lab.stats()
        out["attacked"] = runs
        out["switch"] = {k: after[k] - before[k] for k in (
            "coalesced", "expired", "unheld", "bad_udp_csum", "port_zero", "get_miss")
            if k in after}
        out["attack"] = staller.result(120)
    return out


if __name__ == "__main__":
    import json
    import sys
    print(json.dumps(measure_stall(sys.argv[1] if len(sys.argv) > 1 else "csum")))
