"""`testbed bench throughput`'s cache scaling in a tiny configuration (e2e: a real switch and
live frames in namespaces made and removed here): every size byte-exact with kv_ingress's run
time, and the target's ratio from alternating rounds of the smallest and largest working set."""
import os

import pytest

from conftest import leaves_no_namespaces
from testbed.bench.fetch import throughput
from testbed.bench.fetch.generator import Generator


@pytest.mark.e2e
def test_cache_scaling_measures_alternating_rounds(monkeypatch):
    with leaves_no_namespaces(f"tq{os.getpid() % 100000}") as prefix:
        monkeypatch.setattr(throughput, "PREFIX", prefix)
        gen = Generator()
        try:
            bench = throughput._Bench(gen, 0.3, 1, 0, (0,), lambda *a: None)
            rows = throughput._cache_scaling(bench, [64, 512], 1024)
        finally:
            gen.close()
    assert not bench.problems, bench.problems
    assert [r["entries"] for r in rows] == [64, 512]
    assert all(r["byte_exact_sequential"] and r["byte_exact_zipf"] for r in rows)
    assert all(r["ns_per_frame"] > 0 and r["hit_pps_sequential"] > 0 for r in rows)
    alt = rows[-1]["alternating"]
    assert alt["small_entries"] == 64
    assert len(alt["small_pps"]) == len(alt["large_pps"]) == throughput.SCALING_ROUNDS
    assert min(alt["small_pps"] + alt["large_pps"]) > 0 and alt["ratio"] > 0
