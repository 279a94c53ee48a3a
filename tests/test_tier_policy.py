"""The tier policy's decisions (hostagent.common.tier_policy), table-driven, pure."""
import math

import pytest

from hostagent.common.tier_policy import (OrderedTier, PolicyConfig, PolicyError, PoolSide,
                                          Popularity, TierCost, TierPolicy)

MIB = 1 << 20
BLOCK = 64 * MIB            # a 512-token block of Llama-3-8B


def policy(**kw) -> TierPolicy:
    return TierPolicy(PolicyConfig(**kw))


def used(p: TierPolicy, block, times, depth=0, size=BLOCK):
    for t in times:
        p.access(block, t, depth, size)
    return p


def test_decay_halves_reuses_per_half_life():
    pop = Popularity(half_life_s=10)
    for t in (0, 0, 0):                 # computed, then reused twice at t=0
        pop.touch("b", t)
    assert pop.reuses("b", 0) == pytest.approx(2)
    assert pop.reuses("b", 10) == pytest.approx(1)
    assert pop.reuses("b", 20) == pytest.approx(0.5)
    pop.touch("c", 0)
    assert pop.reuses("c", 0) == 0 and pop.log_reuses("c") == -math.inf


def test_order_of_decayed_counts_is_time_free():
    pop = Popularity(half_life_s=10)
    for t in (0, 0, 0, 0, 0):           # 4 reuses long ago
        pop.touch("old", t)
    for t in (25, 25):                  # 1 reuse recently: 4 * 2**-2.5 = 0.71 < 1
        pop.touch("new", t)
    assert pop.reuses("old", 25) < pop.reuses("new", 25)
    assert pop.log_reuses("old") < pop.log_reuses("new")


# (write_down mode, uses, size, expected)
WRITE_CASES = [
    ("all", 1, BLOCK, "now"),
    ("selective", 1, BLOCK, "later"),           # computed once: not yet
    ("selective", 2, BLOCK, "now"),             # one reuse: write_after=1
    ("selective", 5, BLOCK, "now"),
    ("selective", 3, 10 << 30, "never"),        # 10 GiB of KV for 512 tokens: fetching
]                                               # costs more than computing


def seasoned(p: TierPolicy, depth=0, n=8) -> TierPolicy:
    """A policy that has seen ``n`` blocks at ``depth`` never used again."""
    for i in range(n):
        p.access(("cold", i), 0.0, depth, BLOCK)
    return p


@pytest.mark.parametrize("mode,uses,size,want", WRITE_CASES)
def test_write_down(mode, uses, size, want):
    p = used(seasoned(policy(write_down=mode)), "b", [0.0] * uses, size=size)
    assert p.write_down("b", 0.0, size) == want


# (blocks seen at depth 3, of which reused, write_prob, expected for a new block at depth 3)
DEPTH_CASES = [
    (0, 0, 0.25, "now"),          # no evidence yet: the prior (1 of 1, and itself) writes
    (7, 0, 0.25, "later"),        # (0 + 1) / (7 + 1 + 1) < 0.25
    (7, 2, 0.25, "now"),          # 3/9
    (7, 2, 0.5, "later"),
]


@pytest.mark.parametrize("seen,reused,prob,want", DEPTH_CASES)
def test_selective_learns_which_depths_are_reused(seen, reused, prob, want):
    p = policy(write_down="selective", write_prob=prob)
    for i in range(seen):
        used(p, ("d", i), [0.0] * (2 if i < reused else 1), depth=3)
    seasoned(p, depth=0)                       # other depths do not count
    used(p, "new", [1.0], depth=3)
    assert p.write_down("new", 1.0) == want
    assert p.pop.reuse_share(3) == pytest.approx((reused + 1) / (seen + 2))


def test_selective_threshold_is_configurable():
    p = used(seasoned(policy(write_down="selective", write_after=3)), "b", [0, 1, 2])
    assert p.write_down("b", 2) == "later"
    p.access("b", 3)
    assert p.write_down("b", 3) == "now"


# (demote mode, from tier, uses, expected destination)
DEMOTE_CASES = [
    ("none", "node", 5, None),
    ("none", "pool", 5, None),
    ("all", "node", 1, "pool"),
    ("all", "pool", 1, "disk"),
    ("all", "disk", 5, None),                   # nothing below disk
    ("all", "switch", 5, None),                 # the pool still has what the switch evicts
    ("value", "node", 1, None),                 # never reused: not worth the bytes
    ("value", "pool", 1, None),
    ("value", "node", 2, "pool"),
    ("value", "pool", 2, "disk"),               # 1 reuse: (51 - 22 ms) >= 0.5 x 45 ms
    ("value", "disk", 9, None),
]


@pytest.mark.parametrize("mode,tier,uses,want", DEMOTE_CASES)
def test_demote(mode, tier, uses, want):
    p = used(policy(demote=mode), "b", [0.0] * uses)
    assert p.demote("b", tier, 0.0, BLOCK) == want


def test_value_demotion_weighs_reuses_against_the_tier():
    slow = {"node": TierCost(200, 200), "pool": TierCost(100, 100), "disk": TierCost(4, 2)}
    p = used(TierPolicy(PolicyConfig(demote="value", costs=slow)), "b", [0, 0])
    assert p.demote("b", "pool", 0, BLOCK) is None       # disk read 134 ms > 51 ms saved
    p2 = used(policy(demote="value"), "deep", [0, 0], depth=120)
    p3 = used(policy(demote="value", min_gain=2.0), "b", [0, 0])
    assert p2.demote("deep", "pool", 0, BLOCK) == "disk"
    assert p3.demote("b", "pool", 0, BLOCK) is None       # 29 ms < 2 x 45 ms
    assert p.value("b", 0, BLOCK) == pytest.approx(1 * 0.0512 / BLOCK)
    assert p2.value("deep", 0, BLOCK) == pytest.approx(3 * p.value("b", 0, BLOCK))


