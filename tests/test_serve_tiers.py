"""`testbed bench serve --tiers` (#29): the workload and capacities (pure), the simulator's
tier replay with the shared policy (pure), a tiny live run (2 inference nodes, 1 pool node, a
few requests: every mode ran, every block byte-exact, the issue's JSON schema) and one clear
line for bad input."""
import json
import os
import subprocess

import pytest

from conftest import leaves_no_namespaces
from hostagent.common.tier_policy import PolicyConfig
from testbed.bench.serve.serve import block_bytes_for
from testbed.bench.serve.serve_tiers import (fill_workload, plan, run_tiers, scaled_costs, simulate)
from testbed.lab.topology import python_argv

ROW_KEYS = {"demote", "write_down", "hit_ratio", "hit_ratio_unbounded", "pool_write_bytes",
            "ttft_p50_s", "tier_hits", "sim_tier_hits", "byte_exact"}
TIERS = {"node", "switch", "pool", "disk"}
POOLS = ["198.18.0.101"]


def test_fill_workload_shares_documents_and_gives_each_request_its_own_tail():
    wl = fill_workload(3, docs=8, doc_blocks=3, own_blocks=2, seconds=10)
    reqs = [q for r in wl.requests for q in r]
    assert len(reqs) == wl.n_requests > 10
    assert all(len(q["keys"]) == 5 for q in reqs)
    tails = [k for q in reqs for k in q["keys"][3:]]
    assert len(set(tails)) == len(tails)                     # never reused
    heads = {tuple(q["keys"][:3]) for q in reqs}
    assert len(heads) <= 8 and len(heads) < len(reqs)       # documents are
    cap = plan(wl, 3, 1, block_bytes_for(0.025), 2.0, None, None)
    assert cap["pool_blocks"] == cap["distinct_blocks"] // 2


def sim(demote, write_down, unbounded=False, nodes=3):
    wl = fill_workload(nodes, seconds=20)
    bb = block_bytes_for(0.025)
    cap = plan(wl, nodes, 1, bb, 2.0, None, None)
    cfg = PolicyConfig(demote=demote, write_down=write_down, costs=scaled_costs(0.025))
    return simulate(wl, cap, nodes, POOLS, cfg, bb, unbounded, 0.005, 10_000)


def test_sim_replay_disk_keeps_what_dram_evicts_and_selective_writes_less():
    none, every = sim("none", "all"), sim("all", "all")
    ref = sim("all", "all", unbounded=True)
    assert none["dropped_from_pool"] > 0 and none["tier_hits"]["disk"] == 0
    assert every["demoted_to_disk"] > 0 and every["tier_hits"]["disk"] > 0
    assert every["hit_ratio"] == pytest.approx(ref["hit_ratio"], abs=0.005)
    assert none["hit_ratio"] < every["hit_ratio"]
    sel = sim("value", "selective")
    assert sel["pool_write_bytes"] < 0.5 * sim("value", "all")["pool_write_bytes"]
    for s in (none, every, sel):
        assert set(s["tier_hits"]) == TIERS
        assert sum(s["tier_hits"].values()) == pytest.approx(s["hit_ratio"], abs=1e-3)


@pytest.mark.e2e
@pytest.mark.timeout(600)     # 12 runs (6 modes, each with its unbounded reference) on a box
def test_tiny_tiers_run_every_mode_byte_exact(tmp_path):    # shared with other work
    prefix = f"t{os.getpid() % 100000}"
    with leaves_no_namespaces(prefix):
        out = run_tiers(nodes=2, pools=1, link_gbit=0.025, scale=0.1,
                        json_path=str(tmp_path / "tiers.json"),
                        plot_path=str(tmp_path / "tiers.png"), prefix=prefix)
    rows = out["results"]
    assert {(r["demote"], r["write_down"]) for r in rows} == {
        (d, w) for d in ("none", "all", "value") for w in ("all", "selective")}
    assert len(out["reference"]) == len(rows)
    for r in rows + out["reference"]:
        assert ROW_KEYS - {"hit_ratio_unbounded"} <= set(r), r
        assert r["byte_exact"] and r["requests"] > 0 and r["fetch_errors"] == 0, r
        assert set(r["tier_hits"]) == set(r["sim_tier_hits"]) == TIERS
        assert r["write_errors"] == 0
    assert all(ROW_KEYS <= set(r) for r in rows)
    assert any(r["tier_hits"]["node"] > 0 for r in rows)
    saved = json.loads((tmp_path / "tiers.json").read_text())
    assert saved["results"] == rows and saved["config"]["pools"] == 1
    assert (tmp_path / "tiers.png").stat().st_size > 0


