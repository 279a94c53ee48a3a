"""The traffic generator, driven from Python, and an iperf3 runner.

Request templates (KV GET with room, memcached GET over UDP) are sent out of a host namespace's
eth0 from AF_PACKET TX rings (``hostagent.common.packet_ring``), one per thread, each thread
pinned to one core: a call writes the next frames' key index (from a sweep: ``Sweep``) and
request id into the ring's copies of the template and hands a batch to the kernel, as fast as
possible or at a fixed rate. (BPF_PROG_TEST_RUN in live-frames mode sent several times as many
frames a second from XDP, but kernels may refuse it: this one does, ``xdp.features``.) The
programs of trafficgen.c: the reply counter on the requester's eth0 (replies are counted there,
then dropped) with its byte-exact sample checks, and the bare reflector of the ``ceiling``
measurement.
"""
from __future__ import annotations

import contextlib
import json
import os
import socket
import statistics
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from scapy.layers.inet import IP, UDP
from scapy.layers.l2 import Ether
from scapy.packet import Raw
from scapy.utils import checksum

import xdp
from hostagent.common.packet_ring import PacketRing
from kvproto import HEADER_LEN, OFFSET, PORT, Flag, Message, Op, ProtocolError
from kvproto.frames import HDR_OFF
from kvproto.scapy_layer import KV
from xdp import netns
from xdp.attach import attach_xdp, detach_port
from xdp.loader import load_xdp
from xdp.program import Program

from ...lab import TestbedError, Topology, attach_pass_programs, ip

SOURCE = Path(__file__).resolve().parent / "trafficgen.c"
C = xdp.constants(SOURCE)
GEN_PORT = 40123                     # UDP source port of every generated request
MC_PORT = C["KV_GEN_MC_PORT"]
UDP_OFF = HDR_OFF                    # UDP payload: Ethernet + IPv4 (no options) + UDP
SWEEPS = ("sequential", "uniform", "zipf")
ZIPF_SLOTS = 1 << 16                 # Zipf sweep: key index = table[random slot]
FMT_BE32, FMT_HEX8 = 0, 1            # a key index as 4 bytes big-endian, or 8 lowercase hex digits
_HEX = np.frombuffer(b"0123456789abcdef", np.uint8)
REPLIES = ("kv_pool", "kv_switch", "reflected", "mc_reply")  # what counts as an answered request


