"""Cache policies, the count-min sketch, trace loading and the offline evaluator (pure Python)."""
from __future__ import annotations

import functools
import json
import re

import numpy as np
import pytest
from click.testing import CliRunner

from switchd.policy import DEFAULT_POLICY, LFU, LRU, POLICIES, PrefixAware, TinyLFU, make_policy
from switchd.sketch import U32_MAX, CountMinSketch, key64
from testbed.cli import main
from testbed.sim.baselines import VERSION, runnable
from testbed.sim.evaluate import evaluate
from testbed.sim.hindsight import belady_hits, next_use, static_hits
from testbed.sim.trace import TraceError, generate_sessions, load_trace, resample


def run(policy, keys, times=None):
    """Per-request replay of bare keys (as the evaluator does); returns the hit list."""
    hits = []
    for i, k in enumerate(keys):
        now = float(i if times is None else times[i])
        hit = policy.access(k, now)
        if not hit:
            policy.admit(k, now)
        hits.append(hit)
    return hits


# ---- LRU, LFU, Belady on hand-computed sequences ----------------------------------------------
def test_lru_hand_computed():
    # cap 2: 1m [1] 2m [1,2] 1h [2,1] 3m->evict 2 [1,3] 2m->evict 1 [3,2] 1m->evict 3 [2,1]
    p = LRU(2)
    assert run(p, [1, 2, 1, 3, 2, 1]) == [False, False, True, False, False, False]
    assert set(p.keys()) == {2, 1} and p.used == 2


def test_lfu_keeps_the_frequent_key_where_lru_loses_it():
    seq = [1, 1, 1, 2, 3, 1]
    assert sum(run(LRU(2), seq)) == 2      # 3 evicts 1 (least recent), the last 1 misses
    p = LFU(2)
    assert run(p, seq) == [False, True, True, False, False, True]   # 3 evicts 2 (count 1)
    assert set(p.keys()) == {1, 3}


def test_belady_hand_computed():
    # cap 2: 3 is never needed again -> bypassed; 4 likewise
    assert belady_hits(np.array([1, 2, 3, 1, 2, 4, 1, 2]), 2).tolist() == \
        [False, False, False, True, True, False, True, True]
    # cap 2: at 3, next uses are 1->3, 2->5, 3->4: evict 2 (furthest)
    assert belady_hits(np.array([1, 2, 3, 1, 3, 2]), 2).tolist() == \
        [False, False, False, True, True, False]
    assert sum(run(LRU(2), [1, 2, 3, 1, 2, 4, 1, 2])) == 0


def test_static_hand_computed_and_never_above_belady():
    # counts: 3 x4, 1 x3, 2 x2; cap 1 keeps 3 (hits after its first request), cap 2 adds 1
    seq = np.array([1, 2, 3, 1, 2, 1, 3, 3, 3])
    assert static_hits(seq, 1).tolist() == [False] * 6 + [True] * 3
    assert static_hits(seq, 2).tolist() == \
        [False, False, False, True, False, True, True, True, True]
    # ties go to the earlier first request
    assert static_hits(np.array([5, 4, 4, 5]), 1).tolist() == [False, False, False, True]
    rng = np.random.default_rng(3)
    for _ in range(30):
        keys, cap = rng.integers(0, 8, 40), int(rng.integers(1, 5))
        assert static_hits(keys, cap).sum() <= belady_hits(keys, cap).sum()


def test_next_use():
    assert next_use(np.array([5, 6, 5, 5, 7])).tolist() == [2, 5, 3, 5, 5]


@functools.lru_cache(maxsize=None)
def _optimum(seq: tuple, cap: int, i: int = 0, cache: frozenset = frozenset()) -> int:
    """Exhaustive optimum over every admission/eviction choice (tiny inputs only)."""
    if i == len(seq):
        return 0
    k = seq[i]
    if k in cache:
        return 1 + _optimum(seq, cap, i + 1, cache)
    best = _optimum(seq, cap, i + 1, cache)                  # bypass
    if len(cache) < cap:
        return max(best, _optimum(seq, cap, i + 1, cache | {k}))
    for v in cache:
        best = max(best, _optimum(seq, cap, i + 1, (cache - {v}) | {k}))
    return best


