"""The vLLM KV connector: its pure parts without vLLM (settings, keys and layout tag, the
scheduler's plan, copies between vLLM's CPU paged cache and pool blocks, the I/O backend against
a loopback pool node), and end to end (e2e tier) two vLLM engines sharing a short prefix through
the switch on the testbed (``testbed.demos.vllm``, the minimal version of `make demo-vllm`)."""
import json
import queue
import time

import numpy as np
import pytest

try:
    import torch
except ImportError as exc:
    pytest.fail(f"{exc}: install the inference extra (pip install -e '.[inference]', "
                "or run 'make setup')", pytrace=False)

from conftest import pool_in_thread
from hostagent.common.transfer import BlockNotFound, TransferStats
from hostagent.common.hashing import block_hashes
from hostagent.inference.connectors.paged_kv import PagedKV
from hostagent.inference.connectors.vllm_blocks import (LoadSpec, Planner, PoolLayout,
                                                        Settings, load_targets)
from hostagent.inference.connectors.vllm_pool import PoolBackend, drain_load

L, H, D = 2, 2, 8


def _layout(block_tokens=8, vllm_block=4, dtype=torch.float32) -> PoolLayout:
    return PoolLayout(L, H, D, dtype, block_tokens, vllm_block)


# ---- settings, keys, layout ------------------------------------------------------------------
def test_settings_need_pools_and_refuse_unknown_keys():
    s = Settings.from_extra({"pools": "10.0.0.1,10.0.0.2:7", "chunk_size": 3072})
    assert s.pools == ("10.0.0.1", "10.0.0.2:7") and s.chunk_size == 3072 and s.namespace == 1
    assert s.load_failure == "recompute" and s.deadline == 10
    with pytest.raises(ValueError, match="'pools'"):
        Settings.from_extra({})
    with pytest.raises(ValueError, match="key 'pool': unknown key"):
        Settings.from_extra({"pools": ["10.0.0.1"], "pool": "b"})
    with pytest.raises(ValueError, match="concurrency"):
        Settings.from_extra({"pools": ["10.0.0.1"], "concurrency": 0})


@pytest.mark.parametrize("extra, key", [
    ({"pools": ["10.0.0.1"], "chunk_sise": 3072}, "chunk_sise"),          # unknown
    ({"pools": ["10.0.0.300"]}, "pools"),                                  # bad address
    ({"pools": ["10.0.0.1:70000"]}, "pools"),                              # bad port
    ({"pools": ["10.0.0.1"], "chunk_size": 3000 + 4}, "chunk_size"),       # not a multiple of 8
    ({"pools": ["10.0.0.1"], "chunk_size": 4096}, "chunk_size"),           # past the largest
    ({"pools": ["10.0.0.1"], "window": "64"}, "window"),                   # not an integer
    ({"pools": ["10.0.0.1"], "deadline": 0}, "deadline"),
    ({"pools": ["10.0.0.1"], "load_failure": "retry"}, "load_failure"),
    ({"pools": ["10.0.0.1"], "kv_codec": "zstd"}, "kv_codec"),
    ({"pools": ["10.0.0.1"], "kv_codec": "int8/g99999999999"}, "kv_codec"),
    ({"pools": ["0.0.0.0"]}, "pools"),                                     # no node's address
    ({"pools": ["10.0.0.1", "255.255.255.255"]}, "pools"),
    ({"pools": ["224.0.0.1"]}, "pools"),
    ({"pools": ["5"]}, "pools"),                                           # 0.0.0.5
    ({"pools": ["10.0.0.1"], "deadline": 1e-9}, "deadline"),
    ({"pools": ["10.0.0.1"], "probe_deadline": 0.0009}, "probe_deadline"),
    ({"pools": ["10.0.0.1"], "auth_key_file": "/nonexistent/key"}, "auth_key_file"),
])
def test_a_bad_extra_config_is_one_line_naming_the_key(extra, key):
    from hostagent.inference.connectors.vllm_blocks import SettingsError
    with pytest.raises(SettingsError) as e:
        Settings.from_extra(extra)
    msg = str(e.value)
    assert f"key {key!r}:" in msg and "\n" not in msg, msg


