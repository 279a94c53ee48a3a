"""The tier policy of issue #29, pure and shared: the live system (inference nodes' node-DRAM
tier and write-down, pool nodes' DRAM -> disk eviction) and the simulator (testbed.sim.tiers)
run this one code. It owns a block's value and every decision about moving KV between tiers:

  value      expected reuses x prefill time saved / bytes, in seconds saved per byte. Expected
             reuses are the block's observed reuses (uses after the first, the compute that made
             it), decayed with a half-life: recent demand predicts near demand. Prefill time
             saved is the block's tokens at the preset's prefill speed, a block at prefix depth d
             costing (1 + d / depth_scale) (attention over the prefix, as the cluster model).
  write_down now | later | never: ``all`` writes every computed block through now;
             ``selective`` (SGLang HiCache's write_through_selective) writes a block now once it
             has ``write_after`` reuses, or at once if blocks at its prefix depth have been
             reused often enough here (``write_prob``: the share of blocks first seen at that
             depth that were used again here, learned online, times ``sharers``: the nodes that
             requests for the same content are spread over (a node sees 1/sharers of them under
             random routing; 1 with prefix affinity) — how a node guesses that other nodes will
             want a block it has not seen twice),
             later (asked again on its next use, and when the node tier evicts it) until then,
             never if recomputing it is cheaper than fetching it.
  promote    into node DRAM on a fetch from a lower tier: always, unless the node tier orders
             by value and the block is worth less than what it would push out.
  demote     on eviction from a tier, to the next tier down (node -> pool, pool -> disk):
             ``none`` drops, ``all`` moves everything down, ``value`` moves a block down only
             when its expected reuses pay for the bytes: reuses x (saved - read time from the
             tier) >= min_gain x time to write it there (and > 0), or when the tier below has
             free room (free bytes displace nothing) and a hit from it beats recomputing.
  eviction   ``value`` mode orders a full tier by value (lowest first, ties least recent);
             ``none``/``all`` by recency (LRU).

``OrderedTier`` is a bounded tier's bookkeeping (which blocks, their sizes, who leaves first)
for whoever keeps the bytes elsewhere (the simulator keeps none). Nothing here imports switchd:
hostagent must not depend on the switch's daemon.
"""
from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Hashable, Iterable
from dataclasses import dataclass, field

DEMOTES = ("none", "all", "value")
WRITE_DOWNS = ("all", "selective")
TIERS = ("node", "switch", "pool", "disk")
NEXT_DOWN = {"node": "pool", "pool": "disk"}     # the switch needs no demotion: the pool has it

Block = Hashable


class PolicyError(ValueError):
    """A configuration the policy cannot run with (one line)."""


@dataclass(frozen=True)
class TierCost:
    """How fast a tier is read and written (Gbit/s): what a hit from it costs and what moving
    a block into it costs."""
    read_gbps: float
    write_gbps: float

    def read_s(self, nbytes: float) -> float:
        return nbytes * 8 / (self.read_gbps * 1e9)

    def write_s(self, nbytes: float) -> float:
        return nbytes * 8 / (self.write_gbps * 1e9)


# a cluster's tiers: node DRAM over PCIe, the pool over 100 Gbit/s links, pool NVMe
DEFAULT_COSTS = {"node": TierCost(200.0, 200.0), "pool": TierCost(100.0, 100.0),
                 "disk": TierCost(24.0, 12.0)}


