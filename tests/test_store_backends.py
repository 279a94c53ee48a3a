"""The LMCache plugin and the SGLang HiCache backend without a testbed: their key mapping
(distinct for distinct model, layout and chunk; the same in every process), their option
checks (a bad one fails at load with one line naming it, also through LMCache's and SGLang's
own loaders) and keyed authentication through their I/O against a pool node on 127.0.0.1."""
import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from hostagent.inference.connectors.store import (StoreConfigError, StoreIO, StoreSettings,
                                                    store_key)

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
INSTALL_LMCACHE = ("LMCache is missing: run 'make setup' (it runs pip install --no-deps "
                   "lmcache==0.5.6 and installs the 'lmcache' extra)")


def require_lmcache():
    import importlib.util
    if importlib.util.find_spec("lmcache") is None:
        pytest.fail(INSTALL_LMCACHE, pytrace=False)


def require_sglang(load: bool = True):
    from testbed import sglang_wheel
    try:
        sglang_wheel.ensure()
        if load:
            import sglang.srt.mem_cache.hicache_storage  # noqa: F401
    except (ImportError, RuntimeError) as exc:
        pytest.fail(f"SGLang's HiCache interface cannot be imported ({exc}): "
                    f"{sglang_wheel.INSTALL}", pytrace=False)


def fixture(name: str, *args, env: dict | None = None, timeout: float = 120):
    """tests/store_fixtures.py's ``name(*args)`` in a fresh interpreter: (result, stderr)."""
    r = subprocess.run([sys.executable, str(HERE / "store_fixtures.py"), name,
                        json.dumps(args)], capture_output=True, text=True, timeout=timeout,
                       cwd=ROOT, env={**os.environ, **(env or {})})
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout.strip().splitlines()[-1]), r.stderr


# ---- keys ----------------------------------------------------------------------------------
def test_store_keys_differ_by_model_layout_and_chunk():
    base = ("smollm2@abc", "lmcache|KV_2LTD|2x30x256x192|float32|chunk256", "chunk-1")
    keys = {store_key(*base),
            store_key("smollm2@abd", *base[1:]),
            store_key(base[0], base[1].replace("float32", "bfloat16"), base[2]),
            store_key(base[0], base[1], "chunk-2"),
            # the fields are length-prefixed: moving a byte across a boundary is another key
            store_key(base[0] + "l", base[1][1:], base[2])}
    assert len(keys) == 5 and all(len(k) == 16 for k in keys)
    assert store_key(*base) == store_key(*base)
    assert store_key("m", "l", "n") == store_key("m", "l", b"n")
    # pinned: a key must never change between versions (blocks in pools would be orphaned)
    assert store_key("m", "l", "n").hex() == _reference_key("m", "l", "n")


def _reference_key(model: str, layout: str, name: str) -> str:
    import hashlib
    f = lambda b: len(b).to_bytes(4, "little") + b  # noqa: E731
    return hashlib.sha256(b"kvpool/store/v1" + f(model.encode()) + f(layout.encode()) +
                          f(name.encode())).digest()[:16].hex()


def test_store_keys_are_the_same_in_another_process():
    args = [("smollm2", "sglang|v1|tp0/1", f"page-{i}") for i in range(20)]
    code = ("import json, sys; from hostagent.inference.connectors.store import store_key; "
            "print(json.dumps([store_key(*a).hex() for a in json.loads(sys.argv[1])]))")
    outs = [subprocess.run([sys.executable, "-c", code, json.dumps(args)], capture_output=True,
                           text=True, check=True, cwd=ROOT,
                           env={**os.environ, "PYTHONHASHSEED": seed}).stdout
            for seed in ("1", "2")]
    assert json.loads(outs[0]) == json.loads(outs[1]) == [store_key(*a).hex() for a in args]