@pytest.mark.parametrize("extra, line", [
    ({"pools": ["224.0.0.1"]}, "key 'pools': pool address '224.0.0.1' cannot be a pool node: a "
                               "multicast address"),
    ({"pools": ["5"]}, "key 'pools': pool address '5' (0.0.0.5) cannot be a pool node: in "
                       "0.0.0.0/8 ('this network', never a destination)"),
    ({"pools": ["10.0.0.1"], "deadline": 1e-9}, "key 'deadline': 1e-09 is not a number of "
     "seconds in 0.001..3600 (a deadline under 1 ms is too short for any answer)"),
    ({"pools": ["10.0.0.1"], "kv_codec": "int8/g99999999999"}, "key 'kv_codec': bad KV codec "
     "'int8/g99999999999': its group of 99999999999 tokens is not in 2..65536"),
])
def test_the_refusals_say_why_in_one_line(extra, line):
    with pytest.raises(ValueError) as e:
        Settings.from_extra(extra)
    assert str(e.value) == f"kvswitch connector: kv_connector_extra_config {line}"


def test_a_list_as_the_extra_config_is_one_line_naming_it():
    from hostagent.inference.connectors.vllm_blocks import SettingsError
    with pytest.raises(SettingsError) as e:
        Settings.from_extra(["pools", "10.0.0.1"])
    assert str(e.value) == ("kvswitch connector: kv_connector_extra_config must be a mapping of "
                            "option names to values (a JSON object), not a list")


def test_good_values_pass_as_in_the_stores():
    """Namespace 0 and the last one, loopback and private pools, the deadline floor, the
    largest codec group: taken here as by the LMCache/SGLang options (one rule each)."""
    from hostagent.inference.connectors.store import StoreSettings
    for extra in ({"pools": ["127.0.0.1", "10.0.0.1:7", "192.168.1.2"], "namespace": 0},
                  {"pools": ["10.0.0.1"], "namespace": 0xFFFFFFFF},
                  {"pools": ["10.0.0.1"], "deadline": 0.001, "probe_deadline": 0.001}):
        s = Settings.from_extra(extra)
        assert all(getattr(s, k) == (tuple(v) if k == "pools" else v) for k, v in extra.items())
        StoreSettings.from_options(extra, "test")
    assert Settings.from_extra({"pools": ["10.0.0.1"],
                                "kv_codec": "int8/g65536"}).kv_codec == "int8/g65536"


def test_the_key_file_must_have_the_namespace(tmp_path, monkeypatch):
    """auth_key_file, else $KVSWITCH_AUTH_KEY_FILE: unusable or without a key for the
    namespace, refused by the option check (as the stores'); with none, no keyring."""
    from hostagent.common import auth
    monkeypatch.setattr(auth, "_configured", [])
    monkeypatch.delenv(auth.ENV, raising=False)
    path = tmp_path / "ns.key"
    path.write_text(f"3 {'11' * 32}\n")
    path.chmod(0o600)
    with pytest.raises(ValueError) as e:
        Settings.from_extra({"pools": ["10.0.0.1"], "auth_key_file": str(path)})
    assert str(e.value) == ("kvswitch connector: kv_connector_extra_config key 'auth_key_file': "
                            f"key file {path} has no key for namespace 1 (no '1 <hex key>' line "
                            "and no master key): its blocks would be neither sealed nor checked")
    s = Settings.from_extra({"pools": ["10.0.0.1"], "auth_key_file": str(path), "namespace": 3})
    assert s.keyring().key_for(3) == bytes.fromhex("11" * 32)
    assert Settings.from_extra({"pools": ["10.0.0.1"]}).keyring() is None
    path.chmod(0o644)
    monkeypatch.setenv(auth.ENV, str(path))
    auth._configured.clear()                    # the process's keyring: read again from it
    with pytest.raises(ValueError, match=r"key 'auth_key_file': \$KVSWITCH_AUTH_KEY_FILE: key "
                                         r"file .*: readable or writable by others"):
        Settings.from_extra({"pools": ["10.0.0.1"], "namespace": 3})
    path.chmod(0o600)
    with pytest.raises(ValueError, match=r"\$KVSWITCH_AUTH_KEY_FILE: key file .* has no key for "
                                         r"namespace 1 "):
        Settings.from_extra({"pools": ["10.0.0.1"]})
    assert Settings.from_extra({"pools": ["10.0.0.1"], "namespace": 3}).keyring().covers(3)