@dataclass
class PolicyConfig:
    demote: str = "value"
    write_down: str = "all"
    prefill_tokens_per_s: float = 10_000.0
    block_tokens: int = 512
    half_life_s: float = 60.0
    write_after: int = 1            # reuses before a selective write-down
    depth_scale: float = 60.0
    min_gain: float = 0.5           # demote when expected saving >= min_gain x write time (a
    #                                 write is bandwidth off the critical path: weighed at half)
    write_prob: float = 0.25        # selective: write at once if its depth's reuse share is this
    sharers: int = 1                # nodes sharing the content (the depth share scales with it)
    costs: dict = field(default_factory=lambda: dict(DEFAULT_COSTS))

    def __post_init__(self) -> None:
        if self.demote not in DEMOTES:
            raise PolicyError(f"unknown demote mode {self.demote!r}: choose from "
                              f"{', '.join(DEMOTES)}")
        if self.write_down not in WRITE_DOWNS:
            raise PolicyError(f"unknown write-down mode {self.write_down!r}: choose from "
                              f"{', '.join(WRITE_DOWNS)}")
        for name in ("prefill_tokens_per_s", "half_life_s", "depth_scale"):
            if not getattr(self, name) > 0:
                raise PolicyError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.block_tokens < 1 or self.write_after < 0 or self.min_gain < 0 or self.sharers < 1:
            raise PolicyError("block_tokens and sharers must be >= 1, write_after and min_gain "
                              ">= 0")
        if not 0 <= self.write_prob <= 1.0 + 1e-9:
            raise PolicyError(f"write_prob must be in [0, 1], got {self.write_prob}")


class Popularity:
    """Per block: uses, reuses decayed with a half-life, last use, depth, size. A decayed count
    c at time t is kept as log2(c) + t / half_life, so counts taken at different times compare
    without touching every block (the order of decayed counts does not change with time)."""

    __slots__ = ("half_life", "_log", "last", "uses", "depth", "size", "seen_at", "reused_at")

    def __init__(self, half_life_s: float = 60.0):
        self.half_life = half_life_s
        self._log: dict[Block, float] = {}      # log2(decayed reuses) + t / h, or -inf
        self.last: dict[Block, float] = {}
        self.uses: dict[Block, int] = {}
        self.depth: dict[Block, int] = {}
        self.size: dict[Block, int] = {}
        self.seen_at: dict[int, int] = {}      # depth bucket -> blocks first seen there
        self.reused_at: dict[int, int] = {}    # ... of which used again

    @staticmethod
    def bucket(depth: int) -> int:
        return depth if depth < 16 else 12 + depth.bit_length()

    def reuse_share(self, depth: int | None) -> float:
        """The share of blocks first seen at ``depth``'s bucket that were used again (one
        seen-and-reused block of prior: 1.0 until there is evidence)."""
        b = self.bucket(depth or 0)
        return (self.reused_at.get(b, 0) + 1) / (self.seen_at.get(b, 0) + 1)

    def touch(self, block: Block, now: float, depth: int | None = None,
              size: int | None = None, weight: float = 1.0) -> None:
        """One use of ``block`` at ``now`` (its first use is its compute, not a reuse)."""
        if depth is not None:
            self.depth[block] = depth
        if size is not None:
            self.size[block] = size
        n = self.uses.get(block, 0)
        self.uses[block] = n + 1
        if n < 2:
            b = self.bucket(self.depth.get(block, 0))
            tally = self.seen_at if n == 0 else self.reused_at
            tally[b] = tally.get(b, 0) + 1
        self.last[block] = max(now, self.last.get(block, now))
        if n == 0 or weight <= 0:
            self._log.setdefault(block, -math.inf)
            return
        add = math.log2(weight) + now / self.half_life
        old = self._log.get(block, -math.inf)
        hi, lo = max(old, add), min(old, add)
        self._log[block] = hi + (math.log2(1 + 2 ** (lo - hi)) if lo > -math.inf else 0.0)

    def reuses(self, block: Block, now: float) -> float:
        """Decayed reuses at ``now``."""
        lg = self._log.get(block, -math.inf)
        return 0.0 if lg == -math.inf else 2 ** (lg - now / self.half_life)

    def log_reuses(self, block: Block) -> float:
        """The time-free order key of the decayed reuses (-inf: never reused)."""
        return self._log.get(block, -math.inf)

    def forget(self, block: Block) -> None:
        for d in (self._log, self.last, self.uses, self.depth, self.size):
            d.pop(block, None)

    def __contains__(self, block: Block) -> bool:
        return block in self.uses

    def __len__(self) -> int:
        return len(self.uses)


