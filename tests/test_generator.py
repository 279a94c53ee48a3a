"""The traffic generator: the frames its sender stamps and its byte-exact reply checks (pure
Python), its XDP reply counter on crafted frames (bpf), and frames sent through a real veth
testbed made and removed here (e2e)."""
import os
import socket

import numpy as np
import pytest
from scapy.layers.inet import IP, TCP, UDP
from scapy.layers.l2 import Ether
from scapy.packet import Raw

from conftest import leaves_no_namespaces
from kvproto import PORT, Flag, Message, Op, Status
from kvproto.frames import XDP
from switchd.cache import Cache
from switchd.ports import set_role
from switchd.dataplane import ROLE_POOL, DataPlane, Deployment
from testbed.bench.fetch.throughput import fill_cache
from testbed.bench.fetch.generator import (GEN_PORT, MC_PORT, Endpoint, Generator, Iperf3,
                                           Sweep, check_kv_reply, check_memcached_reply,
                                           check_reflected, endpoint, kv_get, memcached_get,
                                           payload)
from testbed.lab.topology import Topology
from xdp import netns
from xdp.libbpf import xdp_test_run

H1 = Endpoint("x-h1", "eth0", 2, "02:00:00:00:00:01", "198.18.0.1")
P1 = Endpoint("x-p1", "eth0", 2, "02:00:00:00:00:65", "198.18.0.101")
KEY = bytes(range(16))
NS = 3


@pytest.fixture(scope="module")
def gen():
    g = Generator()
    yield g
    g.close()


def switch_reply(chunk: int, size: int = 256, flags: int = Flag.FROM_SWITCH, req_id: int = 7,
                 nchunks: int = 64) -> bytes:
    msg = Message(Op.GET_REPLY, NS, KEY, chunk, nchunks, req_id, flags,
                  payload=payload(chunk, size))
    return bytes(Ether(src=P1.mac, dst=H1.mac) / IP(src=P1.ip, dst=H1.ip) /
                 UDP(sport=PORT, dport=GEN_PORT, chksum=0) / Raw(msg.encode()))


def memcached_datagram(seq: int, total: int, text: bytes, dport: int = GEN_PORT) -> bytes:
    head = (5).to_bytes(2, "big") + seq.to_bytes(2, "big") + total.to_bytes(2, "big") + bytes(2)
    return bytes(Ether(src=P1.mac, dst=H1.mac) / IP(src=P1.ip, dst=H1.ip) /
                 UDP(sport=MC_PORT, dport=dport) / Raw(head + text))


# ---- the frames the sender stamps -----------------------------------------------------------
def stamped(t, sweep: Sweep, n: int, thread: int = 0, first: int = 0) -> list[bytes]:
    frames = np.tile(np.frombuffer(t.frame, np.uint8), (n, 1))
    sweep.write(frames, np.arange(n), np.arange(first, first + n, dtype=np.uint64), thread,
                np.random.default_rng(1))
    return [bytes(f) for f in frames]


def test_frames_get_their_key_index_and_request_id_and_nothing_else():
    t = kv_get(H1, P1, NS, KEY, 256)
    for i, out in enumerate(stamped(t, Sweep(t, nkeys=5, key_base=100), 7, thread=3)):
        expect = bytearray(t.frame)
        expect[t.key_off:t.key_off + 4] = (100 + i % 5).to_bytes(4, "big")
        expect[t.id_off:t.id_off + 4] = ((3 << 24) | i).to_bytes(4, "big")
        assert out == bytes(expect)
        msg = Message.decode(out[t.hdr_len - 48:])
        assert (msg.op, msg.chunk, msg.room, msg.ns, msg.key) == (Op.GET, 100 + i % 5, 256, NS,
                                                                  KEY)


def test_memcached_keys_are_written_in_hex():
    t = memcached_get(H1, P1)
    out = stamped(t, Sweep(t, nkeys=1, key_base=0xABC12), 1, first=0x10005)[0]
    udp = Ether(out)[UDP]
    assert bytes(udp.payload) == b"\x00\x05\x00\x00\x00\x01\x00\x00get kv000abc12\r\n"
    assert udp.dport == MC_PORT and udp.chksum == 0


