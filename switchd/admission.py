"""The admission loop, pure: one step turns what the data plane saw in an interval into decisions
(blocks to admit, blocks to evict, the speculative-fill budget), through the policies of
switchd.policy. It touches no map: switchd.manager reads the maps into an ``Observation`` and
applies the ``Decisions``; the cluster model (testbed.sim) drives the very same loop over its
model of the data plane.

Per step, in order: blocks that left the admit set by other means (an operator) leave the
policies; operator pins are applied (expired ones become ordinary entries); admitted blocks no
policy knows (a restarted daemon's inheritance) are offered, and evicted if refused; the
interval's hits feed the policies; every missed block is counted and, if not cached, offered
(most missed first); speculatively filled blocks nobody missed since are offered. With
``keep`` (a split placement: this cache's share of the blocks) nothing else is offered, and
what else was filled is evicted. With
speculative fill on (``headroom`` > 0) only blocks that were learned are offered: admitting one
that was not would claim room that stays empty until its next miss. The fill budget is what the
policies have not claimed.

Capacity is in the unit of block sizes (chunks live, blocks in the model). A namespace with a
quota has a policy of its own; every other namespace shares the rest (blocks are (ns, key)
tuples then; without quotas any hashable block id works).
"""
from __future__ import annotations

import math
import statistics
from collections.abc import Hashable
from dataclasses import dataclass, field

from .policy import make_policy

Block = Hashable                     # (ns, key) live; any id in the model


@dataclass
class Observation:
    """What the data plane tells the loop about one interval."""
    now: float                                    # seconds, the loop's clock
    misses: dict[Block, int]                      # demand the cache did not meet
    hits: dict[Block, int] = field(default_factory=dict)         # fetches it served
    cached: dict[Block, tuple[float, bool]] = field(default_factory=dict)  # size, speculative
    admitted: dict[Block, float | None] = field(default_factory=dict)  # pin expiry or None
    sizes: dict[Block, float] = field(default_factory=dict)      # sizes learned this interval


@dataclass
class Decisions:
    admit: list[Block]            # (re)write as ordinary admit-set entries
    evict: list[tuple[Block, float | None]]   # drop chunks and admission; the size if known
    spec_budget: float            # may be filled speculatively until the next step


class AdmissionLoop:
    def __init__(self, policy: str, total: float, headroom: float = 0.0,
                 quotas: dict[int, float] | None = None, unit: str = "blocks",
                 keep=None):
        self.total, self.headroom = total, headroom
        self.keep = keep            # None, or which blocks this cache may hold at all
        self.quotas = dict(quotas or {})
        shared = total - headroom - sum(self.quotas.values())
        if shared < 0:
            raise ValueError(f"namespace quotas ({sum(self.quotas.values())} {unit}) and fill "
                             f"headroom ({headroom}) exceed the cache ({total} {unit})")
        self.policies = {ns: make_policy(policy, q) for ns, q in self.quotas.items()}
        self.shared = make_policy(policy, max(1e-9, shared))
        self.policy_name = policy
        self.sizes: dict[Block, float] = {}
        self.admissions = self.evictions = self.rejected = self.steps = 0
        self._changes: dict[Block, bool] = {}     # this step: True admitted, False evicted

    def policy_for(self, block: Block):
        return self.policies.get(block[0], self.shared) if self.policies else self.shared

    def all_policies(self):
        return [*self.policies.values(), self.shared]

    @property
    def claimed(self) -> float:
        return sum(p.used for p in self.all_policies())

    def step(self, obs: Observation) -> Decisions:
        now, admitted, cached = obs.now, obs.admitted, obs.cached
        self._changes = {}
        self.sizes.update(obs.sizes)
        for block, (size, _spec) in cached.items():
            self.sizes[block] = size
        self._forget_removed(admitted)
        self._apply_pins(admitted, now)
        self._adopt(admitted, now)
        for block, count in obs.hits.items():
            pol = self.policy_for(block)
            if count > 0 and block in pol:
                pol.access(block, now, count=count)
        offered = set()
        for block, misses in sorted(obs.misses.items(), key=lambda kv: -kv[1]):
            pol = self.policy_for(block)
            pol.access(block, now, count=misses)
            if block in pol or block in admitted or (self.keep and not self.keep(block)):
                continue
            learned = cached.get(block)
            if self.headroom and learned is None:
                continue
            offered.add(block)
            self._offer(block, now, self._size(block), learned)
        for block, learned in cached.items():
            if (learned[1] and block not in admitted and block not in offered
                    and block not in self.policy_for(block)):
                if self.keep and not self.keep(block):
                    self._evict([block])          # filled before its share was set
                else:
                    self._offer(block, now, learned[0], learned)
        self.steps += 1
        evict = [(b, self.sizes.get(b)) for b, adm in self._changes.items() if not adm]
        return Decisions([b for b, adm in self._changes.items() if adm], evict,
                         max(0.0, self.total - self.claimed) if self.headroom else 0.0)

    # -- the parts of a step
    def _size(self, block: Block) -> float:
        size = self.sizes.get(block)
        if size:
            return size
        return statistics.median(self.sizes.values()) if self.sizes else 1

    def _offer(self, block: Block, now: float, size: float, learned) -> None:
        """Ask the block's policy to cache it: admitted, or (if it was filled speculatively)
        evicted."""
        adm = self.policy_for(block).admit(block, now, size=size)
        self._evict(adm.evicted)
        if adm:
            self._changes[block] = True
            self.admissions += 1
        elif learned is not None and learned[1]:
            self._evict([block])
            self.rejected += 1

    def _evict(self, blocks) -> None:
        for block in blocks:
            self._changes[block] = False
            self.evictions += 1

    def _forget_removed(self, admitted: dict) -> None:
        """Blocks an operator evicted by hand leave the policies too."""
        for pol in self.all_policies():
            for block in [b for b in pol.keys() if b not in admitted]:
                pol.remove(block)

    def _adopt(self, admitted: dict, now: float) -> None:
        """Admitted blocks no policy knows are offered; what it will not keep is evicted, so
        nothing stays unmanaged."""
        for block, pin in admitted.items():
            pol = self.policy_for(block)
            if pin is not None or block in pol:
                continue
            adm = pol.admit(block, now, size=self.sizes.get(block, 1))
            self._evict(adm.evicted)
            if not adm:
                self._evict([block])

    def _apply_pins(self, admitted: dict, now: float) -> None:
        for block, pin in admitted.items():
            if pin is None:
                continue
            pol = self.policy_for(block)
            if pin <= now:                     # the pin is over: an ordinary entry
                self._changes[block] = True
                continue
            if not pol.pinned(block):
                pol.remove(block)
                self._evict(pol.pin(block, now, pin - now if math.isfinite(pin) else math.inf,
                                    size=self.sizes.get(block, 1)).evicted)
