"""Fixtures the LMCache and SGLang store tests run in testbed nodes (``python
tests/store_fixtures.py FUNCTION JSON-ARGS`` prints the function's JSON result as its last
line): LMCache's engine on the CPU whose remote tier is kvswitch's plugin (built by
testbed.lmcache_engine, as `bench lmcache` builds its engines), and a minimal CPU host pool for
SGLang's v1 interface (the buffer and ``get_page_buffer_meta`` of SGLang's MHA host pool in
its ``page_first`` layout)."""
from __future__ import annotations

import json
import logging
import os
import sys
import time

import torch


# ---- SGLang --------------------------------------------------------------------------------
class CpuHostPool:
    """SGLang's MHA host pool as the v1 interface sees it: ``kv_buffer`` shaped [2, tokens,
    layers, heads, head_dim] (``page_first``), ``get_page_buffer_meta`` giving each page's K
    and V regions (SGLang's pool class itself wants a device pool to mirror)."""

    layout = "page_first"
    storage_format_tag = None

    def __init__(self, layers: int, heads: int, head_dim: int, pages: int, page_size: int,
                 dtype=torch.bfloat16):
        self.layer_num, self.head_num, self.head_dim = layers, heads, head_dim
        self.page_size, self.dtype, self.size = page_size, dtype, pages * page_size
        self.kv_buffer = torch.zeros(2, self.size, layers, heads, head_dim, dtype=dtype)
        self.size_per_token = 2 * layers * heads * head_dim * dtype.itemsize

    def get_page_buffer_meta(self, indices):
        """As SGLang's ``MHATokenToKVPoolHost.get_page_buffer_meta`` for ``page_first`` (its
        module imports torchvision, which vLLM's venv must not have)."""
        assert len(indices) % self.page_size == 0
        base, item = self.kv_buffer.data_ptr(), self.dtype.itemsize
        per_token = self.layer_num * self.head_num * self.head_dim * item
        v_offset = self.size * per_token
        ptrs = []
        for i in indices.tolist()[::self.page_size]:
            ptrs += [base + i * per_token, base + i * per_token + v_offset]
        return ptrs, [per_token * self.page_size] * len(ptrs)

    def page(self, first: int) -> bytes:
        return b"".join(self.kv_buffer[kv, first:first + self.page_size].contiguous()
                        .view(torch.uint8).numpy().tobytes() for kv in (0, 1))


def sglang_backend(extra: dict, model: str = "smollm2"):
    """The backend as SGLang's ``dynamic`` factory makes it from ``extra``."""
    from testbed import sglang_wheel
    sglang_wheel.ensure()
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
    config = HiCacheStorageConfig(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=True,
        model_name=model, extra_config=dict(extra))
    return StorageBackendFactory.create_backend("dynamic", config, None)


SG_SHAPE = dict(layers=4, heads=2, head_dim=64, page_size=16)


def sglang_load(extra: dict) -> dict:
    """Make the backend with SGLang's factory: what reaches the caller."""
    try:
        sglang_backend(extra)
    except Exception as exc:
        return {"raised": type(exc).__name__, "message": str(exc)}
    return {"raised": None}


def sglang_generic(extra: dict) -> dict:
    """The generic interface's round trip: ``set``/``batch_set`` of flat tensors, ``exists``/
    ``batch_exists``, ``get`` into a target and ``batch_get`` without; a v1 read of a page
    written flat (other keys: a miss)."""
    backend = sglang_backend(extra)
    pages = [torch.randn(2, 16, 4, 2, 64).to(torch.bfloat16) for _ in range(3)]
    keys = [f"flat-{i}" for i in range(3)]
    raw = lambda t: t.contiguous().view(torch.uint8).numpy().tobytes()  # noqa: E731
    target = torch.zeros_like(pages[0])
    out = {"set": backend.set(keys[0], pages[0]), "batch_set": backend.batch_set(keys[1:],
                                                                                 pages[1:]),
           "exists": [backend.exists(keys[0]), backend.exists("flat-absent")],
           "batch_exists": backend.batch_exists(keys + ["flat-absent"])}
    out["get_is_target"] = backend.get(keys[1], target) is target
    out["get_exact"] = raw(target) == raw(pages[1])
    got = backend.batch_get(keys + ["flat-absent"])
    out["batch_get_exact"] = [g is not None and g.numpy().tobytes() == raw(p)
                              for g, p in zip(got, pages)] + [got[3] is None]
    backend.register_mem_pool_host(CpuHostPool(pages=4, **SG_SHAPE))
    out["v1_of_flat"] = backend.batch_get_v1(keys[:1], torch.arange(16, 32))
    return out


