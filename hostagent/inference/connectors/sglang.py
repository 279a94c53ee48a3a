"""kvswitch as an SGLang HiCache storage backend (SGLang 0.5.23): ``KVSwitchStore``, a
``HiCacheStorage`` with the generic interface (``get``/``batch_get``/``set``/``batch_set``/
``exists``), the zero-copy v1 batch interface (``batch_get_v1``/``batch_set_v1(keys,
host_indices, extra_info)``) and ``batch_exists``. SGLang makes it through its backend factory::

    --enable-hierarchical-cache --hicache-storage-backend dynamic
    --hicache-storage-backend-extra-config '{"backend_name": "kvswitch",
        "module_path": "hostagent.inference.connectors.sglang", "class_name": "KVSwitchStore",
        "interface_v1": 1, "pools": "198.18.0.101", "namespace": 1}'

Every key of the extra config besides SGLang's own (``SGLANG_KEYS``) is a ``StoreSettings``
option (connectors/pool_io.py); a bad one fails the backend's creation with one line
naming it.

A page is one block. v1: the page's regions of the host pool, as the pool's
``get_page_buffer_meta`` lists them (K and V, per layer or not as its layout has it), back to
back; the generic interface stores the flat tensor it is given. The two never share keys: the
interface is part of the layout in ``store_key(model, layout, SGLang's page hash)``, with the
pool's layout, dtype, page size and page bytes and, unless the model's KV is replicated across
ranks (MLA), the tensor- and pipeline-parallel rank. Existence probes chunk 0 alone; a pool
node that does not answer makes misses for a back-off, one log line (connectors.pool_io).
"""
from __future__ import annotations

import ctypes
import logging
from typing import Any, List, Optional

import numpy as np
import torch

from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig

from .store import StoreIO, StoreSettings, io_for, store_key

log = logging.getLogger("sglang.kvswitch")

# keys of the extra config that SGLang reads itself (the dynamic factory, the cache controller)
SGLANG_KEYS = ("backend_name", "module_path", "class_name", "interface_v1", "tp_lcm_size",
               "enable_metadata_cache", "metadata_ttl")


