"""Cache policies for the switch's KV cache (the count-min sketch they use is in switchd.sketch).

The live daemon and the offline evaluator (testbed/policy_eval.py) drive the same policy objects
through one small interface. Keys are any hashable (block ids in a trace, ``(ns, key)`` in the
daemon); ``now`` is in seconds; ``capacity`` and ``size`` are in one unit of your choice (blocks,
chunks or bytes).

    p = make_policy("prefix", capacity)          # or LRU(c), LFU(c), TinyLFU(c), PrefixAware(c)
    hit = p.access(key, now, count=1, depth=0, parent=None, fill=1.0)   # record demand
    adm = p.admit(key, now, size=1, depth=0, parent=None, fill=1.0)     # try to cache a missed key
    if adm: ...                                  # Admission: truthy if cached; adm.evicted = keys
                                                 # that were dropped (delete them from the map)
    p.evict(now) -> key | None                   # free room by one lowest-value entry
    p.pin(key, now, ttl, ...) -> Admission       # cache (if needed) and never evict until now+ttl
    p.remove(key) -> bool                        # the entry is gone (flushed, lost by the map)
    key in p, len(p), p.used, p.capacity

``access`` only records demand: ``count`` requests for ``key`` (a hit if it is cached). Per-request
replay calls it once per block request with count=1 and calls ``admit`` on every miss. The live
daemon, which sees only periodic aggregates, calls it once per period per key it has numbers for:
cached entries with the hits their counters gained, missed keys with their miss count from the
data-plane count-min sketch, then ``admit`` for those worth caching. Hints: ``depth`` = position
of the block in its prefix chain (0 = first block), ``parent`` = key of the block before it,
``fill`` = fraction of a full block's tokens it holds (the partial last block of a prompt < 1).

Policies: LRU; LFU (count-min frequency, no aging); TinyLFU (LRU behind a TinyLFU admission
filter: an aged count-min sketch, admit only if more frequent than the LRU victim); PrefixAware
(our default, see its docstring). Pinning lives in the base class, so it works for every policy.
The offline references with hindsight (Belady, the best fixed set) live beside the evaluator,
in testbed.sim.hindsight.
"""
from __future__ import annotations

import heapq
import math
from collections import OrderedDict
from dataclasses import dataclass
from typing import Hashable

from .sketch import M64, CountMinSketch, key64

Key = Hashable


# ---- the policy interface ----------------------------------------------------------------------
@dataclass(frozen=True)
class Admission:
    """Outcome of ``admit``/``pin``: truthy when the key is cached. ``evicted`` lists the keys
    removed to make room (remove them from the data plane even if ``admitted`` is False)."""
    admitted: bool
    evicted: tuple = ()

    def __bool__(self) -> bool:
        return self.admitted


@dataclass
class _Entry:
    size: float
    depth: int
    parent: Key | None
    fill: float


