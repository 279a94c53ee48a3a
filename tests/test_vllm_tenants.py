"""`vllm serve` with the kvswitch connector as tenants use it (e2e): two servers over a plain
bridge share two pool nodes, each block held by both (``replicas`` 2); a 1,173-token prompt
computed by server 1 under ``cache_salt`` tenant-A is never loaded by server 2 for tenant-B or
for a request without a salt (0 blocks, vLLM's external hits unchanged), and is loaded for
tenant-A (9 blocks, 1,152 tokens, the same text); the connector's numbers are on both servers'
/metrics. Then a load beside the steps: while server 2 streams a long decode, a request whose
prefix is in the pool (a load of about 2 s over 0.2 Gbit/s links) waits for its KV without
stalling the decode. Last, a pool node dies (its server killed, its link down) just before a
load: the request completes with the same text, its blocks loaded from the other holder after
one silence; and when every pool node is dead, a request recomputes its prefix after one bounded
silence and gets the same text."""
import json
import os
import random
import sys
import tempfile
import time

import pytest

from conftest import leaves_no_namespaces

PROMPT_LEN, BLOCK = 1173, 128
LOADABLE = (PROMPT_LEN - 1) // BLOCK                 # 9 blocks, 1,152 tokens
LINK_GBIT = 0.2

POST = """
import json, sys, time, urllib.request
t = time.monotonic()
req = urllib.request.Request("http://127.0.0.1:8000/v1/completions", data=sys.argv[1].encode(),
                             headers={"Content-Type": "application/json"})
out = json.loads(urllib.request.urlopen(req, timeout=600).read())
print(json.dumps({"text": out["choices"][0]["text"], "seconds": time.monotonic() - t}))
"""

# a streamed decode, and after its 10th token a request whose prefix is in the pool: the time
# of every streamed token and the other request's start and end
DECODE_BESIDE_A_LOAD = """
import json, sys, threading, time, urllib.request
URL = "http://127.0.0.1:8000/v1/completions"
decode, loaded = json.loads(sys.argv[1]), json.loads(sys.argv[2])
arrivals, window, tenth = [], {}, threading.Event()

def post(body, stream=False):
    req = urllib.request.Request(URL, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    return urllib.request.urlopen(req, timeout=600)

def other():
    tenth.wait(300)
    window["start"] = time.monotonic()
    out = json.loads(post(loaded).read())
    window["end"], window["text"] = time.monotonic(), out["choices"][0]["text"]

t = threading.Thread(target=other)
t.start()
with post(decode, stream=True) as r:
    for line in r:
        if line.startswith(b"data: {"):
            arrivals.append(time.monotonic())
            if len(arrivals) == 10:
                tenth.set()
tenth.set()
t.join()
print(json.dumps({"arrivals": arrivals, **window}))
"""


def _need_vllm():
    try:
        import vllm  # noqa: F401
    except ImportError as exc:
        pytest.fail(f"vLLM is not importable ({exc}): run 'make setup'", pytrace=False)


def _prompt(seed: int, n: int = PROMPT_LEN) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 40000) for _ in range(n)]


def _post(lab, node: str, body: dict) -> dict:
    r = lab.topo.run(node, [sys.executable, "-c", POST, json.dumps(body)], timeout=600)
    return json.loads(r.stdout.strip().splitlines()[-1])


def _body(prompt, salt=None, max_tokens=4, **kw) -> dict:
    return {"model": "smollm2", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, **({"cache_salt": salt} if salt else {}), **kw}


def _metrics(lab, node: str) -> dict[str, float]:
    """Every vllm:kvswitch_* and vllm:external_prefix_cache_* sample of the server, summed
    over its labels but ``source`` and ``reason`` (``name{value}``)."""
    fetch = ("import urllib.request; print(urllib.request.urlopen("
             "'http://127.0.0.1:8000/metrics', timeout=10).read().decode())")
    text = lab.topo.run(node, [sys.executable, "-c", fetch], timeout=60).stdout
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line.startswith(("vllm:kvswitch_", "vllm:external_prefix_cache")):
            continue
        name, value = line.rsplit(" ", 1)
        base, _, labels = name.partition("{")
        tag = next((p.split("=")[1].strip('"') for p in labels.rstrip("}").split(",")
                    if p.startswith(("source=", "reason="))), None)
        key = f"{base}{{{tag}}}" if tag else base
        out[key] = out.get(key, 0.0) + float(value)
    return out


def _delta(after: dict, before: dict) -> dict:
    return {k: v - before.get(k, 0.0) for k, v in after.items() if v != before.get(k, 0.0)}


def _await_saved(lab, node: str, blocks: float, timeout: float = 120) -> dict:
    """Until the node's connector counted ``blocks`` saved. Acknowledgements that come after
    the engine went idle are counted at its next step: a one-token request makes one."""
    end, nudge = time.monotonic() + timeout, _body(_prompt(99, 16), max_tokens=1)
    while time.monotonic() < end:
        _post(lab, node, nudge)
        m = _metrics(lab, node)
        if m.get("vllm:kvswitch_blocks_saved_total", 0) >= blocks:
            return m
        time.sleep(1)
    raise AssertionError(f"{node} did not save {blocks} blocks in {timeout} s: {m}")


