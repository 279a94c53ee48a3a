"""vLLM as users run it: the `vllm` command of the venv (`vllm --version`, `vllm serve --help`),
`vllm serve` with the kvswitch connector driven by vLLM's own client on the testbed (a tiny
`testbed bench vllm`: every mode, outputs equal), a server whose pool does not answer (requests
complete by recompute, the same text, one log line) and a malformed connector config (the
server does not start; one line names the key)."""
import json
import subprocess
import sys
import time
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
    r = subprocess.run([VLLM, "--version"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip().endswith("+cpu"), r.stderr[-800:]
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


@pytest.mark.e2e
@pytest.mark.timeout(600)
def test_a_silent_pool_costs_a_bounded_wait_and_recomputes_the_same_text(tiny_bench, tmp_path):
    """The connector's pool node address answers nothing: every request completes by recompute,
    none waits much past the probe's deadline plus vLLM's own time (a hang would be the load's
    10 s deadline or the client's 300 s), the text is vLLM's alone, and the server says so in
    one line."""
    from testbed.bench.serve.vllm_server import ServerSpec, VllmServer, Workload, run_clients
    from testbed.demos import realmodel
    from testbed.lab import Lab
    bench, _ = tiny_bench
    local = next(r for r in bench["results"] if r["mode"] == "local")["vllm"]
    with leaves_no_namespaces("vbq"), Lab("vbq", hosts=1, pools=1, switch=True) as lab:
        silent = "198.18.0.150"                          # on the testbed's subnet, nobody there
        spec = ServerSpec(str(realmodel.model_dir()), "smollm2", 384, 4, connector={
            "pools": [silent], "chunk_size": 3072, "model_id": realmodel.model_id(),
            "probe_deadline": 1.0, "retry_s": 60})          # one probe of the silent node
        server = VllmServer(lab.topo, "h1", spec, str(tmp_path / "server.log"), core=0)
        server.start()
        try:
            server.wait_ready()
            start = time.monotonic()
            [res] = run_clients(lab.topo, ["h1"], Workload(**TINY), spec, str(tmp_path),
                                "silent", 300)
            seconds = time.monotonic() - start
        finally:
            server.stop()
        log = server.log()
    assert res["completed"] == 4 and res["failed"] == 0
    assert res["generated_texts"] == local["generated_texts"]
    # one probe of 1 s in the queue's way, and room for a busy box (the two runs are apart)
    assert max(res["ttfts"]) < max(local["ttfts"]) + 1.0 + 5.0, (res["ttfts"], local["ttfts"])
    lines = [ln for ln in log.splitlines() if "does not answer" in ln]
    assert len(lines) == 1 and silent in lines[0], lines
    print(f"silent pool: 4 requests in {seconds:.1f} s, TTFTs {res['ttfts']}")


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