def test_layout_tag_and_keys_are_the_hugging_face_connectors():
    from hostagent.inference.connectors.hf import BlockLayout
    for dtype in (torch.float32, torch.bfloat16):
        ours = PoolLayout(4, 2, 64, dtype, 128, 128)
        theirs = BlockLayout(4, 2, 64, dtype, 128)
        assert ours.tag() == theirs.tag() and ours.block_bytes == theirs.block_bytes
    layout, tokens = _layout(), list(range(3, 30))
    keys = layout.keys(tokens, "m@1")
    assert len(keys) == 3                                       # full 8-token blocks only
    assert keys == block_hashes(tokens, 8, extra=b"m@1|" + layout.tag())
    assert layout.keys(tokens, "m@2") != keys                   # the model is in the key
    assert _layout(dtype=torch.bfloat16).keys(tokens, "m@1") != keys   # and the layout
    with pytest.raises(ValueError, match="multiple"):
        PoolLayout(L, H, D, torch.float32, 6, 4)


# ---- the plan ------------------------------------------------------------------------------
def test_load_targets_map_pool_blocks_onto_vllm_blocks():
    layout = _layout(8, 4)                                       # two vLLM blocks per pool block
    ids = [10, 11, 12, 13, 14, 15]
    assert load_targets(layout, 0, 16, ids) == [[(0, 10), (1, 11)], [(0, 12), (1, 13)]]
    # vLLM holds the first 4 tokens locally: only the second half of pool block 0 is written
    assert load_targets(layout, 4, 16, ids) == [[(1, 11)], [(0, 12), (1, 13)]]
    assert load_targets(layout, 8, 24, ids) == [[(0, 12), (1, 13)], [(0, 14), (1, 15)]]
    with pytest.raises(ValueError):
        load_targets(layout, 0, 12, ids)                         # not a pool block boundary


def test_planner_loads_the_hit_and_saves_each_new_full_block_once():
    layout = _layout(8, 4)
    p = Planner(layout, "m")
    prompt = list(range(3, 3 + 37))                 # 4 full pool blocks + 5 tokens
    keys = p.keys(prompt)
    assert p.loadable(len(prompt)) == 4 and p.loadable(32) == 3   # never the last token
    assert p.matched("r", keys, 2, 0) == 16         # the pool has blocks 0 and 1
    p.allocated("r", 16)
    ids = list(range(100, 110))
    # chunked prefill: 8 of the 21 remaining tokens in this step
    plan = p.build([("r", prompt, ids, 16, 8)], [])
    [ld] = plan.loads
    assert (ld.keys, ld.first, ld.tokens) == (keys[:2], 0, 16)
    assert ld.targets == [[(0, 100), (1, 101)], [(0, 102), (1, 103)]]
    [sv] = plan.saves                               # block 2 is now computed
    assert (sv.keys, sv.first, sv.ids) == ([keys[2]], 2, [[104, 105]])
    plan = p.build([], [("r", False, [], 24, 13)])  # the rest of the prompt
    assert not plan.loads and [(s.keys, s.ids) for s in plan.saves] == [([keys[3]], [[106, 107]])]
    plan = p.build([], [("r", False, [110], 37, 1)])  # decoding: nothing more
    assert not plan.loads and not plan.saves
    p.build([], [], finished=["r"])
    assert not p._tracked


