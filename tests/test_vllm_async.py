"""The vLLM connector's asynchronous loads and saves and its metrics, driven through its own
methods as vLLM's scheduler and worker call them (a scheduler-role and a worker-role connector
on a real ``VllmConfig``, vLLM ``Request`` objects, a pool node on 127.0.0.1, a CPU paged
cache): a remote prefix loads beside the steps (``load_kv_async``, completion in
``get_finished``), a block that is gone or late fails exactly the blocks that did not land,
another salt never loads, saves keep a finished request's blocks until copied out, and the
numbers reach vLLM's ``KVConnectorStats`` and Prometheus."""
import shutil
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

try:
    import torch
    from vllm.config import CacheConfig, KVTransferConfig, ModelConfig, VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request
except ImportError as exc:
    pytest.fail(f"{exc}: install the vllm extra (run 'make setup')", pytrace=False)

from hostagent.common.transfer import BlockNotFound
from hostagent.inference.connectors import vllm_async as vllm_connector_async
from hostagent.inference.connectors.paged_kv import PagedKV
from hostagent.inference.connectors.vllm import KVSwitchConnector
from hostagent.inference.connectors.vllm_async import AsyncLoads, AsyncSaves
from test_vllm import pool  # noqa: F401  (a pool node on 127.0.0.1, a fixture)

ROOT = Path(__file__).resolve().parents[1]
BS, NBLOCKS = 16, 64
PROMPT = list(range(5, 5 + 5 * BS + 3))          # 5 loadable blocks and a tail


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("small-llama")   # the config alone: nothing is run
    shutil.copy(ROOT / "testbed/demos/models/small-llama/config.json", d)
    return str(d)


def _connectors(model_dir, pool, **extra):
    """A scheduler-role and a worker-role connector of one engine, the worker's paged cache
    registered as ``register_kv_caches`` would (CPU layout)."""
    tc = KVTransferConfig(kv_connector="KVSwitchConnector", kv_role="kv_both",
                          kv_connector_module_path="hostagent.inference.connectors.vllm",
                          kv_connector_extra_config={"pools": [pool], "chunk_size": 1024,
                                                     "fetch_engine": "off", **extra})
    cfg = VllmConfig(model_config=ModelConfig(model=model_dir, skip_tokenizer_init=True,
                                              dtype="float32", max_model_len=1024),
                     cache_config=CacheConfig(block_size=BS), kv_transfer_config=tc)
    s = KVSwitchConnector(cfg, KVConnectorRole.SCHEDULER)
    w = KVSwitchConnector(cfg, KVConnectorRole.WORKER)
    lay = w.layout
    caches = [torch.zeros(NBLOCKS, lay.kv_heads, BS, 2 * lay.head_dim) for _ in range(lay.layers)]
    w._paged = PagedKV(caches, lay)
    if w.async_mode:
        w._async_loads = AsyncLoads(w.backend, w._paged, w.ns, w.nchunks)
        w._async_saves = AsyncSaves(w.backend, w._paged, w.ns, w.backend.record)
    return s, w


def _request(rid, salt=None):
    return Request(rid, list(PROMPT), SamplingParams(max_tokens=4), None, cache_salt=salt)


class _Blocks:                       # vLLM's KVCacheBlocks as update_state_after_alloc sees it
    def __init__(self, ids):
        self.ids = list(ids)

    def get_block_ids(self):
        return (self.ids,)


def _step(s, new=(), finished=(), preempted=None):
    """One scheduler step's output with ``new`` = [(request, block ids, computed, scheduled)]."""
    so = SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id=r.request_id, block_ids=(ids,),
                                            prompt_token_ids=r.prompt_token_ids,
                                            num_computed_tokens=c) for r, ids, c, _ in new],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[], resumed_req_ids=set(),
                                              new_block_ids=[], num_computed_tokens=[]),
        num_scheduled_tokens={r.request_id: n for r, _, _, n in new},
        finished_req_ids=set(finished), preempted_req_ids=preempted)
    return s.build_connector_meta(so)


def _blocks_of(w, salt):
    keys = w.planner.keys(PROMPT, _extras(salt))
    data = [torch.full(w.layout.shape, float(i + 1)).numpy().tobytes() for i in range(5)]
    return keys[:5], data