def payload(index: int, size: int) -> bytes:
    """The chunk (or memcached value) stored under key index ``index``: distinct per index."""
    return (index.to_bytes(4, "big") + bytes([index & 0xFF]) * 4) * (size // 8) + \
        bytes(size % 8)


def memcached_key(index: int) -> bytes:
    return b"kv%08x" % index


@dataclass(frozen=True)
class Endpoint:
    netns: str
    ifname: str
    ifindex: int
    mac: str
    ip: str


def endpoint(netns_name: str, ifname: str = "eth0") -> Endpoint:
    link = json.loads(ip("-j", "addr", "show", ifname, ns=netns_name).stdout)[0]
    addr = next(a["local"] for a in link["addr_info"] if a["family"] == "inet")
    return Endpoint(netns_name, ifname, link["ifindex"], link["address"], addr)


@dataclass(frozen=True)
class Template:
    """A request frame and where each copy of it gets its key index and request id."""
    frame: bytes
    hdr_len: int
    key_off: int
    key_fmt: int                     # FMT_BE32 or FMT_HEX8
    id_off: int
    id_len: int                      # 2 or 4 bytes, big-endian


class Sweep:
    """Which key index each frame of a template asks for, and its request id: ``sweep`` over
    key_base .. key_base + nkeys - 1 (sequential: frame number mod nkeys; uniform random; Zipf
    of exponent ``zipf_s``, index 0 the most popular), the request id (the thread's number << 24
    | its frame number, 2-byte ids the low 16 bits). ``write`` stamps a batch of frames."""

    def __init__(self, t: Template, nkeys: int, sweep: str = "sequential", key_base: int = 0,
                 zipf_s: float = 1.0):
        if not 1 <= nkeys < 1 << 32 or sweep not in SWEEPS:
            raise ValueError("nkeys out of range or unknown sweep")
        self.t, self.nkeys, self.sweep, self.key_base = t, nkeys, sweep, key_base
        self.zipf = self._zipf_table(nkeys, zipf_s) if sweep == "zipf" else None

    @staticmethod
    def _zipf_table(nkeys: int, s: float) -> np.ndarray:
        """Slot j holds the key index whose Zipf(s) CDF first reaches (j + 0.5) / slots: index 0
        is the most popular. Keys rarer than one slot in ZIPF_SLOTS get none."""
        cdf = np.cumsum(1.0 / np.arange(1, nkeys + 1, dtype=np.float64) ** s)
        idx = np.searchsorted(cdf / cdf[-1], (np.arange(ZIPF_SLOTS) + 0.5) / ZIPF_SLOTS)
        return np.minimum(idx, nkeys - 1).astype(np.uint32)

    def keys(self, seq: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        """Key indexes of frames number ``seq`` of one thread."""
        if self.sweep == "zipf":
            idx = self.zipf[rng.integers(0, ZIPF_SLOTS, seq.size)]
        elif self.sweep == "uniform":
            idx = rng.integers(0, self.nkeys, seq.size)
        else:
            idx = seq % self.nkeys
        return (self.key_base + idx.astype(np.uint64)).astype(np.uint32)

    def write(self, frames: np.ndarray, rows: np.ndarray, seq: np.ndarray, thread: int,
              rng: np.random.Generator) -> None:
        """Stamp key indexes and request ids into rows ``rows`` of ``frames`` (copies of the
        template), frames number ``seq`` of thread ``thread``."""
        t, idx = self.t, self.keys(seq, rng)
        if t.key_fmt == FMT_HEX8:
            nibbles = (idx[:, None] >> np.arange(28, -1, -4, dtype=np.uint32)) & 0xF
            frames[rows, t.key_off:t.key_off + 8] = _HEX[nibbles]
        else:
            frames[rows, t.key_off:t.key_off + 4] = idx.astype(">u4").view(np.uint8).reshape(-1, 4)
        rid = (np.uint32(thread) << np.uint32(24)) | (seq & 0xFFFFFF).astype(np.uint32)
        width = ">u2" if t.id_len == 2 else ">u4"
        frames[rows, t.id_off:t.id_off + t.id_len] = (
            rid.astype(width).view(np.uint8).reshape(-1, t.id_len))


def kv_get(src: Endpoint, dst: Endpoint, ns: int, key: bytes, room: int) -> Template:
    """A KV GET from src to the pool node dst; the key index goes into the chunk field."""
    frame = bytes(Ether(src=src.mac, dst=dst.mac) / IP(src=src.ip, dst=dst.ip) /
                  UDP(sport=GEN_PORT, dport=PORT, chksum=0) /
                  KV(op=Op.GET, ns=ns, key=key) / Raw(bytes(room)))
    return Template(frame, UDP_OFF + HEADER_LEN, UDP_OFF + OFFSET["chunk"], FMT_BE32,
                    UDP_OFF + OFFSET["req_id"], 4)


def memcached_get(src: Endpoint, dst: Endpoint) -> Template:
    """memcached's UDP frame header (request id, sequence 0, 1 datagram, reserved) and
    ``get kvXXXXXXXX``; the key index goes into the hex digits."""
    text = b"\x00\x00\x00\x00\x00\x01\x00\x00get " + memcached_key(0) + b"\r\n"
    frame = bytes(Ether(src=src.mac, dst=dst.mac) / IP(src=src.ip, dst=dst.ip) /
                  UDP(sport=GEN_PORT, dport=MC_PORT, chksum=0) / Raw(text))
    return Template(frame, len(frame), UDP_OFF + 14, FMT_HEX8, UDP_OFF, 2)


@dataclass
class Run:
    """One measurement: counter deltas over ``seconds`` of steady sending."""
    seconds: float
    sent: int
    counts: dict[str, int]
    cores: tuple[int, ...]
    rate: float
    windows: list[float]            # replies per second in each part of the measured time

    def pps(self, name: str = "replies") -> float:
        n = self.sent if name == "sent" else (
            sum(self.counts[r] for r in REPLIES) if name == "replies" else self.counts[name])
        return n / self.seconds

    def median_pps(self) -> float:
        """Replies per second, the median of the windows: robust to a window in which other
        work on the machine took the generator's core."""
        return statistics.median(self.windows)

    def as_dict(self) -> dict:
        return {"seconds": round(self.seconds, 4), "sent_pps": round(self.pps("sent")),
                "reply_pps": round(self.median_pps()), "mean_reply_pps": round(self.pps()),
                "window_reply_pps": [round(w) for w in self.windows],
                "offered_rate": self.rate or "max", "cores": list(self.cores),
                "counts": self.counts}


class Generator(Program, source=str(SOURCE), stats="KV_CNT_"):
    """The reply counter and the reflector, compiled, and the sender of what ``configure``
    says; one per process is enough (the programs are not tied to a namespace until attached).
    ``counters()``: count_replies' counters by name."""

    def __init__(self):
        self.bpf, fns = load_xdp(SOURCE, ("count_replies", "reflect"))
        self.count_fn, self.reflect_fn = fns["count_replies"], fns["reflect"]
        (self.rx_cfg, self.rx_count, self.rx_sample) = (
            self.bpf.get_table(n) for n in (b"rx_cfg", b"rx_count", b"rx_sample"))
        self._sample_gen = 0
        self.clear_sample()
        self.sweep: Sweep | None = None
        self._sent: list[int] = []

    def close(self) -> None:
        self.bpf.cleanup()

    # ---- what to send --------------------------------------------------------------------
    def configure(self, t: Template, nkeys: int, sweep: str = "sequential", key_base: int = 0,
                  zipf_s: float = 1.0) -> None:
        """Send ``t`` with key indexes key_base .. key_base + nkeys - 1, swept as asked."""
        self.sweep = Sweep(t, nkeys, sweep, key_base, zipf_s)

    @property
    def template(self) -> Template | None:
        return self.sweep.t if self.sweep else None

    # ---- where it goes -------------------------------------------------------------------
    @contextlib.contextmanager
    def counting(self, requester: str, ifname: str = "eth0"):
        """The reply counter on the requester's veth end instead of its XDP_PASS program,
        which is put back afterwards."""
        with netns.inside(requester):
            attach_xdp(ifname, self.count_fn)
        try:
            yield self
        finally:
            if netns.exists(requester):
                attach_pass_programs([requester], ifname)

    @contextlib.contextmanager
    def reflecting(self, switch_ns: str, port: str):
        """The bare XDP_TX reflector on a switch port (nothing else may be attached there)."""
        with netns.inside(switch_ns):
            attach_xdp(port, self.reflect_fn)
        try:
            yield
        finally:
            if netns.exists(switch_ns):
                with netns.inside(switch_ns):
                    detach_port(port)

    # ---- counters ------------------------------------------------------------------------
    def stats_fd(self) -> int:
        return self.rx_count.get_fd()

    def sent(self) -> int:
        """Frames handed to the kernel by the last run's threads (so far)."""
        return sum(self._sent)

    def clear_sample(self) -> None:
        """Ask for a new sample: count_replies keeps the next reply of the new generation."""
        self._sample_gen += 1
        self.rx_cfg[0] = self.rx_cfg.Leaf(port=socket.htons(GEN_PORT),
                                          sample_gen=self._sample_gen)

    def sample(self) -> bytes | None:
        """The first reply counted (on any CPU) since clear_sample()."""
        for v in self.rx_sample[self.rx_sample.Key(0)]:
            if v.gen == self._sample_gen and v.len:
                return bytes(v.data[:v.len])
        return None

    # ---- sending -------------------------------------------------------------------------
    def _send(self, n: int, src: Endpoint, cpu: int, rate: float, batch: int,
              stop: threading.Event) -> None:
        """Thread ``n``'s loop: pinned to ``cpu``, a packet ring in the sender's namespace,
        batches of frames as fast as possible or ``rate`` frames a second (batches of about a
        millisecond's worth, each sent when it is due)."""
        os.sched_setaffinity(0, {cpu})
        with netns.inside(src.netns):
            ring = PacketRing(src.ifname, len(self.sweep.t.frame), max(batch, 64))
        try:
            ring.frames[:] = np.frombuffer(self.sweep.t.frame, np.uint8)
            rng = np.random.default_rng(n)
            size = min(ring.slots, batch if not rate else max(1, int(rate / 1000)))
            seq, due = 0, time.monotonic()
            while not stop.is_set():
                if rate:
                    wait = due - time.monotonic()
                    if wait > 0:
                        time.sleep(wait)
                    due = max(due, time.monotonic() - 0.01) + size / rate
                self.sweep.write(ring.frames, ring.next_frames(size),
                                 np.arange(seq, seq + size, dtype=np.uint64), n, rng)
                seq += ring.send(size)
                self._sent[n] = seq
        finally:
            ring.close()

    def run(self, src: Endpoint, seconds: float = 1.0, warmup: float = 0.3, rate: float = 0,
            cores: tuple[int, ...] = (0,), windows: int = 1, batch: int = 1024) -> Run:
        """Send the configured frames out of ``src`` from one thread per core and count replies
        over ``seconds`` after ``warmup``, in ``windows`` equal parts. ``rate``: frames per
        second in all, shared evenly by the cores; 0: as fast as possible. The sample slot holds
        a reply of the measured time."""
        if self.sweep is None:
            raise RuntimeError("configure() first")
        stop, errors = threading.Event(), []
        self._sent = [0] * len(cores)

        def worker(n: int, cpu: int):
            try:
                self._send(n, src, cpu, rate / len(cores), batch, stop)
            except BaseException as exc:  # reported by the caller
                errors.append(exc)
                stop.set()

        threads = [threading.Thread(target=worker, args=(i, c), daemon=True)
                   for i, c in enumerate(cores)]
        for t in threads:
            t.start()
        try:
            stop.wait(warmup)
            self.clear_sample()
            marks = [(self.counters(), self.sent(), time.monotonic())]
            for _ in range(windows):
                stop.wait(seconds / windows)
                marks.append((self.counters(), self.sent(), time.monotonic()))
        finally:
            stop.set()
            for t in threads:
                t.join(30)
        if errors:
            raise TestbedError(f"generator failed: {errors[0]}")
        (c0, s0, t0), (c1, s1, t1) = marks[0], marks[-1]
        parts = [sum(b[0][r] - a[0][r] for r in REPLIES) / (b[2] - a[2])
                 for a, b in zip(marks, marks[1:])]
        return Run(t1 - t0, s1 - s0, {k: c1[k] - c0[k] for k in c1}, tuple(cores), rate, parts)


# ---- byte-exact checks of sampled replies ------------------------------------------------
def check_kv_reply(frame: bytes | None, src: Endpoint, dst: Endpoint, ns: int, key: bytes,
                   nkeys: int, chunk_size: int, nchunks: int | None = None) -> str | None:
    """None if ``frame`` is, byte for byte, the reply to one of the swept GETs of ``src`` to
    ``dst`` for chunks 0..nkeys-1 of a block of ``nchunks`` (default nkeys) chunks holding
    payload(i, chunk_size) each (a switch-made reply must match the whole frame the data plane
    writes); else what is wrong."""
    if frame is None:
        return "no reply sampled"
    pkt = Ether(frame)
    if IP not in pkt or UDP not in pkt:
        return "sampled frame is not IPv4/UDP"
    if (pkt[Ether].dst, pkt[IP].src, pkt[IP].dst, pkt[UDP].sport, pkt[UDP].dport) != (
            src.mac, dst.ip, src.ip, PORT, GEN_PORT):
        return "reply is not addressed from the pool node to the generator"
    body = bytes(pkt[UDP].payload)[:pkt[UDP].len - 8]
    try:
        msg = Message.decode(body)
    except ProtocolError as exc:
        return f"reply does not decode: {exc}"
    if not (msg.op == Op.GET_REPLY and msg.ns == ns and msg.key == key and msg.chunk < nkeys):
        return f"reply is for something not asked: {msg.op}, ns {msg.ns}, chunk {msg.chunk}"
    expect = Message(Op.GET_REPLY, ns, key, msg.chunk, nchunks or nkeys, msg.req_id,
                     msg.flags & Flag.FROM_SWITCH, payload=payload(msg.chunk, chunk_size))
    if body != expect.encode():
        return f"reply for chunk {msg.chunk} differs from the stored chunk"
    if msg.flags & Flag.FROM_SWITCH:
        whole = bytes(Ether(src=dst.mac, dst=src.mac) / IP(src=dst.ip, dst=src.ip) /
                      UDP(sport=PORT, dport=GEN_PORT, chksum=0) / Raw(expect.encode()))
        if frame != whole:
            return "switch-made reply frame differs from the expected frame"
    elif checksum(frame[14:34]) != 0:
        return "bad IP checksum"
    return None


def check_memcached_reply(frame: bytes | None, src: Endpoint, value_size: int) -> str | None:
    """None if ``frame`` is the first datagram of a memcached answer to one of the swept GETs,
    carrying (the start of) the value stored under that key; else what is wrong."""
    if frame is None:
        return "no reply sampled"
    pkt = Ether(frame)
    if UDP not in pkt or (pkt[IP].dst, pkt[UDP].sport, pkt[UDP].dport) != (src.ip, MC_PORT,
                                                                           GEN_PORT):
        return "reply is not addressed from memcached to the generator"
    data = bytes(pkt[UDP].payload)[:pkt[UDP].len - 8]
    seq, total = int.from_bytes(data[2:4], "big"), int.from_bytes(data[4:6], "big")
    text = data[8:]
    head, sep, rest = text.partition(b"\r\n")
    parts = head.split()
    if seq != 0 or not sep or len(parts) != 4 or parts[0] != b"VALUE":
        return f"not the first datagram of a VALUE answer: {text[:40]!r}"
    index = int(parts[1][2:], 16)
    if parts[1] != memcached_key(index) or int(parts[3]) != value_size:
        return f"answer for a key or size not asked: {head!r}"
    expect = payload(index, value_size) + b"\r\nEND\r\n"
    if (total == 1 and rest != expect) or (total > 1 and not expect.startswith(rest)):
        return f"value of {parts[1].decode()} differs from the stored one"
    return None


def check_reflected(frame: bytes | None, t: Template) -> str | None:
    """None if ``frame`` is one of the generated requests, come back unchanged."""
    if frame is None:
        return "no frame sampled"
    if len(frame) != len(t.frame):
        return f"reflected frame has {len(frame)} bytes, sent {len(t.frame)}"
    written = [(t.key_off, 8 if t.key_fmt == FMT_HEX8 else 4), (t.id_off, t.id_len)]
    a, b = bytearray(frame[:t.hdr_len]), bytearray(t.frame[:t.hdr_len])
    for off, n in written:
        a[off:off + n] = b[off:off + n] = bytes(n)
    return None if a == b else "reflected frame's headers differ from the template"


# ---- background TCP ----------------------------------------------------------------------
class Iperf3:
    """iperf3 TCP from ``client`` to ``server`` (node names of a topology): run() in the
    foreground, or start() ... result() around other work for background traffic. ``cpus``
    pins the client and the server to one CPU each."""

    def __init__(self, topo: Topology, client: str, server: str, seconds: float = 2.0,
                 port: int = 5201, cpus: tuple[int, int] | None = None):
        self.topo, self.client, self.server = topo, client, server
        self.seconds, self.port = seconds, port
        self.affinity = ([["-A", str(cpu)] for cpu in cpus] if cpus else [[], []])
        self._srv: subprocess.Popen | None = None
        self._cli: subprocess.Popen | None = None

    def start(self) -> Iperf3:
        addr = self.topo.node(self.server).ip
        self._srv = self.topo.popen(self.server, ["iperf3", "-s", "-1", "-B", addr,
                                                  "-p", str(self.port), *self.affinity[1]],
                                    stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 10
        while not self.topo.run(self.server, ["ss", "-Hltn", f"sport = :{self.port}"]).stdout:
            if self._srv.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise TestbedError(f"iperf3 server did not start: {self._srv.stderr.read()}")
            time.sleep(0.02)
        self._cli = self.topo.popen(self.client, ["iperf3", "-c", addr, "-p", str(self.port),
                                                  "-t", f"{self.seconds:g}", "-J",
                                                  *self.affinity[0]],
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        return self

    def result(self) -> dict:
        """Wait for the client; received bits per second and sender retransmits."""
        try:
            out, err = self._cli.communicate(timeout=self.seconds + 30)
            if self._cli.returncode:
                raise TestbedError(f"iperf3 failed: {(err or out).strip()[-400:]}")
            end = json.loads(out)["end"]
            return {"bits_per_second": end["sum_received"]["bits_per_second"],
                    "retransmits": end["sum_sent"].get("retransmits", 0),
                    "seconds": self.seconds}
        finally:
            self.stop()

    def stop(self) -> None:
        for p in (self._cli, self._srv):
            if p is not None and p.poll() is None:
                p.terminate()
                try:
                    p.wait(5)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()

    def run(self) -> dict:
        return self.start().result()