def test_planner_with_a_local_hit_a_miss_and_roles():
    layout = _layout(8, 4)
    p = Planner(layout, "m")
    prompt = list(range(3, 3 + 25))
    keys = p.keys(prompt)
    assert p.matched("a", keys, 3, 20) == 4         # vLLM holds 20 tokens: load 20..24
    p.allocated("a", 4)
    [ld] = p.build([("a", prompt, list(range(7)), 24, 1)], []).loads
    assert (ld.first, ld.keys, ld.targets, ld.tokens) == (2, [keys[2]], [[(1, 5)]], 4)
    assert p.matched("b", keys, 0, 0) == 0          # a miss: nothing loaded, all saved
    p.allocated("b", 0)
    plan = p.build([("b", prompt, list(range(7)), 0, 25)], [])
    assert not plan.loads and plan.saves[0].keys == keys
    consumer = Planner(layout, "m", save=False)
    consumer.matched("c", keys, 0, 0)
    assert not consumer.build([("c", prompt, list(range(7)), 0, 25)], []).saves
    producer = Planner(layout, "m", load=False)
    assert producer.matched("d", keys, 3, 0) == 0   # found blocks are not saved again
    plan = producer.build([("d", prompt, list(range(7)), 0, 25)], [])
    assert not plan.loads and not plan.saves


def test_planner_reloads_a_preempted_request_and_forgets_an_aborted_one():
    """vLLM's scheduler may preempt a request (its blocks freed) and resume it later with new
    blocks: the connector is asked again and loads again into the new blocks. A request
    aborted after its blocks were allocated but before it ran loads nothing."""
    layout = _layout(8, 4)
    p = Planner(layout, "m")
    prompt = list(range(3, 3 + 25))
    keys = p.keys(prompt)
    assert p.matched("r", keys, 3, 0) == 24
    p.allocated("r", 24)
    [first] = p.build([("r", prompt, list(range(10, 17)), 0, 25)], []).loads
    assert first.targets[0] == [(0, 10), (1, 11)]
    # preempted; on resumption vLLM asks again (the pool still has the blocks) with new blocks
    assert p.matched("r", keys, 3, 0) == 24
    p.allocated("r", 24)
    [again] = p.build([], [("r", True, list(range(40, 47)), 0, 25)]).loads
    assert again.keys == keys[:3] and again.targets == [[(0, 40), (1, 41)], [(0, 42), (1, 43)],
                                                        [(0, 44), (1, 45)]]
    # aborted between allocation and its first step: nothing is loaded for it
    assert p.matched("x", keys, 3, 0) == 24
    p.allocated("x", 24)
    assert not p.build([], [], finished=["x"]).loads
    assert not p.build([("y", prompt, list(range(7)), 0, 25)], []).loads
    assert "x" not in p._loads and "x" not in p._tracked


# ---- copies between the paged cache and pool blocks ----------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_blocks_have_the_pool_layout_and_round_trip(dtype):
    layout = _layout(8, 4, dtype)
    torch.manual_seed(0)
    # vLLM's CPU paged cache: per layer [num_blocks, kv_heads, block_size, 2 * head_dim], each
    # (block, head) holding K [block_size, head_dim] then V
    caches = [torch.randn(6, H, 4, 2 * D).to(dtype) for _ in range(L)]
    raw = PagedKV(caches, layout).read([3, 1])
    assert len(raw) == layout.block_bytes
    block = torch.frombuffer(bytearray(raw), dtype=dtype).view(layout.shape)  # [L,2,H,bt,D]
    for li in range(L):
        kv = caches[li].view(6, H, 2, 4, D)
        for half, vid in enumerate([3, 1]):
            for which in (0, 1):                               # K, V
                assert torch.equal(block[li, which, :, half * 4:(half + 1) * 4],
                                   kv[vid, :, which])
    fresh = [torch.zeros_like(c) for c in caches]
    paged = PagedKV(fresh, layout)
    paged.write(raw, [(0, 5), (1, 0)])
    for li in range(L):
        assert torch.equal(fresh[li][5], caches[li][3]) and torch.equal(fresh[li][0], caches[li][1])
        assert not fresh[li][1:5].any()                        # nothing else written
    paged.write(memoryview(raw), [(1, 2)])                     # any buffer; only part of it
    assert torch.equal(fresh[0][2], caches[0][1])
    with pytest.raises(ValueError, match="bytes"):
        paged.write(raw[:-2], [(0, 0)])