def test_value_demotes_unproven_blocks_only_into_free_room():
    p = used(policy(demote="value"), "b", [0.0])            # never reused
    assert p.demote("b", "pool", 0, BLOCK, free=0) is None
    assert p.demote("b", "pool", 0, BLOCK, free=BLOCK) == "disk"
    assert p.demote("b", "pool", 0, BLOCK, free=BLOCK - 1) is None
    slow = {"node": TierCost(200, 200), "pool": TierCost(100, 100), "disk": TierCost(4, 2)}
    q = used(TierPolicy(PolicyConfig(demote="value", costs=slow)), "b", [0.0])
    assert q.demote("b", "pool", 0, BLOCK, free=10 * BLOCK) is None   # slower than compute


def test_pool_side_counts_what_reaches_the_pool():
    t = [0.0]
    side = PoolSide(PolicyConfig(demote="value"), clock=lambda: t[0])
    side.put(1, b"a", BLOCK)
    side.put(1, b"b", BLOCK)
    side.get(1, b"b", BLOCK)
    side.put(1, b"b", BLOCK)                                 # a rewrite is not a use
    assert side.value_fn(1, b"a", BLOCK) < side.value_fn(1, b"b", BLOCK)
    assert not side.demote_fn(1, b"a", BLOCK) and side.demote_fn(1, b"b", BLOCK)
    assert side.demote_fn(1, b"a", BLOCK, free=BLOCK)
    side.forget(1, b"b")
    assert (1, b"b") not in side.policy.pop


def test_value_decays_so_old_demand_demotes_no_more():
    p = used(policy(demote="value", half_life_s=10), "b", [0, 0])
    assert p.demote("b", "pool", 0, BLOCK) == "disk"
    assert p.demote("b", "pool", 20, BLOCK) is None      # 0.25 reuses: 7 ms < 22 ms


# (by_value, accesses per block, expected eviction order)
ORDER_CASES = [
    (False, {"a": [0], "b": [1, 1, 1], "c": [2]}, ["a", "b", "c"]),        # LRU
    (True, {"a": [0], "b": [1, 1, 1], "c": [2]}, ["a", "c", "b"]),         # never-reused first
    (True, {"a": [0, 0, 0], "b": [1, 1], "c": [2, 2, 2, 2]}, ["b", "a", "c"]),
]


@pytest.mark.parametrize("by_value,uses,order", ORDER_CASES)
def test_eviction_order(by_value, uses, order):
    p = policy(demote="value" if by_value else "all")
    tier = OrderedTier(3 * BLOCK, p, by_value=by_value)
    for b, times in uses.items():
        used(p, b, times)
        assert tier.put(b, BLOCK) == []
    out = []
    for i in range(3):              # hot newcomers (by value, a cold one would leave first)
        used(p, f"new{i}", [3.0] * 9)
        out += [b for b, _ in tier.put(f"new{i}", BLOCK)]
    assert out == order
    assert tier.used == 3 * BLOCK and tier.evicted == 3


def test_tier_bounds_lookups_and_oversized_blocks():
    tier = OrderedTier(2 * BLOCK)
    assert tier.put("a", BLOCK) == [] and tier.put("b", BLOCK) == []
    assert tier.get("a") and not tier.get("z")
    assert tier.put("c", BLOCK) == [("b", BLOCK)]         # "a" was used more recently
    assert tier.put("huge", 3 * BLOCK) == [("huge", 3 * BLOCK)] and "huge" not in tier
    assert tier.hits == 1 and tier.used == 2 * BLOCK


# (tier by value, room, candidate uses, victim uses, promote?)
PROMOTE_CASES = [
    (False, 0, 1, 5, True),        # an LRU node tier takes every fetched block
    (True, 1, 1, 5, True),         # room: yes
    (True, 0, 1, 5, False),        # full, worth less than what it would push out
    (True, 0, 5, 2, True),
]


@pytest.mark.parametrize("by_value,room,cand,victim,want", PROMOTE_CASES)
def test_promote(by_value, room, cand, victim, want):
    p = policy(demote="value" if by_value else "all")
    tier = OrderedTier((1 + room) * BLOCK, p, by_value=by_value)
    used(p, "v", [0] * victim)
    tier.put("v", BLOCK)
    used(p, "c", [1] * cand)
    assert p.promote("c", 1, tier, BLOCK) is want


@pytest.mark.parametrize("kw,msg", [
    ({"demote": "some"}, "unknown demote mode 'some'"),
    ({"write_down": "later"}, "unknown write-down mode 'later'"),
    ({"half_life_s": 0}, "half_life_s must be > 0"),
    ({"write_after": -1}, "write_after and min_gain"),
    ({"write_prob": 1.5}, "write_prob must be in"),
])
def test_bad_config_is_one_line(kw, msg):
    with pytest.raises(PolicyError, match=msg) as e:
        PolicyConfig(**kw)
    assert "\n" not in str(e.value)


def test_value_tier_needs_the_policy():
    with pytest.raises(PolicyError):
        OrderedTier(10, by_value=True)
    with pytest.raises(PolicyError):
        OrderedTier(-1)
