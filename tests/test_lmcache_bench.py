"""`testbed bench lmcache`: its bad options (one line, a non-zero exit, before any testbed), the
phases it plans, and a tiny run of every store side by side on a live testbed (2 nodes, one
256-token chunk): every retrieve byte-exact, the switch sends the hot prefix out of the
storage node once where every other store sends it once per node, nothing left behind."""
import json
import shutil
import subprocess
import sys

import pytest

from conftest import leaves_no_namespaces, need_mooncake
from testbed.bench.stores.lmcache_bench import HOT, WARM, ZIPF, LmcacheBench

TESTBED = [sys.executable, "-m", "testbed"]


@pytest.mark.parametrize("args, said", [
    (["--stores", "redis,tape"], "unknown store 'tape': choose from kvswitch-switch"),
    (["--workloads", "incast,storm"], "unknown workload 'storm'"),
    (["--nodes", "0"], "'--nodes': 0 is not in the range 1<=x<=64"),
    (["--link-gbit", "0"], "'--link-gbit': 0.0 is not in the range x>0"),
    (["--hot-tokens", "-1"], "'--hot-tokens': -1 is not in the range x>=1"),
    (["--timeout-s", "0"], "'--timeout-s': 0 is not in the range x>=1"),
])
def test_bad_options_are_one_line_before_any_testbed(args, said):
    r = subprocess.run(TESTBED + ["bench", "lmcache", "--json", "", *args],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and said in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_the_phases_warm_up_then_incast_rounds_then_zipf():
    cfg = LmcacheBench(nodes=3, incast_rounds=2, zipf_prefixes=4, zipf_requests=5)
    phases = cfg.shaped_phases()
    assert [w for w, _ in phases] == ["store", "warm-up", "incast", "incast", "zipf"]
    stored = {pid for pid, _ in phases[0][1]["prefixes"]}
    assert stored == {WARM, HOT, HOT + 1, *range(ZIPF, ZIPF + 4)}
    for _, p in phases[1:]:
        assert p["nodes"] == [0, 1, 2] and set(p["plan"]) == {"0", "1", "2"}
    assert all(p["plan"]["1"] == [[HOT + r, 1024, 0.0]] for r, (_, p) in
               enumerate(phases[2:4]))
    zipf = [item for items in phases[4][1]["plan"].values() for item in items]
    assert len(zipf) == 15 and {pid for pid, *_ in zipf} <= set(range(ZIPF, ZIPF + 4))
    assert [w for w, _ in cfg.single_phases()] == ["store", "warm-up", "single"]
    firsts, seconds = (cfg.single_phases(t)[-1][1]["plan"]["0"] for t in (0, 1))
    assert not {pid for pid, *_ in firsts} & {pid for pid, *_ in seconds}, \
        "each turn retrieves prefixes of its own"


def test_lmcache_queue_workers_survive_callers_that_give_up(monkeypatch):
    """LMCache's AsyncPQExecutor (its Redis connector's job queue) loses a worker to each job
    whose caller timed out; after four every lookup waits forever, which hung Redis in the
    benchmark. The nodes' fix keeps all four and the queue running."""
    import asyncio
    import threading
    from lmcache.v1.storage_backend.job_executor.pq_executor import AsyncPQExecutor
    from testbed.bench.stores.lmcache_node import fix_lmcache_executor
    # the fix patches LMCache's class; LMCache's own code comes back for the other tests
    monkeypatch.setattr(AsyncPQExecutor, "submit_job", AsyncPQExecutor.submit_job)
    fix_lmcache_executor()
    loop = asyncio.new_event_loop()
    ex = AsyncPQExecutor(loop)

    async def slow(x):
        await asyncio.sleep(0.1)
        return x

    async def callers():
        for i in range(6):                 # each gives up before its job ends
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(ex.submit_job(slow, i, priority=1), 0.01)
        await asyncio.sleep(0.3)
        return sum(not w.done() for w in ex._workers), \
            await asyncio.wait_for(ex.submit_job(slow, 99), 5)
    runner = threading.Thread(target=loop.run_forever, daemon=True)
    runner.start()
    try:
        assert asyncio.run_coroutine_threadsafe(callers(), loop).result(10) == (4, 99)
    finally:
        ex.shutdown(wait=True)             # its workers end before their loop does
        loop.call_soon_threadsafe(loop.stop)
        runner.join(5)
        loop.close()


def test_the_lone_retrievers_turns_rotate_so_each_store_goes_first_in_turn():
    from testbed.bench.stores.lmcache_bench import turn_order
    stores = ["a", "b", "c"]
    orders = [turn_order(stores, t) for t in range(4)]
    assert orders == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"], ["a", "b", "c"]]


@pytest.mark.e2e
@pytest.mark.timeout(900)
def test_a_tiny_run_of_every_store_side_by_side(tmp_path):
    """Every store through LMCache's own connector on one testbed (incast, zipf) and the
    lone retriever on an unshaped one, byte-exact; the hot prefix leaves the storage node once
    through the switch and once per node over the bridge and from every peer."""
    need_mooncake()
    assert shutil.which("redis-server"), "redis-server is missing: run `make setup` " \
                                         "(apt-get install redis-server)"
    out_path = tmp_path / "lmcache.json"
    prefixes = ("lbt", "lbtm", "lbtu", "lbtmu")
    with leaves_no_namespaces(prefixes[0]), leaves_no_namespaces(prefixes[1]), \
            leaves_no_namespaces(prefixes[2]), leaves_no_namespaces(prefixes[3]):
        r = subprocess.run(TESTBED + [
            "bench", "lmcache", "--nodes", "2", "--link-gbit", "0.5", "--hot-tokens", "256",
            "--incast-rounds", "1", "--zipf-prefixes", "2", "--zipf-requests", "2",
            "--single-prefixes", "1", "--single-rounds", "1", "--json", str(out_path),
            "--prefix", "lbt"],
            capture_output=True, text=True, timeout=880)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(out_path.read_text())
    assert out_path.with_suffix(".png").stat().st_size > 0
    got = {(row["store"], row["workload"]): row for row in out["results"]}
    stores = ("kvswitch-switch", "kvswitch-bridge", "lmcache-server", "redis", "mooncake")
    assert set(got) == {(s, w) for s in stores for w in ("incast", "zipf", "single")}
    assert all(row["byte_exact"] and row["retrieves"] > 0 for row in got.values())
    hot = out["config"]["hot_prefix_bytes"]
    # through the switch the hot prefix leaves p1 once; everywhere else once per node
    assert got["kvswitch-switch", "incast"]["storage_egress_bytes"] < 1.2 * hot
    for s in stores[1:]:
        assert got[s, "incast"]["storage_egress_bytes"] > 1.8 * hot, (s, got[s, "incast"])
    assert got["kvswitch-switch", "incast"]["switch_hit_ratio"] is not None
    assert out["summary"]["byte_exact"]
    # the lone retriever: every store one turn here (turn_order rotates them over more);
    # medians and per-turn ratios
    turns = {}
    for row in out["results"]:
        if row["workload"] == "single":
            turns.setdefault(row["store"], []).append(row["turn"])
    assert turns == {st: [0] for st in stores}, turns
    lone = out["summary"]["single"]
    assert set(lone["gbytes_per_s"]) == set(stores)
    assert set(lone["kvswitch_switch_over"]) == set(stores[1:])