@pytest.mark.parametrize("codec", ["int8", "fp8", "int4"])
def test_coded_blocks_round_trip_through_the_paged_cache(codec):
    """kv_codec: PagedKV.read encodes, PagedKV.write decodes into the paged cache (bounded error);
    the coded block is smaller and its keys are the codec's own."""
    from hostagent.inference import codec as codecs
    layout = PoolLayout(L, H, D, torch.float32, 8, 4, codec)
    raw_layout = _layout(8, 4)
    torch.manual_seed(0)
    caches = [torch.randn(6, H, 4, 2 * D) for _ in range(L)]
    coded = PagedKV(caches, layout).read([3, 1])
    assert len(coded) == layout.coded_bytes < layout.block_bytes
    assert layout.nchunks(64) == -(-layout.coded_bytes // 64)
    fresh = [torch.zeros_like(c) for c in caches]
    PagedKV(fresh, layout).write(coded, [(0, 5), (1, 0)])
    exact = torch.frombuffer(bytearray(PagedKV(caches, raw_layout).read([3, 1])),
                             dtype=torch.float32).view(raw_layout.shape)
    bound = codecs.max_abs_error_bound(codec, exact, 8)
    for li in range(L):
        assert (fresh[li][5] - caches[li][3]).abs().max() <= bound
        assert (fresh[li][0] - caches[li][1]).abs().max() <= bound
        assert not fresh[li][1:5].any()
    tokens = list(range(3, 30))
    assert layout.keys(tokens, "m") != raw_layout.keys(tokens, "m")
    with pytest.raises(ValueError, match="bytes"):
        PagedKV(fresh, layout).write(coded[:-1], [(0, 0)])


def test_settings_refuse_an_unknown_codec_in_one_line():
    assert Settings.from_extra({"pools": ["10.0.0.1"], "kv_codec": "int4"}).kv_codec == "int4"
    with pytest.raises(ValueError, match="unknown KV codec 'zstd'") as e:
        Settings.from_extra({"pools": ["10.0.0.1"], "kv_codec": "zstd"})
    assert "\n" not in str(e.value)


def test_a_failed_block_ends_the_load_there():
    layout = _layout(8, 4)
    caches = [torch.zeros(6, H, 4, 2 * D) for _ in range(L)]
    paged = PagedKV(caches, layout)
    good = [bytes([i + 1]) * layout.block_bytes for i in range(3)]
    ld = LoadSpec("r", [b"k0", b"k1", b"k2"], 0, [[(0, 0), (1, 1)], [(0, 2), (1, 3)],
                                                  [(0, 4), (1, 5)]], 24)

    def queued(*items):
        q = queue.SimpleQueue()
        for item in items:
            q.put(item)
        return q

    ok = TransferStats(chunks=2, bytes=layout.block_bytes)
    # blocks arrive out of order; block 1 is missing: block 2 is written but not counted
    q = queued((2, good[2], ok), (0, good[0], ok), (1, BlockNotFound("gone"), None))
    loaded, stats, error = drain_load(ld, q, paged, 5)
    assert (loaded, stats.chunks) == (1, 4) and "gone" in error
    assert caches[0][1].view(-1)[0].item() == torch.frombuffer(bytearray(good[0][:4]),
                                                               dtype=torch.float32).item()
    loaded, _, error = drain_load(ld, queued((0, good[0], ok), (1, good[1][:-4], ok),
                                             (2, good[2], ok)), paged, 5)
    assert loaded == 1 and "bytes" in error                      # a block of the wrong size
    loaded, _, error = drain_load(ld, queued((0, good[0], ok), (2, good[2], ok)), paged,
                                  0.2)
    assert loaded == 1 and "no block" in error                   # block 1 never came
    assert drain_load(ld, queued(*((i, good[i], ok) for i in range(3))), paged, 5)[::2] == (3, None)

    from hostagent.common.block import Block
    released = []

    def zero_copy(i):                  # a client's Block: a view, released once copied
        return Block(1, bytes(16), 1, np.frombuffer(good[i], np.uint8), ok,
                     lambda: released.append(i))

    caches[0].zero_()
    q = queued(*((i, zero_copy(i), ok) for i in range(3)))
    assert drain_load(ld, q, paged, 5)[::2] == (3, None) and sorted(released) == [0, 1, 2]
    assert caches[0][5].view(-1)[0].item() == torch.frombuffer(bytearray(good[2][:4]),
                                                               dtype=torch.float32).item()


# ---- the I/O backend against a loopback pool node ------------------------------------------
@pytest.fixture
def pool():
    """A pool node served on 127.0.0.1 by its own event loop thread: its address."""
    with pool_in_thread() as addr:
        yield addr


def test_backend_probes_fetches_and_saves(pool):
    layout = PoolLayout(L, H, D, torch.float32, 32, 16)
    s = Settings.from_extra({"pools": [pool], "chunk_size": 256, "namespace": 4})
    b = PoolBackend(s)
    keys = layout.keys(list(range(3, 3 + 4 * 32)), "m")
    blocks = [bytes([i + 1]) * layout.block_bytes for i in range(4)]
    nchunks = layout.nchunks(256)
    assert b.probe(4, keys)[0] == 0                                    # an empty pool
    b.save(4, keys[:3], blocks[:3])
    assert b.flush(20)
    found, stats = b.probe(4, keys)
    assert found == 3 and stats.chunks == 3 and stats.from_pool == 3   # one chunk a block
    assert b.probe(5, keys)[0] == 0                                    # namespaces apart
    q = b.fetch(4, keys, nchunks)
    got = dict((i, (data, st)) for i, data, st in (q.get(timeout=20) for _ in keys))
    assert all(got[i][0].tobytes() == blocks[i] and got[i][1].chunks == nchunks
               for i in range(3))
    assert got[3][1] is None and isinstance(got[3][0], BlockNotFound)
    b.save(4, keys[:1], [blocks[1]])                                   # other bits: refused
    assert b.flush(20) and b.save_refused == 1

    class Seam:                        # the line-rate fetch engine plugs in as ``getter``
        calls = 0

        async def get_block_view(self, ns, key, nchunks=None):
            Seam.calls += 1
            return await b.client.get_block_view(ns, key, nchunks=nchunks)

    b.getter = Seam()
    q = b.fetch(4, keys[:2], nchunks)
    assert sorted(q.get(timeout=20)[0] for _ in range(2)) == [0, 1] and Seam.calls == 2


def test_only_silence_takes_a_pool_node_out_of_use():
    """A transfer that timed out with answers is congestion (a busy pool link), not a dead
    node: it must not stop the connector from using the node."""
    from hostagent.common.transfer import NoAnswer, TransferTimeout
    from hostagent.inference.fetch.engine import NoReply
    from hostagent.common.transfer import unreachable
    assert unreachable(NoAnswer("none answered")) and unreachable(NoReply("no reply"))
    assert unreachable(ConnectionRefusedError()) and unreachable(OSError(101, "unreachable"))
    assert not unreachable(TransferTimeout("53 chunk(s) still missing"))
    assert not unreachable(BlockNotFound("gone")) and not unreachable(TimeoutError())


def test_a_silent_pool_node_is_skipped_for_a_while_with_one_log_line(caplog):
    """Nothing answers at the pool's address: the first probe waits its deadline, says miss and
    logs one line; while the node is out of use probes say miss at once and saves are dropped;
    after the back-off the probe still says miss at once (the scheduler never waits for a
    suspect) and the node is asked again in the background (nothing answers: its back-off
    doubles, no second line)."""
    import socket
    quiet = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)     # bound, never read: silent
    quiet.bind(("127.0.0.1", 0))
    addr = "%s:%d" % quiet.getsockname()
    s = Settings.from_extra({"pools": [addr], "chunk_size": 256, "probe_deadline": 0.3,
                             "retry_s": 0.6, "silence_s": 0.2, "fetch_engine": "off"})
    b = PoolBackend(s)
    node = b.placement.pools[0]
    layout = PoolLayout(L, H, D, torch.float32, 32, 16)
    keys = layout.keys(list(range(3, 3 + 4 * 32)), "m")
    with caplog.at_level("WARNING", logger="vllm.kvswitch"):
        start = time.monotonic()
        assert b.probe(4, keys)[0] == 0
        first = time.monotonic() - start
        start = time.monotonic()
        assert b.probe(4, keys)[0] == 0 and time.monotonic() - start < 0.1   # skipped
        b.save(4, keys[:2], [bytes(layout.block_bytes)] * 2)
        assert b.flush(5) and b.save_dropped == 2 and b.save_failed == 0
        assert b.snapshot()["probes_skipped"] >= 1
        time.sleep(0.7)                                          # the back-off is over
        start = time.monotonic()
        assert b.probe(4, keys)[0] == 0 and time.monotonic() - start < 0.1   # not waited for
        end = time.monotonic() + 5
        while b.placement._down[node][1] < 1.2 and time.monotonic() < end:
            time.sleep(0.02)                                     # the background check
        assert b.placement._down[node][1] == pytest.approx(1.2)  # asked again: still silent
    lines = [r.getMessage() for r in caplog.records if "does not answer" in r.getMessage()]
    assert 0.25 <= first < 2 and len(lines) == 1 and addr in lines[0], lines
    quiet.close()