def test_belady_is_the_optimum_and_beats_every_policy():
    rng = np.random.default_rng(7)
    for _ in range(30):
        seq = rng.integers(0, 5, 12)
        cap = int(rng.integers(1, 4))
        opt = _optimum(tuple(seq.tolist()), cap)
        assert int(belady_hits(seq, cap).sum()) == opt
        for name in POLICIES:
            assert sum(run(make_policy(name, cap), seq.tolist())) <= opt


# ---- TinyLFU, pinning, prefix awareness --------------------------------------------------------
def test_tinylfu_rejects_a_one_hit_wonder():
    p = TinyLFU(2)
    run(p, [1, 1, 2, 2])
    assert not p.access(9, 10.0)
    adm = p.admit(9, 10.0)
    assert not adm and adm.evicted == ()
    assert set(p.keys()) == {1, 2}
    # once it is more frequent than the LRU victim it gets in, replacing that victim (1)
    p.access(9, 11.0)
    p.access(9, 12.0)
    adm = p.admit(9, 12.0)
    assert adm and adm.evicted == (1,)
    assert set(p.keys()) == {2, 9}


def test_lru_admits_a_one_hit_wonder():
    p = LRU(2)
    run(p, [1, 1, 2, 2])
    assert p.admit(9, 10.0).evicted == (1,)


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_pinned_key_survives_until_its_ttl(name):
    p = make_policy(name, 2)
    assert p.pin(100, now=0.0, ttl=10.0)
    for t, k in enumerate([1, 2, 3, 4, 5, 6], 1):     # heavy churn, all admitted by LRU
        p.access(k, float(t))
        p.admit(k, float(t))
        assert 100 in p and p.pinned(100)
    other = [k for k in p.keys() if k != 100]
    assert len(other) <= 1
    if other:
        assert p.evict(9.0) == other[0]
    assert p.evict(9.0) is None                        # only the pinned key is left
    assert p.evict(10.0) == 100                        # its TTL is over
    assert len(p) == 0 and p.used == 0


def test_pins_fill_the_cache_then_nothing_else_gets_in():
    p = LRU(2)
    assert p.pin("a", 0.0, 5.0) and p.pin("b", 0.0, 5.0)
    assert not p.pin("c", 1.0, 5.0)
    assert not p.admit("d", 1.0)
    assert set(p.keys()) == {"a", "b"}
    assert p.admit("d", 6.0).evicted == ("a",)        # pins expired: "a" is least recent
    with pytest.raises(ValueError):
        p.pin("e", 7.0, 0)


def test_remove_forgets_a_key():
    p = make_policy(DEFAULT_POLICY, 4)
    run(p, [1, 2, 3])
    p.pin(3, 5.0, 100.0)
    assert p.remove(2) and p.remove(3) and not p.remove(2)
    assert set(p.keys()) == {1} and p.used == 1


def chain_replay(policy, chain, times):
    for t in times:
        for depth, k in enumerate(chain):
            parent = chain[depth - 1] if depth else None
            if not policy.access(k, t, depth=depth, parent=parent):
                policy.admit(k, t, depth=depth, parent=parent)


def test_prefix_aware_keeps_chain_heads_where_lru_keeps_tails():
    chain = [10, 11, 12, 13, 14]
    p = PrefixAware(3, tau=100.0)
    chain_replay(p, chain, [0.0, 1.0, 2.0])
    assert set(p.keys()) == {10, 11, 12}
    lru = LRU(3)
    chain_replay(lru, chain, [0.0, 1.0, 2.0])
    assert set(lru.keys()) == {12, 13, 14}
    assert p.evict(3.0) == 12                          # trimmed from the tail