@pytest.mark.filterwarnings("ignore::DeprecationWarning")     # LMCache's opentelemetry
def test_lmcache_keys_carry_model_layout_and_chunk():
    require_lmcache()
    import torch
    from lmcache.utils import CacheEngineKey
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.metadata import LMCacheMetadata
    from hostagent.inference.connectors.lmcache import KVSwitchConnector

    def connector(dtype=torch.float32, heads=3, model_id=None):
        extra = {"remote_storage_plugin.kvswitch.pools": "127.0.0.1:9",
                 "remote_storage_plugin.kvswitch.fetch_engine": "off"}
        if model_id:
            extra["remote_storage_plugin.kvswitch.model_id"] = model_id
        config = LMCacheEngineConfig.from_dict({"chunk_size": 256, "extra_config": extra})
        meta = LMCacheMetadata(model_name="m", world_size=1, local_world_size=1, worker_id=0,
                               local_worker_id=0, kv_dtype=dtype,
                               kv_shape=(30, 2, 256, heads, 64))
        return KVSwitchConnector(None, None, config, meta, plugin_name="kvswitch")

    def key(model="m", chunk=1, dtype=torch.float32):
        return CacheEngineKey(model_name=model, world_size=1, worker_id=0, chunk_hash=chunk,
                              dtype=dtype)

    c = connector()
    keys = {c.block_key(key()), c.block_key(key(chunk=2)), c.block_key(key(model="m2")),
            connector(heads=2).block_key(key()),
            connector(dtype=torch.bfloat16).block_key(key(dtype=torch.bfloat16)),
            connector(model_id="m@sha").block_key(key())}
    assert len(keys) == 6
    assert c.block_key(key()) == connector().block_key(key())
    assert "2x30x256x192" in c.layout and "float32" in c.layout and "chunk256" in c.layout


# ---- options -------------------------------------------------------------------------------
@pytest.mark.parametrize("options, named", [
    ({"pools": "198.18.0.101", "colour": "red"}, "colour"),
    ({"pools": "no-such-host.invalid"}, "pools"),
    ({"pools": "198.18.0.101:99999"}, "pools"),
    ({}, "pools"),
    ({"pools": "198.18.0.101", "chunk_size": 1001}, "chunk_size"),
    ({"pools": "198.18.0.101", "deadline": 0}, "deadline"),
    ({"pools": "198.18.0.101", "fetch_engine": "xdp"}, "fetch_engine"),
    ({"pools": "198.18.0.101", "namespace": "one"}, "namespace"),
    ({"pools": "198.18.0.101", "auth_key_file": "/nonexistent/key"}, "auth_key_file"),
    ({"pools": "0.0.0.0"}, "pools"),                   # addresses no pool node can have
    ({"pools": "198.18.0.101,255.255.255.255"}, "pools"),
    ({"pools": ["224.0.0.1"]}, "pools"),
    ({"pools": "5"}, "pools"),                         # 0.0.0.5
    ({"pools": "198.18.0.101", "deadline": 1e-9}, "deadline"),
    ({"pools": "198.18.0.101", "probe_deadline": 0.0009}, "probe_deadline"),
    ({"pools": "198.18.0.101", "namespace": -1}, "namespace"),
    ({"pools": "198.18.0.101", "namespace": 1 << 32}, "namespace"),
])
def test_a_bad_option_is_one_line_naming_it(options, named):
    with pytest.raises(StoreConfigError) as e:
        StoreSettings.from_options(options, "test")
    assert e.value.key == named and f"option {named!r}" in str(e.value)
    assert "\n" not in str(e.value)


def test_the_options_must_be_a_mapping():
    with pytest.raises(StoreConfigError) as e:
        StoreSettings.from_options(["pools", "198.18.0.101"], "test")
    assert str(e.value) == ("kvswitch test: the options must be a mapping of option names to "
                            "values (a JSON object), not a list")


