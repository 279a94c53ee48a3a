"""LMCache's own cache engine (``LMCacheEngine``, LMCache 0.5.6) on the CPU, as the testbed runs
it: SmolLM2-135M's KV shape, the remote tier one of the stores LMCache reaches (kvswitch's
plugin, LMCache's server, Redis, Mooncake Store), and a connector that copies KV between one
tensor and LMCache's chunks in place of LMCache's GPU connectors (which need CUDA). The tests
and `testbed bench lmcache` build their engines here; nothing of the product imports it.

A prompt's KV is one tensor ``[2, layers, tokens, kv_heads * head_dim]`` (LMCache's KV_2LTD
format); ``prompt(tokens, seed)`` makes a seeded one, the same in every process."""
from __future__ import annotations

import time

# SmolLM2-135M-Instruct: 30 layers, 3 KV heads of 64
MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
LAYERS, KV_HEADS, HEAD_DIM = 30, 3, 64
CHUNK_TOKENS = 256                        # LMCache's default chunk
VOCAB = 49152
PLUGIN_LINES = {"module_path": "hostagent.inference.connectors.lmcache",
                "class_name": "KVSwitchAdapter"}


def kv_bytes_per_token(dtype) -> int:
    return 2 * LAYERS * KV_HEADS * HEAD_DIM * dtype.itemsize


def config(remote_url: str | None = None, plugin: dict | None = None, extra: dict | None = None,
           cpu_gib: float = 0.5, save_unfull_chunk: bool = False,
           timeout_s: int | None = None):
    """An engine config whose remote tier is ``remote_url`` (LMCache's own connectors) or
    kvswitch's plugin with the options ``plugin``; no local CPU tier, so every retrieve
    reaches the remote store. ``cpu_gib``: LMCache's buffer for the chunks in flight;
    ``timeout_s``: how long LMCache waits for a remote chunk (its ``blocking_timeout_secs``,
    10 s by default; a chunk late past it is a miss)."""
    from lmcache.v1.config import LMCacheEngineConfig
    extra = dict(extra or {})
    cfg = {"chunk_size": CHUNK_TOKENS, "local_cpu": False, "max_local_cpu_size": cpu_gib,
           "remote_serde": "naive", "save_unfull_chunk": save_unfull_chunk,
           "pre_caching_hash_algorithm": "sha256_cbor"}
    if plugin is not None:
        cfg["remote_storage_plugins"] = ["kvswitch"]
        extra.update({f"remote_storage_plugin.kvswitch.{k}": v
                      for k, v in {**PLUGIN_LINES, **plugin}.items()})
    else:
        cfg["remote_url"] = remote_url
    if timeout_s is not None:
        cfg["blocking_timeout_secs"] = timeout_s
    cfg["extra_config"] = extra
    return LMCacheEngineConfig.from_dict(cfg)


def engine(cfg, name: str, dtype=None):
    """An LMCache engine named ``name`` (one per name and process) with this config; KV of
    ``dtype`` (default bfloat16)."""
    import torch
    from lmcache.v1.cache_engine import LMCacheEngineBuilder
    from lmcache.v1.gpu_connector.gpu_connectors import GPUConnectorInterface
    from lmcache.v1.metadata import LMCacheMetadata

    class CpuConnector(GPUConnectorInterface):
        """KV as one tensor [2, layers, tokens, heads * head_dim] (LMCache's KV_2LTD)."""

        def to_gpu(self, memory_obj, start, end, **kw):
            kw["kvcaches"][:, :, start:end].copy_(memory_obj.tensor)

        def from_gpu(self, memory_obj, start, end, **kw):
            memory_obj.tensor.copy_(kw["kvcaches"][:, :, start:end])

        def batched_to_gpu(self, memory_objs, starts, ends, **kw):
            for m, s, e in zip(memory_objs, starts, ends):
                self.to_gpu(m, s, e, **kw)

        def batched_from_gpu(self, memory_objs, starts, ends, **kw):
            for m, s, e in zip(memory_objs, starts, ends):
                self.from_gpu(m, s, e, **kw)

        def get_shape(self, num_tokens):
            return torch.Size([2, LAYERS, num_tokens, KV_HEADS * HEAD_DIM])

    metadata = LMCacheMetadata(model_name=MODEL, world_size=1, local_world_size=1, worker_id=0,
                               local_worker_id=0, kv_dtype=dtype or torch.bfloat16,
                               kv_shape=(LAYERS, 2, CHUNK_TOKENS, KV_HEADS, HEAD_DIM))
    eng = LMCacheEngineBuilder.get_or_create(name, cfg, metadata, CpuConnector(),
                                             lambda t, r: None, lambda o, r: o)
    eng.post_init()
    return eng


def prompt(n: int, seed: int, dtype=None):
    """A seeded prompt of ``n`` tokens and its KV (the same in every process)."""
    import torch
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (n,), generator=g)
    kv = torch.randn(2, LAYERS, n, KV_HEADS * HEAD_DIM, generator=g).to(dtype or torch.bfloat16)
    return tokens, kv


def remote_backend(eng):
    from lmcache.v1.storage_backend.remote_backend import RemoteBackend
    return next(b for b in eng.storage_manager.storage_backends.values()
                if isinstance(b, RemoteBackend))


def store(eng, tokens, kv, timeout: float = 120) -> dict:
    """Store a prompt's KV and wait until the remote tier has done every put: LMCache's
    ``put_tasks`` are empty, and where the connector puts in batches (Mooncake's: those are
    not ``put_tasks``) a lookup finds every full chunk."""
    t0 = time.monotonic()
    eng.store(tokens, kvcaches=kv)
    backend, full = remote_backend(eng), len(tokens) // CHUNK_TOKENS * CHUNK_TOKENS
    batched = backend.connection is not None and backend.connection.support_batched_put()
    found = None
    while time.monotonic() - t0 < timeout:
        if not backend.put_tasks:
            if not batched:
                break
            found = eng.lookup(tokens)
            if found >= full:
                break
        time.sleep(0.005)
    return {"seconds": time.monotonic() - t0, "pending": len(backend.put_tasks),
            "found_tokens": found}


def retrieve(eng, tokens, kv) -> dict:
    """Retrieve a prompt's KV into a zeroed tensor; how many tokens came and whether every
    one of their bytes is the stored one."""
    import torch
    out = torch.zeros_like(kv)
    t0 = time.monotonic()
    mask = eng.retrieve(tokens, kvcaches=out)
    seconds = time.monotonic() - t0
    got = int(mask.sum())
    return {"seconds": seconds, "tokens": got,
            "exact": got == kv.shape[2] and torch.equal(out, kv)}