def test_prefix_aware_parent_outranks_a_more_valuable_child():
    # gamma > 0 makes the deeper block worth more by itself; its parent must still outrank it
    p = PrefixAware(8, tau=100.0, gamma=1.0)
    chain_replay(p, [1, 2, 3], [0.0, 1.0])
    assert p._heap.prio(1) > p._heap.prio(2) > p._heap.prio(3)
    assert [p.evict(2.0) for _ in range(3)] == [3, 2, 1]


def test_prefix_aware_prefers_the_hotter_chain_and_skips_partial_tails():
    p = PrefixAware(4, tau=100.0)
    hot, cold = [1, 2], [7, 8]
    chain_replay(p, cold, [0.0])
    chain_replay(p, hot, [1.0, 2.0, 3.0])
    chain_replay(p, cold, [4.0])                       # cold is now requested twice, hot 3x
    assert set(p.keys()) == {1, 2, 7, 8}
    p.access(5, 5.0)
    p.access(5, 5.5)                                   # a new chain seen twice ...
    assert p.admit(5, 5.5).evicted == (8,)             # ... displaces the colder tail
    for t in (6.0, 7.0, 8.0):                          # a partial block (fill 0.1) never
        p.access(99, t, fill=0.1)                      # outranks a full one requested as often
    assert not p.admit(99, 8.0, fill=0.1)


def test_prefix_aware_retunes_tau():
    p = PrefixAware(64, window=50)
    start = p.tau
    rng = np.random.default_rng(1)
    keys = (rng.zipf(1.3, 6000) % 500).tolist()        # stationary: slow decay wins
    run(p, keys, times=[i * 0.5 for i in range(6000)])
    assert p.tau > start and p.tau in PrefixAware.TAUS


def test_make_policy_rejects_unknown_names_and_bad_capacity():
    with pytest.raises(ValueError, match="unknown policy"):
        make_policy("fifo", 10)
    with pytest.raises(ValueError):
        LRU(0)
    assert DEFAULT_POLICY == "prefix"


# ---- count-min sketch --------------------------------------------------------------------------
def test_sketch_bounds_hold():
    eps, delta = 0.002, 0.01
    cms = CountMinSketch.for_error(eps, delta, seed=3)
    assert cms.width >= 2 * np.e / eps and cms.depth == 5
    keys = np.random.default_rng(0).zipf(1.2, 50_000) % 20_000
    cms.add_many(keys)
    n = len(keys)
    assert cms.total == n
    true = np.bincount(keys, minlength=20_000)
    est = cms.estimate_many(np.arange(20_000)).astype(np.int64)
    assert (est >= true).all()                                  # never underestimates
    assert ((est - true) > eps * n).mean() <= delta             # rarely overestimates by > eps*N
    assert cms.estimate(int(keys[0])) == est[keys[0]]


def test_sketch_scalar_and_bulk_agree_and_age():
    a, b = CountMinSketch(64, 3, seed=1), CountMinSketch(64, 3, seed=1)
    keys = [5, 9, 5, 123456789, -4, 5]
    for k in keys:
        a.add(k)
    b.add_many(np.array(keys, np.int64))
    assert (a.table == b.table).all() and a.estimate(5) == 3
    a.halve()
    assert a.estimate(5) == 1 and a.total == 3
    aged = CountMinSketch(64, 2, aging_interval=4)
    for _ in range(4):
        aged.add("x")
    assert aged.estimate("x") == 2 and aged.total == 2          # halved at the 4th increment
    big = CountMinSketch(64, 2)
    big.add(b"\x01" * 16, 2 ** 33)
    assert big.estimate(b"\x01" * 16) == U32_MAX                # saturates like the u32 map


def test_sketch_load_and_keys():
    cms = CountMinSketch(32, 2)
    cms.add(("ns", b"k" * 16), 7)
    twin = CountMinSketch(32, 2)
    twin.load(cms.table)
    assert twin.estimate(("ns", b"k" * 16)) == 7 and twin.total == 7
    with pytest.raises(ValueError):
        twin.load(np.zeros((3, 32)))
    assert key64(b"\x01" + b"\0" * 7 + b"\x02" + b"\0" * 7) == 3
    assert key64(-1) == 2 ** 64 - 1


