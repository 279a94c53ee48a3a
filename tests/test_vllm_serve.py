"""vLLM as users run it: the `vllm` command of the venv (`vllm serve --help`, the CPU build),
`vllm serve` with the kvswitch connector driven by vLLM's own client on the testbed (a tiny
`testbed bench vllm`: every mode, outputs equal) and a malformed connector config (the server
does not start; one line names the key). A server whose pool nodes are all dead is in
test_vllm_tenants.py (requests complete by recompute, the same text, one line a process)."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import leaves_no_namespaces

VLLM = str(Path(sys.executable).with_name("vllm"))


def _need_vllm():
    try:
        import vllm  # noqa: F401
    except ImportError as exc:
        pytest.fail(f"vLLM is not importable ({exc}): run 'make setup', or pip install -e "
                    "'.[vllm]' and python -m hostagent.inference.vllm_dist", pytrace=False)
    if not Path(VLLM).exists():
        pytest.fail(f"no {VLLM}: run 'make setup'", pytrace=False)


def test_the_vllm_command_runs_from_the_venv():
    _need_vllm()
    from hostagent.inference.vllm_dist import ensure
    assert ensure() is not None                          # idempotent: already there
    from importlib.metadata import version
    assert version("vllm").endswith("+cpu")              # the CPU build (what --version says)
    r = subprocess.run([VLLM, "serve", "--help=all"], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0 and "--kv-transfer-config" in r.stdout, r.stderr[-800:]


TINY = dict(prefix_len=256, suffix_len=32, prefixes=2, output_len=4, prompts=4, rate=1.0)


@pytest.fixture(scope="module")
def tiny_bench(tmp_path_factory):
    """`testbed bench vllm` on 1 server, 1 pool node, 1 Gbit/s links, 4 requests, every mode."""
    _need_vllm()
    from testbed.bench.serve.serve_vllm import VllmBench, run_vllm_bench
    from testbed.bench.serve.vllm_server import Workload
    cfg = VllmBench(servers=1, pools=1, link_gbit=1.0, workload=Workload(**TINY), kv_blocks=4,
                    prefix="vbt")
    out = tmp_path_factory.mktemp("vllm") / "vllm-serve.json"
    with leaves_no_namespaces("vbt"), leaves_no_namespaces("vbtu"):
        run_vllm_bench(cfg, str(out), str(out.with_suffix(".png")))
    return json.loads(out.read_text()), out


@pytest.mark.e2e
@pytest.mark.timeout(900)
def test_a_tiny_vllm_bench_runs_every_mode_with_the_same_outputs(tiny_bench):
    out, path = tiny_bench
    assert path.with_suffix(".png").stat().st_size > 0
    assert set(out) >= {"config", "results", "outputs_match", "unshaped_gbit"}
    assert out["unshaped_gbit"] > 0
    assert [(r["mode"], r["server"]) for r in out["results"]] == \
        [("local", 0), ("pool", 0), ("switch", 0)]
    for r in out["results"]:
        v = r["vllm"]                                    # vLLM's own result, unchanged
        assert v["completed"] == 4 and v["failed"] == 0 and len(v["ttfts"]) == 4
        assert {"median_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "request_throughput",
                "generated_texts"} <= set(v)
        assert "pool_egress_bytes" in r and "switch_hit_ratio" in r
    assert out["outputs_match"]
    by = {r["mode"]: r for r in out["results"]}
    block = 128 * out["config"]["kv_bytes_per_token"]
    # the pool served loads (a prefix's blocks, more than once): KV crossed the pool's link
    assert by["pool"]["pool_egress_bytes"] > block
    assert by["local"]["pool_egress_bytes"] < block // 10  # vLLM alone: nothing from the pool
    assert by["switch"]["switch_hit_ratio"] is not None and by["local"]["switch_hit_ratio"] is None
    # the connector loaded in both pool modes (its log lines), from where each mode says
    pool, switch = by["pool"]["connector_loads"], by["switch"]["connector_loads"]
    assert pool["loads"] > 0 and pool["chunks_from_pool"] > 0 and not pool["chunks_from_switch"]
    assert switch["loads"] > 0 and switch["failed"] == 0 and pool["failed"] == 0
    assert 0 < switch["chunks_from_switch"] <= by["switch"]["switch_counters"]["get_hit"]
    assert by["local"]["connector_loads"]["loads"] == 0
    assert by["pool"]["server_metrics"]["vllm:external_prefix_cache_hits"] > 0


@pytest.mark.timeout(300)
def test_a_malformed_connector_config_stops_the_start_with_one_line_naming_the_key(tmp_path):
    _need_vllm()
    import os
    import signal
    from testbed.bench.serve.vllm_server import ENV, ServerSpec
    from testbed.demos import realmodel
    spec = ServerSpec(str(realmodel.model_dir()), "smollm2", 384, 4,
                      connector={"pools": ["10.0.0.1"], "chunk_size": 3004})
    p = subprocess.Popen(spec.argv() + ["--port", "0"], stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, env={**os.environ, **ENV},
                         cwd=tmp_path, start_new_session=True)
    try:
        out, _ = p.communicate(timeout=240)
    finally:                             # vLLM's engine processes too, whatever happened
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert p.returncode != 0
    said = [ln for ln in out.splitlines() if "kv_connector_extra_config key 'chunk_size'" in ln]
    assert said and "a multiple of 8" in said[-1], out[-2000:]