class Policy:
    """Base class: keeps the cached set, its size, and pins. Subclasses say which unpinned entry
    goes first (``_victim``), whether a candidate beats it (``_admissible``), and what demand
    they remember (``_record``)."""

    name = "base"

    def __init__(self, capacity: float):
        if not capacity > 0:
            raise ValueError(f"capacity must be > 0, got {capacity!r}")
        self.capacity = capacity
        self.used = 0.0
        self._entries: dict[Key, _Entry] = {}
        self._pins: dict[Key, float] = {}              # pinned key -> expiry time
        self._expiry: list[tuple[float, int, Key]] = []
        self._pin_seq = 0

    def __contains__(self, key) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def keys(self):
        return self._entries.keys()

    def pinned(self, key) -> bool:
        return key in self._pins

    def access(self, key, now: float, *, count: int = 1, depth: int = 0, parent=None,
               fill: float = 1.0) -> bool:
        """Record ``count`` requests for ``key`` at ``now``; True if it is cached (a hit)."""
        hit = key in self._entries
        self._record(key, now, count, hit, depth, parent, fill)
        return hit

    def admit(self, key, now: float, *, size: float = 1, depth: int = 0, parent=None,
              fill: float = 1.0) -> Admission:
        """Try to cache ``key``; evicts lower-value entries if the policy lets it in."""
        return self._admit(key, now, _Entry(size, depth, parent, fill), force=False)

    def evict(self, now: float):
        """Evict the lowest-value unpinned entry; returns its key (None if all are pinned)."""
        self._expire(now)
        victim = self._victim(now)
        if victim is not None:
            self._evict(victim)
        return victim

    def pin(self, key, now: float, ttl: float, *, size: float = 1, depth: int = 0, parent=None,
            fill: float = 1.0) -> Admission:
        """Cache ``key`` (bypassing admission) and keep it until ``now + ttl``; re-pinning
        sets a new expiry."""
        if not ttl > 0:
            raise ValueError(f"ttl must be > 0, got {ttl!r}")
        adm = self._admit(key, now, _Entry(size, depth, parent, fill), force=True)
        if adm:
            if key not in self._pins:
                self._drop(key)
            self._pins[key] = now + ttl
            self._pin_seq += 1
            heapq.heappush(self._expiry, (now + ttl, self._pin_seq, key))
        return adm

    def remove(self, key) -> bool:
        """Forget a cached key (it left the data plane by other means)."""
        e = self._entries.pop(key, None)
        if e is None:
            return False
        if self._pins.pop(key, None) is None:
            self._drop(key)
        self.used -= e.size
        return True

    # -- machinery shared by all policies
    def _admit(self, key, now, entry: _Entry, force: bool) -> Admission:
        if key in self._entries:
            return Admission(True)
        if entry.size > self.capacity:
            return Admission(False)
        self._expire(now)
        evicted = []
        if self.used + entry.size > self.capacity:
            victim = self._victim(now)
            if victim is None or not (force or self._admissible(key, victim, now, entry)):
                return Admission(False)
            while self.used + entry.size > self.capacity:
                victim = self._victim(now)
                if victim is None:
                    return Admission(False, tuple(evicted))
                self._evict(victim)
                evicted.append(victim)
        self._entries[key] = entry
        self.used += entry.size
        self._insert(key, now)
        return Admission(True, tuple(evicted))

    def _evict(self, key) -> None:
        e = self._entries.pop(key)
        self.used -= e.size
        self._drop(key)
        self._evicted(key)

    def _expire(self, now: float) -> None:
        while self._expiry and self._expiry[0][0] <= now:
            t, _, key = heapq.heappop(self._expiry)
            if self._pins.get(key) == t:
                del self._pins[key]
                self._insert(key, now)

    # -- subclass hooks
    def _record(self, key, now, count, hit, depth, parent, fill) -> None:
        """Remember demand; for a cached unpinned key, update its eviction order."""

    def _insert(self, key, now) -> None:
        """A cached key becomes evictable (``self._entries[key]`` holds its hints)."""
        raise NotImplementedError

    def _drop(self, key) -> None:
        """Take a key out of the eviction order (evicted, removed or pinned)."""
        raise NotImplementedError

    def _victim(self, now):
        """The unpinned cached key to evict next, or None."""
        raise NotImplementedError

    def _admissible(self, key, victim, now, entry: _Entry) -> bool:
        return True

    def _evicted(self, key) -> None:
        """Called after ``key`` was evicted by the policy."""


class _LazyHeap:
    """Min-heap of keys by priority with O(log n) update/discard (stale items skipped on peek).
    Equal priorities come out oldest-pushed first."""

    def __init__(self):
        self._heap: list = []
        self._live: dict = {}   # key -> (seq, prio)
        self._seq = 0

    def push(self, key, prio) -> None:
        self._seq += 1
        self._live[key] = (self._seq, prio)
        heapq.heappush(self._heap, (prio, self._seq, key))
        if len(self._heap) > 64 + 4 * len(self._live):
            self._heap = [it for it in self._heap if self._live.get(it[2], (0,))[0] == it[1]]
            heapq.heapify(self._heap)

    def discard(self, key) -> None:
        self._live.pop(key, None)

    def __contains__(self, key) -> bool:
        return key in self._live

    def prio(self, key):
        return self._live[key][1]

    def peek(self):
        h, live = self._heap, self._live
        while h and live.get(h[0][2], (0,))[0] != h[0][1]:
            heapq.heappop(h)
        return h[0][2] if h else None


class _HeapPolicy(Policy):
    """A policy that evicts the lowest ``_prio(key, now)``; priorities must keep their order
    while time passes (they change only when the key is accessed)."""

    def __init__(self, capacity: float):
        super().__init__(capacity)
        self._heap = _LazyHeap()

    def _prio(self, key, now):
        raise NotImplementedError

    def _insert(self, key, now):
        self._heap.push(key, self._prio(key, now))

    def _drop(self, key):
        self._heap.discard(key)

    def _victim(self, now):
        return self._heap.peek()

    def _record(self, key, now, count, hit, depth, parent, fill):
        if key in self._heap:
            self._heap.push(key, self._prio(key, now))


def _sketch_width(capacity: float) -> int:
    return int(min(1 << 20, max(1024, 8 * capacity)))


# ---- the policies ------------------------------------------------------------------------------
class LRU(_HeapPolicy):
    """Least recently used: evict the entry whose last access is oldest; admits everything."""

    name = "lru"

    def _prio(self, key, now):
        return 0    # ties leave in push order: the least recently touched first


