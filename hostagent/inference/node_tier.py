"""The node DRAM tier of an inference node (issue #29): a bounded cache of whole KV blocks in
the node's memory, shared by every engine of the node, checked before the switch.

``NodeTier`` holds blocks *as they are handed to it* — the fetch engine's zero-copy ``Block``s
(views of the engine's arena), or the bytes/memoryview an engine saved — and hands the same
object back on a hit: no copy in, no copy out. It is bounded in bytes; when a ``put`` needs
room the least recently used entry leaves first (``evict="lru"``), or the lowest-valued
(``evict="value"``: ``value_fn(ns, key, nbytes)`` returns anything comparable, lowest leaves
first, ties the one put (or found risen) first — ``hostagent.common.eviction.ValueHeap``;
``hostagent.common.tier_policy`` supplies the function). Every eviction is told
to ``on_evict(ns, key, obj, nbytes)`` first (where a demotion decision — write it down to the
pool, or drop it — is made; the object is still valid during the call), then the object is
released (``Block.release()``, or the ``release`` given to ``put``), which gives a fetch
engine's arena slots back. An entry in use (``lease``) is never evicted.

How a node shares it: one ``NodeTier`` per node process (the process that runs the node's
engines, connectors or serving loop), passed to every engine/connector of that process. It is
thread-safe (one lock; the ``on_evict`` callback and the releases run outside it, in the thread
whose ``put`` caused the eviction). A fetch engine's ``Block`` must be released in the engine's
own thread: pass ``release=`` (e.g. ``loop.call_soon_threadsafe(blk.release)``) when other
threads may evict it. Sizing: the tier's blocks occupy the fetch engine's arena, so give the
engine ``arena_bytes`` of at least the tier's capacity plus the blocks in flight (the engine
grows its arena up to ``max_arena_bytes`` when it is full and idle).

``fetch`` / ``fetch_sync`` are the small wrappers serving code and connectors call: the node
tier first, else a fetch through the client (``get_block_view``, every client's: the fetch
engine's zero-copy ``Block``, the asyncio client's own) or the engine, inserted into the tier if
``admit`` says so. ``save`` puts a block an engine computed into the tier and, if asked, writes
it down to the pool.
"""
from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from hostagent.common.block import Block
from hostagent.common.eviction import ValueHeap, check_eviction

__all__ = ["Fetched", "Lease", "NodeTier", "fetch", "fetch_sync", "nbytes_of", "save",
           "view_of"]

log = logging.getLogger("hostagent.node_tier")


def nbytes_of(obj) -> int:
    """Bytes of a block as the tier holds it (a Block, bytes, bytearray, memoryview, array)."""
    return obj.nbytes if isinstance(obj, Block) else memoryview(obj).nbytes


def view_of(obj) -> memoryview:
    """A memoryview of a held block's bytes, without a copy."""
    if isinstance(obj, memoryview):
        return obj
    return obj.view if isinstance(obj, Block) else memoryview(obj)


@dataclass(eq=False)
class _Entry:
    obj: Any
    nbytes: int
    release: Callable[[], None] | None
    pins: int = 0