class TierPolicy:
    """The decisions, for one holder of blocks (an inference node, a pool node, a simulator)."""

    def __init__(self, cfg: PolicyConfig | None = None, popularity: Popularity | None = None):
        self.cfg = cfg or PolicyConfig()
        self.pop = popularity or Popularity(self.cfg.half_life_s)

    # ---- signals -----------------------------------------------------------------------
    def access(self, block: Block, now: float, depth: int | None = None,
               size: int | None = None) -> None:
        self.pop.touch(block, now, depth, size)

    @property
    def evict_by_value(self) -> bool:
        return self.cfg.demote == "value"

    def saved_s(self, block: Block) -> float:
        """Prefill seconds a hit of ``block`` saves."""
        c = self.cfg
        d = self.pop.depth.get(block, 0)
        return c.block_tokens / c.prefill_tokens_per_s * (1 + d / c.depth_scale)

    def _size(self, block: Block, size: int | None) -> int:
        return max(1, size if size is not None else self.pop.size.get(block, 1))

    def value(self, block: Block, now: float, size: int | None = None) -> float:
        """Expected reuses x prefill seconds saved / bytes (seconds saved per byte)."""
        return self.pop.reuses(block, now) * self.saved_s(block) / self._size(block, size)

    def order_key(self, block: Block, size: int | None = None) -> tuple[float, float]:
        """Lowest first leaves first: log2 of the value (time-free), then last use."""
        lg = self.pop.log_reuses(block)
        if lg > -math.inf:
            lg += math.log2(self.saved_s(block) / self._size(block, size))
        return lg, self.pop.last.get(block, -math.inf)

    # ---- decisions ---------------------------------------------------------------------
    def write_down(self, block: Block, now: float, size: int | None = None) -> str:
        """Write a block this node computed or holds down to the pool: now, later or never."""
        if self.cfg.write_down == "all":
            return "now"
        if self.saved_s(block) <= self.cfg.costs["pool"].read_s(self._size(block, size)):
            return "never"                  # fetching it would take longer than computing it
        if self.pop.uses.get(block, 0) - 1 >= self.cfg.write_after:
            return "now"
        share = self.pop.reuse_share(self.pop.depth.get(block)) * self.cfg.sharers
        return "now" if share >= self.cfg.write_prob else "later"

    def pays(self, block: Block, tier: str, now: float, size: int | None = None) -> bool:
        """Do ``block``'s expected reuses pay for holding its bytes in ``tier``?"""
        n = self._size(block, size)
        cost = self.cfg.costs[tier]
        reuses = self.pop.reuses(block, now)
        gain = reuses * (self.saved_s(block) - cost.read_s(n))
        return reuses > 0 and gain > 0 and gain >= self.cfg.min_gain * cost.write_s(n)

    def demote(self, block: Block, from_tier: str, now: float, size: int | None = None,
               free: float = 0.0) -> str | None:
        """Where a block evicted from ``from_tier`` goes: the next tier down, or None (drop).
        ``free``: bytes the tier below has free, if the caller knows (a pool node its disk)."""
        down = NEXT_DOWN.get(from_tier)
        if down is None or self.cfg.demote == "none":
            return None
        if self.cfg.demote == "all":
            return down
        n = self._size(block, size)
        if self.pays(block, down, now, n):
            return down
        roomy = free >= n and self.saved_s(block) > self.cfg.costs[down].read_s(n)
        return down if roomy else None

    def promote(self, block: Block, now: float, tier: "OrderedTier | None" = None,
                size: int | None = None) -> bool:
        """Put a block fetched from a lower tier into node DRAM (``tier``)?"""
        if tier is None or not tier.by_value or tier.free >= self._size(block, size):
            return True
        victim = tier.victim()
        return victim is None or self.order_key(block, size) >= self.order_key(victim)