def sglang_put(extra: dict, pages: int, seed: int) -> dict:
    """Fill a host pool with seeded random pages and ``batch_set_v1`` them."""
    backend = sglang_backend(extra)
    pool = CpuHostPool(pages=pages + 1, **SG_SHAPE)
    torch.manual_seed(seed)
    pool.kv_buffer.copy_(torch.randn(pool.kv_buffer.shape).to(pool.dtype))
    backend.register_mem_pool_host(pool)
    keys = [f"page-{seed}-{i}" for i in range(pages)]
    ps = pool.page_size
    t0 = time.monotonic()
    ok = backend.batch_set_v1(keys, torch.arange(ps, ps * (pages + 1)))
    return {"ok": ok, "seconds": time.monotonic() - t0,
            "pages": [pool.page(ps * (i + 1)).hex() for i in range(pages)]}


def sglang_get(extra: dict, pages: int, seed: int, extra_keys: int = 0) -> dict:
    """``batch_exists`` then ``batch_get_v1`` of the pages into a zeroed host pool (at other
    indices than they were written from); ``extra_keys`` keys never written follow."""
    backend = sglang_backend(extra)
    pool = CpuHostPool(pages=pages + extra_keys + 3, **SG_SHAPE)
    backend.register_mem_pool_host(pool)
    keys = [f"page-{seed}-{i}" for i in range(pages + extra_keys)]
    ps, first = pool.page_size, 3 * pool.page_size
    t0 = time.monotonic()
    found = backend.batch_exists(keys)
    t_exists = time.monotonic() - t0
    got = backend.batch_get_v1(keys, torch.arange(first, first + ps * len(keys)))
    return {"exists": found, "exists_seconds": t_exists, "got": got,
            "seconds": time.monotonic() - t0, "stats": backend.get_stats(),
            "pages": [pool.page(first + ps * i).hex() for i in range(len(keys))]}


# ---- LMCache -------------------------------------------------------------------------------
def lmcache_both(pools: str, n: int, seed: int, options: dict) -> dict:
    """Store then look up and retrieve in one process (two engines): what an engine sees of
    a pool (an unreachable one, say) on both paths."""
    stored = lmcache_store(pools, n, seed, options)
    return {"store": stored, "retrieve": lmcache_retrieve(pools, n, seed, options)}


def lmcache_load(*cases: tuple[str, dict]) -> list[dict]:
    """Build an engine per (pools, plugin options): what reaches the caller, for each."""
    out = []
    for i, (pools, options) in enumerate(cases):
        try:
            lmcache_engine(lmcache_config(pools, **options), f"load{i}")
        except BaseException as exc:       # PluginConfigError is one (it must pass LMCache)
            out.append({"raised": type(exc).__name__, "message": str(exc)})
        else:
            out.append({"raised": None})
    return out


def lmcache_config(pools: str, **options):
    """An engine config whose remote tier is kvswitch's plugin (testbed.lmcache_engine)."""
    from testbed import lmcache_engine
    return lmcache_engine.config(plugin={"pools": pools, **options}, save_unfull_chunk=True)


def lmcache_engine(config, name: str):
    """LMCache's engine on the CPU with SmolLM2's KV shape, fp32 as this CPU serves it."""
    from testbed import lmcache_engine as le
    return le.engine(config, name, torch.float32)


def prompt(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    from testbed import lmcache_engine as le
    return le.prompt(n, seed, torch.float32)


def lmcache_store(pools: str, n: int, seed: int, options: dict) -> dict:
    """Store a prompt's KV through an LMCache engine whose remote tier is kvswitch."""
    from testbed import lmcache_engine as le
    engine = lmcache_engine(lmcache_config(pools, **options), "store")
    done = le.store(engine, *prompt(n, seed), timeout=60)
    return {**done, "counts": _io_counts(le.remote_backend(engine))}


def lmcache_retrieve(pools: str, n: int, seed: int, options: dict) -> dict:
    """Look the prompt up and retrieve its KV through another engine; bit-exact?"""
    from testbed import lmcache_engine as le
    engine = lmcache_engine(lmcache_config(pools, **options), "retrieve")
    tokens, kv = prompt(n, seed)
    out = torch.zeros_like(kv)
    t0 = time.monotonic()
    hit = engine.lookup(tokens)
    t_lookup = time.monotonic() - t0
    mask = engine.retrieve(tokens, kvcaches=out) if hit else torch.zeros(n, dtype=torch.bool)
    got = int(mask.sum())
    return {"lookup": int(hit), "lookup_seconds": t_lookup, "retrieved": got,
            "seconds": time.monotonic() - t0,
            "bit_exact": bool(got and torch.equal(out[:, :, :got], kv[:, :, :got])),
            "counts": _io_counts(le.remote_backend(engine))}


def _io_counts(backend) -> dict:
    conn = backend.connection
    conn = getattr(conn, "getWrappedConnector", lambda: conn)()
    return conn.io.stats


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                        format="%(levelname)s %(name)s: %(message)s")
    sys.path.insert(0, os.getcwd())
    result = globals()[sys.argv[1]](*json.loads(sys.argv[2]))
    print(json.dumps(result), flush=True)
    os._exit(0)        # LMCache's engine keeps threads that are not daemons