class NodeTier:
    """A bounded, shared, zero-copy block cache of ``capacity_bytes`` (see the module doc)."""

    def __init__(self, capacity_bytes: int, evict: str = "lru",
                 value_fn: Callable[[int, bytes, int], Any] | None = None,
                 on_evict: Callable[[int, bytes, Any, int], None] | None = None):
        if capacity_bytes <= 0:
            raise ValueError("a node tier's capacity must be positive")
        self.capacity = int(capacity_bytes)
        self.on_evict = on_evict
        self._entries: OrderedDict[tuple[int, bytes], _Entry] = OrderedDict()
        self._lock = threading.Lock()
        self.set_eviction(evict, value_fn)
        self.used = 0
        self.counters = {"hits": 0, "misses": 0, "inserts": 0, "rejected": 0, "evictions": 0,
                         "evicted_bytes": 0, "hit_bytes": 0}

    def set_eviction(self, evict: str, value_fn=None) -> None:
        """Switch the eviction order: ``lru``, or ``value`` with ``value_fn(ns, key, nbytes)``."""
        check_eviction(evict, value_fn)
        with self._lock:
            self.evict, self.value_fn, self._values = evict, value_fn, None
            if evict == "value":
                self._values = ValueHeap(value_fn)
                self._values.rebuild(self._held())

    def _held(self):
        return [(n, e, e.nbytes) for n, e in self._entries.items()]

    # ---- lookups -------------------------------------------------------------------------
    def get(self, ns: int, key: bytes, touch: bool = True):
        """The held object (the same one that was put: no copy), or None. Counts a hit or a
        miss. The object stays valid until it is evicted: ``lease`` to keep it from that."""
        e = self._lookup(ns, key, True, touch, False)
        return None if e is None else e.obj

    def lease(self, ns: int, key: bytes, count: bool = True) -> Lease | None:
        """A hit pinned until ``Lease.release()`` (or the ``with`` block's end), or None."""
        e = self._lookup(ns, key, count, True, True)
        return None if e is None else Lease(self, (ns, key), e)

    def _lookup(self, ns: int, key: bytes, count: bool, touch: bool, pin: bool):
        with self._lock:
            e = self._entries.get((ns, key))
            if count:
                self.counters["misses" if e is None else "hits"] += 1
                self.counters["hit_bytes"] += e.nbytes if e is not None else 0
            if e is not None:
                if touch:
                    self._entries.move_to_end((ns, key))
                e.pins += pin
            return e

    def __contains__(self, name: tuple[int, bytes]) -> bool:
        return name in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    # ---- inserts and evictions -------------------------------------------------------------
    def put(self, ns: int, key: bytes, block, release: Callable[[], None] | None = None) -> bool:
        """Hold ``block`` (a Block, bytes or memoryview; not copied). True if it is held: the
        tier owns it now and releases it on eviction (``release``, else ``block.release``).
        False if it is not taken — larger than the tier, the tier full of leased entries, or
        the name already held (blocks are immutable: the first copy stays) — and the caller
        still owns it."""
        return self._insert(ns, key, block, release) is not None

    def _insert(self, ns: int, key: bytes, block, release=None, pin: bool = False):
        nbytes = nbytes_of(block)
        if release is None:
            release = block.release if isinstance(block, Block) else None
        with self._lock:
            if (ns, key) in self._entries:
                self._entries.move_to_end((ns, key))
                return None
            if nbytes > self.capacity:
                self.counters["rejected"] += 1
                return None
            victims = self._make_room(nbytes)
            if victims is None:
                self.counters["rejected"] += 1
                return None
            entry = self._entries[(ns, key)] = _Entry(block, nbytes, release, 1 if pin else 0)
            if self._values is not None:
                self._values.push((ns, key), entry, nbytes)
            self.used += nbytes
            self.counters["inserts"] += 1
        self._evicted(victims)
        return entry

    def _make_room(self, nbytes: int) -> list | None:
        """Take out the entries that must leave for ``nbytes`` more (under the lock), or None
        (nothing taken) if leased entries keep it from fitting."""
        free = self.capacity - self.used
        if nbytes <= free:
            return []
        if self.evict == "lru":
            order = ((n, e) for n, e in self._entries.items() if not e.pins)
        else:
            entries = self._entries
            order = ((n, entries[n]) for n in self._values.victims(
                entries, lambda e: e.pins, lambda e: e.nbytes, self._held))
        chosen, gain = [], 0
        for name, e in order:
            chosen.append((name, e))
            gain += e.nbytes
            if free + gain >= nbytes:
                break
        if free + gain < nbytes:
            for name, e in chosen:            # they stay: back in the value order
                if self._values is not None:
                    self._values.push(name, e, e.nbytes)
            return None
        for name, e in chosen:
            del self._entries[name]
            self.used -= e.nbytes
            self.counters["evictions"] += 1
            self.counters["evicted_bytes"] += e.nbytes
        return chosen

    def _evicted(self, victims: list) -> None:
        for (ns, key), e in victims:
            if self.on_evict is not None:
                try:
                    self.on_evict(ns, key, e.obj, e.nbytes)
                except Exception:             # a demotion that failed must not leak the rest
                    log.exception("node tier: on_evict failed for %d/%s", ns, key.hex())
            if e.release is not None:
                e.release()

    def remove(self, ns: int, key: bytes) -> bool:
        """Drop a block (released now, or when its last lease ends); no on_evict call."""
        with self._lock:
            e = self._entries.pop((ns, key), None)
            if e is None:
                return False
            self.used -= e.nbytes
            if e.pins:                        # released when the last lease ends
                e.pins = -e.pins
                return True
        if e.release is not None:
            e.release()
        return True

    def clear(self) -> None:
        for ns, key in list(self._entries):
            self.remove(ns, key)

    def _unpin(self, name, e: _Entry) -> None:
        with self._lock:
            if e.pins > 0:
                e.pins -= 1
                return
            e.pins += 1                       # removed while leased: negative count
            last = e.pins == 0
        if last and e.release is not None:
            e.release()

    def stats(self) -> dict:
        with self._lock:
            return {"blocks": len(self._entries), "bytes": self.used,
                    "capacity": self.capacity, "evict": self.evict, **self.counters}


