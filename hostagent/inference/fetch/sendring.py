"""The send ring: GETs queued by the stepping thread as entries (chunk, transfer, flags), sent in
calls of up to ``frames`` GETs each from an AF_PACKET TX ring (``hostagent.common.packet_ring``):
a call writes each GET's Ethernet/IPv4/UDP header (its route's) and KV header (its transfer's,
read from the program's transfer table as the receiver reads it) into the ring's frames, whose
room stays zero, and hands them to the kernel with one system call. Positions only grow;
position p is entry p mod SENDQ. When each position was sent and when its call ended feed the
round-trip estimates and the tail-loss rule (``transfers``). ``EngineStats`` counts where an
engine's time goes. ``Sender`` makes the calls: a thread of its own, or the stepping thread."""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import numpy as np

from hostagent.common.packet_ring import PacketRing
from kvproto import LAYOUT, MAGIC, VERSION, Flag, Op
from kvproto.frames import HDR_OFF, PAYLOAD_OFF

from .program import ROUTES, SENDQ, FetchProgram
from .transfers import Transfer

_NO_CACHE = int(Flag.NO_CACHE)
_CODES = {"H": ">u2", "B": "u1", "I": ">u4"}
# a GET's headers as the ring's frames hold them: Ethernet + IPv4 + UDP (its route's), then
# struct kvhdr (kvproto.LAYOUT, big-endian)
GET_HEADERS = np.dtype([("route", "u1", HDR_OFF)] + [
    (name, ("u1", int(code[:-1])) if code.endswith("s") else _CODES[code])
    for name, code in LAYOUT])
assert GET_HEADERS.itemsize == PAYLOAD_OFF


@dataclass
class EngineStats:
    steps: int = 0
    sends: int = 0                 # test-run calls
    frames: int = 0                # GETs queued for sending
    unsent: int = 0                # GETs queued whose transfer was over by their call
    send_seconds: float = 0.0      # in the send calls (sending, and the kernel receiving)
    verify_seconds: float = 0.0    # scanning slot words and checking CRCs
    idle_seconds: float = 0.0      # waiting for replies
    step_cpu: float = 0.0          # CPU time of the stepping thread in step()
    sender_cpu: float = 0.0        # CPU time in the send calls (the kernel's work included)
    rebuilds: int = 0              # larger arenas loaded
    moved: int = 0                 # transfers that moved on to a block's next holder


class SendRing:
    """The send queue as positions: the stepping thread queues up to ``prod``, the send calls
    send up to ``cons`` through ``packet`` (a PacketRing on the node's interface); when each
    position was sent and its call ended. ``routes``: each route's 42-byte header."""

    def __init__(self, prog: FetchProgram, packet: PacketRing, chunk_size: int):
        self.prog, self.packet, self.chunk_size = prog, packet, chunk_size
        self.prod = self.cons = 0
        self.entries = np.zeros(SENDQ, np.uint64)    # chunk | transfer << 32 | flags << 48
        self.routes = np.zeros((ROUTES, HDR_OFF), np.uint8)
        self.pos_time = np.zeros(SENDQ, np.float64)
        self.done_time = np.full(SENDQ, np.inf)

    @property
    def queued(self) -> int:
        return self.prod - self.cons

    def set_route(self, index: int, header: bytes) -> None:
        self.routes[index] = np.frombuffer(header[:HDR_OFF], np.uint8)

    def queue(self, t: Transfer, idx: np.ndarray, now: float) -> None:
        """Append GETs for chunks ``idx`` of ``t``."""
        n = idx.size
        flags = np.where(t.bypass[idx] | t.no_cache, _NO_CACHE, 0).astype(np.uint64)
        entries = idx.astype(np.uint64) | np.uint64(t.idx << 32) | (flags << np.uint64(48))
        pos = self.prod % SENDQ
        first = min(n, SENDQ - pos)
        self.entries[pos:pos + first] = entries[:first]
        self.entries[:n - first] = entries[first:]
        t.sent_seq[idx] = np.arange(self.prod, self.prod + n)
        t.sent_t[idx] = now
        t.tries[idx] += 1
        self.prod += n

    def sent_time(self, seq: np.ndarray, queued: np.ndarray) -> np.ndarray:
        """When positions ``seq`` were sent (their queueing time if overwritten since)."""
        t = self.pos_time[seq % SENDQ]
        return np.where(self.prod - seq < SENDQ, np.maximum(t, queued), queued)

    def _mark(self, a: int, n: int, where: np.ndarray, value: float) -> None:
        b = min(SENDQ, a + n)
        where[a:b] = value
        where[:n - (b - a)] = value

    def headers(self, entries: np.ndarray) -> np.ndarray:
        """The GETs of send-queue ``entries``, as GET_HEADERS, from the transfer table as it is
        now (its flags too: a transfer restarted past the switch's cache sends its GETs queued
        before with NO_CACHE); a GET of a transfer no longer active gets op 0 (not sent)."""
        chunk = (entries & np.uint64(0xFFFFFFFF)).astype(np.uint32)
        xi = ((entries >> np.uint64(32)) & np.uint64(0xFF)).astype(np.intp)
        x = self.prog.xfers[xi]
        live = (x["gen"] != 0) & (chunk < x["nslots"])
        h = np.zeros(entries.size, GET_HEADERS)
        h["route"] = self.routes[x["route"] & 0xFFFF]
        h["magic"], h["version"], h["op"] = MAGIC, VERSION, np.where(live, int(Op.GET), 0)
        h["flags"] = (entries >> np.uint64(48)).astype(np.uint16) | (x["route"] >> 16)
        h["ns"], h["key"], h["chunk"], h["len"] = x["ns"], x["key"], chunk, self.chunk_size
        h["req_id"] = (xi.astype(np.uint32) << 24) | x["gen"]
        return h

    def send(self, frames: int, stats: EngineStats) -> BaseException | None:
        """One call for up to ``frames`` queued GETs (none queued: no call)."""
        cons, prod = self.cons, self.prod
        if prod == cons:
            return None
        n = min(prod - cons, frames, self.packet.slots)
        t0, c0 = time.monotonic(), time.thread_time()
        a = cons % SENDQ
        self._mark(a, n, self.pos_time, t0)
        self._mark(a, n, self.done_time, np.inf)
        b = min(SENDQ, a + n)
        entries = np.concatenate((self.entries[a:b], self.entries[:n - (b - a)]))
        h = self.headers(entries)
        live = h["op"] != 0
        h = h[live]
        err = None
        try:
            slots = self.packet.next_frames(h.size)
            self.packet.frames[slots, :PAYLOAD_OFF] = h.view(np.uint8).reshape(h.size, PAYLOAD_OFF)
            self.packet.send(h.size)
        except BaseException as exc:          # raised by the stepping thread
            err = exc
        t1 = time.monotonic()
        self._mark(a, n, self.done_time, t1)
        self.cons = cons + n
        stats.unsent += n - h.size
        stats.send_seconds += t1 - t0
        stats.sender_cpu += time.thread_time() - c0
        stats.sends += 1
        return err