def _computed_and_saved(lab, prompt, salt) -> dict:
    """Server 1 computes ``prompt`` under ``salt`` and its full blocks reach the pool."""
    saved = _metrics(lab, "h1").get("vllm:kvswitch_blocks_saved_total", 0)
    first = _post(lab, "h1", _body(prompt, salt))
    _await_saved(lab, "h1", saved + PROMPT_LEN // BLOCK)
    return first


@pytest.fixture(scope="module")
def two_servers():
    """Two `vllm serve` (SmolLM2-135M, 128-token blocks) on h1 and h2, the connector on both,
    two pool nodes holding each block, a plain bridge, every link 0.2 Gbit/s."""
    _need_vllm()
    from testbed.bench.serve.vllm_server import ServerSpec, VllmServer
    from testbed.demos import realmodel
    from testbed.lab import Lab
    model_dir = str(realmodel.model_dir())
    with tempfile.TemporaryDirectory(prefix="kvtest-tenants-") as tmp, \
            leaves_no_namespaces("vkt"), \
            Lab("vkt", hosts=2, pools=2, switch=False, chunk_size=3072, pool_capacity="1GiB",
                link_gbit=LINK_GBIT) as lab:
        spec = ServerSpec(model_dir, "smollm2", 1280, 24, BLOCK, connector={
            "pools": lab.pool_addrs, "chunk_size": 3072, "model_id": realmodel.model_id(),
            "replicas": 2})
        ncpu = len(os.sched_getaffinity(0))
        servers = [VllmServer(lab.topo, f"h{i + 1}", spec, os.path.join(tmp, f"h{i + 1}.log"),
                              core=i % ncpu) for i in range(2)]
        try:
            start = time.monotonic()
            for s in servers:
                s.start()
            for s in servers:
                s.wait_ready()
            print(f"two servers ready in {time.monotonic() - start:.0f} s")
            yield lab, servers
        finally:
            for s in servers:
                s.stop()


@pytest.mark.e2e
@pytest.mark.timeout(1200)
def test_a_salt_is_loaded_only_by_its_own_tenant_across_servers(two_servers):
    lab, (s1, s2) = two_servers
    prompt, start = _prompt(1), time.monotonic()
    first = _post(lab, "h1", _body(prompt, "tenant-A"))
    _await_saved(lab, "h1", PROMPT_LEN // BLOCK)            # its 9 full blocks in the pool
    before = _metrics(lab, "h2")
    _post(lab, "h2", _body(prompt, "tenant-B"))            # another tenant
    _post(lab, "h2", _body(prompt))                        # no salt
    other = _delta(_metrics(lab, "h2"), before)
    assert other.get("vllm:external_prefix_cache_hits_total", 0) == 0, other
    assert not any(k.startswith("vllm:kvswitch_blocks_loaded") for k in other), other
    assert other["vllm:kvswitch_blocks_asked_total"] == 2 * LOADABLE
    assert other.get("vllm:kvswitch_blocks_found_total", 0) == 0, other
    before = _metrics(lab, "h2")
    same = _post(lab, "h2", _body(prompt, "tenant-A"))     # the same tenant: loaded
    own = _delta(_metrics(lab, "h2"), before)
    assert own["vllm:external_prefix_cache_hits_total"] == LOADABLE * BLOCK, own
    assert own["vllm:kvswitch_blocks_loaded_total{pool}"] == LOADABLE, own
    assert own["vllm:kvswitch_blocks_found_total"] == LOADABLE
    assert own["vllm:kvswitch_load_bytes_total"] > 0
    assert own["vllm:kvswitch_load_seconds_count"] == 1
    assert not any(k.startswith("vllm:kvswitch_load_failures") for k in own), own
    assert same["text"] == first["text"]
    print(f"salts: {time.monotonic() - start:.0f} s; tenant-A on h2 loaded "
          f"{own['vllm:kvswitch_load_bytes_total'] / 1e6:.1f} MB in "
          f"{own['vllm:kvswitch_load_seconds_sum']:.2f} s")


@pytest.mark.e2e
@pytest.mark.timeout(1200)
def test_a_load_waits_beside_a_decode_that_keeps_going(two_servers):
    lab, (s1, s2) = two_servers
    prompt = _prompt(2)
    first = _computed_and_saved(lab, prompt, "tenant-Q")
    mark, before = s2.log_size(), _metrics(lab, "h2")
    decode = _body(_prompt(3, 64), max_tokens=200, stream=True)
    r = lab.topo.run("h2", [sys.executable, "-c", DECODE_BESIDE_A_LOAD, json.dumps(decode),
                            json.dumps(_body(prompt, "tenant-Q"))], timeout=900)
    out = json.loads(r.stdout.strip().splitlines()[-1])
    own = _delta(_metrics(lab, "h2"), before)
    assert own["vllm:kvswitch_blocks_loaded_total{pool}"] == LOADABLE, own
    assert out["text"] == first["text"]
    load_s = own["vllm:kvswitch_load_seconds_sum"]
    arrivals = out["arrivals"]
    during = [t for t in arrivals if out["start"] <= t <= out["end"]]
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:]) if b >= out["start"] and a <= out["end"]]
    log = s2.log(since=mark)
    assert "loaded" in log and "kvswitch" in log
    # the load took long enough to see (0.2 Gbit/s: ~53 MB), and the decode went on meanwhile
    assert load_s >= 1.0, own
    assert len(arrivals) >= 150 and len(during) >= 10, (len(arrivals), len(during))
    assert max(gaps) < load_s / 2, (max(gaps), load_s)
    print(f"beside a load of {load_s:.2f} s: {len(during)} tokens streamed meanwhile, the "
          f"longest gap {max(gaps) * 1e3:.0f} ms; request {out['end'] - out['start']:.2f} s")


