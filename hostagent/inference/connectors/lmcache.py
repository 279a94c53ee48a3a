"""kvswitch as an LMCache remote store (LMCache 0.5.6): ``KVSwitchConnector``, a
``RemoteConnector``, and ``KVSwitchAdapter``, its ``ConnectorAdapter``, loaded by LMCache's
plugin config (docs/connectors.md has it whole)::

    remote_storage_plugins: ["kvswitch"]
    extra_config:
      remote_storage_plugin.kvswitch.module_path: hostagent.inference.connectors.lmcache
      remote_storage_plugin.kvswitch.class_name: KVSwitchAdapter
      remote_storage_plugin.kvswitch.pools: "198.18.0.101"

or by the legacy ``remote_url: kvswitch://198.18.0.101:19286`` with the same two plugin lines
(LMCache's ``basic_check --mode test_remote`` uses the URL). Every other
``remote_storage_plugin.<name>.*`` key is an option of ``StoreSettings``
(hostagent/inference/connectors/pool_io.py).

A chunk (one MemoryObj) is one block: LMCache's remote metadata (length, shapes, dtypes, memory
format, as its FS connector writes it) followed by the MemoryObj's bytes; its key is
``store_key(model id, layout, CacheEngineKey.to_string())``, the layout being the connector's
full-chunk shapes, dtypes, format and LMCache's chunk size. ``exists`` probes chunk 0 only.
``get`` lands a block in its MemoryObj with one copy out of the fetch engine's arena, on the
I/O thread, where a MemoryObj is free without an eviction; else LMCache's loop allocates.
The wrapper LMCache puts around a connector drops the MemoryObj's reference after ``put``, so
``put`` here does not.

A bad option raises ``PluginConfigError`` at load, after one error-level log line naming it;
so does a ``$KVSWITCH_AUTH_KEY_FILE`` that cannot be used or has no key for the namespace (it is
``auth_key_file``'s default; ``hostagent.inference.connectors.options``). LMCache catches every
``Exception`` a plugin raises while it is created, logs it and runs on with misses only;
``PluginConfigError`` derives from ``BaseException`` so that it stops the engine's start
instead.
"""
from __future__ import annotations

import logging
from typing import List, Optional
from urllib.parse import urlparse

from lmcache.utils import CacheEngineKey
from lmcache.v1.memory_management import MemoryObj
from lmcache.v1.protocol import RemoteMetadata
from lmcache.v1.storage_backend.connector import (ConnectorAdapter, ConnectorContext,
                                                  extract_plugin_type)
from lmcache.v1.storage_backend.connector.base_connector import RemoteConnector

from .store import StoreConfigError, StoreIO, StoreSettings, io_for, store_key

log = logging.getLogger("lmcache.kvswitch")

SCHEME = "kvswitch://"
PLUGIN_TYPE = "kvswitch"
LMCACHE_KEYS = ("module_path", "class_name")       # LMCache's own keys under the prefix


class PluginConfigError(BaseException):
    """A bad plugin option (module docstring: why not an Exception)."""


def plugin_options(extra: dict | None, plugin: str) -> dict:
    """The ``remote_storage_plugin.<plugin>.*`` options of LMCache's ``extra_config``."""
    prefix = f"remote_storage_plugin.{plugin}."
    return {k[len(prefix):]: v for k, v in (extra or {}).items()
            if k.startswith(prefix) and k[len(prefix):] not in LMCACHE_KEYS}


def url_pools(url: str) -> list[str]:
    """The pools of ``kvswitch://IP[:PORT][,IP[:PORT]...]``."""
    rest = url[len(SCHEME):].split("/", 1)[0].split("?", 1)[0]
    return [p for p in rest.split(",") if p]


def settings_for(config, plugin: str | None, url: str | None) -> StoreSettings:
    """The connector's settings from LMCache's config; PluginConfigError (one line, logged
    at error level) names a bad option."""
    name = plugin or PLUGIN_TYPE
    where = f"LMCache plugin {name}"
    options = plugin_options(getattr(config, "extra_config", None), name)
    from_url = bool(url and url.startswith(SCHEME) and "pools" not in options)
    if from_url:
        options["pools"] = url_pools(url)
    try:
        return StoreSettings.from_options(options, where)
    except StoreConfigError as exc:
        key = "remote_url" if exc.key == "pools" and from_url else \
            f"remote_storage_plugin.{name}.{exc.key}"
        msg = str(exc).replace(f"option {exc.key!r}", f"extra_config key {key!r}", 1)
        log.error("%s", msg)
        raise PluginConfigError(msg) from None