def _extras(salt):
    from hostagent.inference.connectors.block_keys import KeyExtras
    return KeyExtras(cache_salt=salt)


def _until_recv(w, rid, timeout=20.0):
    """Worker steps (get_finished each) until ``rid`` finished receiving: its invalid blocks."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        sending, recving = w.get_finished(set())
        if recving and rid in recving:
            return w.get_block_ids_with_load_errors()
        time.sleep(0.01)
    raise AssertionError(f"{rid} never finished receiving")


def _admit(s, w, req, ids):
    """Scheduler admits ``req`` (probe, allocation, metadata); the worker starts its load."""
    n, is_async = s.get_num_new_matched_tokens(req, 0)
    s.update_state_after_alloc(req, _Blocks(ids), n)
    meta = _step(s)
    w.bind_connector_metadata(meta)
    start = time.monotonic()
    w.start_load_kv(None)
    w.wait_for_save()
    held = time.monotonic() - start
    w.clear_connector_metadata()
    return n, is_async, meta, held


def test_async_loads_land_beside_the_steps_and_fail_only_what_did_not_land(model_dir, pool,
                                                                           monkeypatch):
    s, w = _connectors(model_dir, pool, deadline=0.3)
    keys, data = _blocks_of(w, "tenant-A")
    w.backend.save(w.ns, keys, data)
    assert w.backend.flush(20)
    # another salt: a miss, nothing loaded; the same salt: a load beside the steps
    assert s.get_num_new_matched_tokens(_request("b", "tenant-B"), 0) == (0, False)
    inner = w.backend.client

    class Slow:                      # every block takes 0.5 s: the step must not wait for it
        async def get_block_view(self, ns, key, nchunks=None):
            import asyncio
            await asyncio.sleep(0.5)
            return await inner.get_block_view(ns, key, nchunks=nchunks)

    w.backend.getter = Slow()
    n, is_async, meta, held = _admit(s, w, _request("a", "tenant-A"), range(10, 16))
    assert (n, is_async) == (80, True) and not meta.loads and len(meta.async_loads) == 1
    assert held < 0.2                # the step went on (the blocks take >= 0.5 s)
    assert w.get_finished(set()) == (None, None)
    assert _until_recv(w, "a") == set()
    for i, vid in enumerate(range(10, 15)):
        assert w._paged.views[0][vid].flatten()[0].item() == i + 1
    # block 2 is gone when the load asks for it: blocks 2.. fail, 0 and 1 stay loaded
    gone = keys[2]

    class Gone:
        async def get_block_view(self, ns, key, nchunks=None):
            if key == gone:
                raise BlockNotFound("evicted")
            return await inner.get_block_view(ns, key, nchunks=nchunks)

    w.backend.getter = Gone()
    _admit(s, w, _request("c", "tenant-A"), range(20, 26))
    assert _until_recv(w, "c") == {22, 23, 24}
    # block 1 comes too late: the load gives up at its time, block 1 is never written
    monkeypatch.setattr(vllm_connector_async, "LATE_S", 0.2)

    class Late:
        async def get_block_view(self, ns, key, nchunks=None):
            import asyncio
            if key == keys[1]:
                await asyncio.sleep(1.5)
            return await inner.get_block_view(ns, key, nchunks=nchunks)

    w.backend.getter = Late()
    start = time.monotonic()
    _admit(s, w, _request("d", "tenant-A"), range(30, 36))
    assert _until_recv(w, "d") == {31, 32, 33, 34} and time.monotonic() - start < 1.4
    time.sleep(1.5)                  # block 1 arrives now: released, not copied
    w.backend.getter = inner
    assert w._paged.views[0][31].abs().sum().item() == 0
    assert w._paged.views[0][30].flatten()[0].item() == 1
    # vLLM's numbers: probes at admission, loads by source, failures by why
    sched, work = s.get_kv_connector_stats().data, w.get_kv_connector_stats().data
    assert sched["blocks_asked"] == 15 and sched["blocks_found"] == 15
    assert work["blocks_loaded_pool"] == 5 + 2 + 1 and work["load_failures_not_cached"] == 1
    assert work["load_failures_read_failed"] == 1 and len(work["load_seconds"]) == 3
    # bytes fetched: a's 5 blocks, c's 0, 1 (and 3 if it was in flight), d's all but 1
    assert work["load_bytes"] in (11 * w.layout.block_bytes, 12 * w.layout.block_bytes)
    assert w.get_kv_connector_stats() is None            # reset: nothing since


def test_a_request_not_admitted_yet_reuses_its_probe(model_dir, pool, monkeypatch):
    """vLLM asks about a waiting request every step while it has no room for its blocks: the
    pool is probed once per ``PROBE_REUSE_S``, not once a step (under the busy workload a slow
    probe held every step while a request waited for room)."""
    from hostagent.inference.connectors import vllm as connector
    s, w = _connectors(model_dir, pool)
    keys, data = _blocks_of(w, None)
    w.backend.save(w.ns, keys, data)
    assert w.backend.flush(20)
    calls, real = [], s.backend.probe
    monkeypatch.setattr(s.backend, "probe", lambda ns, ks: calls.append(len(ks)) or real(ns, ks))
    req = _request("waits")
    answers = [s.get_num_new_matched_tokens(req, 0) for _ in range(6)]
    assert answers == [(5 * BS, True)] * 6 and calls == [5]
    monkeypatch.setattr(connector, "PROBE_REUSE_S", 0.0)
    assert s.get_num_new_matched_tokens(req, 0) == (5 * BS, True) and calls == [5, 5]


def test_sync_mode_loads_in_the_step(model_dir, pool):
    s, w = _connectors(model_dir, pool, load_mode="sync")
    keys, data = _blocks_of(w, None)
    w.backend.save(w.ns, keys, data)
    assert w.backend.flush(20)
    req = _request("a")
    n, is_async = s.get_num_new_matched_tokens(req, 0)
    assert (n, is_async) == (80, False)
    s.update_state_after_alloc(req, _Blocks(range(6)), n)
    meta = _step(s, [(req, list(range(6)), 80, 3)])
    assert len(meta.loads) == 1 and not meta.async_loads
    w.bind_connector_metadata(meta)
    w.start_load_kv(None)
    w.wait_for_layer_load("model.layers.0.self_attn.attn")
    assert w._paged.views[0][4].flatten()[0].item() == 5
    assert w.get_block_ids_with_load_errors() == set()
    assert s.request_finished(req, [])[0] is False


def test_async_saves_keep_a_finished_requests_blocks_until_copied(model_dir, pool):
    s, w = _connectors(model_dir, pool)
    req = _request("e", "tenant-C")
    assert s.get_num_new_matched_tokens(req, 0) == (0, False)
    s.update_state_after_alloc(req, _Blocks(range(40, 46)), 0)
    for i, vid in enumerate(range(40, 46)):
        w._paged.views[0][vid].fill_(i + 1)
    meta = _step(s, [(req, list(range(40, 46)), 0, len(PROMPT))])
    assert [len(sv.keys) for sv in meta.saves] == [5]
    w.bind_connector_metadata(meta)
    w.start_load_kv(None)
    w.wait_for_save()
    w.clear_connector_metadata()
    assert s.request_finished(req, []) == (True, None)   # its blocks wait for the copies
    meta = _step(s, finished=["e"])                      # the next step names it
    assert meta.hold == {"e"} and not _step(s).hold
    w.bind_connector_metadata(meta)
    w.start_load_kv(None)
    end, sending = time.monotonic() + 20, None
    while not sending and time.monotonic() < end:
        sending, _ = w.get_finished({"e"})
        time.sleep(0.01)
    assert sending == {"e"} and w.get_finished(set()) == (None, None)   # reported once
    assert w.backend.flush(20)
    keys = s.planner.keys(PROMPT, _extras("tenant-C"))
    assert w.backend.probe(w.ns, keys[:5])[0] == 5
    work = w.get_kv_connector_stats().data
    assert work["blocks_saved"] == 5 and work["save_bytes"] == 5 * w.layout.block_bytes
    # a preemption: its blocks may be reused in this very step, so pending copies end first
    from hostagent.inference.connectors.vllm import KVSwitchMetadata
    from hostagent.inference.connectors.vllm_blocks import SaveSpec
    read = w._paged.read
    w._paged.read = lambda ids, *pos: (time.sleep(0.3), read(ids, *pos))[1]
    w._async_saves.submit(SaveSpec("h", keys[:1], 0, [[40]]))
    start = time.monotonic()
    w.handle_preemptions(KVSwitchMetadata(preempted=True))
    assert time.monotonic() - start >= 0.25 and not w._async_saves._copying
    w._paged.read = read
    # a request never saved is freed at once and never reported
    other = _request("f", "tenant-C")
    s.get_num_new_matched_tokens(other, 0)
    assert s.request_finished(other, []) == (False, None) and not _step(s).hold
    # nor one waiting for a load after a preemption (vLLM holds its blocks for the load; the
    # preemption finished its copies): the load's end frees it, never a finished_sending
    assert s.planner.take_load("e2", []) is None
    s.planner._saving.add("g")
    s.planner._loads["g"], s.planner._matched["g"] = (0, 16), (keys, 1)
    assert s.planner.take_load("g", list(range(50, 56))) is not None
    assert s.request_finished(SimpleNamespace(request_id="g"), []) == (False, None)


def test_the_numbers_reach_prometheus():
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
    from hostagent.inference.connectors.vllm_stats import KVSwitchPromMetrics, KVSwitchStats
    registry = CollectorRegistry()

    def own(cls):                    # the classes vLLM passes, registered in a registry of ours
        return type(cls.__name__, (cls,), {"__init__": lambda self, *a, **kw: cls.__init__(
            self, *a, registry=registry, **kw)})

    types = {Counter: own(Counter), Gauge: own(Gauge), Histogram: own(Histogram)}
    prom = KVSwitchPromMetrics(SimpleNamespace(kv_transfer_config=None), types,
                               ["model_name", "engine"], {0: ["m", "0"]})
    a, b = KVSwitchStats(), KVSwitchStats()
    a.count("blocks_asked", 6)
    a.count("blocks_found", 4)
    b.count("blocks_loaded_switch", 3)
    b.count("blocks_loaded_pool", 1)
    b.count("load_failures_not_cached")
    b.count("load_bytes", 1000)
    b.data["load_seconds"] += [0.02, 0.3]
    both = KVSwitchConnector.build_kv_connector_stats(b.aggregate(a).to_dict())
    assert not both.is_empty() and KVSwitchStats().is_empty()
    assert both.reduce()["loaded from switch"] == 3 and both.reduce()["loads"] == 2
    prom.observe(both.to_dict(), 0)
    text = generate_latest(registry).decode()
    for line in ('vllm:kvswitch_blocks_asked_total{engine="0",model_name="m"} 6.0',
                 'vllm:kvswitch_blocks_found_total{engine="0",model_name="m"} 4.0',
                 'vllm:kvswitch_blocks_loaded_total{engine="0",model_name="m",source="switch"} 3.0',
                 'vllm:kvswitch_load_failures_total{engine="0",model_name="m",reason="not_cached"}'
                 ' 1.0',
                 'vllm:kvswitch_load_bytes_total{engine="0",model_name="m"} 1000.0',
                 'vllm:kvswitch_load_seconds_count{engine="0",model_name="m"} 2.0'):
        assert line in text, line


def test_load_mode_auto_is_async_only_where_the_engine_core_has_its_own_process():
    """`make demo-vllm` runs vLLM in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0): asynchronous
    loads there ran 15x slower than in the step or timed out, the engine's loop stepping in the
    same interpreter; `vllm serve` keeps its engine core apart and loads beside its steps."""
    from hostagent.inference.connectors.vllm_blocks import Settings, resolve_load_mode
    assert Settings.from_extra({"pools": ["127.0.0.1"]}).load_mode == "auto"
    assert resolve_load_mode("auto", multiprocessing=True) == "async"
    assert resolve_load_mode("auto", multiprocessing=False) == "sync"
    for mode in ("async", "sync"):
        assert resolve_load_mode(mode, multiprocessing=False) == mode
        assert resolve_load_mode(mode, multiprocessing=True) == mode