class LFU(_HeapPolicy):
    """Least frequently used: evict the entry with the fewest requests ever (counted in a
    count-min sketch, never aged), least recent first among equals; admits everything."""

    name = "lfu"

    def __init__(self, capacity: float, *, sketch_width: int | None = None):
        super().__init__(capacity)
        self.sketch = CountMinSketch(sketch_width or 4 * _sketch_width(capacity), 4)

    def _record(self, key, now, count, hit, depth, parent, fill):
        self.sketch.add(key, count)
        super()._record(key, now, count, hit, depth, parent, fill)

    def _prio(self, key, now):
        return self.sketch.estimate(key)


class TinyLFU(LRU):
    """LRU behind a TinyLFU admission filter (Einziger et al.): a count-min sketch of recent
    demand, halved every ``sample`` increments (default 10x capacity); a missed key replaces the
    LRU victim only if the sketch says it is requested more often than the victim."""

    name = "tinylfu"

    def __init__(self, capacity: float, *, sample: int | None = None,
                 sketch_width: int | None = None):
        super().__init__(capacity)
        self.sketch = CountMinSketch(sketch_width or _sketch_width(capacity), 4,
                                     aging_interval=sample or int(max(100, 10 * capacity)))

    def _record(self, key, now, count, hit, depth, parent, fill):
        self.sketch.add(key, count)
        super()._record(key, now, count, hit, depth, parent, fill)

    def _admissible(self, key, victim, now, entry):
        return self.sketch.estimate(key) > self.sketch.estimate(victim)