class OrderedTier:
    """A bounded tier's bookkeeping: blocks and sizes, the order they leave in (LRU, or by the
    policy's value with ``by_value``). ``put`` returns the blocks it pushed out, for the caller
    to demote or drop; the caller keeps the bytes (or, in the simulator, none)."""

    def __init__(self, capacity: float, policy: TierPolicy | None = None,
                 by_value: bool = False):
        if capacity < 0:
            raise PolicyError(f"tier capacity must be >= 0, got {capacity}")
        if by_value and policy is None:
            raise PolicyError("a tier ordered by value needs the policy")
        self.capacity, self.policy, self.by_value = capacity, policy, by_value
        self.blocks: OrderedDict[Block, int] = OrderedDict()
        self.used = 0
        self.hits = self.puts = self.evicted = 0

    @property
    def free(self) -> float:
        return self.capacity - self.used

    def __contains__(self, block: Block) -> bool:
        return block in self.blocks

    def __len__(self) -> int:
        return len(self.blocks)

    def get(self, block: Block) -> bool:
        """A lookup: True (and the block is most recent) if held."""
        if block not in self.blocks:
            return False
        self.blocks.move_to_end(block)
        self.hits += 1
        return True

    def victim(self) -> Block | None:
        if not self.blocks:
            return None
        if not self.by_value:
            return next(iter(self.blocks))
        key = self.policy.order_key
        return min(self.blocks, key=lambda b: key(b, self.blocks[b]))

    def put(self, block: Block, size: int) -> list[tuple[Block, int]]:
        """Hold ``block``; the blocks pushed out to make room (oldest / lowest value first).
        A block larger than the tier is not held (returned as pushed out itself)."""
        if size > self.capacity:
            return [(block, size)]
        if block in self.blocks:
            self.blocks.move_to_end(block)
            return []
        out = []
        while self.used + size > self.capacity:
            v = self.victim()
            out.append((v, self.blocks[v]))
            self.remove(v)
            self.evicted += 1
        self.blocks[block] = size
        self.used += size
        self.puts += 1
        return out

    def remove(self, block: Block) -> bool:
        size = self.blocks.pop(block, None)
        if size is None:
            return False
        self.used -= size
        return True

    def keys(self) -> Iterable[Block]:
        return self.blocks.keys()


class PoolSide:
    """A pool node's use of the policy (blocks are (ns, key)): the PUTs and the GETs that reach
    it feed it (switch hits never do); it gives the store its eviction order (``value_fn``, for
    ``evict="value"``) and decides whether a block leaving DRAM goes to disk (``demote_fn``)."""

    def __init__(self, cfg: PolicyConfig | None = None, clock=None):
        import time
        self.policy = TierPolicy(cfg)
        self.clock = clock or time.monotonic

    def put(self, ns: int, key: bytes, nbytes: int) -> None:
        """A block written to the pool (its first use: the compute that made it)."""
        if (ns, key) not in self.policy.pop:
            self.policy.access((ns, key), self.clock(), None, nbytes)

    def get(self, ns: int, key: bytes, nbytes: int | None = None) -> None:
        """A GET of the block's chunk 0 (one per fetch) that reached this pool node."""
        self.policy.access((ns, key), self.clock(), None, nbytes)

    def value_fn(self, ns: int, key: bytes, nbytes: int):
        return self.policy.order_key((ns, key), nbytes)

    def demote_fn(self, ns: int, key: bytes, nbytes: int, free: float = 0.0) -> bool:
        return self.policy.demote((ns, key), "pool", self.clock(), nbytes, free) == "disk"

    def forget(self, ns: int, key: bytes) -> None:
        self.policy.pop.forget((ns, key))