@pytest.mark.parametrize("options", [
    {"pools": "127.0.0.1,10.0.0.1:7,192.168.1.2,localhost"},   # loopback and private
    {"pools": "198.18.0.101", "namespace": 0},
    {"pools": "198.18.0.101", "namespace": 0xFFFFFFFF},
    {"pools": "198.18.0.101", "deadline": 0.001, "probe_deadline": 3600},
    {"pools": "198.18.0.101", "retry_s": 0.0001},                # not a deadline
])
def test_good_values_pass(options):
    s = StoreSettings.from_options(options, "test")
    assert all(getattr(s, k) == (tuple(v.split(",")) if k == "pools" else v)
               for k, v in options.items())


# ---- the key file must cover the namespace -----------------------------------------------
@pytest.fixture
def no_process_keyring(monkeypatch):
    """The process's keyring unset (it is read from $KVSWITCH_AUTH_KEY_FILE on first use)."""
    from hostagent.common import auth
    monkeypatch.setattr(auth, "_configured", [])
    monkeypatch.delenv(auth.ENV, raising=False)
    return monkeypatch


def test_a_key_file_without_the_namespace_is_refused(tmp_path, no_process_keyring):
    ns3 = tmp_path / "ns3.key"
    ns3.write_text(f"3 {'11' * 32}\n")
    ns3.chmod(0o600)
    with pytest.raises(StoreConfigError) as e:
        StoreSettings.from_options({"pools": "198.18.0.101", "auth_key_file": str(ns3)}, "t")
    assert str(e.value) == (f"kvswitch t: option 'auth_key_file': key file {ns3} has no key "
                            "for namespace 1 (no '1 <hex key>' line and no master key): its "
                            "blocks would be neither sealed nor checked")
    s = StoreSettings.from_options({"pools": "198.18.0.101", "auth_key_file": str(ns3),
                                    "namespace": 3}, "t")
    assert s.keyring().covers(3)
    master = _key_file(tmp_path / "master.key", "22" * 32)    # a master key covers them all
    for ns in (0, 1, 0xFFFFFFFF):
        StoreSettings.from_options({"pools": "198.18.0.101", "auth_key_file": master,
                                    "namespace": ns}, "t")
    assert StoreSettings.from_options({"pools": "198.18.0.101"}, "t").keyring() is None


def test_the_environments_key_file_is_checked_as_the_options_default(tmp_path,
                                                                    no_process_keyring):
    """$KVSWITCH_AUTH_KEY_FILE is auth_key_file's default: unusable (mode 644) or without the
    namespace, it is a bad option at the option check, not a ValueError when the I/O starts."""
    from hostagent.common import auth
    path = tmp_path / "env.key"
    path.write_text(f"3 {'11' * 32}\n")
    path.chmod(0o644)
    no_process_keyring.setenv(auth.ENV, str(path))
    with pytest.raises(StoreConfigError) as e:
        StoreSettings.from_options({"pools": "198.18.0.101", "namespace": 3}, "t")
    assert str(e.value) == (f"kvswitch t: option 'auth_key_file': $KVSWITCH_AUTH_KEY_FILE: key "
                            f"file {path}: readable or writable by others (chmod 600 it)")
    path.chmod(0o600)
    with pytest.raises(StoreConfigError, match=r"\$KVSWITCH_AUTH_KEY_FILE: key file .* has no "
                                               r"key for namespace 1 "):
        StoreSettings.from_options({"pools": "198.18.0.101"}, "t")
    s = StoreSettings.from_options({"pools": "198.18.0.101", "namespace": 3}, "t")
    assert s.keyring() is auth.current() and s.keyring().covers(3)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")     # LMCache's opentelemetry