def test_sweeps_stay_in_range_and_zipf_is_skewed():
    t = kv_get(H1, P1, NS, KEY, 64)
    for sweep in ("uniform", "zipf"):
        keys = [int.from_bytes(f[t.key_off:t.key_off + 4], "big")
                for f in stamped(t, Sweep(t, nkeys=1000, sweep=sweep), 3000)]
        assert all(0 <= k < 1000 for k in keys)
        top = keys.count(0) / len(keys)
        if sweep == "zipf":       # Zipf(1) over 1000 keys: the first has ~13 % of the mass
            assert 0.09 < top < 0.18 and len(set(keys)) > 100
        else:
            assert top < 0.01 and len(set(keys)) > 900


def test_a_bad_sweep_is_refused():
    t = kv_get(H1, P1, NS, KEY, 64)
    for bad in (dict(nkeys=0), dict(nkeys=4, sweep="zigzag")):
        with pytest.raises(ValueError):
            Sweep(t, **bad)


# ---- count_replies ---------------------------------------------------------------------------
@pytest.mark.bpf
def test_count_replies_counts_drops_and_samples_only_ours(gen):
    gen.clear_sample()
    cases = [  # frame, verdict, counter that must move (None: none)
        (switch_reply(9), XDP.DROP, "kv_switch"),
        (switch_reply(10, flags=0), XDP.DROP, "kv_pool"),
        (bytes(Ether(src=P1.mac, dst=H1.mac) / IP(src=P1.ip, dst=H1.ip) /
               UDP(sport=PORT, dport=GEN_PORT) /
               Raw(Message(Op.NACK, NS, KEY, 1, status=Status.NOT_FOUND).encode())),
         XDP.DROP, "kv_other"),
        (kv_get(H1, P1, NS, KEY, 64).frame, XDP.DROP, "reflected"),
        (memcached_datagram(0, 1, b"VALUE kv00000001 0 3\r\nabc\r\nEND\r\n"), XDP.DROP,
         "mc_reply"),
        (memcached_datagram(0, 2, b"VALUE kv00000002 0 3000\r\n" + bytes(100)), XDP.DROP, None),
        (memcached_datagram(1, 2, bytes(100) + b"\r\nEND\r\n"), XDP.DROP, "mc_reply"),
        (memcached_datagram(0, 1, b"END\r\n"), XDP.DROP, "mc_other"),
        (memcached_datagram(0, 1, b"END\r\n", dport=GEN_PORT + 1), XDP.PASS, None),
        (switch_reply(9)[:60], XDP.DROP, "kv_other"),  # truncated: ours, but no reply
        (bytes(Ether() / IP(src=P1.ip, dst=H1.ip) / TCP(sport=PORT, dport=GEN_PORT)), XDP.PASS,
         None),
        (bytes(Ether(type=0x0806) / Raw(bytes(28))), XDP.PASS, None),
    ]
    for frame, verdict, counter in cases:
        before = gen.counters()
        assert xdp_test_run(gen.count_fn.fd, frame)[0] == verdict, counter
        moved = {k for k, v in gen.counters().items() if v != before[k]} - {"bytes"}
        assert moved == ({counter} if counter else set()), (counter, moved)
    assert gen.sample() == cases[0][0]   # the first counted reply, whole
    gen.clear_sample()
    assert gen.sample() is None


# ---- checks of sampled replies (pure Python) -------------------------------------------------
def test_check_kv_reply_is_byte_exact():
    good = switch_reply(5)
    assert check_kv_reply(good, H1, P1, NS, KEY, 64, 256) is None
    assert check_kv_reply(switch_reply(5, flags=0), H1, P1, NS, KEY, 64, 256) is None
    flipped = bytearray(good)
    flipped[-1] ^= 1
    assert "differs" in check_kv_reply(bytes(flipped), H1, P1, NS, KEY, 64, 256)
    assert "not asked" in check_kv_reply(good, H1, P1, NS, KEY, 5, 256)
    assert "differs" in check_kv_reply(switch_reply(5, nchunks=65), H1, P1, NS, KEY, 64, 256)
    ttl = bytearray(good)
    ttl[22] = 63                 # a switch reply must be exactly what the data plane writes
    assert check_kv_reply(bytes(ttl), H1, P1, NS, KEY, 64, 256) is not None
    assert check_kv_reply(None, H1, P1, NS, KEY, 64, 256) == "no reply sampled"