@pytest.mark.parametrize("args, message", [
    (["--demote", "sometimes"], "unknown demote mode 'sometimes'"),
    (["--write-down", "later"], "unknown write-down mode 'later'"),
    (["--fill", "0.5"], "--fill must be >= 1"),
    (["--nodes", "40"], "--nodes must be 1..16 for --tiers"),
])
def test_bad_tiers_options_are_one_clear_line(args, message):
    r = subprocess.run(python_argv("testbed", "bench", "serve", "--tiers", *args, "--json", ""),
                       capture_output=True, text=True)
    assert r.returncode != 0
    assert message in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


# (demote mode, blocks found after 30 puts into 10 blocks of DRAM and a disk of 100)
POOL_CASES = [("none", 10), ("all", 30), ("value", 30)]


@pytest.mark.parametrize("demote,found", POOL_CASES)
def test_pool_side_on_a_store_demotes_into_an_empty_disk(tmp_path, demote, found):
    """The benchmark's pool node: DRAM evictions go to disk (an empty disk tier has room)."""
    import asyncio

    from hostagent.pool.disk_tier import DiskTier
    from hostagent.pool.store import MemoryStore
    from hostagent.common.tier_policy import PoolSide
    from kvproto import checksum
    from testbed.bench.serve.serve_tiers import object_bytes, staged_bytes
    from testbed.bench.serve.serve_tiers_pool import attach

    bb, cs = block_bytes_for(0.025), 3072
    cfg = PolicyConfig(demote=demote, costs=scaled_costs(0.025))

    async def go():
        disk = DiskTier(tmp_path, 100 * object_bytes(bb)) if demote != "none" else None
        store = MemoryStore(10 * staged_bytes(bb), disk=disk)
        attach(store, PoolSide(cfg), cfg)
        blocks = {i.to_bytes(16, "big"): os.urandom(bb) for i in range(30)}
        for key, data in blocks.items():
            for c in range(bb // cs):
                p = data[c * cs:(c + 1) * cs]
                done = store.put_chunk(1, key, c, bb // cs, p, checksum(p))
                if isinstance(done, asyncio.Future):
                    await done
        n = 0
        for key, data in blocks.items():
            try:
                got = store.get(1, key)
                got = await got if isinstance(got, asyncio.Future) else got
            except Exception:   # noqa: BLE001 - NOT_FOUND
                continue
            n += b"".join(bytes(got.chunk(c)[0]) for c in range(got.nchunks)) == data
        await store.close()
        return n

    assert asyncio.run(go()) == found


def test_the_benchmarks_pool_side_hears_every_fetch_the_server_sees():
    """attach() hooks the pool side to the store's on_get, which the server calls for every GET
    of a chunk 0, staged hits included (test_tiers_store checks the server's side of it); the
    handle() patch it replaced never saw the staged hits, so `value` ordered by PUTs alone."""
    from hostagent.common.tier_policy import PoolSide
    from hostagent.pool.store import MemoryStore
    from testbed.bench.serve.serve_tiers import staged_bytes
    from testbed.bench.serve.serve_tiers_pool import attach

    bb = block_bytes_for(0.025)
    cfg = PolicyConfig(demote="value", costs=scaled_costs(0.025))
    store, side = MemoryStore(10 * staged_bytes(bb)), PoolSide(cfg)
    attach(store, side, cfg)
    hot, cold = b"h" * 16, b"c" * 16
    for key in (hot, cold):
        side.put(1, key, bb)
    for _ in range(3):
        store.on_get(1, hot)
    assert side.value_fn(1, hot, bb) > side.value_fn(1, cold, bb)