# ---- traces ------------------------------------------------------------------------------------
def write_lines(path, lines):
    path.write_text("".join(line + "\n" for line in lines))
    return path


GOOD = ['{"timestamp": 0, "input_length": 1100, "output_length": 5, "hash_ids": [5, 6, 7]}',
        '{"timestamp": 40, "input_length": 1024, "output_length": 3, "hash_ids": [5, 6]}']


def test_load_trace_and_stream(tmp_path):
    tr = load_trace(write_lines(tmp_path / "t.jsonl", GOOD + [""]))
    assert tr.n_requests == 2 and tr.n_block_requests == 5 and tr.distinct_blocks == 3
    assert tr.blocks(1).tolist() == [5, 6]
    s = tr.stream()
    assert s.depth.tolist() == [0, 1, 2, 0, 1]
    assert s.parent.tolist() == [-1, 5, 6, -1, 5]
    assert s.fill.tolist() == [1, 1, 76 / 512, 1, 1]
    assert s.time.tolist() == [0, 0, 0, 0.04, 0.04]


@pytest.mark.parametrize("bad, why", [
    ('{"timestamp": 50, "input_length": 10, "output_length": 1, "hash_ids": [1', "not valid JSON"),
    ('{"timestamp": 50, "input_length": 10, "hash_ids": [1]}', "missing field(s) output_length"),
    ('{"timestamp": 50, "input_length": -1, "output_length": 1, "hash_ids": [1]}', "input_length"),
    ('{"timestamp": 50, "input_length": 1, "output_length": 1, "hash_ids": [1, "x"]}', "hash_ids"),
    ('{"timestamp": 10, "input_length": 1, "output_length": 1, "hash_ids": [1]}', "back in time"),
    ('[1, 2]', "expected a JSON object"),
])
def test_malformed_line_names_its_line(tmp_path, bad, why):
    path = write_lines(tmp_path / "t.jsonl", GOOD + [bad])
    with pytest.raises(TraceError, match=rf"t\.jsonl:3: .*{re.escape(why)}"):
        load_trace(path)


def test_empty_trace_is_an_error(tmp_path):
    with pytest.raises(TraceError, match="no requests"):
        load_trace(write_lines(tmp_path / "t.jsonl", [""]))


def test_resampled_and_generated_traces_round_trip(tmp_path):
    base = generate_sessions(300, seed=1)
    assert base.n_requests == 300 and base.distinct_blocks < base.n_block_requests
    for method in ("zipf", "shuffle"):
        other = resample(base, seed=2, method=method)
        other.save(tmp_path / f"{method}.jsonl")
        back = load_trace(tmp_path / f"{method}.jsonl")
        assert back.n_requests == 300
        assert (back.hash_ids == other.hash_ids).all()
        assert not np.array_equal(back.hash_ids[:200], base.hash_ids[:200])
    shuffled = resample(base, seed=2, method="shuffle")
    assert sorted(np.diff(shuffled.offsets)) == sorted(np.diff(base.offsets))
    with pytest.raises(ValueError):
        resample(base, seed=2, method="nope")


# ---- evaluator and CLI -------------------------------------------------------------------------
def test_evaluate_hand_computed():
    reqs = [{"timestamp": t, "input_length": 512 * len(h), "output_length": 1, "hash_ids": h}
            for t, h in [(0, [1, 2]), (1000, [1, 2]), (2000, [3]), (3000, [1, 2])]]
    r = evaluate(reqs, 2, ["lru"])
    # lru: 1m 2m | 1h 2h | 3m (evicts 1) | 1m 2m      belady: 3 is bypassed -> 4 hits
    assert r["capacity_blocks"] == 2 and r["block_requests"] == 7
    # static: 1 and 2 are requested most, cached at their first miss -> 4 hits
    assert r["hit_ratio"] == {"lru": 2 / 7, "belady": 4 / 7, "static": 4 / 7}


