"""The LMCache plugin and the SGLang HiCache backend on a testbed, through the switch: LMCache's
own checker against the plugin, a prompt's KV stored by an LMCache engine on h1 and retrieved
bit-exact by one on h2, SGLang's v1 batch interface writing pages from a host pool on h1 and
reading them byte-exact into one on h2 (the backend made by SGLang's factory), and both with
the pool unreachable: misses within a bounded time, one log line, no exception."""
import json
import os
import re
import sys
import time
from pathlib import Path

import pytest

from conftest import leaves_no_namespaces
from test_store_backends import require_lmcache, require_sglang
from testbed.lab import Lab

pytestmark = pytest.mark.e2e

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
SILENT = "198.18.0.250"              # in the testbed's subnet, nobody's address


@pytest.fixture(scope="module")
def lab():
    require_lmcache()
    require_sglang(load=False)        # the fixtures import it in the nodes
    with leaves_no_namespaces(f"lm{os.getpid() % 100000}") as prefix, \
            Lab(prefix, hosts=2, pools=1, chunk_size=3072) as running:
        yield running


def run(lab, node: str, name: str, *args, env: dict | None = None, timeout: float = 120):
    """tests/store_fixtures.py's ``name(*args)`` in ``node``: (result, stderr)."""
    argv = ["env", *(f"{k}={v}" for k, v in (env or {}).items()), sys.executable,
            str(HERE / "store_fixtures.py"), name, json.dumps(args)]
    r = lab.topo.run(node, argv, timeout=timeout, check=False)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1]), r.stderr


def start(lab, node: str, name: str, *args):
    import subprocess
    return lab.topo.popen(node, [sys.executable, str(HERE / "store_fixtures.py"), name,
                                 json.dumps(args)], stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True, cwd=ROOT)


def finish(proc, timeout: float = 120):
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1]), err


def sglang_extra(pools: str, **more) -> dict:
    return {"backend_name": "kvswitch", "module_path": "hostagent.inference.connectors.sglang",
            "class_name": "KVSwitchStore", "interface_v1": 1, "pools": pools,
            "chunk_size": 3072, **more}


def test_lmcache_basic_check_through_the_switch(lab, tmp_path):
    cfg = tmp_path / "lmcache.yaml"
    cfg.write_text(f"""chunk_size: 256
local_cpu: false
max_local_cpu_size: 1
remote_url: "kvswitch://{lab.pool_addrs[0]}:19286"
remote_serde: naive
remote_storage_plugins: ["kvswitch"]
extra_config:
  remote_storage_plugin.kvswitch.module_path: hostagent.inference.connectors.lmcache
  remote_storage_plugin.kvswitch.class_name: KVSwitchAdapter
  remote_storage_plugin.kvswitch.chunk_size: 3072
""")
    before = lab.counters()
    r = lab.topo.run("h1", ["env", f"LMCACHE_CONFIG_FILE={cfg}", sys.executable, "-m",
                            "lmcache.v1.basic_check", "--mode", "test_remote",
                            "--num-keys", "8"], timeout=120, check=False)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-3000:]
    # exists of absent keys, put, exists of present ones, get (not None, content correct)
    passed = re.findall(r"Validation(?: \(content correct\))?: (\d+)/(\d+) passed", out)
    assert passed == [("8", "8")] * 4, out[-3000:]
    after = lab.counters()
    # through the switch's XDP program: the checker's 8 objects (1 KiB each: its chunk of 256
    # tokens of one bf16 element) put (PUT and ack), probed absent and present, got back
    moved = {k: after[k] - before[k] for k in after}
    assert moved["other_kv"] >= 2 * 8, moved
    assert moved["get_miss"] + moved["get_hit"] >= 3 * 8, moved


def test_lmcache_engine_stores_on_h1_and_h2_retrieves_bit_exact(lab):
    n, seed = 1000, 11                   # 3 full chunks of 256 tokens and one of 232
    opts = {"chunk_size": 3072}
    stored, _ = run(lab, "h1", "lmcache_store", lab.pool_addrs[0], n, seed, opts)
    assert stored["pending"] == 0 and stored["counts"]["puts"] == 4, stored
    got, err = run(lab, "h2", "lmcache_retrieve", lab.pool_addrs[0], n, seed, opts)
    assert got["lookup"] == n and got["retrieved"] == n, (got, err[-2000:])
    assert got["bit_exact"], got
    assert "the XDP fetch engine on eth0 fetches blocks" in err, err[-2000:]
    assert got["counts"]["hits"] == 4


def test_sglang_v1_pages_from_h1_come_back_byte_exact_on_h2(lab):
    extra, pages, seed = sglang_extra(lab.pool_addrs[0]), 6, 5
    put, _ = run(lab, "h1", "sglang_put", extra, pages, seed)
    assert put["ok"] == [True] * pages
    got, err = run(lab, "h2", "sglang_get", extra, pages, seed, 2)
    assert got["exists"] == pages, (got["exists"], err[-2000:])
    assert got["got"] == [True] * pages + [False] * 2
    assert got["pages"][:pages] == put["pages"]
    assert "the XDP fetch engine on eth0 fetches blocks" in err, err[-2000:]
    assert set("".join(got["pages"][pages:])) == {"0"}       # misses leave the pool alone


def test_unreachable_pool_gives_misses_quickly_with_one_log_line(lab):
    """Both backends pointed at an address nobody answers: misses within the deadlines, one
    line each about the silent node, never an exception into the engine."""
    opts = {"chunk_size": 3072, "deadline": 1, "probe_deadline": 1}
    sg_opts = sglang_extra(SILENT, deadline=1, probe_deadline=1)
    t0 = time.monotonic()
    lm = start(lab, "h1", "lmcache_both", SILENT, 600, 3, opts)
    sg_put = start(lab, "h2", "sglang_put", sg_opts, 3, 9)
    sg_get = start(lab, "h2", "sglang_get", sg_opts, 3, 9)
    put, put_err = finish(sg_put)
    assert put["ok"] == [False] * 3 and put["seconds"] < 5, put
    assert put_err.count("does not answer") == 1, put_err[-2000:]
    sg, sg_err = finish(sg_get)
    assert sg["exists"] == 0 and sg["got"] == [False] * 3 and sg["seconds"] < 5, sg
    assert sg_err.count("does not answer") == 1, sg_err[-2000:]
    both, lm_err = finish(lm)
    assert both["store"]["pending"] == 0 and both["store"]["seconds"] < 5, both
    got = both["retrieve"]
    assert got["lookup"] == 0 and got["retrieved"] == 0 and got["seconds"] < 5, got
    assert lm_err.count("does not answer") == 1, lm_err[-2000:]
    assert "Traceback" not in lm_err + sg_err
    assert time.monotonic() - t0 < 90
