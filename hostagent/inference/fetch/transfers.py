"""Transfers in flight and what to ask for next: per-transfer state, round-trip estimates, the
congestion window per pool node, and loss recovery.

Loss recovery is RACK-like: a chunk is presumed lost when a chunk asked for after it (send-ring
order, first asks only: Karn) has come back on the pool's path (the pool node's reply or the
switch's replica of one: replies keep their order on a path; a hit from the switch's cache
overtakes a miss the switch holds for the pool's reply, so on the pool's path hits never mark a
chunk lost) and it is older than the reordering window (a quarter of the least recent round
trip, at least ``reo_floor``). For a transfer the switch answers from its cache (at least 90%
FROM_SWITCH replies) within the test-run call that sent the GET (``sync``: fewer than
``LATE_MAX`` of its replies came after their call had ended and a look had not found them - no
link queue in between, however long the engine's own batches make the round trip), a chunk is
lost when a hit asked for after it came back (SACK-like: replies keep arriving, so this is loss,
not a queue) and its call ended before the last look (the first ``FAST_TRIES`` asks) or
``tail_wait`` (or eight gaps between deliveries at the measured rate) ago, or when nothing came
back for that long since its call; each try after those waits ``HIT_BACKOFF`` times longer. Once
a reply of the transfer came on the pool's path, or while more than ``HELD_SHARE`` of the chunks
asked are missing, a hole may be a miss the switch holds for a pool node's reply (a block it is
still learning) rather than a lost hit: that rule then takes a chunk for lost for its first
``FAST_TRIES`` asks only and keeps at most ``FAST_OUT`` chunks asked again out at once, and a
held miss waits for its reply or the timeout (every hole asked again at every scan overfilled a
shaped link's queue). Always when nothing came back for the retransmission timeout (RFC 6298 per
transfer, following the measured round trip as a link's queue grows, at least ``DRAIN_GAIN`` x
the time the route's chunks in flight (every transfer's: they share the link's queue) take at
the measured delivery rate, at most ``MAX_RTO`` before backing off; before a transfer's first
reply at least ``INITIAL_RTO``, or ``ACTIVE_FIRST_RTO`` once the route has delivered, and that
until the route has a delivery rate; restarted by every delivery, backing off per try; the
oldest ``TIMEOUT_BATCH`` unverified chunks per scan), and only once what was in flight ahead
of the ask on the engine's interface settled (``Interface``: every route's replies share its
link queues, and a transfer asked behind another pool node's window hears nothing for as long
as that takes: a fresh engine's first fetch of 32 blocks from two pool nodes over an idle
25 Mbit/s link asked 59-79 of its 160 chunks again). Before a retransmission the candidates'
slot words are read again: arrived but not yet verified is not lost. Scans look at the
unverified chunks only (a chunk lost twice keeps the lowest unverified one far behind).

The window per pool node starts at ``INITIAL_WINDOW`` (at most ``start_window``), grows as
TCP's (slow start, then congestion avoidance) and halves once per round trip on loss towards
the pool node (a queue overflowed); loss where the switch answers from its cache leaves it
alone. It is also held to ``BDP_GAIN`` x the measured delivery rate x the least round trip +
``BDP_HEADROOM`` chunks (as BBR does), where a link's queue is in the way: not for ``sync``
transfers, whose round trip is the engine's own batch (that bound shrank with the window it set,
to ~130 chunks under 5 % loss), nor while a transfer's round trip stays within ``QUEUE_SIGNAL``
of the base one (an unshaped pool node: the round trip is the engine's batches and the pool's
own work, and the bound held a 64 MiB fetch to ~200 chunks in flight and 0.6 GB/s, idle 38 %
of the time, against 1.0 GB/s without it),
and to the rate x (``BDP_GAIN`` x the base round trip + ``QUEUE_MAX``) + ``BDP_HEADROOM`` (the
base round trip is a plain minimum over ``BASE_RTT_WINDOW``, so a standing queue never raises
it): over a shaped link the queue in front of it stays short instead of filling until it drops
(a GET carries room for its reply, so GETs load the link towards the pool as much as the
replies load the way back). The round trips of these bounds are the pool node's own replies
once there are any (``Route.rtt_sample``), and a transfer most of whose replies a switch sends
(hits, copies of a reply to another reader's GET it held: ``copied``) has the queue bound alone,
with ``COPIED_HEADROOM``: its GETs do not load the pool node's link. The headroom and the
initial window are small because engines that share a link queue each add theirs: 8 nodes
fetching from 2 pool nodes over bridges at 64 / 64 offered ~1,024 GETs to two queues of ~51
chunks and lost 229-256 of them (docs/fabric.md).
Transfers are filled in the order they were submitted, each as far as the room goes, so a step
verifies one or two transfers rather than all and a prefix of blocks is usable from its start.
"""
from __future__ import annotations