def test_cli_writes_the_json_document(tmp_path):
    trace = tmp_path / "s.jsonl"
    generate_sessions(400, seed=5).save(trace)
    out = tmp_path / "out" / "r.json"
    res = CliRunner().invoke(main, ["policy-eval", "--trace", str(trace), "--capacity", "0.05",
                                    "--json", str(out)])
    assert res.exit_code == 0, res.output
    doc = json.loads(out.read_text())
    assert doc["trace"] == str(trace) and doc["default_policy"] == DEFAULT_POLICY
    tr = load_trace(trace)
    assert doc["capacity_blocks"] == round(0.05 * tr.distinct_blocks)
    lcs = {"lcs:" + n for n in runnable(doc["capacity_blocks"])}
    assert set(doc["hit_ratio"]) == {*POLICIES, "belady", "static", *lcs}
    assert all(0 <= v <= doc["hit_ratio"]["belady"] for v in doc["hit_ratio"].values())
    assert doc["hit_ratio"]["belady"] > 0
    assert set(doc["seconds"]) == set(doc["hit_ratio"])
    # the best of libCacheSim's algorithms that do not read the future
    assert doc["groups"]["hindsight"] == ["belady", "static", "lcs:Belady"]
    others = {k: v for k, v in doc["hit_ratio"].items() if k in lcs and k != "lcs:Belady"}
    assert doc["best_other"]["hit_ratio"] == max(others.values())
    assert others[doc["best_other"]["name"]] == max(others.values())
    assert doc["libcachesim"]["version"] == VERSION
    assert doc["libcachesim"]["belady_in_our_model_equal"] is True


def test_evaluate_takes_libcachesim_names_and_reports_the_best_other():
    trace = generate_sessions(200, seed=3)
    r = evaluate(trace, 0.1, ["prefix", "ARC", "lcs:LRU", "lru", "Belady"])
    assert list(r["hit_ratio"]) == ["prefix", "lcs:ARC", "lcs:LRU", "lru", "belady", "static",
                                    "lcs:Belady"]
    assert r["hit_ratio"]["lcs:LRU"] == r["hit_ratio"]["lru"]          # the same LRU
    assert r["groups"] == {"switchd": ["prefix", "lru"], "libcachesim": ["lcs:ARC", "lcs:LRU"],
                           "hindsight": ["belady", "static", "lcs:Belady"]}
    best = max(("lcs:ARC", "lcs:LRU"), key=r["hit_ratio"].get)
    assert r["best_other"] == {"name": best, "hit_ratio": r["hit_ratio"][best]}
    assert r["hit_ratio"]["lcs:Belady"] <= r["hit_ratio"]["belady"]   # it may not bypass
    assert evaluate(trace, 0.1, ["lru"])["best_other"] is None
    with pytest.raises(ValueError, match="too small for S3FIFO"):
        evaluate(trace, 3, ["S3FIFO"])


def test_cli_sweep_writes_json_and_plot(tmp_path):
    trace = tmp_path / "s.jsonl"
    generate_sessions(300, seed=4).save(trace)
    out = tmp_path / "sweep.json"
    res = CliRunner().invoke(main, ["policy-eval", "--trace", str(trace), "--sweep", "0.2,0.05",
                                    "--policies", "prefix,ARC,lcs:LIRS,TwoQ,LRU",
                                    "--json", str(out)])
    assert res.exit_code == 0, res.output
    doc = json.loads(out.read_text())
    assert doc["capacities"] == [0.05, 0.2] and len(doc["results"]) == 2
    assert len(doc["plotted"]) == 3 and set(doc["plotted"]) <= {"lcs:ARC", "lcs:LIRS",
                                                                "lcs:TwoQ", "lcs:LRU"}
    assert doc["results"][0]["capacity_blocks"] < doc["results"][1]["capacity_blocks"]
    assert (tmp_path / "sweep.png").read_bytes()[:4] == b"\x89PNG"