def test_a_pool_node_back_after_its_silence_is_probed_again(pool):
    """A consumer that only probes (no saves re-ask the node) finds a pool node again once it
    answers: past the back-off the probe says miss at once and checks the node in the
    background; the next probe finds the blocks."""
    from hostagent.common.transfer import NoAnswer
    layout = PoolLayout(L, H, D, torch.float32, 32, 16)
    s = Settings.from_extra({"pools": [pool], "chunk_size": 256, "retry_s": 0.2,
                             "fetch_engine": "off"})
    b = PoolBackend(s)
    keys = layout.keys(list(range(3, 3 + 2 * 32)), "m")
    b.save(4, keys, [bytes(layout.block_bytes)] * 2)
    assert b.flush(20) and b.probe(4, keys)[0] == 2
    node = b.placement.pools[0]
    b.placement.failed(node, "read", NoAnswer("a test's silence"))
    assert b.probe(4, keys)[0] == 0                              # left out: a miss at once
    time.sleep(0.25)
    start = time.monotonic()
    assert b.probe(4, keys)[0] == 0 and time.monotonic() - start < 0.1
    end = time.monotonic() + 5
    while b.placement.suspect(node) and time.monotonic() < end:
        time.sleep(0.02)
    assert not b.placement.suspect(node) and b.probe(4, keys)[0] == 2