def test_lmcache_plugin_refuses_an_unusable_environment_key_file(tmp_path, no_process_keyring):
    """At the plugin's option check, as every bad option: PluginConfigError (which LMCache
    does not turn into a warning and misses), one error line naming it."""
    require_lmcache()
    from hostagent.common import auth
    from hostagent.inference.connectors.lmcache import PluginConfigError, settings_for
    path = tmp_path / "env.key"
    path.write_text("ab" * 32 + "\n")
    path.chmod(0o644)
    no_process_keyring.setenv(auth.ENV, str(path))

    class Config:
        extra_config = {"remote_storage_plugin.kvswitch.pools": "198.18.0.101"}

    with pytest.raises(PluginConfigError) as e:
        settings_for(Config(), "kvswitch", None)
    assert str(e.value) == ("kvswitch LMCache plugin kvswitch: extra_config key "
                            "'remote_storage_plugin.kvswitch.auth_key_file': "
                            f"$KVSWITCH_AUTH_KEY_FILE: key file {path}: readable or writable "
                            "by others (chmod 600 it)")


def test_lmcache_refuses_a_bad_option_at_load_loudly(tmp_path):
    """Through LMCache's own plugin loading: the engine's start fails (LMCache would catch an
    Exception and run on with misses only) and one error line names the option; so does an
    unusable key file in $KVSWITCH_AUTH_KEY_FILE (auth_key_file's default), which used to pass
    the check and fail as a ValueError LMCache turned into a warning and misses."""
    require_lmcache()
    env_key = tmp_path / "env.key"
    env_key.write_text("ab" * 32 + "\n")
    env_key.chmod(0o644)
    (colour, host, key), err = fixture("lmcache_load", ["127.0.0.1:9", {"colour": "red"}],
                                       ["no-such-host.invalid", {}], ["127.0.0.1:9", {}],
                                       env={"KVSWITCH_AUTH_KEY_FILE": str(env_key)})
    assert colour["raised"] == "PluginConfigError"
    assert "'remote_storage_plugin.kvswitch.colour': unknown option" in colour["message"]
    assert host["raised"] == "PluginConfigError"
    assert "'remote_storage_plugin.kvswitch.pools': pool address" in host["message"]
    assert key["raised"] == "PluginConfigError"
    assert ("'remote_storage_plugin.kvswitch.auth_key_file': $KVSWITCH_AUTH_KEY_FILE: key file "
            f"{env_key}: readable or writable by others (chmod 600 it)") in key["message"]
    errors = [ln for ln in err.splitlines() if "ERROR" in ln and "kvswitch" in ln]
    assert len(errors) == 3, err[-2000:]                       # one line per bad config
    assert "remote_storage_plugin.kvswitch.colour" in errors[0]
    assert "no-such-host.invalid" in errors[1]
    assert "KVSWITCH_AUTH_KEY_FILE" in errors[2]


SGLANG_LINES = {"backend_name": "kvswitch", "module_path": "hostagent.inference.connectors.sglang",
                "class_name": "KVSwitchStore"}


def test_sglang_factory_refuses_a_bad_option():
    """Through SGLang's own ``dynamic`` factory (in a fresh interpreter: importing SGLang sets
    environment variables and warning filters)."""
    require_sglang(load=False)
    got, err = fixture("sglang_load", {**SGLANG_LINES, "interface_v1": 1,
                                       "pools": "127.0.0.1:9", "colour": "red"})
    assert got["raised"] == "StoreConfigError", (got, err[-2000:])
    assert got["message"].startswith("kvswitch SGLang HiCache backend: option 'colour': "
                                     "unknown option") and "\n" not in got["message"]
    got, _ = fixture("sglang_load", {**SGLANG_LINES, "pools": "256.1.1.1"})
    assert got["raised"] == "StoreConfigError" and "option 'pools'" in got["message"]


