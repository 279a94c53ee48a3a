"""Admission and eviction on the live switch: every interval switchd reads the data plane's
demand numbers (the miss sketch, the recently missed blocks, per-entry hit counters) into an
observation for the pure admission loop (switchd.admission) and applies its decisions to the
maps: admitting a block adds it to the admit set (the data plane then learns its chunks as pool
replies pass), evicting one deletes its chunks, and the speculative-fill budget goes into the
data plane's settings.

Capacity is counted in chunks (map entries); quotas are given in bytes. Blocks admitted by an
operator (`switchd cache admit`) are pinned: the policy never evicts them until their TTL, if
any, ends.
"""
from __future__ import annotations

import logging
import math

from .admission import AdmissionLoop, Observation
from .cache import PINNED, Cache, monotonic_ns
from .dataplane import DataPlane, SwitchError
from .popularity import BlockId, Popularity, Snapshot

log = logging.getLogger("switchd.manager")


def in_share(key: bytes, share: tuple[int, int] | None) -> bool:
    """Whether a block key is in share (K, N): its first 8 bytes, little-endian, mod N are K
    (as the data plane's learn_reply tests it)."""
    return share is None or int.from_bytes(key[:8], "little") % share[1] == share[0]


def default_headroom(entries: int) -> int:
    """Chunks kept free for speculative fills: a sixteenth of the cache."""
    return entries // 16


class CacheManager:
    def __init__(self, dp: DataPlane, policy: str = "prefix",
                 quotas: dict[int, int] | None = None, fill_headroom: int | None = None,
                 share: tuple[int, int] | None = None):
        chunk, total = dp.deployment.chunk_size, dp.deployment.cache_entries
        headroom = default_headroom(total) if fill_headroom is None else fill_headroom
        self.dp, self.popularity = dp, Popularity(dp)
        self.cache = Cache(dp)
        self.quota_chunks = {ns: max(1, q // chunk) for ns, q in (quotas or {}).items()}
        try:
            self.loop = AdmissionLoop(policy, total, headroom, self.quota_chunks, unit="chunks",
                                      keep=share and (lambda b: in_share(b[1], share)))
        except ValueError as exc:
            raise SwitchError(str(exc)) from None
        self._hits: dict[BlockId, int] = {}       # chunk-0 hit counters at the last step
        self.snapshot: Snapshot | None = None

    admissions = property(lambda self: self.loop.admissions)
    evictions = property(lambda self: self.loop.evictions)
    rejected = property(lambda self: self.loop.rejected)

    def observe(self, now: float, now_ns: int) -> Observation:
        """The interval as the maps tell it (reading the sketch resets it)."""
        snap = self.snapshot = self.popularity.snapshot()
        hits = {}
        for block, cb in snap.cached.items():
            hits[block] = cb.hits - self._hits.get(block, 0)
            self._hits[block] = cb.hits
        for block in [b for b in self._hits if b not in snap.cached]:
            del self._hits[block]
        admitted = {}
        for block, (flags, expires_ns) in self.cache.admit_entries().items():
            pin = None
            if flags & PINNED:
                pin = now + (expires_ns - now_ns) / 1e9 if expires_ns else math.inf
            admitted[block] = pin
        return Observation(
            now, misses={b: m for b, (m, _n) in snap.candidates.items()}, hits=hits,
            cached={b: (cb.nchunks, cb.speculative) for b, cb in snap.cached.items()},
            admitted=admitted, sizes=self.sizes())

    def step(self, now: float | None = None) -> Snapshot:
        now_ns = monotonic_ns()
        decisions = self.loop.step(self.observe(now_ns / 1e9 if now is None else now, now_ns))
        for (ns, key), size in decisions.evict:
            if size:
                self.cache.evict_block(ns, key, int(size))
            else:
                self.cache.evict(ns, key)
                self.cache.unadmit(ns, key)
            self._hits.pop((ns, key), None)
            log.info("evicted ns=%d key=%s", ns, key.hex())
        for ns, key in decisions.admit:
            self.cache.admit(ns, key)
        # what the data plane may carve for blocks it learns first: what the policies left
        self.cache.tend(self.sizes(), int(decisions.spec_budget))
        if self.loop.headroom:
            self.dp.set("spec_fill", int(decisions.spec_budget))
        return self.snapshot

    def sizes(self) -> dict[BlockId, int]:
        """Chunk counts known for blocks: from pool replies seen (the recently missed ones)."""
        snap = self.snapshot
        return {b: n for b, (_m, n) in snap.candidates.items() if n} if snap else {}

    def usage(self) -> dict[int, dict[str, int]]:
        """Per namespace: chunks cached, quota in chunks (0: shared)."""
        out: dict[int, dict[str, int]] = {}
        if self.snapshot:
            for (ns, _key), cb in self.snapshot.cached.items():
                u = out.setdefault(ns, {"chunks": 0, "quota_chunks": self.quota_chunks.get(ns, 0)})
                u["chunks"] += cb.chunks
        return out