import copy
import time

import numpy as np

from hostagent.common.transfer import TransferStats

from .program import GEN_MASK, SENDQ


INITIAL_RTO = 0.2                       # seconds, before a round trip was measured
ACTIVE_FIRST_RTO = 0.05                 # seconds, the same once the route has delivered
INITIAL_WINDOW = 16                     # chunks in flight per pool node before any reply
LATE_MAX = 0.25                         # share of replies after their call ended: a queue
BDP_GAIN, BDP_HEADROOM = 2.0, 8         # window <= gain x delivery rate x min RTT + headroom
COPIED_HEADROOM = 24                    # the same, where a switch sends most of the replies
QUEUE_MAX = 0.015                       # and <= rate x (gain x base RTT + this) + headroom
QUEUE_SIGNAL = 0.002                    # round trip above the base one: a link's queue
BASE_RTT_WINDOW = 10.0                  # seconds a base (least) round trip is trusted (BBR's)
DRAIN_GAIN = 2.0                        # timeout >= this x (chunks in flight / delivery rate)
MAX_RTO = 1.0                           # seconds, before backoff: RFC 6298's own bound here
HIT_BACKOFF = 2.0                       # the tail rule's wait grows this much per try
FAST_TRIES = 2                          # asks lost at the first look after their call: a
#                                         retransmission lost too (1 in 20 at 5 % loss) is not
#                                         held 0.4 ms; where a hole may be a held miss, the
#                                         only asks the tail rule takes for lost
FAST_OUT = 64                           # chunks asked again and not back, most the tail rule
#                                         adds to: the holes of a block the switch is still
#                                         learning are held misses, and 600 asked again at once
#                                         filled a 50 Mbit/s link's queue and were dropped
HELD_SHARE = 0.5                        # more than this share of the chunks asked missing:
#                                         held, not lost (if lost, not to be asked again at once)
REORDER_ASKS = 8                        # asks a route's reply may come after another's asked later
TIMEOUT_BATCH = 16                      # chunks presumed lost by a timeout per scan
RATE_SPAN = 0.002                       # seconds a delivery-rate sample spans at least: 16
#                                         readers on 2 cores verify replies in bursts, and 1 ms
#                                         spans measured up to 3x the link's rate (windows that
#                                         overflowed its queue: bench incast p99 1.3-3.2 s)


class Rtt:
    """Round-trip estimator (RFC 6298) and RACK's reordering window, per transfer: chunks the
    switch answers come back within microseconds, the pool node's after its queue."""

    def __init__(self):
        self.srtt: float | None = None
        self.rttvar = 0.0
        self.min_rtt = 1.0
        self.rto = INITIAL_RTO          # until there are samples
        self.reo = 0.001                # reordering window of loss detection
        self.late = 1.0                 # share of replies that came after their call (EWMA)

    def sample(self, rtt: float, floor: float, reo_floor: float) -> None:
        """``rtt``: a batch of replies' mean round trip (the route has its own estimates:
        ``Route.rtt_sample``)."""
        if self.srtt is None:
            self.srtt, self.rttvar = rtt, rtt / 2
        else:
            self.rttvar = 0.75 * self.rttvar + 0.25 * abs(self.srtt - rtt)
            self.srtt = 0.875 * self.srtt + 0.125 * rtt
        # the least round trip seen lately (drifting up slowly); a quarter of it is the window
        self.min_rtt = min(rtt, self.min_rtt + (rtt - self.min_rtt) / 64)
        self.reo = max(reo_floor, self.min_rtt / 4)
        self.rto = min(MAX_RTO, max(floor, self.srtt + 4 * self.rttvar))

    def arrived(self, late: float) -> None:
        """``late``: the share of a batch of replies that came after the test-run call that sent
        their GETs had ended (a look after that call did not find them)."""
        self.late = 0.5 * self.late + 0.5 * late

    @property
    def sync(self) -> bool:
        """Whether replies come within the call that sent their GETs (the switch's XDP_TX, no
        link queue in between), however long the engine's own batches make the round trip."""
        return self.late < LATE_MAX


