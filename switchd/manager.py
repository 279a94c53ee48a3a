"""Admission and eviction: every interval switchd turns the data plane's demand numbers (the
miss sketch, the recently missed blocks, per-entry hit counters) into decisions of a policy from
switchd.policy and applies them to the maps: admitting a block adds it to the admit set (the data
plane then learns its chunks as pool replies pass), evicting one deletes its chunks.

Speculative fill: the data plane also learns replies of blocks that are not admitted, as long as
a budget switchd sets lasts (``fill_headroom`` chunks kept free for it). At the next step each
such block is offered to its policy, which keeps it (it is admitted) or not (it is evicted). A
block is so cached from its first miss, as an offline policy that admits on the miss would have
it, instead of from the first miss after switchd's decision. With speculative fill on, only
blocks that were learned are offered: admitting one that was not would claim room that stays
empty until its next miss.

Capacity is counted in chunks (map entries). A namespace with a byte quota gets a policy of its
own sized to the quota; every other namespace shares what is left. Blocks admitted by an operator
(`switchd cache admit`) are pinned: the policy never evicts them until their TTL, if any, ends.
"""
from __future__ import annotations

import logging
import math
import statistics

from .cache import PINNED, Cache, monotonic_ns
from .dataplane import DataPlane, SwitchError
from .policy import make_policy
from .popularity import BlockId, Popularity, Snapshot

log = logging.getLogger("switchd.manager")


def default_headroom(entries: int) -> int:
    """Chunks kept free for speculative fills: a sixteenth of the cache."""
    return entries // 16


class CacheManager:
    def __init__(self, dp: DataPlane, policy: str = "prefix",
                 quotas: dict[int, int] | None = None, fill_headroom: int | None = None):
        self.dp, self.cache, self.popularity = dp, Cache(dp), Popularity(dp)
        chunk, total = dp.deployment.chunk_size, dp.deployment.cache_entries
        self.total = total
        self.headroom = default_headroom(total) if fill_headroom is None else fill_headroom
        self.quota_chunks = {ns: max(1, q // chunk) for ns, q in (quotas or {}).items()}
        shared = total - self.headroom - sum(self.quota_chunks.values())
        if shared < 0:
            raise SwitchError(f"namespace quotas ({sum(self.quota_chunks.values())} chunks) and "
                              f"fill headroom ({self.headroom}) exceed the cache ({total} chunks)")
        self.policies = {ns: make_policy(policy, q) for ns, q in self.quota_chunks.items()}
        self.shared = make_policy(policy, max(1, shared))
        self.policy_name = policy
        self.sizes: dict[BlockId, int] = {}       # known block sizes, in chunks
        self._hits: dict[BlockId, int] = {}
        self.admissions = self.evictions = self.rejected = 0
        self.snapshot: Snapshot | None = None

    def policy_for(self, ns: int):
        return self.policies.get(ns, self.shared)

    def _all_policies(self):
        return [*self.policies.values(), self.shared]

    def step(self, now: float | None = None) -> Snapshot:
        now_ns = monotonic_ns()
        now = now_ns / 1e9 if now is None else now
        snap = self.popularity.snapshot()
        admitted = self.cache.admit_entries()
        for block, cb in snap.cached.items():
            self.sizes[block] = cb.nchunks
        for block, (_misses, nchunks) in snap.candidates.items():
            if nchunks:
                self.sizes[block] = nchunks
        self._forget_removed(admitted)
        self._apply_pins(admitted, now, now_ns)
        self._adopt(admitted, now)
        for block, cb in snap.cached.items():           # demand the cache met
            delta = cb.hits - self._hits.get(block, 0)
            self._hits[block] = cb.hits
            pol = self.policy_for(block[0])
            if delta > 0 and block in pol:
                pol.access(block, now, count=delta)
        typical = self._typical_size()
        offered = set()
        for block, (misses, _n) in sorted(snap.candidates.items(), key=lambda kv: -kv[1][0]):
            pol = self.policy_for(block[0])               # demand it did not meet
            pol.access(block, now, count=misses)
            if block in pol or block in admitted:
                continue
            cached = snap.cached.get(block)
            if self.headroom and cached is None:
                continue    # not learned (no budget left): its next miss may be; claim no room
            offered.add(block)
            self._offer(block, now, self.sizes.get(block, typical), cached)
        for block, cb in snap.cached.items():           # speculative fills nobody missed since
            if cb.speculative and block not in admitted and block not in offered:
                if block not in self.policy_for(block[0]):
                    self._offer(block, now, cb.nchunks, cb)
        self._refill_budget()
        self.snapshot = snap
        return snap

    def _offer(self, block: BlockId, now: float, size: int, cached) -> None:
        """Ask the block's policy to cache it: admitted, or (if it was filled speculatively)
        evicted."""
        adm = self.policy_for(block[0]).admit(block, now, size=size)
        self._evict(adm.evicted)
        if adm:
            self.cache.admit(*block)
            self.admissions += 1
        elif cached is not None and cached.speculative:
            self._evict([block])
            self.rejected += 1

    def _refill_budget(self) -> None:
        """Let the data plane fill what the policies have not claimed (at least the headroom)."""
        if not self.headroom:
            return
        claimed = sum(p.used for p in self._all_policies())
        self.dp.set("spec_fill", max(0, int(self.total - claimed)))

    def _typical_size(self) -> int:
        return int(statistics.median(self.sizes.values())) if self.sizes else 1

    def _forget_removed(self, admitted: dict) -> None:
        """Blocks an operator evicted by hand leave the policies too."""
        for pol in self._all_policies():
            for block in [b for b in pol.keys() if b not in admitted]:
                pol.remove(block)
                self._hits.pop(block, None)

    def _adopt(self, admitted: dict, now: float) -> None:
        """Admitted blocks no policy knows (a restarted daemon's inheritance) are offered to the
        policy; what it will not keep is evicted, so nothing stays unmanaged."""
        for block, (flags, _expires) in admitted.items():
            pol = self.policy_for(block[0])
            if flags & PINNED or block in pol:
                continue
            adm = pol.admit(block, now, size=self.sizes.get(block, 1))
            self._evict(adm.evicted)
            if not adm:
                self._evict([block])

    def _apply_pins(self, admitted: dict, now: float, now_ns: int) -> None:
        for block, (flags, expires_ns) in admitted.items():
            if not flags & PINNED:
                continue
            pol = self.policy_for(block[0])
            if expires_ns and expires_ns <= now_ns:      # the pin is over: an ordinary entry
                self.cache.admit(*block)
                continue
            if not pol.pinned(block):
                ttl = (expires_ns - now_ns) / 1e9 if expires_ns else math.inf
                pol.remove(block)
                self._evict(pol.pin(block, now, ttl, size=self.sizes.get(block, 1)).evicted)

    def _evict(self, blocks) -> None:
        for ns, key in blocks:
            n = self.sizes.get((ns, key))
            if n:
                self.cache.evict_block(ns, key, n)
            else:
                self.cache.evict(ns, key)
                self.cache.unadmit(ns, key)
            self._hits.pop((ns, key), None)
            self.evictions += 1
            log.info("evicted ns=%d key=%s", ns, key.hex())

    def usage(self) -> dict[int, dict[str, int]]:
        """Per namespace: chunks cached, bytes of payload, quota in chunks (0: shared)."""
        out: dict[int, dict[str, int]] = {}
        if self.snapshot:
            for (ns, _key), cb in self.snapshot.cached.items():
                u = out.setdefault(ns, {"chunks": 0, "quota_chunks": self.quota_chunks.get(ns, 0)})
                u["chunks"] += cb.chunks
        return out