class Lease:
    """A node-tier hit kept from eviction until ``release()``; ``obj`` is the held object."""

    def __init__(self, tier: NodeTier, name, entry: _Entry):
        self._tier, self._name, self._entry = tier, name, entry
        self.obj = entry.obj

    @property
    def view(self) -> memoryview:
        return view_of(self.obj)

    def release(self) -> None:
        if self._entry is not None:
            self._tier._unpin(self._name, self._entry)
            self._entry = None

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


@dataclass(eq=False)
class Fetched:
    """A block from ``fetch``: ``data`` (a Block or bytes), where it came from (``"node"``: the
    node tier, no network; ``"fetch"``: the switch or a pool), the transfer's stats (None on a
    node hit), whether the node tier holds it. ``release()`` when done: a held block is
    unpinned (it stays in the tier), one the tier did not take is released."""
    data: Any
    source: str
    stats: Any = None
    held: bool = False
    _done: Callable[[], None] | None = field(default=None, repr=False)

    @property
    def view(self) -> memoryview:
        return view_of(self.data)

    def release(self) -> None:
        done, self._done = self._done, None
        if done is not None:
            done()

    def __enter__(self) -> Fetched:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def _hit(tier: NodeTier, ns: int, key: bytes) -> Fetched | None:
    lease = tier.lease(ns, key)
    if lease is None:
        return None
    return Fetched(lease.obj, "node", None, True, lease.release)


def _keep(tier: NodeTier, ns: int, key: bytes, data, stats, admit) -> Fetched:
    """A fetched block into the tier (pinned for the caller), if admitted."""
    name, own = (ns, key), data.release if isinstance(data, Block) else None
    if admit is None or admit(ns, key, nbytes_of(data)):
        entry = tier._insert(ns, key, data, pin=True)
        if entry is not None:
            return Fetched(data, "fetch", stats, True, lambda: tier._unpin(name, entry))
        lease = tier.lease(ns, key, count=False)    # a concurrent fetch of it got in first
        if lease is not None:
            if own is not None:
                own()
            return Fetched(lease.obj, "fetch", stats, True, lease.release)
    return Fetched(data, "fetch", stats, False, own)


async def fetch(tier: NodeTier, client, ns: int, key: bytes, nchunks: int | None = None,
                no_cache: bool = False,
                admit: Callable[[int, bytes, int], bool] | None = None) -> Fetched:
    """The node tier first (a hit: no network), else fetch through ``client`` (its
    ``get_block_view``: the fetch engine's zero-copy Block, the asyncio client's own) and keep
    the block in the tier if ``admit(ns, key, nbytes)`` (default: always). Raises what the
    fetch raises."""
    got = _hit(tier, ns, key)
    if got is not None:
        return got
    data, stats = await client.get_block_view(ns, key, nchunks, no_cache)
    return _keep(tier, ns, key, data, stats, admit)


def fetch_sync(tier: NodeTier, engine, ns: int, key: bytes, nchunks: int | None = None,
               no_cache: bool = False,
               admit: Callable[[int, bytes, int], bool] | None = None) -> Fetched:
    """``fetch`` over a ``FetchEngine`` used synchronously (``engine.get_block``)."""
    got = _hit(tier, ns, key)
    if got is not None:
        return got
    blk = engine.get_block(ns, key, nchunks, no_cache)
    return _keep(tier, ns, key, blk, blk.stats, admit)


async def save(tier: NodeTier, ns: int, key: bytes, data, client=None,
               write_down: bool = True) -> bool:
    """A block an engine computed: into the node tier (not copied), and written down to the
    pool through ``client.put_block`` when ``write_down`` (the tier policy's decision: now, or
    later on the block's next use or eviction). True if the node tier holds it."""
    held = tier.put(ns, key, data)
    if write_down and client is not None:
        await client.put_block(ns, key, data if isinstance(data, bytes) else bytes(view_of(data)))
    return held