def test_cli_says_how_to_install_a_missing_libcachesim(tmp_path, monkeypatch):
    from testbed.sim import baselines
    monkeypatch.setattr(baselines, "_lcs", None)
    trace = write_lines(tmp_path / "t.jsonl", GOOD)
    res = CliRunner().invoke(main, ["policy-eval", "--trace", str(trace)])
    assert res.exit_code == 1 and f"pip install libcachesim=={VERSION}" in res.output


@pytest.mark.parametrize("args, message", [
    (["--capacity", "0"], "must be > 0"),
    (["--capacity", "-3"], "must be > 0"),
    (["--policies", "lru,fifo"], "unknown policy fifo"),
    (["--policies", "ARC,lcs:NoSuch"], "unknown policy lcs:NoSuch"),
    (["--capacity", "3", "--policies", "S3FIFO"], "too small for S3FIFO"),
    (["--sweep", "0.1,0"], "must be > 0"),
])
def test_cli_bad_arguments(tmp_path, args, message):
    trace = write_lines(tmp_path / "t.jsonl", GOOD)
    res = CliRunner().invoke(main, ["policy-eval", "--trace", str(trace), *args])
    assert res.exit_code == 2 and message in res.output


def test_cli_missing_and_malformed_trace(tmp_path):
    res = CliRunner().invoke(main, ["policy-eval", "--trace", str(tmp_path / "nope.jsonl")])
    assert res.exit_code == 2 and "does not exist" in res.output
    bad = write_lines(tmp_path / "t.jsonl", GOOD + ["{oops"])
    res = CliRunner().invoke(main, ["policy-eval", "--trace", str(bad)])
    assert res.exit_code == 2 and "t.jsonl:3" in res.output


@pytest.mark.parametrize("sharing, capacity", [(0.0, 0.02), (0.0, 0.1), (0.6, 0.1)])
def test_default_policy_is_not_below_lru_on_traces_it_was_not_tuned_on(sharing, capacity):
    """Resampled from the start of the Mooncake trace (the sim's documented resampling): a
    workload whose reuse differs from the shared trace's."""
    from pathlib import Path
    from testbed.sim.evaluate import evaluate
    from testbed.sim.config import SimConfig
    from testbed.sim.workload import workload
    from testbed.sim.trace import load_trace
    trace = load_trace(Path(__file__).parent / "data" / "mooncake-head300.jsonl")
    wl = workload(trace, SimConfig(nodes=1, seed=7), requests=1500, sharing=sharing)
    order = np.argsort(wl.time, kind="stable")
    requests = [{"timestamp": int(wl.time[i] * 1000), "input_length": int(wl.input_length[i]),
                 "output_length": 1,
                 "hash_ids": wl.hash_ids[wl.offsets[i]:wl.offsets[i + 1]].tolist()}
                for i in order]
    hit = evaluate(requests, capacity, ["lru", "prefix"])["hit_ratio"]
    assert hit["prefix"] >= hit["lru"] - 0.002, hit


def test_a_cache_with_a_share_admits_only_its_blocks_and_evicts_what_else_was_filled():
    """A split placement (docs/fabric.md): a switch caching share 0 of 2 never admits a block
    of the other share, and a block of it filled speculatively (before the share was set) goes."""
    from switchd.admission import AdmissionLoop, Observation
    from switchd.manager import in_share
    mine, other = (1, bytes(16)), (1, (1).to_bytes(8, "little") + bytes(8))
    assert in_share(mine[1], (0, 2)) and not in_share(other[1], (0, 2))
    loop = AdmissionLoop("lru", 100, keep=lambda b: in_share(b[1], (0, 2)))
    d = loop.step(Observation(1.0, misses={mine: 3, other: 3}, sizes={mine: 1, other: 1}))
    assert d.admit == [mine] and not d.evict
    d = loop.step(Observation(2.0, misses={}, cached={other: (1, True)}))
    assert d.evict == [(other, 1)] and not d.admit
