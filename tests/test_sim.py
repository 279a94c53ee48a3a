"""The cluster model (testbed.sim.model) on tiny hand-made traces with known answers, the sweep's
break-even, the CLI's errors, and one end-to-end validation against the veth testbed."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from testbed.cli import main
from testbed.sim.config import GIB, SimConfig, SimError, xdp_frame_cost
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


def test_sampled_switch_leaves_the_pool_figures_exact():
    # a switch with no room hits nothing: sampled or not, the pool links carry what they carry
    # with the pool off (the pool-side figures are the exact ones minus what the switch served)
    rng = np.random.default_rng(3)
    chains = [[int(h), int(h) + 1000] for h in rng.integers(0, 40, 400)]
    wl = _wl(chains, np.sort(rng.uniform(0, 40, 400)))
    for budget in (10**9, 200):
        r = simulate(wl, _cfg(nodes=8, pools=2, preload=True, switch_budget=budget,
                              pool_gbps=2e-4, coalesce=False))
        on, off = r["pool_on"], r["pool_off"]
        assert (on["switch"]["sample_rate"] < 0.5) == (budget == 200)
        assert on["hit_ratio"]["switch"] == 0 and on["hit_ratio"]["pool"] == 1.0
        assert on["pool_link"] == off["pool_link"] and on["bytes"] == off["bytes"]
        assert 0.2 < off["pool_link"]["mean_utilisation"] < 1
        # what is left is the switch's hop on every fetch (5 us)
        assert on["gpu_s_total"] == pytest.approx(off["gpu_s_total"], abs=800 * 5e-6 + 0.01)


def test_data_plane_cpu_is_read_from_the_throughput_result(tmp_path):
    res = tmp_path / "throughput.json"
    res.write_text(json.dumps({"results": [{"chunk_bytes": 1024, "switch_hit_pps": 4_000_000},
                                           {"chunk_bytes": 3072, "switch_hit_pps": 2_500_000}]}))
    x = xdp_frame_cost(SimConfig(throughput_json=str(res), chunk_bytes=2048))
    assert x["ns_per_frame"] == 400.0 and x["measured_chunk_bytes"] == 3072   # nearest, ties up
    x = xdp_frame_cost(SimConfig(throughput_json=str(res), chunk_bytes=1024))
    assert x["ns_per_frame"] == 250.0 and x["measured_chunk_bytes"] == 1024
    assert xdp_frame_cost(SimConfig(xdp_ns_per_frame=99.0))["ns_per_frame"] == 99.0
    with pytest.raises(SimError, match="testbed bench throughput"):
        xdp_frame_cost(SimConfig(throughput_json=str(tmp_path / "missing.json")))
    r = CliRunner().invoke(main, ["sim", "run", "--trace", str(TRACE_HEAD), "--throughput-json",
                                  str(tmp_path / "missing.json")])
    assert r.exit_code == 2 and "missing.json" in r.output
    # the cost charged: a hit is one run of the program, a fetch through it two
    r = simulate(_wl([[1, 2]] * 40, np.arange(40) * 0.5),
                 _cfg(nodes=4, switch_gib=8 * 1024 / GIB, preload=True, switch_policy="lru",
                      throughput_json=str(res)))
    on, b = r["pool_on"], r["switch_benefit"]
    hits = on["hit_ratio"]["switch"] * 80
    assert on["switch"]["frames_per_s"] == pytest.approx((hits + 2 * (80 - hits)) / 19.5, abs=0.05)
    assert b["xdp_cores"] == pytest.approx(on["switch"]["frames_per_s"] * 250e-9, abs=1e-3)


def test_run_and_sweep_compute_the_same_point(tmp_path):
    # a small workload with reuse and a switch with room: with the pool on, the switch serves
    # part of it; `sim run` and the sweep's point for the same flags give the same figures
    run_json, sweep_json = tmp_path / "run.json", tmp_path / "sweep.json"
    flags = ["--trace", str(TRACE_HEAD), "--nodes", "4", "--switch-gib", "64", "--sharing", "0.5"]
    r = CliRunner().invoke(main, ["sim", "run", *flags, "--json", str(run_json)])
    assert r.exit_code == 0, r.output
    run = json.loads(run_json.read_text())
    on, off = run["pool_on"], run["pool_off"]
    assert on["hit_ratio"]["switch"] > 0.01
    assert on["bytes"]["pool_to_switch"] < off["bytes"]["pool_to_switch"]
    assert on["gpu_s_total"] != off["gpu_s_total"]
    r = CliRunner().invoke(main, ["sim", "sweep", *flags, "--skew-cases", "",
                                  "--json", str(sweep_json)])
    assert r.exit_code == 0, r.output
    assert sweep_json.with_suffix(".png").stat().st_size > 0    # the plot beside the JSON
    (pt,) = json.loads(sweep_json.read_text())["points"]
    b = run["switch_benefit"]
    assert pt["switch_hit_ratio"] == pytest.approx(
        on["hit_ratio"]["switch"] + on["hit_ratio"]["switch_replica"], rel=0.01)
    for k in ("gpu_s_saved_per_hour", "net_usd_per_hour", "cost_usd_per_hour"):
        assert pt[k] == pytest.approx(b[k], rel=0.01)
    assert (pt["ttft_p50_on"], pt["ttft_p99_on"]) == (on["ttft_s"]["p50"], on["ttft_s"]["p99"])
    assert {k: v for k, v in pt.items() if k != "wall_seconds"} == \
        {k: v for k, v in run["point"].items() if k != "wall_seconds"}


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
    # requests arrive at the cluster's rate from start to end, even when the run is no longer
    # than a tree (here 2 s): trees are cut at the run's edges, not the run stretched by them
    busy = workload(trace, _cfg(nodes=400), requests=6000, sharing=0.0)
    span = 6000 / (400 * 0.7 * 10_000 / trace.input_length.mean())
    assert busy.time[-1] == pytest.approx(span, rel=0.05)
    halves = np.histogram(busy.time, bins=2, range=(0, span))[0]
    assert halves.min() > 0.9 * halves.max()


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
    from testbed.bench.validate.validate import run_validate
    out = run_validate(str(TRACE_HEAD), limit=300,
                       capacity=0.05, speedup=30.0, json_path=str(tmp_path / "v.json"),
                       log=lambda m: None)
    c = out["comparison"]
    assert out["live"]["byte_exact"]
    assert abs(c["switch_hit_ratio"]["difference_pp"]) <= 6
    for link in ("nodes_to_switch", "switch_to_nodes", "pool_to_switch", "switch_to_pool"):
        assert abs(c["bytes_per_link"][link]["error"]) <= 0.2