class PrefixAware(_HeapPolicy):
    """Our default: the value of a block is its decayed request rate times the work a hit saves,
    and a block is never worth less than any cached block that extends its prefix.

    - demand: S = exponentially decayed request count with time constant ``tau`` seconds, i.e.
      frequency and recency in one number (LRFU). Kept as the time-invariant log rank
      ln S(t) + t/tau, so ranks change only on access and a heap suffices.
    - self-tuning (``tau=None``, the default): how fast demand drifts, and whether a key seen
      once is worth admitting, are properties of the workload, so the policy replays a
      1-in-``sample`` sample of the keys through miniature caches (capacity/``sample``), one per
      candidate tau in ``taus`` and admission bar (1 or ``min_count``), and adopts the pair
      whose miniature hit the most in the last window (SHARDS-style spatial sampling). It
      starts with bar 1, i.e. admitting as LRU does, so it is not below LRU while it learns.
    - work saved: ``fill * (1 + gamma*depth)``: a partial block holds fewer tokens, and a deeper
      block's prefill attends over a longer prefix (gamma ~ attention/linear FLOPs per 512-token
      block of context, ~1/60 for an 8B model). gamma=0 (default) maximises hits; > 0 trades
      hits for prefill compute saved.
    - chains: block i of a chain is needed by every request that needs block i+1, so a parent
      is ranked at least as high as any child that hit through it; among equals the deepest
      block goes first, so chains are trimmed from the tail and heads stay.
    - admission: when the cache is full, a key is admitted only if it was requested at least
      ``min_count`` times recently (with bar 2, a one-request chain such as the unique tail of
      a prompt never displaces anything) and it outranks the victim.
    Demand of keys not cached is remembered for the ``history`` most recent ones.
    """

    name = "prefix"
    TAUS = (0.25, 2.0, 8.0, 32.0, 128.0, 512.0, 2048.0)
    MIN_COUNT = 2   # the admission bar that keeps one-request chains out

    def __init__(self, capacity: float, *, tau: float | None = None, gamma: float = 0.0,
                 min_count: int = MIN_COUNT, history: int | None = None, taus=TAUS,
                 sample: int = 4, window: int = 2000, margin: float = 1.05, keep: float = 0.5):
        super().__init__(capacity)
        self.gamma, self.min_count = float(gamma), int(min_count)
        self.history = int(history or max(4096, 8 * capacity))
        self._rank: dict[Key, list] = {}   # cached: key -> [log rank, count, floor, last access]
        self._ghost: OrderedDict[Key, list] = OrderedDict()
        self._minis: list[PrefixAware] = []
        if tau is None:
            mini = max(1.0, capacity / sample)
            self._minis = [PrefixAware(mini, tau=t, gamma=gamma, min_count=mc,
                                       history=max(512, int(8 * mini)))
                           for mc in sorted({1, self.min_count}) for t in taus]
            self._mini_hits = [0.0] * len(self._minis)
            self._window = int(window)
            self._margin, self._keep = margin, keep
            self._seen = 0
            self._sample_bits = 64 - max(0, (int(sample) - 1).bit_length())
            tau = taus[len(taus) // 2]
            self.min_count = 1     # admit like LRU until the miniatures show the filter pays
        self.tau = float(tau)

    # -- demand and rank
    def access(self, key, now, *, count=1, depth=0, parent=None, fill=1.0) -> bool:
        hit = super().access(key, now, count=count, depth=depth, parent=parent, fill=fill)
        if self._minis and (key64(key) * 0x9E3779B97F4A7C15 & M64) >> self._sample_bits == 0:
            self._replay_sample(key, now, count, depth, parent, fill)
        return hit

    def _record(self, key, now, count, hit, depth, parent, fill):
        st = self._rank.get(key) or self._ghost.get(key)
        a = math.log(count) + now / self.tau
        if st is None:
            st = [a, 0, -math.inf, now]
            self._remember(key, st)
        else:
            b = st[0]
            st[0] = max(a, b) + math.log1p(math.exp(-abs(a - b)))
            st[3] = now
            if key in self._ghost:
                self._ghost.move_to_end(key)
        st[1] += count
        if key in self._heap:
            self._heap.push(key, self._prio(key, now))
        if parent is not None and hit:
            mine = self._heap.prio(key)[0] if key in self._heap else self._value(st[0], depth,
                                                                                 fill)
            self._lift(parent, mine, now)

    def _lift(self, key, floor, now):
        """Rank ``key`` and its cached ancestors at least ``floor`` (a descendant's rank)."""
        while key is not None and key in self._heap and floor > self._heap.prio(key)[0]:
            self._rank[key][2] = floor
            self._heap.push(key, self._prio(key, now))
            key = self._entries[key].parent

    def _remember(self, key, st):
        self._ghost[key] = st
        if len(self._ghost) > self.history:
            self._ghost.popitem(last=False)

    def _value(self, log_rank, depth, fill):
        if self.gamma == 0 and fill >= 1:
            return log_rank
        return log_rank + math.log(max(fill, 1e-6) * (1 + self.gamma * depth))

    def _prio(self, key, now):
        e, st = self._entries[key], self._rank[key]
        return (max(self._value(st[0], e.depth, e.fill), st[2]), -e.depth)

    # -- cache membership
    def _insert(self, key, now):
        if key not in self._rank:
            self._rank[key] = self._ghost.pop(key, None) or [now / self.tau, 1, -math.inf, now]
        super()._insert(key, now)

    def _evicted(self, key):
        st = self._rank.pop(key)
        st[2] = -math.inf
        self._remember(key, st)

    def remove(self, key) -> bool:
        gone = super().remove(key)
        if gone:
            self._rank.pop(key, None)
        return gone

    def _admissible(self, key, victim, now, entry):
        st = self._rank.get(key) or self._ghost.get(key)
        if st is None or st[1] < self.min_count:
            return False
        return (self._value(st[0], entry.depth, entry.fill), -entry.depth) > self._heap.prio(victim)

    # -- self-tuning tau
    def _replay_sample(self, key, now, count, depth, parent, fill):
        for i, mini in enumerate(self._minis):
            if mini.access(key, now, count=count, depth=depth, parent=parent, fill=fill):
                self._mini_hits[i] += count
            else:
                mini.admit(key, now, depth=depth, parent=parent, fill=fill)
        self._seen += 1
        if self._seen >= self._window:
            hits = self._mini_hits
            cur = next((h for h, m in zip(hits, self._minis)
                        if (m.tau, m.min_count) == (self.tau, self.min_count)), 0.0)
            best = max(range(len(hits)), key=hits.__getitem__)
            if hits[best] > self._margin * cur:
                self.retune(self._minis[best].tau, now, self._minis[best].min_count)
            self._mini_hits = [h * self._keep for h in hits]
            self._seen = 0

    def retune(self, tau: float, now: float, min_count: int | None = None) -> None:
        """Switch to time constant ``tau`` (and admission bar ``min_count``): re-express every
        remembered demand, re-rank."""
        if min_count is not None:
            self.min_count = int(min_count)
        old, self.tau = self.tau, float(tau)
        for st in (*self._rank.values(), *self._ghost.values()):
            log_s = st[0] - st[3] / old          # ln S at the last access
            st[0] = log_s + st[3] / self.tau
            st[2] = -math.inf
        for key in self._rank:
            if key in self._heap:
                self._heap.push(key, self._prio(key, now))


POLICIES: dict[str, type[Policy]] = {p.name: p for p in (LRU, LFU, TinyLFU, PrefixAware)}
DEFAULT_POLICY = PrefixAware.name


def make_policy(name: str, capacity: float, **options) -> Policy:
    """A policy by its name (one of ``POLICIES``)."""
    try:
        cls = POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r} (choose from {', '.join(POLICIES)})") from None
    return cls(capacity, **options)