class Sender:
    """Who makes the ring's send calls: a thread of its own when ``threaded`` (the calls release
    the GIL, so the stepping thread verifies meanwhile), else the stepping thread itself
    (``send``). A few GETs (a round of retransmissions) the stepping thread sends itself while
    the thread is idle (``send_few``): waking the thread and handing it the GIL took 0.1-0.3 ms
    here, longer than such a call. What a call in the thread raised is raised in the stepping
    thread by ``check``."""

    def __init__(self, ring: SendRing, frames: int, stats: EngineStats, threaded: bool):
        self.ring, self.threaded = ring, threaded
        self._call = (frames, stats)
        self.error: BaseException | None = None
        self._stop = False
        self._wake, self._progress = threading.Event(), threading.Event()
        self._calling = threading.Lock()          # one send call on the ring at a time
        self._thread = None
        if threaded:
            self._thread = threading.Thread(target=self._run, name="kvfetch-sender", daemon=True)
            self._thread.start()

    def check(self) -> None:
        """Raise (once) what the thread's calls raised."""
        if self.error is not None:
            err, self.error = self.error, None
            raise err

    def send(self) -> None:
        """One call's worth, from the calling thread."""
        with self._calling:
            self._send_here()

    def _send_here(self) -> None:
        """A call from the calling thread, which holds ``_calling``; what it raised is raised."""
        err = self.ring.send(*self._call)
        if err is not None:
            raise err

    def send_few(self, most: int) -> bool:
        """Send what is queued from the calling thread if it is at most ``most`` GETs and the
        thread is not in a call; whether it did."""
        if self.ring.queued > most or not self._calling.acquire(blocking=False):
            return False
        try:
            self._send_here()
        finally:
            self._calling.release()
        return True

    def kick(self) -> None:
        """Something was queued: the thread sends it."""
        self._wake.set()

    def wait(self, timeout: float = 0.005) -> None:
        """Until the thread's next call ends (at most ``timeout`` seconds)."""
        self._progress.wait(timeout)
        self._progress.clear()

    def drained(self, timeout: float = 1.0) -> bool:
        """The thread has sent everything queued (at most a call's worth), so the ring and the
        program may be replaced."""
        end = time.monotonic() + timeout
        while self.threaded and self.ring.queued and time.monotonic() < end:
            if self.error is not None or self._thread is None or not self._thread.is_alive():
                return False
            self.kick()
            self.wait()
        return not (self.threaded and self.ring.queued)

    def stop(self) -> None:
        self._stop = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(10)

    def _run(self) -> None:
        try:
            while not self._stop:
                if not self.ring.queued:
                    self._wake.wait(0.05)
                    self._wake.clear()
                    continue
                with self._calling:
                    err = self.ring.send(*self._call)
                if err is not None:
                    self.error = err
                self._progress.set()
        except BaseException as exc:
            self.error = exc