# ---- end to end ----------------------------------------------------------------------------
@pytest.mark.e2e
@pytest.mark.timeout(600)
def test_two_vllm_engines_share_a_prefix_through_the_switch(tmp_path):
    try:
        import vllm  # noqa: F401
    except ImportError as exc:
        pytest.fail(f"vLLM is not importable ({exc}): run 'make setup', or "
                    "pip install -e '.[vllm]' (pip install 'kvswitch[vllm]')", pytrace=False)
    from conftest import leaves_no_namespaces
    from testbed.demos.vllm import run_vllm_demo
    out = tmp_path / "vllm.json"
    start = time.monotonic()
    with leaves_no_namespaces("vlt"):
        ok = run_vllm_demo(shared=400, question=16, new_tokens=8, ttft_reps=1, must_win=False,
                           prefix="vlt", json_path=str(out))
    seconds = time.monotonic() - start
    result = json.loads(out.read_text())
    checks = result["checks"]
    assert ok and all(checks.values()), checks
    b = result["h2"]
    assert b["second"]["tokens"] == b["recompute"]["tokens"] == result["h3"]["tokens"]
    assert b["first"]["cached_tokens"] == b["second"]["cached_tokens"] == 384  # 3 whole blocks
    assert b["first"]["load"]["bytes"] == 3 * 128 * 4096                       # over the wire
    assert b["second"]["load"]["from_switch"] == b["second"]["load"]["chunks"] > 0
    assert b["fetch_path"] == "xdp"                      # loads through the XDP fetch engine
    print(f"vLLM e2e: {seconds:.0f} s")
