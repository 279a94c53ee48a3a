"""The send ring: GETs queued by the stepping thread into kvf_sendq (mmapped), sent by
BPF_PROG_TEST_RUN calls in live-frames mode, each call taking up to ``frames`` entries (the
generator part of kv_fetch advances ``send_pos`` atomically per frame). Positions only grow;
position p is entry p mod KV_FETCH_SENDQ. When each position was sent and when its call ended
feed the round-trip estimates and the tail-loss rule (``transfers``). ``EngineStats`` counts
where an engine's time goes. ``Sender`` makes the test-run calls: a thread of its own, or the
stepping thread."""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import numpy as np

from kvproto import Flag

from xdp import libbpf

from .program import SENDQ, FetchProgram
from .transfers import Transfer

_NO_CACHE = int(Flag.NO_CACHE)


@dataclass
class EngineStats:
    steps: int = 0
    sends: int = 0                 # test-run calls
    frames: int = 0                # GETs queued for the generator
    send_seconds: float = 0.0      # in the test-run calls (sending, and the kernel receiving)
    verify_seconds: float = 0.0    # scanning slot words and checking CRCs
    idle_seconds: float = 0.0      # waiting for replies
    step_cpu: float = 0.0          # CPU time of the stepping thread in step()
    sender_cpu: float = 0.0        # CPU time in the test-run calls (the kernel's work included)
    rebuilds: int = 0              # larger arenas loaded


class SendRing:
    """The send ring (kvf_sendq) as positions: the stepping thread queues up to ``prod``, the
    test-run calls send up to ``cons``; when each position was sent and its call ended."""

    def __init__(self, prog: FetchProgram):
        self.prog = prog
        self.prod = self.cons = 0
        self.pos_time = np.zeros(SENDQ, np.float64)
        self.done_time = np.full(SENDQ, np.inf)

    @property
    def queued(self) -> int:
        return self.prod - self.cons

    def queue(self, t: Transfer, idx: np.ndarray, now: float) -> None:
        """Append GETs for chunks ``idx`` of ``t``."""
        n = idx.size
        flags = np.where(t.bypass[idx] | t.no_cache, _NO_CACHE, 0).astype(np.uint64)
        entries = idx.astype(np.uint64) | np.uint64(t.idx << 32) | (flags << np.uint64(48))
        pos = self.prod % SENDQ
        first = min(n, SENDQ - pos)
        self.prog.sendq[pos:pos + first] = entries[:first]
        self.prog.sendq[:n - first] = entries[first:]
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

    def send(self, ifindex: int, template: bytes, meta: bytes, frames: int, batch: int,
             stats: EngineStats) -> BaseException | None:
        """One test-run call for up to ``frames`` queued GETs (none queued: no call)."""
        cons, prod = self.cons, self.prod
        if prod == cons:
            return None
        n = min(prod - cons, frames)
        ctl = self.prog.ctl[0]
        ctl["send_end"] = cons                # nothing to take while it is set up
        ctl["send_pos"] = cons
        ctl["send_end"] = cons + n
        t0, c0 = time.monotonic(), time.thread_time()
        a = cons % SENDQ
        self._mark(a, n, self.pos_time, t0)
        self._mark(a, n, self.done_time, np.inf)
        err = None
        try:
            libbpf.live_frames(self.prog.fd, template, ifindex, n, min(n, batch), meta=meta)
        except BaseException as exc:          # raised by the stepping thread
            err = exc
        t1 = time.monotonic()
        self._mark(a, n, self.done_time, t1)
        self.cons = cons + n
        stats.send_seconds += t1 - t0
        stats.sender_cpu += time.thread_time() - c0
        stats.sends += 1
        return err


class Sender:
    """Who makes the ring's test-run calls, from inside the engine's namespace ``ns``: a thread
    of its own when ``threaded`` (the calls release the GIL, so the stepping thread verifies
    meanwhile), else the stepping thread itself (``send``). A few GETs (a round of
    retransmissions) the stepping thread sends itself while the thread is idle (``send_few``):
    waking the thread and handing it the GIL took 0.1-0.3 ms here, longer than such a call.
    What a call in the thread raised is raised in the stepping thread by ``check``."""

    def __init__(self, ring: SendRing, ns, ifindex: int, template: bytes, meta: bytes,
                 frames: int, batch: int, stats: EngineStats, threaded: bool):
        self.ring, self.ns, self.threaded = ring, ns, threaded
        self._call = (ifindex, template, meta, frames, batch, stats)
        self.error: BaseException | None = None
        self._stop = False
        self._wake, self._progress = threading.Event(), threading.Event()
        self._calling = threading.Lock()          # one test-run call on the ring at a time
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
        with self.ns:
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
            with self.ns:
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