class KVSwitchStore(HiCacheStorage):
    """SGLang's pages as kvswitch blocks (module docstring)."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: Any = None,
                 io: StoreIO | None = None):
        extra = dict(storage_config.extra_config or {})
        options = {k: v for k, v in extra.items() if k not in SGLANG_KEYS}
        self.settings = StoreSettings.from_options(options, "SGLang HiCache backend")
        self.config = storage_config
        self.ns = self.settings.namespace
        self.model = self.settings.model_id or storage_config.model_name or ""
        c = storage_config
        self.rank = ("replicated" if c.is_mla_model else
                     f"tp{c.tp_rank}/{c.tp_size}|pp{c.pp_rank}/{c.pp_size}|"
                     f"cp{c.attn_cp_rank}/{c.attn_cp_size}|dcp{c.dcp_rank}/{c.dcp_size}")
        self.writer = c.is_storage_writer
        self.io = io or io_for(self.settings)
        self.mem_pool_host = None
        self._layout: dict[str, str] = {}

    # ---- keys ------------------------------------------------------------------------------
    def _tag(self, interface: str) -> str:
        if interface not in self._layout:
            pool = self.mem_pool_host
            geometry = "none" if pool is None else (
                f"{getattr(pool, 'layout', '?')}|{str(getattr(pool, 'dtype', '?'))}|"
                f"page{getattr(pool, 'page_size', '?')}|"
                f"{getattr(pool, 'storage_format_tag', None) or ''}")
            if interface == "v1" and pool is not None:
                _, sizes = pool.get_page_buffer_meta(torch.arange(pool.page_size))
                geometry += "|" + ",".join(map(str, sizes))
            self._layout[interface] = f"sglang|{interface}|{self.rank}|{geometry}"
        return self._layout[interface]

    def block_keys(self, keys: List[str], interface: str) -> list[bytes]:
        tag = self._tag(interface)
        return [store_key(self.model, tag, k) for k in keys]

    def register_mem_pool_host(self, mem_pool_host) -> None:
        super().register_mem_pool_host(mem_pool_host)
        self._layout.clear()

    # ---- v1: pages straight from and into the host pool ----------------------------------
    def _regions(self, host_indices: torch.Tensor, n: int) -> list[list[tuple[int, int]]]:
        """Per page, its (address, bytes) regions in the host pool."""
        pool = self.mem_pool_host
        if pool is None:
            raise RuntimeError("kvswitch: no host memory pool registered")
        ptrs, sizes = pool.get_page_buffer_meta(host_indices)
        per = len(ptrs) // n if n else 0
        if per * n != len(ptrs):
            raise ValueError(f"{len(ptrs)} host regions for {n} pages")
        return [list(zip(ptrs[i * per:(i + 1) * per], sizes[i * per:(i + 1) * per]))
                for i in range(n)]

    def batch_set_v1(self, keys: List[str], host_indices: torch.Tensor,
                     extra_info: Any = None) -> List[bool]:
        if not keys:
            return []
        if not self.writer:                          # another rank writes this replica
            return [True] * len(keys)
        pages = self._regions(host_indices, len(keys))
        blocks = [b"".join(ctypes.string_at(p, s) for p, s in regions) for regions in pages]
        return self.io.put_many(self.ns, self.block_keys(keys, "v1"), blocks)

    def batch_get_v1(self, keys: List[str], host_indices: torch.Tensor,
                     extra_info: Any = None) -> List[bool]:
        if not keys:
            return []
        pages = self._regions(host_indices, len(keys))

        def sink(regions):
            want = sum(s for _, s in regions)

            def write(view: memoryview) -> bool:
                if view.nbytes != want:
                    log.warning("kvswitch: a page of %d bytes where %d were expected",
                                view.nbytes, want)
                    return False
                off = 0
                for ptr, size in regions:
                    dst = (ctypes.c_char * size).from_address(ptr)
                    memoryview(dst).cast("B")[:] = view[off:off + size]
                    off += size
                return True
            return write

        got = self.io.get_many(self.ns, self.block_keys(keys, "v1"),
                               [sink(r) for r in pages])
        return [bool(g) for g in got]

    def batch_exists(self, keys: List[str], extra_info: Any = None) -> int:
        return self.io.prefix_now(self.ns, self.block_keys(keys, self._probe_interface()))

    def _probe_interface(self) -> str:
        v1 = bool((self.config.extra_config or {}).get("interface_v1", 0))
        return "v1" if v1 and self.mem_pool_host is not None else "flat"

    # ---- the generic interface: flat tensors -----------------------------------------------
    def exists(self, key: str) -> bool:
        return self.io.exists(self.ns, self.block_keys([key], self._probe_interface())[0])

    def get(self, key: str, target_location: Optional[Any] = None,
            target_sizes: Optional[Any] = None) -> torch.Tensor | None:
        return self.batch_get([key], [target_location])[0]

    def batch_get(self, keys: List[str], target_locations: Optional[Any] = None,
                  target_sizes: Optional[Any] = None) -> List[torch.Tensor | None]:
        targets = list(target_locations or [None] * len(keys))

        def sink(target):
            def write(view: memoryview):
                if target is None:
                    return torch.frombuffer(bytearray(view), dtype=torch.uint8)
                dst = target.view(-1).view(torch.uint8)
                if dst.numel() != view.nbytes:
                    log.warning("kvswitch: a page of %d bytes for a %d-byte target",
                                view.nbytes, dst.numel())
                    return None
                dst.numpy()[:] = np.frombuffer(view, np.uint8)
                return target
            return write

        return self.io.get_many(self.ns, self.block_keys(keys, "flat"),
                                [sink(t) for t in targets])

    def set(self, key: str, value: Optional[Any] = None, target_location: Optional[Any] = None,
            target_sizes: Optional[Any] = None) -> bool:
        return self.batch_set([key], [value])

    def batch_set(self, keys: List[str], values: Optional[Any] = None,
                  target_locations: Optional[Any] = None,
                  target_sizes: Optional[Any] = None) -> bool:
        if not keys:
            return True
        if not self.writer:
            return True
        blocks = [v.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes()
                  for v in values]
        return all(self.io.put_many(self.ns, self.block_keys(keys, "flat"), blocks))

    def get_stats(self):
        return self.io.stats

    def clear(self) -> None:
        pass                                   # the pool's blocks are shared; nothing local

    def close(self) -> None:
        pass                                   # the I/O thread is the process's
