"""`testbed bench fetch` in a tiny configuration (e2e: a real switch, pool node and fetch engine in
namespaces made and removed here): every path byte-exact, and the first reader's fetch comes
from the pool node while the switch learns the block, which it then answers whole."""
import os

import pytest

from conftest import leaves_no_namespaces
from testbed.bench.fetch import fetch


@pytest.mark.e2e
def test_a_tiny_fetch_bench_measures_every_path(monkeypatch):
    with leaves_no_namespaces(f"tf{os.getpid() % 100000}") as prefix:
        monkeypatch.setattr(fetch, "PREFIX", prefix)
        out = fetch.run_fetch(chunk_sizes=(3072,), sizes_mib=(1,), rounds=1, reps=1, losses=(),
                              hit_seconds=0.2, mooncake=False, log=lambda *a: None)
    rows = {(r["path"], r["source"]): r for r in out["results"]}
    assert set(rows) == {("xdp", "switch"), ("xdp-auth", "switch"), ("xdp", "pool"),
                         ("xdp-auth", "pool"), ("xdp", "pool-learned"), ("asyncio", "switch")}
    assert all(r["byte_exact"] and r["gbytes_per_s"] for r in rows.values()), rows
    learned = rows[("xdp", "pool-learned")]
    assert learned["from_pool"] == -(-(1 << 20) // 3072)      # every chunk, from the pool node
    assert learned["then_from_switch"] and learned["vs_pool_bypass"] > 0
    assert out["switch_hit"][0]["byte_exact"]