# ---- keyed authentication ------------------------------------------------------------------
@pytest.fixture
def pool_node(tmp_path):
    """A pool node (``hostagent serve``) on 127.0.0.1 at a free port: its address."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "hostagent", "serve", "--bind", "127.0.0.1",
                             "--port", str(port), "--capacity", "16MiB"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        for line in proc.stdout:
            if "ready" in line:
                break
        else:
            pytest.fail(f"the pool node did not start (exit {proc.wait()})")
        yield f"127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(10)


def _key_file(path: Path, hexkey: str) -> str:
    path.write_text(f"* {hexkey}\n")
    path.chmod(0o600)
    return str(path)


def test_blocks_are_sealed_with_the_configured_key(pool_node, tmp_path):
    key_a = _key_file(tmp_path / "a.key", "11" * 32)
    key_b = _key_file(tmp_path / "b.key", "22" * 32)
    common = {"pools": pool_node, "fetch_engine": "off", "deadline": 2, "probe_deadline": 1}
    writer = StoreIO(StoreSettings.from_options({**common, "auth_key_file": key_a}, "t"))
    same = StoreIO(StoreSettings.from_options({**common, "auth_key_file": key_a,
                                               "window": 32}, "t"))
    other = StoreIO(StoreSettings.from_options({**common, "auth_key_file": key_b,
                                                "window": 16}, "t"))
    try:
        data, key = os.urandom(5000), store_key("m", "l", "sealed")
        assert writer.put_many(1, [key], [data]) == [True]
        assert same.get_many(1, [key], [bytes]) == [data]
        assert same.prefix_now(1, [key, store_key("m", "l", "absent")]) == 1
        assert other.get_many(1, [key], [bytes]) == [None]       # its tag fails: a miss
        assert other.counts["misses"] == 1
    finally:
        for io in (writer, same, other):
            io.close()


def test_sglang_generic_interface_round_trip(pool_node):
    """``set``/``batch_set`` store the flat tensors SGLang hands over, ``get``/``batch_get``
    fill its targets (or return bytes), ``exists``/``batch_exists`` probe; v1 keys are apart."""
    require_sglang(load=False)
    got, err = fixture("sglang_generic", {**SGLANG_LINES, "pools": pool_node,
                                          "fetch_engine": "off", "deadline": 2,
                                          "probe_deadline": 1})
    assert got == {"set": True, "batch_set": True, "exists": [True, False], "batch_exists": 3,
                   "get_is_target": True, "get_exact": True,
                   "batch_get_exact": [True] * 4, "v1_of_flat": [False]}, err[-2000:]


def test_docs_name_every_option():
    text = (ROOT / "docs" / "connectors.md").read_text()
    for name in StoreSettings.__dataclass_fields__:
        assert re.search(rf"`{name}`", text), name


@pytest.mark.filterwarnings("ignore::DeprecationWarning")     # LMCache's opentelemetry
def test_lmcache_chunks_land_in_memory_objs_bit_exact(pool_node):
    """``get`` lands a chunk in a MemoryObj on the I/O thread when LMCache has one free without
    an eviction, else hands the bytes to LMCache's loop, which allocates (evicting if it must);
    a block whose metadata lies is a miss; a landed chunk whose caller gave up is released
    (``test_a_result_the_caller_gave_up_on_is_handed_back`` shows when that is called)."""
    require_lmcache()
    import asyncio
    import torch
    from lmcache.utils import CacheEngineKey
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.memory_management import MemoryFormat
    from lmcache.v1.metadata import LMCacheMetadata
    from hostagent.inference.connectors.lmcache import KVSwitchConnector, _release_landed

    class Obj:                       # a MemoryObj as the connector uses one
        def __init__(self, shapes, dtypes, fmt):
            self.shapes, self.dtypes, self.fmt = shapes, dtypes, fmt
            self.byte_array = bytearray(sum(torch.empty(s, dtype=d).nbytes
                                            for s, d in zip(shapes, dtypes)))
            self.refs = 1

        def get_shapes(self):
            return self.shapes

        def get_dtypes(self):
            return self.dtypes

        def get_memory_format(self):
            return self.fmt

        def ref_count_down(self):
            self.refs -= 1

    class Backend:                   # LocalCPUBackend.allocate: None without room to spare
        def __init__(self):
            self.room, self.calls = True, []

        def allocate(self, shapes, dtypes, fmt, busy_loop=True):
            self.calls.append(busy_loop)
            return Obj(shapes, dtypes, fmt) if self.room or busy_loop else None

    extra = {"remote_storage_plugin.kvswitch.pools": pool_node,
             "remote_storage_plugin.kvswitch.fetch_engine": "off",
             "remote_storage_plugin.kvswitch.deadline": 2}
    config = LMCacheEngineConfig.from_dict({"chunk_size": 256, "extra_config": extra})
    meta = LMCacheMetadata(model_name="m", world_size=1, local_world_size=1, worker_id=0,
                           local_worker_id=0, kv_dtype=torch.bfloat16,
                           kv_shape=(2, 2, 256, 1, 64))
    backend = Backend()
    c = KVSwitchConnector(None, backend, config, meta, plugin_name="kvswitch")
    key = CacheEngineKey(model_name="m", world_size=1, worker_id=0, chunk_hash=7,
                         dtype=torch.bfloat16)
    src = Obj([torch.Size((2, 2, 256, 64))], [torch.bfloat16], MemoryFormat.KV_2LTD)
    src.byte_array[:] = os.urandom(len(src.byte_array))
    asyncio.run(c.put(key, src))
    got = asyncio.run(c.get(key))                       # landed on the I/O thread
    assert backend.calls == [False] and got.byte_array == src.byte_array
    backend.room, backend.calls = False, []
    got = asyncio.run(c.get(key))                       # no room there: LMCache's loop
    assert backend.calls == [False, True] and got.byte_array == src.byte_array
    liar = CacheEngineKey(model_name="m", world_size=1, worker_id=0, chunk_hash=8,
                          dtype=torch.bfloat16)
    assert c.io.put_many(c.ns, [c.block_key(liar)], [b"\0" * 4096]) == [True]
    assert asyncio.run(c.get(liar)) is None
    landed = Obj(src.shapes, src.dtypes, src.fmt)
    _release_landed(landed)
    _release_landed(b"bytes are collected")
    _release_landed(None)
    assert landed.refs == 0


def test_a_result_the_caller_gave_up_on_is_handed_back():
    """``await_on(..., abandoned=f)``: a caller cancelled while its coroutine finishes on the
    I/O loop (before the cancel reaches that loop) never sees the result, and ``f`` gets it,
    once; a result the caller receives, or a coroutine cancelled before it finished, never
    reaches ``f``. A real cancellation across two loops, not a hand-made future."""
    import asyncio
    import threading
    from hostagent.inference.connectors.pool_io import await_on

    io = asyncio.new_event_loop()
    thread = threading.Thread(target=io.run_forever, daemon=True)
    thread.start()
    handed: list = []
    started, release = threading.Event(), threading.Event()

    async def lands_late():
        started.set()
        release.wait(10)             # holds the I/O loop: the caller's cancel waits behind it
        return "memory obj"

    async def slow():
        await asyncio.sleep(10)
        return "never"

    async def main():
        caller = asyncio.ensure_future(await_on(io, lands_late(), handed.append))
        while not started.is_set():
            await asyncio.sleep(0.01)
        caller.cancel()
        with pytest.raises(asyncio.CancelledError):
            await caller
        assert handed == []          # not finished yet: nothing to give back
        release.set()
        for _ in range(500):
            if handed:
                break
            await asyncio.sleep(0.01)
        assert handed == ["memory obj"]
        assert await await_on(io, asyncio.sleep(0, "kept"), handed.append) == "kept"
        caller = asyncio.ensure_future(await_on(io, slow(), handed.append))
        await asyncio.sleep(0.1)
        caller.cancel()
        with pytest.raises(asyncio.CancelledError):
            await caller
        await asyncio.sleep(0.2)
        assert handed == ["memory obj"]

    try:
        asyncio.run(main())
    finally:
        io.call_soon_threadsafe(io.stop)
        thread.join(5)