def test_check_memcached_and_reflected():
    value = payload(0x2A, 64)
    one = memcached_datagram(0, 1, b"VALUE kv0000002a 0 64\r\n" + value + b"\r\nEND\r\n")
    assert check_memcached_reply(one, H1, 64) is None
    first = memcached_datagram(0, 3, b"VALUE kv0000002a 0 64\r\n" + value[:20])
    assert check_memcached_reply(first, H1, 64) is None
    wrong = memcached_datagram(0, 1, b"VALUE kv0000002a 0 64\r\n" + bytes(64) + b"\r\nEND\r\n")
    assert "differs" in check_memcached_reply(wrong, H1, 64)
    t = kv_get(H1, P1, NS, KEY, 64)
    back = bytearray(t.frame)
    back[t.key_off + 3] = 9       # key index and request id are the generator's to write
    back[t.id_off] = 1
    assert check_reflected(bytes(back), t) is None
    back[30] ^= 1                 # anything else is not
    assert check_reflected(bytes(back), t) is not None


# ---- frames through a testbed ----------------------------------------------------------
@pytest.fixture(scope="module")
def topo():
    with leaves_no_namespaces(f"tg{os.getpid() % 100000}") as prefix, \
            Topology(prefix, hosts=1, pools=1) as t:
        yield t


@pytest.mark.e2e
def test_ceiling_and_switch_hits_are_counted_at_the_requester(gen, topo):
    h1, p1 = endpoint(topo.node("h1").netns), endpoint(topo.node("p1").netns)
    t = kv_get(h1, p1, NS, KEY, 1024)
    gen.configure(t, nkeys=256)
    with gen.counting(h1.netns):
        with gen.reflecting(topo.switch_ns, "h1"):
            run = gen.run(h1, seconds=0.3, warmup=0.1)
        assert run.counts["reflected"] > 0.5 * run.sent > 0
        assert check_reflected(gen.sample(), t) is None

        dp = DataPlane(Deployment(1024, 4096, None))
        try:
            with netns.inside(topo.switch_ns):
                set_role(dp, "p1", ROLE_POOL)
                for port in ("h1", "p1"):
                    dp.attach(port)
            fill_cache(Cache(dp), NS, KEY, 0, 256, 256)
            before = dp.counters()["get_hit"]
            run = gen.run(h1, seconds=0.3, warmup=0.1)
            assert run.counts["kv_switch"] > 0.5 * run.sent > 0
            assert run.counts["kv_pool"] == run.counts["kv_other"] == 0
            assert dp.counters()["get_hit"] - before >= run.counts["kv_switch"]
            assert check_kv_reply(gen.sample(), h1, p1, NS, KEY, 256, 1024) is None

            rated = gen.run(h1, seconds=0.5, warmup=0.1, rate=20000)
            assert 16000 < rated.pps("sent") < 22000
            assert rated.pps() > 0.9 * rated.pps("sent")
        finally:
            with netns.inside(topo.switch_ns):
                dp.detach_all()
            dp.bpf.cleanup()
    with netns.inside(h1.netns):   # the XDP_PASS program is back on the requester's port
        assert socket.if_nametoindex("eth0")
    assert "xdp" in topo.run("h1", ["ip", "link", "show", "eth0"]).stdout


@pytest.mark.e2e
def test_iperf3_runs_tcp_through_the_switch(topo):
    result = Iperf3(topo, "h1", "p1", seconds=1, cpus=(0, 0)).run()
    assert result["bits_per_second"] > 1e8
    assert not topo.run("p1", ["ss", "-Hltn", "sport = :5201"]).stdout  # server gone
