"""The model on a fabric of switches (issue 43), pure Python: the serve-level fabric model
(testbed.sim.fabric_serve_model) on bench serve's own workloads, shrunk; the comparison with a
`bench serve --racks` result (testbed.bench.validate.validate_fabric) on a synthetic one; the
cluster-scale sweep (testbed.sim.fabric_sweep) on the trace's head; the commands' one-line
errors."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from testbed.bench.serve.serve_workloads import burst_workload, zipf_workload
from testbed.cli import main
from testbed.lab.topology import TestbedError as FabricError
from testbed.sim.config import FRAME_OVERHEAD
from testbed.sim.fabric_serve_model import (FABRIC_MODES, check_shape, measure_start,
                                            simulate_fabric)
from testbed.sim.serve_model import Calibration, summarise
from testbed.sim.tiers import POOL, REPLICA
from testbed.bench.validate.validate_fabric import compare_fabric, pool_addrs

CAL = Calibration(link_bytes_per_s=1e6, rtt_s=0.002, chunk=1000, block_bytes=3000)
WIRE = 3 * (1000 + FRAME_OVERHEAD)
PREFIX = 4
TRACE_HEAD = Path(__file__).parent / "data" / "mooncake-head300.jsonl"


def _burst(hosts: int):
    """bench serve's burst: one node computes a 4-block prefix, then every node asks for it
    at nearly the same instant (no tail)."""
    return burst_workload(hosts, 10_000, prefix_blocks=PREFIX, burst_per_node=1, window=0.02,
                          tail_s=0.0)


def _run(wl, mode, racks, hosts, pools=1, **kw):
    return simulate_fabric(wl.requests, wl.preload, mode, pool_addrs(pools), 40, CAL, 10_000,
                           racks, hosts, cache_blocks=100, **kw)


def test_one_rack_the_uplink_carries_a_burst_prefix_once_with_a_rack_switch():
    wl = _burst(4)
    runs = {m: _run(wl, m, 1, 4) for m in FABRIC_MODES}
    prefix = PREFIX * WIRE
    # measured after the warm-up (the first node computing and writing the prefix)
    assert runs["fabric"]["measure_from_s"] == pytest.approx(measure_start(wl.requests))
    assert runs["fabric"]["uplink_bytes"] == [prefix]          # the rack switch holds the rest
    assert runs["rack"]["uplink_bytes"] == [prefix]
    assert runs["bridge"]["uplink_bytes"] == [4 * prefix]      # once per host
    assert runs["pool-side"]["uplink_bytes"] == [4 * prefix]   # the agg switch is above it
    assert sum(runs["bridge"]["pool_egress_bytes"]) == 4 * prefix
    for m in ("rack", "pool-side", "fabric"):                   # coalesced once at some level
        assert sum(runs[m]["pool_egress_bytes"]) == prefix
    # the rack's other hosts trail the first one's fetch and hit what their switch learned
    assert runs["fabric"]["hit_ratio"] == {"rack": 0.75, "pool-side": 0.0}
    assert runs["pool-side"]["hit_ratio"] == {"rack": None, "pool-side": 0.75}
    assert runs["bridge"]["hit_ratio"] == {"rack": None, "pool-side": None}
    # coalescing shortens the burst: four hosts' replies no longer share the pool's link
    ttft = {m: summarise(r["requests"])["ttft_p50_s"] for m, r in runs.items()}
    assert ttft["fabric"] < ttft["bridge"] and ttft["rack"] < ttft["bridge"]


def test_two_racks_each_uplink_once_and_the_pool_once_only_with_the_agg_switch():
    wl = _burst(4)
    runs = {m: _run(wl, m, 2, 2) for m in FABRIC_MODES}
    prefix = PREFIX * WIRE
    assert runs["rack"]["uplink_bytes"] == [prefix, prefix]
    assert sum(runs["rack"]["pool_egress_bytes"]) == 2 * prefix       # once per rack
    assert sum(runs["fabric"]["pool_egress_bytes"]) == prefix         # the racks' coalesced
    assert runs["fabric"]["uplink_bytes"] == [prefix, prefix]
    assert runs["bridge"]["uplink_bytes"] == [2 * prefix, 2 * prefix]
    # the second rack's miss is a hit at the agg switch (it trails the first rack's)
    assert runs["fabric"]["hit_ratio"]["pool-side"] == 0.5


def test_split_placement_each_level_caches_and_holds_only_its_share_of_the_keys():
    from switchd.manager import in_share
    wl = _burst(4)
    keys = [bytes.fromhex(k) for k in wl.requests[1][0]["keys"]]
    racks_half = sum(in_share(k, (0, 2)) for k in keys)
    assert 0 < racks_half < PREFIX                     # the prefix has blocks of both shares
    other = PREFIX - racks_half
    rack = _run(wl, "rack", 1, 4, placement="split")
    # the rack switch learns and holds its half; the other half each host fetches itself
    assert rack["uplink_bytes"] == [(racks_half + 4 * other) * WIRE]
    agg = _run(wl, "pool-side", 1, 4, placement="split")
    # the agg switch's half leaves the pool once, and again at most once more: the chunks a
    # same-rack follower asked before its leader's reply passed (the agg switch holds one GET
    # per port; here a follower asked its whole prefix 0.3 ms after the leader, all of it
    # ahead), the other half per host
    assert (other + 4 * racks_half) * WIRE <= sum(agg["pool_egress_bytes"]) \
        <= (2 * other + 4 * racks_half) * WIRE
    both = _run(wl, "fabric", 1, 4, placement="split")
    assert sum(both["pool_egress_bytes"]) == PREFIX * WIRE     # every block leaves it once
    assert both["placement"] == "split"
    with pytest.raises(FabricError, match="placement 'spread': choose from independent, split"):
        _run(wl, "rack", 1, 4, placement="spread")


@pytest.mark.parametrize("mode", FABRIC_MODES)
def test_hit_ratios_are_ratios_and_every_request_is_served(mode):
    pools = [(a, 7000) for a in pool_addrs(2)]
    wl = zipf_workload(4, pools, 41, objects=8, hot=2, seconds=1.5)
    r = simulate_fabric(wl.requests, wl.preload, mode, pool_addrs(2), 41, CAL, 10_000, 2, 2,
                        oversub=1.0, cache_blocks=100)
    assert len(r["requests"]) == wl.n_requests
    for level, h in r["hit_ratio"].items():
        running = mode in ({"rack": ("rack", "fabric"),
                            "pool-side": ("pool-side", "fabric")}[level])
        assert (h is None) == (not running)
        assert h is None or 0.0 <= h <= 1.0
    assert sum(r["served_share"].values()) == pytest.approx(1.0, abs=1e-3)
    assert min(r["uplink_bytes"]) > 0 and len(r["pool_egress_bytes"]) == 2


@pytest.mark.parametrize("shape, message", [
    ((0, 4, 2.0), "--racks must be at least 1, got 0"),
    ((2, 0, 2.0), "--hosts-per-rack must be at least 1, got 0"),
    ((2, 4, 0.0), "--oversub must be > 0 (hosts' total : uplink), got 0"),
    ((2, 4, -1.0), "--oversub must be > 0"),
])
def test_a_fabric_the_model_cannot_have_is_one_clear_error(shape, message):
    with pytest.raises(FabricError, match=message.replace("(", r"\(").replace(")", r"\)")):
        check_shape(*shape)
    with pytest.raises(FabricError, match="--racks must be at least 1"):
        simulate_fabric([[]], [], "fabric", pool_addrs(1), 40, CAL, 10_000, 0, 1)
    with pytest.raises(FabricError, match="mode 'spine': choose from"):
        simulate_fabric([[]], [], "spine", pool_addrs(1), 40, CAL, 10_000, 1, 1)


@pytest.mark.parametrize("args, message", [
    (["sim", "validate", "--serve", "--racks", "0"], "--racks must be at least 1, got 0"),
    (["sim", "validate", "--serve", "--racks", "2", "--oversub", "0"], "--oversub must be > 0"),
    (["sim", "validate", "--racks", "2"], "--racks and --live-json go with --serve"),
    (["sim", "fabric", "--racks", "0"], "--racks must be at least 1, got 0"),
    (["sim", "fabric", "--racks", "2", "--oversub", "2,0"], "--oversub must be > 0"),
    (["sim", "fabric", "--hosts-per-rack", "many"], "give a comma-separated list of numbers"),
])
def test_commands_refuse_a_bad_fabric_in_one_line(tmp_path, args, message):
    r = CliRunner().invoke(main, [*args, "--json", str(tmp_path / "out.json")])
    assert r.exit_code != 0
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], r.stderr
    assert not (tmp_path / "out.json").exists()


# ---- the comparison with a `bench serve --racks` result -----------------------------------------
def _live(rows) -> dict:
    return {"config": {"racks": 1, "hosts_per_rack": 2, "pools": 1, "oversub": 2.0,
                       "link_gbit": 0.008, "pool_link_gbit": 0.008, "chunk_bytes": 3072,
                       "block_bytes": 3 * 3072, "scale": 0.1, "preset": "llama3-8b"},
            "results": rows}


def _row(mode, p50, rack=None, agg=None) -> dict:
    return {"workload": "zipf", "mode": mode, "ttft_p50_s": p50, "ttft_p99_s": 2 * p50,
            "hit_ratio": {"rack": rack, "pool-side": agg}, "uplink_bytes": [1],
            "pool_egress_bytes": [1], "byte_exact": True}


def test_the_comparison_is_built_from_a_live_result_without_a_testbed():
    cal = {m: {"rtt_s": 0.002, "wake_s": 0.0} for m in ("rack", "fabric")}
    incast = {"workload": "incast", "mode": "fabric", "completion_p50_s": 1.0}
    first = compare_fabric(_live([_row("rack", 0.1, 0.5), _row("fabric", 0.1, 0.5, 0.2),
                                  incast]), cal)
    model = {r["mode"]: r for r in first["rows"]}
    assert set(model) == {"rack", "fabric"}                      # incast is not modelled
    f = model["fabric"]
    assert set(f["hit_ratio"]) == {"rack", "pool-side"}
    assert 0.0 <= f["hit_ratio"]["pool-side"]["model"] <= 1.0     # one rack: its misses, once
    none = {"live": None, "model": None, "difference_pp": None, "bound_pp": None, "agrees": None}
    assert model["rack"]["hit_ratio"]["pool-side"] == none
    # a live result equal to the model's figures is within the targets; a hit ratio 30 % off
    # is not (the bound is relative: 20 % of the measured ratio, 1 pp at least)
    m = lambda r, lv: r["hit_ratio"][lv]["model"]                      # noqa: E731
    same = [_row(x["mode"], x["ttft_p50_s"]["model"], m(x, "rack"), m(x, "pool-side"))
            for x in first["rows"]]
    out = compare_fabric(_live(same), cal)
    assert all(out["within_targets"].values()), out["within_targets"]
    assert all(r["ttft_p50_s"]["error"] == 0.0 for r in out["rows"])
    rack = m(first["rows"][1], "rack")
    near, far = rack / 0.9, max(rack / 0.7, rack + 0.02)      # model 10 % / 30 % under live
    for live_rack, agrees in ((near, True), (far, False)):
        off = [dict(same[1], hit_ratio={"rack": live_rack,
                                        "pool-side": m(first["rows"][1], "pool-side")})]
        (r,) = compare_fabric(_live(off), cal)["rows"]
        assert r["hit_ratio"]["rack"]["difference_pp"] == pytest.approx(
            100 * (rack - live_rack), abs=0.01)
        assert r["ttft_p50_within_target"] and r["hit_ratio_within_target"] is agrees
    json.dumps(out)                                                       # JSON as it is
    assert out["calibration_source"] == "given"
    with pytest.raises(FabricError, match="no calibration for mode 'rack'"):
        compare_fabric(_live(same), {"fabric": cal["fabric"]})


def test_a_result_file_without_constants_takes_the_serve_validations(tmp_path):
    from testbed.bench.validate.validate_fabric import compare_file
    path = tmp_path / "live.json"
    path.write_text(json.dumps(_live([_row("bridge", 0.1), _row("pool-side", 0.1, agg=0.5)])))
    out = compare_file(str(path))
    assert "sim-validate-serve.json" in out["calibration_source"]
    assert out["calibration"]["bridge"] != out["calibration"]["pool-side"]
    # a validation's own result compares again from its live part and constants
    path.write_text(json.dumps({**out, "live": _live(
        [_row("pool-side", 0.1, agg=0.5)]), "calibration": {"pool-side": {"rtt_s": 0.001}}}))
    again = compare_file(str(path))
    assert again["calibration_source"] == "the live result's"
    path.write_text("{}")
    with pytest.raises(FabricError, match="not a `bench serve --racks` result"):
        compare_file(str(path))


def test_validate_calibrates_each_mode_runs_the_bench_then_the_model(tmp_path, monkeypatch):
    # the orchestration alone: no testbed (the fabric, the probe and the bench are stand-ins)
    import testbed.bench.serve.serve_fabric as bench
    import testbed.bench.validate.validate_serve as vs
    from testbed.bench.validate.validate_fabric import run_validate_fabric
    built = []

    class Lab:
        def __init__(self, prefix, racks, hosts, pools, oversub, switches, **kw):
            built.append((racks, hosts, tuple(switches), kw["link_gbit"],
                          kw["cache_entries"], sorted(kw["box_args"])))

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            pass

    def run_fabric(racks, hosts, pools, oversub, link_gbit, pool_link_gbit, workloads, modes,
                   model, scale, **kw):
        out = _live([_row(m, 0.1, 0.5 if m == "rack" else None) for m in modes])
        out["config"].update(placement=kw["placement"], cache_entries=kw["cache_entries"])
        return {**out, "summary": {"all_byte_exact": True}}
    monkeypatch.setattr(bench, "FabricLab", Lab)           # as serve_fabric.fabric_lab builds it
    monkeypatch.setattr(vs, "calibrate", lambda lab, bb, chunk, gbit: Calibration(
        gbit * 1e9 / 8, 0.002, chunk, bb, source={"probed_rate_vs_configured": 1.0}))
    monkeypatch.setattr(bench, "run_fabric", run_fabric)
    out = run_validate_fabric(1, 2, 1, 2.0, 0.008, workloads=("zipf",),
                              modes=("bridge", "rack"), json_path=str(tmp_path / "v.json"),
                              log=lambda m: None, placement="split", cache_entries=640)
    split = ["agg", "r1"]                          # each switch's --cache-share
    assert built == [(1, 2, (), 0.008, 640, split), (1, 2, ("r1",), 0.008, 640, split)]
    assert out["config"]["switch"]["placement"] == "split"
    assert out["config"]["switch"]["cache_entries"] == 640
    assert out["completed"] and [r["mode"] for r in out["rows"]] == ["bridge", "rack"]
    assert out["calibration"]["rack"]["rtt_s"] == 0.002
    assert json.loads((tmp_path / "v.json").read_text())["live"]["results"]
    with pytest.raises(FabricError, match="workload 'incast': the model replays"):
        run_validate_fabric(1, 2, workloads=("incast",), log=lambda m: None)


# ---- the cluster-scale sweep ------------------------------------------------------------------
def test_unheld_at_agg_makes_a_same_rack_follower_a_miss():
    from testbed.sim.fabric_sweep import unheld_at_agg
    out = np.array([POOL, REPLICA, REPLICA, POOL], np.int8)
    got = unheld_at_agg(np.array([1, 1, 1, 2]), np.array([0, 0, 1, 0]), out)
    assert got.tolist() == [POOL, POOL, REPLICA, POOL]


def test_fabric_sweep_second_level_saves_pool_egress_not_uplink_bytes(tmp_path):
    from testbed.sim.fabric_sweep import run_fabric_sweep
    out = run_fabric_sweep(str(TRACE_HEAD), racks=(2, 4), hosts_per_rack=(4,),
                           oversub=(1.0, 4.0), sharing=(0.9,), requests_per_node=12,
                           json_path=str(tmp_path / "f.json"), plot_path=str(tmp_path / "f.png"),
                           log=lambda m: None, xdp_ns_per_frame=300.0, pools=2)
    assert (tmp_path / "f.png").stat().st_size > 0
    assert json.loads((tmp_path / "f.json").read_text())["answer"]["racks"] == 4
    for p in out["points"]:
        md, g = p["modes"], p["second_level"]
        for m in FABRIC_MODES:
            for h in md[m]["hit_ratio"].values():
                assert h is None or 0.0 <= h <= 1.0
        assert g["uplink_saved"] == 0.0 and g["boxes"] == 1       # agg hits cross the uplink
        assert md["fabric"]["pool_egress_bytes_per_s"] <= md["rack"]["pool_egress_bytes_per_s"]
        assert md["rack"]["uplink_bytes_per_s"] <= md["bridge"]["uplink_bytes_per_s"]
        assert md["bridge"]["boxes"] == 0 and md["fabric"]["boxes"] == p["racks"] + 1
        assert md["fabric"]["xdp_cores"] == pytest.approx(md["rack"]["xdp_cores"]
                                                          + g["xdp_cores"], abs=1e-2)
    # oversubscription moves only the timing
    a, b = [p for p in out["points"] if p["racks"] == 4]
    assert a["modes"]["fabric"]["pool_egress_bytes_per_s"] == \
        b["modes"]["fabric"]["pool_egress_bytes_per_s"]
    assert b["modes"]["bridge"]["peak_uplink_utilisation"] == pytest.approx(
        4 * a["modes"]["bridge"]["peak_uplink_utilisation"], rel=1e-3)
    assert {c["hosts_per_rack"] for c in out["break_even"]} == {4}