class KVSwitchConnector(RemoteConnector):
    """LMCache chunks as kvswitch blocks (module docstring)."""

    def __init__(self, loop, local_cpu_backend, config, metadata=None,
                 plugin_name: str | None = None, url: str | None = None,
                 io: StoreIO | None = None):
        self.settings = settings_for(config, plugin_name, url)
        metadata = metadata if metadata is not None else local_cpu_backend.metadata
        super().__init__(config, metadata)
        self.loop, self.local_cpu_backend = loop, local_cpu_backend
        self.ns = self.settings.namespace
        self.model = self.settings.model_id
        shapes = ",".join("x".join(map(str, s)) for s in self.meta_shapes)
        dtypes = ",".join(str(d).removeprefix("torch.") for d in self.meta_dtypes)
        self.layout = (f"lmcache|{self.meta_fmt.name}|{shapes}|{dtypes}|"
                       f"chunk{metadata.chunk_size}|serde={getattr(config, 'remote_serde', '')}")
        self.io = io or io_for(self.settings)

    def block_key(self, key: CacheEngineKey) -> bytes:
        return store_key(self.model or key.model_name, self.layout, key.to_string())

    # ---- existence -------------------------------------------------------------------------
    async def exists(self, key: CacheEngineKey) -> bool:
        return await self.io.awaitable(self.io.prefix(self.ns, [self.block_key(key)], 1)) == 1

    def exists_sync(self, key: CacheEngineKey) -> bool:
        return self.io.exists(self.ns, self.block_key(key))

    def support_batched_contains(self) -> bool:
        return True

    def batched_contains(self, keys: List[CacheEngineKey]) -> int:
        return self.io.prefix_now(self.ns, [self.block_key(k) for k in keys])

    async def batched_async_contains(self, lookup_id: str, keys: List[CacheEngineKey],
                                     pin: bool = False) -> int:
        return await self.io.awaitable(self.io.prefix(
            self.ns, [self.block_key(k) for k in keys], self.io.settings.concurrency))

    # ---- chunks ----------------------------------------------------------------------------
    async def get(self, key: CacheEngineKey) -> Optional[MemoryObj]:
        """The chunk, landed in a MemoryObj straight from the fetch engine's arena where one
        can be allocated there without waiting for an eviction, else through a copy."""
        got = await self.io.awaitable(
            self.io.get(self.ns, self.block_key(key), lambda view: self._land(key, view)),
            abandoned=_release_landed)           # landed for a caller who gave up
        return self._memory_obj(key, got) if isinstance(got, bytes) else got

    def _meta(self, key: CacheEngineKey, data) -> Optional[RemoteMetadata]:
        """The block's LMCache metadata, or None (logged) when it has none or it lies."""
        head = self.remote_metadata_bytes
        try:
            meta = RemoteMetadata.deserialize(bytes(data[:head]))
        except Exception as exc:
            log.warning("kvswitch: block of %s has no LMCache metadata: %s", key, exc)
            return None
        if meta.length != len(data) - head:
            log.warning("kvswitch: block of %s holds %d bytes, its metadata says %d",
                        key, len(data) - head, meta.length)
            return None
        return meta

    def _land(self, key: CacheEngineKey, view: memoryview):
        """On the I/O thread: the block in a new MemoryObj (one copy, out of the engine's
        arena), its bytes when no MemoryObj is free without an eviction, or None."""
        meta = self._meta(key, view)
        if meta is None:
            return None
        obj = self.local_cpu_backend.allocate(meta.shapes, meta.dtypes, meta.fmt,
                                              busy_loop=False)
        if obj is None:
            return bytes(view)          # LMCache's loop allocates, evicting if it must
        return self._fill(obj, meta, view)

    def _memory_obj(self, key: CacheEngineKey, data: bytes) -> Optional[MemoryObj]:
        meta = self._meta(key, data)
        if meta is None:
            return None
        obj = self.local_cpu_backend.allocate(meta.shapes, meta.dtypes, meta.fmt)
        return None if obj is None else self._fill(obj, meta, memoryview(data))

    def _fill(self, obj: MemoryObj, meta: RemoteMetadata, data: memoryview):
        dst = memoryview(obj.byte_array).cast("B")
        if dst.nbytes < meta.length:
            obj.ref_count_down()
            return None
        dst[:meta.length] = data[self.remote_metadata_bytes:]
        return obj

    async def put(self, key: CacheEngineKey, memory_obj: MemoryObj):
        buf = memoryview(memory_obj.byte_array).cast("B")
        meta = RemoteMetadata(buf.nbytes, memory_obj.get_shapes(), memory_obj.get_dtypes(),
                              memory_obj.get_memory_format())
        data = meta.serialize() + bytes(buf)       # the MemoryObj may be reused once we return
        await self.io.awaitable(self.io.store(self.ns, self.block_key(key), data))

    async def list(self) -> List[str]:
        return []                                  # the pool does not enumerate its blocks

    async def close(self):
        pass                                       # the I/O thread is the process's

    def __repr__(self) -> str:
        return f"<KVSwitchConnector pools={','.join(self.settings.pools)} ns={self.ns}>"


def _release_landed(got) -> None:
    """What a get's I/O returned to a caller who gave up: a landed MemoryObj is released."""
    if got is not None and not isinstance(got, bytes):
        got.ref_count_down()


class KVSwitchAdapter(ConnectorAdapter):
    """Makes ``KVSwitchConnector`` for ``plugin://kvswitch[.instance]`` and
    ``kvswitch://IP[:PORT],...``."""

    def __init__(self) -> None:
        super().__init__(SCHEME)

    def can_parse(self, url: str) -> bool:
        if url.startswith(SCHEME):
            return True
        return (url.startswith("plugin://")
                and extract_plugin_type(url[len("plugin://"):]) == PLUGIN_TYPE)

    def create_connector(self, context: ConnectorContext) -> RemoteConnector:
        url = context.url if context.url.startswith(SCHEME) else None
        if url is not None:
            parsed = urlparse(url.split(",", 1)[0])
            if not parsed.hostname:
                msg = f"kvswitch LMCache plugin: remote_url {url!r} names no pool node"
                log.error("%s", msg)
                raise PluginConfigError(msg)
        return KVSwitchConnector(context.loop, context.local_cpu_backend, context.config,
                                 context.metadata, plugin_name=context.plugin_name, url=url)