@pytest.mark.e2e
@pytest.mark.timeout(1200)
def test_a_pool_node_dead_before_a_load_costs_one_silence(two_servers):
    """With every block on both pool nodes, p1 dies (its server SIGKILLed, its link down) and
    server 2 asks for a prefix server 1 saved: the request completes with server 1's text, every
    block loaded (from p2: those whose first holder was p1 after one silence of 1 s), no load
    failure; each of the connector's processes says once that p1 does not answer, none blames p2."""
    import signal
    from testbed.lab.topology import ip
    lab, (s1, s2) = two_servers
    prompt = _prompt(4)
    first = _computed_and_saved(lab, prompt, "tenant-K")
    lab.stop_pool(0, signal.SIGKILL)
    ip("link", "set", lab.topo.pool_nodes[0].name, "down", ns=lab.topo.switch_ns)
    mark, before = s2.log_size(), _metrics(lab, "h2")
    again = _post(lab, "h2", _body(prompt, "tenant-K"))
    own = _delta(_metrics(lab, "h2"), before)
    assert again["text"] == first["text"]
    assert own["vllm:kvswitch_blocks_loaded_total{pool}"] == LOADABLE, own
    assert not any(k.startswith("vllm:kvswitch_load_failures") for k in own), own
    said = [ln for ln in s2.log(since=mark).splitlines() if "does not answer" in ln]
    # the scheduler's process and the worker's each keep their own placement: once each
    speakers = [ln.split(")")[0] for ln in said]
    assert len(set(speakers)) == len(speakers) <= 2, said
    assert all(lab.pool_addrs[0] in ln for ln in said), said
    # one silence (1 s) at most in the load's way, then p2's blocks over a 0.2 Gbit/s link
    assert own["vllm:kvswitch_load_seconds_sum"] < 1.0 + 4.0, own
    print(f"p1 dead: the load took {own['vllm:kvswitch_load_seconds_sum']:.2f} s, the request "
          f"{again['seconds']:.2f} s")


@pytest.mark.e2e
@pytest.mark.timeout(1200)
def test_every_pool_node_dead_costs_a_bounded_wait_and_recomputes_the_same_text(two_servers):
    """Server 1 saves a prefix, then every pool node dies (those still alive SIGKILLed, their
    links down): server 2's request for it completes by recompute with server 1's text, loads
    nothing and fails no load, waits at most one silence more than server 1 took to compute it
    (a hang would be the load's deadline or the client's), and says once per process that the
    nodes that died now do not answer."""
    import signal
    from testbed.lab.topology import ip
    lab, (s1, s2) = two_servers
    prompt = _prompt(5)
    first = _computed_and_saved(lab, prompt, "tenant-Z")
    mark, before = s2.log_size(), _metrics(lab, "h2")
    newly = [i for i, p in enumerate(lab.pools) if p is not None]
    for i in newly:
        lab.stop_pool(i, signal.SIGKILL)
    for node in lab.topo.pool_nodes:
        ip("link", "set", node.name, "down", ns=lab.topo.switch_ns)
    again = _post(lab, "h2", _body(prompt, "tenant-Z"))
    own = _delta(_metrics(lab, "h2"), before)
    assert again["text"] == first["text"]
    assert not any(k.startswith(("vllm:kvswitch_blocks_loaded", "vllm:kvswitch_load_failures"))
                   for k in own), own
    # one silence (1 s) in the way at most, and room for a busy box
    assert again["seconds"] < first["seconds"] + 1.0 + 5.0, (again, first)
    said = [ln for ln in s2.log(since=mark).splitlines() if "does not answer" in ln]
    assert all(any(a in ln for a in lab.pool_addrs) for ln in said), said
    for i in newly:                    # the nodes that died now: said once by a process or two
        lines = [ln for ln in said if lab.pool_addrs[i] in ln]
        speakers = [ln.split(")")[0] for ln in lines]
        assert 1 <= len(lines) == len(set(speakers)) <= 2, (lab.pool_addrs[i], said)
    print(f"every pool node dead: the request took {again['seconds']:.2f} s (server 1 computed "
          f"it in {first['seconds']:.2f} s)")
