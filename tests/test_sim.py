"""The cluster model (testbed.sim.model) on tiny hand-made traces with known answers, the sweep's
break-even, the CLI's errors, and one end-to-end validation against the veth testbed."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from testbed.cli import main
from testbed.sim.config import GIB, SimConfig
from testbed.sim.model import simulate
from testbed.sim.tiers import POOL, REPLICA, SWITCH, SwitchModel, che_ttl
from testbed.sim.workload import Workload, route, workload
from testbed.sim.sweep import break_even
from testbed.sim.trace import parse_requests

KIB_TOKEN = 2   # 1024-byte blocks: easy byte arithmetic
TRACE_HEAD = Path(__file__).parent / "data" / "mooncake-head300.jsonl"  # the shared trace's start


def _wl(chains, times, tokens=512):
    offsets = np.zeros(len(chains) + 1, np.int64)
    np.cumsum([len(c) for c in chains], out=offsets[1:])
    return Workload(np.asarray(times, float), np.array([len(c) * tokens for c in chains]),
                    offsets, np.array([h for c in chains for h in c], np.int64))


def _cfg(**kw):
    base = dict(nodes=1, pools=1, kv_bytes_per_token=KIB_TOKEN, hbm_gib=0, dram_gib=0,
                switch_gib=0, chunk_bytes=1024, demote="none", routing="random",
                switch_budget=10**9, interval=1.0)
    base.update(kw)
    return SimConfig(**base)


def test_prefix_reuse_from_the_pool_node():
    # request 2 shares blocks 1,2 with request 1, then needs a new block 9
    r = simulate(_wl([[1, 2, 3], [1, 2, 9]], [0.0, 10.0]), _cfg())
    off = r["pool_off"]
    assert off["hit_ratio"]["pool"] == pytest.approx(2 / 6)
    assert off["hit_ratio"]["recompute"] == pytest.approx(4 / 6)
    # two 1024-byte blocks fetched: 1024 + 90 bytes of frame each
    assert off["bytes"]["switch_to_nodes"] - 4 * 90 == 2 * 1114   # + PUT_ACK headers
    assert off["remote_bytes"] == 2048


def test_prefix_stops_at_the_first_unavailable_block():
    # block 5 was never computed, so block 6 (cached) cannot be used after it
    r = simulate(_wl([[1, 5, 6], [1, 6]], [0.0, 0.0]), _cfg(preload=False))
    r2 = simulate(_wl([[1, 2], [1, 7, 2]], [0.0, 5.0]), _cfg())
    assert r2["pool_off"]["hit_ratio"]["pool"] == pytest.approx(1 / 5)   # 1 yes, 7 no, 2 not used
    assert r["pool_off"]["hit_ratio"]["recompute"] == 1.0               # same instant: none ready


def test_hbm_holds_what_fits_and_demotion_to_dram_saves_remote_bytes():
    # one node; chain of 4 blocks every second, alternating two chains: HBM holds one chain
    a, b = [1, 2, 3, 4], [11, 12, 13, 14]
    chains = [a, b] * 20
    times = np.arange(40.0)
    hbm = 4 * 1024 / GIB
    no = simulate(_wl(chains, times), _cfg(hbm_gib=hbm * 1.5, dram_gib=0))
    assert no["pool_off"]["hit_ratio"]["hbm"] < 0.2        # LRU of 6 blocks cycling over 8
    yes = simulate(_wl(chains, times), _cfg(hbm_gib=hbm * 1.5, dram_gib=hbm, demote="all"))
    hits = yes["pool_off"]["hit_ratio"]
    assert hits["hbm"] + hits["dram"] == pytest.approx(38 * 4 / 160)   # all but first use
    assert yes["demotion"]["remote_bytes_saved"] > 0
    assert yes["pool_off"]["bytes"]["dram_to_hbm"] > 0


def test_che_ttl_matches_occupancy():
    # one block accessed every 10 s for 100 s: with room for it, it is never evicted
    seg = np.zeros(10, np.int64)
    g = np.full(10, 10.0)
    assert che_ttl(seg, g, np.ones(10), 1.0, 1, 100.0)[0] == np.inf
    T = che_ttl(seg, g, np.ones(10), 0.5, 1, 100.0)
    assert T[0] == pytest.approx(5.0)


def test_switch_model_admits_at_a_step_and_fills_on_pass():
    m = SwitchModel("lru", capacity=4, headroom=0, interval=1.0)
    keys = np.array([7, 7, 7, 7])
    times = np.array([0.1, 0.5, 1.5, 1.6])
    out = m.run(keys, times, np.ones(4), np.zeros(4))
    # before the first step nothing is admitted and there is no fill budget: two misses;
    # the step at 1.1 admits 7, the miss at 1.5 fills it, the fetch at 1.6 hits
    assert out.tolist() == [POOL, POOL, POOL, SWITCH]


def test_switch_model_coalesces_concurrent_misses():
    m = SwitchModel("lru", capacity=4, headroom=0, interval=10.0)
    out = m.run(np.array([3, 3, 3]), np.array([0.0, 0.001, 0.5]), np.ones(3),
                np.full(3, 0.01))
    assert out.tolist() == [POOL, REPLICA, POOL]


def test_switch_pool_serves_cross_node_sharing():
    # 4 nodes, the same 2-block chain asked every 0.5 s by random nodes, no node tiers
    chains = [[1, 2]] * 40
    cfg = _cfg(nodes=4, switch_gib=8 * 1024 / GIB, preload=True, switch_policy="lru")
    r = simulate(_wl(chains, np.arange(40) * 0.5), cfg)
    on, off = r["pool_on"], r["pool_off"]
    assert off["hit_ratio"]["pool"] == 1.0
    assert on["hit_ratio"]["switch"] > 0.9
    assert on["bytes"]["pool_to_switch"] < 0.1 * off["bytes"]["pool_to_switch"]
    assert on["bytes"]["switch_to_nodes"] == off["bytes"]["switch_to_nodes"]


def test_routing():
    wl = _wl([[i, i + 100] for i in range(200)], np.arange(200.0))
    aff = route(wl, _cfg(nodes=8, routing="affinity"))
    assert np.array_equal(aff, route(wl, _cfg(nodes=8, routing="affinity")))
    same_head = _wl([[5, i] for i in range(50)], np.arange(50.0))
    assert len(set(route(same_head, _cfg(nodes=8, routing="affinity")).tolist())) == 1
    assert len(set(route(same_head, _cfg(nodes=8, routing="random")).tolist())) > 4
    ll = route(same_head, _cfg(nodes=4, routing="least-loaded"))
    assert sorted(np.bincount(ll, minlength=4).tolist()) == [12, 12, 13, 13]


def test_resampling_keeps_trees_and_sharing():
    trace = parse_requests(enumerate([
        {"timestamp": 0, "input_length": 1024, "output_length": 1, "hash_ids": [1, 2]},
        {"timestamp": 1000, "input_length": 1536, "output_length": 1, "hash_ids": [1, 2, 3]},
        {"timestamp": 2000, "input_length": 512, "output_length": 1, "hash_ids": [4]}], 1))
    cfg = _cfg(nodes=2)
    private = workload(trace, cfg, requests=300, sharing=0.0)
    shared = workload(trace, cfg, requests=300, sharing=1.0)
    assert private.n == shared.n == 300
    assert len(np.unique(shared.hash_ids)) == 4
    assert len(np.unique(private.hash_ids)) > 100
    assert np.all(np.diff(private.time) >= 0)


def test_break_even_interpolates():
    assert break_even([4, 16, 64], [-1.0, -0.5, 0.5]) == pytest.approx(32.0)
    assert break_even([4, 16], [-1.0, -0.5]) is None
    assert break_even([4, 16], [1.0, 2.0]) == 4.0


def test_config_and_cli_errors():
    with pytest.raises(ValueError, match="routing"):
        SimConfig(routing="nearest")
    with pytest.raises(ValueError, match="block tokens"):
        SimConfig(block_tokens=100)
    r = CliRunner().invoke(main, ["sim", "run", "--trace", str(TRACE_HEAD),
                                  "--routing", "nearest"])
    assert r.exit_code == 2 and "nearest" in r.output
    r = CliRunner().invoke(main, ["sim", "sweep", "--trace", str(TRACE_HEAD),
                                  "--sharing", "0,2"])
    assert r.exit_code == 2 and "sharing" in r.output


def test_cli_run_writes_json(tmp_path):
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(json.dumps({"timestamp": i * 100, "input_length": 1024,
                                         "output_length": 1, "hash_ids": [1, 2 + i]}) + "\n"
                             for i in range(20)))
    out = tmp_path / "r.json"
    r = CliRunner().invoke(main, ["sim", "run", "--trace", str(trace), "--nodes", "4",
                                  "--routing", "random", "--json", str(out)])
    assert r.exit_code == 0, r.output
    res = json.loads(out.read_text())
    for mode in ("pool_on", "pool_off"):
        assert set(res[mode]["hit_ratio"]) >= {"hbm", "dram", "switch", "pool", "recompute"}
        assert {"p50", "p99"} <= set(res[mode]["ttft_s"])
        assert "incast" in res[mode] and "bytes" in res[mode]


@pytest.mark.e2e
def test_validate_on_the_testbed(tmp_path):
    from testbed.sim.validate import run_validate
    out = run_validate(str(TRACE_HEAD), limit=300,
                       capacity=0.05, speedup=30.0, json_path=str(tmp_path / "v.json"),
                       log=lambda m: None)
    c = out["comparison"]
    assert out["live"]["byte_exact"]
    assert abs(c["switch_hit_ratio"]["difference_pp"]) <= 6
    for link in ("nodes_to_switch", "switch_to_nodes", "pool_to_switch", "switch_to_pool"):
        assert abs(c["bytes_per_link"][link]["error"]) <= 0.2
