"""`testbed bench serve` on a tiny configuration (2 inference nodes, 1 pool node, a few requests
per workload, shaped links): every workload runs in every mode, every fetched block is
byte-exact, the JSON has the issue's schema; bad input gets one clear line. The workloads'
shapes are checked in the pure-Python tier."""
import json
import os
import subprocess

import pytest

from conftest import leaves_no_namespaces
from testbed.bench.serve.serve import MODES, run_serve
from testbed.bench.serve.serve_workloads import WORKLOADS, burst_workload, zipf_workload
from testbed.lab.topology import python_argv
from testbed.sim.trace import DEFAULT_TRACE

TRACE = DEFAULT_TRACE
ROW_KEYS = {"workload", "mode", "ttft_p50_s", "ttft_p99_s", "pool_egress_bytes",
            "switch_hit_ratio", "retransmit_ratio", "byte_exact"}


def test_burst_puts_a_request_on_every_node_after_the_first_computes_the_prefix():
    wl = burst_workload(4, 10_000, prefix_blocks=8, tail_s=2.0)
    first = wl.requests[0][0]
    assert first["at"] == 0 and len(first["keys"]) == 8
    burst_at = wl.params["burst_at_s"]
    for node in wl.requests:
        hot = [r for r in node if r["keys"] == first["keys"] and r["at"] >= burst_at]
        assert len(hot) == 2 and all(r["at"] <= burst_at + 0.2 for r in hot)


def test_burst_runs_its_warmup_to_the_end_before_any_burst_request():
    from testbed.bench.serve.serve import phases
    wl = burst_workload(4, 10_000, prefix_blocks=8, tail_s=2.0)
    warm, rest = phases(wl)
    assert [len(r) for r in warm] == [1, 0, 0, 0] and warm[0][0]["warmup"]
    assert not any(q.get("warmup") for r in rest for q in r)
    assert sum(map(len, rest)) == wl.n_requests - 1
    ats = [q["at"] for r in rest for q in r]
    assert min(ats) == 0 and all(q["at"] <= 0.2 for r in rest for q in r
                                 if q["keys"] == warm[0][0]["keys"])
    zipf = zipf_workload(2, [("198.18.0.101", 1)], 5, objects=8, hot=2, seconds=1.0)
    assert phases(zipf) == [zipf.requests]


def test_zipf_puts_the_hottest_objects_on_the_first_pool_node():
    from hostagent.common.pools import pool_for
    pools = [("198.18.0.101", 1), ("198.18.0.102", 1)]
    wl = zipf_workload(2, pools, 5, objects=16, hot=4, seconds=2.0)
    first_blocks = wl.preload[:4 * 4]
    assert all(pool_for(pools, 5, bytes.fromhex(k)) == pools[0] for k in first_blocks)
    assert sum(len(r) for r in wl.requests) > 0


@pytest.mark.e2e
def test_tiny_serve_runs_every_workload_in_every_mode_byte_exact(tmp_path):
    assert os.path.exists(TRACE), f"the trace that ships with the project is missing: {TRACE}"
    prefix = f"s{os.getpid() % 100000}"
    with leaves_no_namespaces(prefix):
        out = run_serve(nodes=2, pools=1, link_gbit=0.1, trace_path=TRACE, trace_requests=4,
                        scale=0.1, json_path=str(tmp_path / "serve.json"), prefix=prefix)
    rows = out["results"]
    assert {(r["workload"], r["mode"]) for r in rows} == {(w, m) for w in WORKLOADS
                                                          for m in MODES}
    for r in rows:
        assert ROW_KEYS <= set(r), r
        assert r["byte_exact"] and r["requests"] > 0 and r["fetch_errors"] == 0, r
        assert len(r["pool_egress_bytes"]) == 1
    assert any(r["switch_hit_ratio"] > 0 for r in rows if r["mode"] == "switch")
    assert all(r["switch_hit_ratio"] == 0 for r in rows if r["mode"] != "switch")
    saved = json.loads((tmp_path / "serve.json").read_text())
    assert saved["config"]["preset"] == "llama3-8b" and saved["results"] == rows


@pytest.mark.parametrize("args, message", [
    (["--workloads", "nope"], "unknown workload 'nope'"),
    (["--link-gbit", "0"], "--link-gbit must be > 0"),
    (["--nodes", "500"], "--nodes must be 1..24"),
])
def test_bad_serve_options_are_one_clear_line(args, message):
    r = subprocess.run(python_argv("testbed", "bench", "serve", *args, "--json", ""),
                       capture_output=True, text=True)
    assert r.returncode != 0
    assert message in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