class Interface:
    """What every route's chunks share: the engine's interface and the link queues behind it.
    Replies come back through it in about the order their GETs left, so a chunk asked with
    ``n`` chunks in flight ahead of it is due once ``n`` more asks were settled: answered, or
    presumed lost (a lost one ahead must not hold back those behind it)."""

    def __init__(self):
        self.settled = 0                   # asks answered or presumed lost, every route's
        self.last_delivery = time.monotonic()

    def drained(self, asked_at: np.ndarray, ahead: np.ndarray, now: float, pause: float,
                quiet: np.ndarray) -> np.ndarray:
        """Whether what was in flight ahead of each ask (``ahead``, when ``settled`` was
        ``asked_at``) has settled: all of it and a margin more (routes overtake each other by a
        few: one pool node answers sooner), or all of it and the interface paused ``pause``
        since (nothing comes after the last asks of a fetch), or nothing came for ``quiet``."""
        gone, idle = self.settled - asked_at, now - self.last_delivery
        return ((gone >= ahead + ahead // 4 + REORDER_ASKS) | ((gone >= ahead) & (idle > pause))
                | (idle > quiet))


class Route:
    """A pool node as the generator addresses it (kvf_routes index), with its window."""

    def __init__(self, index: int, addr: tuple[str, int], start_window: int,
                 iface: Interface | None = None):
        self.index, self.addr, self.iface = index, addr, iface or Interface()
        self.cwnd, self.ssthresh = float(min(start_window, INITIAL_WINDOW)), 1e9
        self.last_cut = 0.0
        self.rtts: dict[bool, Rtt] = {}    # the last transfer's estimator, by who answered
        self.last_switched = False
        self.min_rtt = 1.0                 # least round trip (drifting up slowly), seconds
        self.base_rtt = 1.0                # least round trip of the last 10 s, seconds
        self._base_t = 0.0
        self.own_path = False              # the pool node answered a GET of ours (not a copy)
        self.bw = 0.0                      # delivery rate, chunks/s (max filter, decaying)
        self.inflight = 0                  # chunks asked for and not verified, all transfers
        self._acc, self._t0 = 0, time.monotonic()

    def rtt_sample(self, rtt: float, least: float, own: bool = True) -> None:
        """``rtt``: a batch's mean round trip; ``least``: its last-asked chunk's. The base round
        trip is a plain minimum of ``least``, renewed after ``BASE_RTT_WINDOW``: it must not
        follow a standing queue up (the drifting least round trip does, on a shaped link, and
        the window set from it kept the queue standing and growing until the link dropped
        GETs: ~250 in flight at 100 Mbit/s). ``own``: the pool node's replies to our GETs;
        else the switch's (hits, or copies of another reader's reply to a GET it held). Once
        the pool node answered, only its own replies set the least round trip (the
        bandwidth-delay bound's): a copy answers as soon as the other reader's reply passes,
        0.1-0.3 ms for 16 readers of one block, and the window set from that shrank to its
        headroom (1.6 x their time on a 50 Mbit/s link). Every reply may lower the base round
        trip (the queue bound's floor: a smaller one only tightens it)."""
        if own and not self.own_path:       # the switch's round trips were no path's
            self.own_path, self.min_rtt = True, rtt
        if own or not self.own_path:
            self.min_rtt = min(rtt, self.min_rtt + (rtt - self.min_rtt) / 1024)
        now = time.monotonic()
        if least <= self.base_rtt or now - self._base_t > BASE_RTT_WINDOW:
            self.base_rtt, self._base_t = least, now

    def window(self, sync: bool = False, copied: bool = False) -> int:
        """Chunks this route may have in flight: the congestion window, held to the measured
        bandwidth-delay product (times the gain, plus headroom), and to ``QUEUE_MAX`` of queue
        beyond the base one at the measured rate, once there is a rate. Where the round trip is
        a link's queue the second keeps that queue short. ``sync``: no queue is in the way
        (the switch answers within the sending call, or the round trip stays near the base
        one), the round trip is the engine's own batch and the peer's work (a smaller window
        makes a shorter one): only the second bound holds. ``copied``: a switch sends most
        replies (hits, copies of a reply to another reader's GET), at the pace of a pool node
        this route's GETs do not load: the second bound alone, with ``COPIED_HEADROOM``."""
        if self.bw <= 0:
            return int(self.cwnd)
        head = COPIED_HEADROOM if copied else BDP_HEADROOM
        queue = self.bw * (BDP_GAIN * self.base_rtt + QUEUE_MAX) + head
        if sync or copied:
            return int(min(self.cwnd, queue))
        return int(min(self.cwnd, BDP_GAIN * self.bw * self.min_rtt + head, queue))

    def _deliveries(self, n: int, now: float) -> None:
        """A delivery-rate sample per round trip (at least ``RATE_SPAN``); a long pause is idle
        time, not a rate, and what ended it came during it."""
        span = max(self.min_rtt, RATE_SPAN)
        el = now - self._t0
        if el > 20 * span:
            self._acc, self._t0 = 0, now
            return
        self._acc += n
        if el >= span:
            self.bw = max(self._acc / el, self.bw * 0.8)
            self._acc, self._t0 = 0, now

    def acked(self, n: int, max_window: int) -> None:
        now = time.monotonic()
        self._deliveries(n, now)
        self.iface.settled += n
        self.iface.last_delivery = now
        if self.cwnd < self.ssthresh:
            self.cwnd = min(max_window, self.cwnd + n)              # slow start
        else:
            self.cwnd = min(max_window, self.cwnd + n / self.cwnd)  # congestion avoidance

    def lost(self, now: float, min_window: int, rtt: float) -> None:
        if now - self.last_cut > rtt:                               # once per round trip
            self.ssthresh = self.cwnd = max(float(min_window), self.cwnd / 2)
            self.last_cut = now


def queue_free(t: "Transfer") -> bool:
    """Whether ``t``'s round trip shows no link queue yet: measured, and within
    ``QUEUE_SIGNAL`` of its route's base round trip."""
    return t.rtt.srtt is not None and t.rtt.srtt <= t.route.base_rtt + QUEUE_SIGNAL


class Transfer:
    """One block being fetched into a slot range (``base``, transfer table entry ``idx`` with
    generation ``gen``)."""

    def __init__(self, route: Route, ns: int, key: bytes, nchunks: int | None, no_cache: bool,
                 deadline: float):
        if len(key) != 16:
            raise ValueError("block key must be 16 bytes")
        self.ns, self.key, self.no_cache, self.route = ns, key, no_cache, route
        self.known = nchunks is not None
        self.nchunks = nchunks if self.known else 1
        if self.nchunks < 1:
            raise ValueError("a block has at least one chunk")
        self.start = time.monotonic()
        self.deadline = self.start + deadline
        self.stats = TransferStats()
        self.result = None                   # a Block when done
        self.error: BaseException | None = None
        self.idx = self.gen = self.base = -1
        self.others: list = []               # the block's next holders, to ask if this is silent
        self._on(route)

    def _on(self, route: Route) -> None:
        """Ask ``route``, from the last transfer's round trips there (the switch's, unless
        bypassed); nothing asked yet."""
        self.route = route
        last = route.rtts.get(not self.no_cache) or route.rtts.get(False)
        self.rtt = copy.copy(last) if last is not None else Rtt()
        self.seen_received = 0
        self.reset(self.nchunks)
        self.switched = not self.no_cache and route.last_switched
        self.heard = time.monotonic()        # the last reply to it (or when it was routed)

    def move(self, route: Route) -> None:
        """Ask another pool node for the block: the same slots, every chunk asked afresh (a
        replica holds the same bytes, but a restart keeps the verification simple)."""
        stats = self.stats
        self._on(route)
        self.stats = stats

    def reset(self, n: int) -> None:
        """Per-chunk state for ``n`` chunks, nothing asked yet."""
        self.sent_seq = np.full(n, -1, np.int64)      # send-ring position of the last ask
        self.sent_t = np.zeros(n, np.float64)
        self.tries = np.zeros(n, np.int32)
        self.asked_at = np.zeros(n, np.int64)         # interface's settled count at the ask
        self.ahead = np.zeros(n, np.int64)            # and asks in flight before it then
        self.verified = np.zeros(n, bool)
        self.bypass = np.zeros(n, bool)               # ask with KV_F_NO_CACHE (a bad CRC)
        self.nverified = 0
        self.next_new = 0                             # chunks never asked for start here
        self.lo = 0                                   # lowest unverified chunk
        self.max_recv_seq = -1                        # latest position answered (first asks)
        self.max_hit_seq = -1                         # latest one answered from the cache
        self.pool_path = False                        # a reply came on the pool's path
        self.last_delivery = time.monotonic()
        self.switched = False                         # the switch answers it (within the call)
        self.copied = False                           # most replies from a switch, not the pool
        self.next_scan = 0.0
        self.looked: float | None = None              # when verify last read the slot words

    @property
    def done(self) -> bool:
        return self.result is not None or self.error is not None

    @property
    def inflight(self) -> int:
        return self.next_new - self.nverified


def _timers(t: Transfer) -> tuple[bool, float]:
    """Whether ``t`` is answered by the switch (the tail rule applies) and its retransmission
    timeout. Until a reply of this transfer came back both are an earlier transfer's guess, and
    a miss may wait for a pool node's fill (a Mooncake read: tens of milliseconds): no tail
    rule, and a timeout of at least the initial one."""
    rto = t.rtt.rto
    if t.route.bw > 0:                  # what is in flight takes this long at the measured rate,
        # up to MAX_RTO: a transfer starved behind others on a full link measures a rate of a
        # few chunks a second, and its timeout grew past the deadline (16 readers on one
        # 50 Mbit/s pool link over a bridge: a reader left 1,361 chunks unasked for 30 s)
        rto = max(rto, min(MAX_RTO, DRAIN_GAIN * max(t.inflight, t.route.inflight)
                           / t.route.bw))
    elif t.seen_received:
        # no delivery rate yet: the first replies can be hits or a queue's head, and the rest
        # of the window wait behind a slow link (4 readers of a 10 Mbit/s pool node: 16 chunks
        # of a reader's first 66 timed out 1.4 ms after 2 hits)
        rto = max(rto, ACTIVE_FIRST_RTO)
    if t.seen_received:
        # answers within the call: a short round trip, and a measured delivery rate (its gaps
        # set the tail rule's wait, see _tail_wait); else a link queue is in between
        return t.switched and t.rtt.sync and t.route.bw > 0, rto
    # before a reply: the initial timeout, or a shorter one once the route has delivered (its
    # pool node answers; a GET the switch held and dropped is not waited for 200 ms)
    return False, max(rto, ACTIVE_FIRST_RTO if t.route.bw > 0 else INITIAL_RTO)


def _tail_wait(t: Transfer, tail_wait: float) -> float:
    """The tail rule's wait: ``tail_wait``, or eight gaps between deliveries at the measured
    rate if longer (a link's pace, not a loss)."""
    return max(tail_wait, 8 / t.route.bw) if t.route.bw > 0 else tail_wait


def _lost(t: Transfer, ring, meta: np.ndarray, now: float, tail_wait: float,
          share: int) -> np.ndarray:
    """Chunks of ``t`` presumed lost (at most ``share``), by the rules in the module doc."""
    rtt, (fast, rto) = t.rtt, _timers(t)
    tail_wait = _tail_wait(t, tail_wait)
    lo = t.lo                       # the chunks asked for and not verified, sent already
    idx = lo + np.flatnonzero(~t.verified[lo:t.next_new])
    seq = t.sent_seq[idx]
    sent = (seq >= 0) & (seq < ring.cons)
    idx, seq = idx[sent], seq[sent]
    if not idx.size:
        return idx
    tries = t.tries[idx]
    age = now - ring.sent_time(seq, t.sent_t[idx])
    backoff = np.exp2(np.minimum(tries - 1, 6))
    # and once what was in flight ahead of the ask came back (or the interface went quiet):
    # every route's replies share the interface's queues, and a transfer whose chunks queue
    # behind other transfers' hears nothing for as long as those take
    drained = t.route.iface.drained(t.asked_at[idx], t.ahead[idx], now, tail_wait,
                                    rto * backoff)
    timed_out = ((age > rto * backoff) & (now - t.last_delivery > rto * backoff)) & drained
    # a timeout says little about which chunks are gone: the oldest few are asked again (their
    # replies restart the timer); a stall of the receiver itself must not resend a window
    timed_out[np.flatnonzero(timed_out)[TIMEOUT_BATCH:]] = False
    lost = ((seq < t.max_recv_seq) & (age > rtt.reo)) | timed_out
    if fast:            # no queue to wait for: a reply comes within the call that sent it
        ended = now - ring.done_time[seq % SENDQ]
        quiet = np.minimum(ended, now - t.last_delivery)
        # a hole behind a later-asked hit whose call has ended is lost (SACK-like: replies
        # keep coming, so loss, not a queue), as is one after which the transfer went quiet;
        # each try waits HIT_BACKOFF times longer: a chunk the switch holds for a pool reply
        # (a miss among hits) is not asked again at every scan
        wait = tail_wait * np.power(HIT_BACKOFF, np.minimum(tries - 1, 6))
        behind = seq < t.max_hit_seq
        tail = (behind & (ended > wait)) | (quiet > wait)
        if t.looked is not None:        # an early ask whose call ended before the last look
            tail |= behind & (tries <= FAST_TRIES) & (ring.done_time[seq % SENDQ] < t.looked)
        if t.pool_path or idx.size > HELD_SHARE * (t.next_new - lo):
            # the switch forwards misses of this block, or most of what was asked is missing:
            # a hole can be a miss it holds for a pool node's reply rather than a lost hit (no
            # reply says which), so each chunk is taken for lost this way FAST_TRIES times at
            # most, at most FAST_OUT out at once
            tail &= (tries <= FAST_TRIES) & ~lost
            out = t.tries[lo:t.next_new][~t.verified[lo:t.next_new]] > 1   # queued ones too
            room = max(0, FAST_OUT - int(np.count_nonzero(out)))
            tail[np.flatnonzero(tail)[room:]] = False
        lost |= tail
    idx = idx[lost][:share]
    if not idx.size:
        return idx
    words = meta[t.base + idx]                     # arrived since the last look: not lost
    return idx[((words >> np.uint64(32)) & np.uint64(GEN_MASK)) != t.gen]


def _scan_due(t: Transfer, ring, now: float, tail_wait: float) -> bool:
    """Whether looking for lost chunks of ``t`` can find any now (cheap tests first)."""
    if t.next_new <= t.lo:
        return False
    first = int(t.sent_seq[t.lo])
    if first < 0 or first >= ring.cons:
        return False
    rtt, (fast, rto) = t.rtt, _timers(t)
    tail_wait, ended = _tail_wait(t, tail_wait), ring.done_time[first % SENDQ]
    return (now >= t.next_scan or (first < t.max_recv_seq and now - t.sent_t[t.lo] > rtt.reo)
            or (fast and first < t.max_hit_seq and
                (now - ended > tail_wait or (t.looked is not None and ended < t.looked and
                                             t.tries[t.lo] <= FAST_TRIES)))
            or (now - t.last_delivery > min(rto, tail_wait if fast else 1.0) and
                now - ended > (tail_wait if fast else 0)))


def fill(active: list[Transfer], ring, meta: np.ndarray, now: float, burst: int,
         tail_wait: float, max_ahead: int) -> int:
    """Queue GETs into ``ring``: retransmissions of chunks presumed lost, then new chunks within
    each route's window, transfers in submission order. At most ``burst`` per step and
    ``max_ahead`` queued but unsent. Returns how many were queued."""
    budget = min(burst, max_ahead - ring.queued)
    if budget <= 0:
        return 0
    inflight: dict[int, int] = {}
    for t in active:
        inflight[t.route.index] = inflight.get(t.route.index, 0) + t.inflight
    for t in active:                    # what the route has in flight sets every timeout
        t.route.inflight = inflight[t.route.index]
    queued, ahead = 0, sum(inflight.values())       # every route's: one interface's queues
    for t in active:
        if budget <= 0:
            break
        share, route, rtt = budget, t.route, t.rtt
        if _scan_due(t, ring, now, tail_wait):
            idx = _lost(t, ring, meta, now, tail_wait, share)
            if idx.size:
                if not t.switched:
                    route.lost(now, 16, rtt.srtt or rtt.rto)
                route.iface.settled += idx.size
                ring.queue(t, idx, now)
                t.asked_at[idx], t.ahead[idx] = route.iface.settled, ahead
                t.stats.retransmits += idx.size
                queued += idx.size
                budget -= idx.size
                share -= idx.size
                t.next_scan = now + rtt.reo
            else:
                t.next_scan = now + max(_timers(t)[1] / 2, 0.002)
        left = t.nchunks - t.next_new
        if left > 0 and share > 0:
            m = min(left, share,
                    max(0, route.window(_timers(t)[0] or queue_free(t), t.copied)
                        - inflight[route.index]))
            if m > 0:
                ring.queue(t, np.arange(t.next_new, t.next_new + m), now)
                new = slice(t.next_new, t.next_new + m)
                t.asked_at[new], t.ahead[new] = route.iface.settled, ahead + np.arange(m)
                ahead += m
                t.next_new += m
                inflight[route.index] += m
                queued += m
                budget -= m
    return queued
