"""The integration layer between a Hugging Face decoder and the KV pool: a model's KV cache as
content-addressed blocks.

It owns cutting a ``transformers.DynamicCache`` into blocks and rebuilding one
from blocks, block-aligned chunked prefill, and ``KVConnector``, which puts the blocks of a prompt
and loads the longest prefix of a prompt whose blocks the switch or the pool nodes have.

Blocks and keys. A block holds the KV of ``block_tokens`` consecutive prompt tokens for every
layer. Its key is the chained prefix hash of the tokens (``hostagent.common.hashing.block_hashes``)
with ``extra`` = model id + the layout tag (``BlockLayout.tag``), so blocks of another model,
another set of weights or another layout never share a key. Only full blocks get keys. What else
makes a prompt's KV differ is the caller's ``extras`` (``connectors.block_keys.KeyExtras``,
the vLLM connector's key function too): a cache salt keeps tenants apart, a LoRA adapter
(``adapter=(name, path)``, e.g. a PEFT adapter's) changes every block, a multimodal input's
content hash the blocks its placeholder tokens cover; ``keys``, ``save`` and ``load`` take it.

The block layout (its bytes and tag) is ``hostagent.inference.block_layout``'s, which
both connectors use.

Determinism. Prefill runs in chunks aligned to block boundaries (``prefill``), so the KV of a
block is the same bits whether a node computed it or fetched it, and greedy generation from a
fetched prefix is token-for-token (and logit-for-logit) that of a full recompute. Pool blocks
are immutable: a node whose bits differed would have its PUTs refused.

Codecs. ``KVConnector(kv_codec=...)`` codes blocks with ``hostagent.inference.codec`` (none, int8,
fp8, int4, int4h, pca): encoded where saved (a block with its first token's position, which the
``pca`` codec uses to take RoPE off the keys), decoded where loaded (each block straight into the
cache's tensor as it arrives, in a worker thread, while later blocks are fetched); the pool and
the switch carry the coded bytes. The codec's tag joins ``extra``, so a reader with another codec
(or another ``pca`` calibration) misses.

Finding the prefix. Blocks are fetched in chain order, ``concurrency`` at a time; a missing block
answers NACK (``BlockNotFound``) within one round trip, and the search stops there: blocks after
the first missing one are cancelled or dropped. The fetch is the probe, so a present block is
never asked for twice. Batch size 1, full-attention layers (``DynamicLayer``) only.
"""
from __future__ import annotations

import asyncio
import math
import os
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

os.environ.setdefault("HF_HUB_OFFLINE", "1")       # nothing here ever downloads a model

import torch                                       # noqa: E402
from transformers import DynamicCache              # noqa: E402

from hostagent.common.block import Block  # noqa: E402
from hostagent.common.transfer import BlockNotFound, TransferStats  # noqa: E402
from ..client import KVClient  # noqa: E402
from ..codec import Codec, make as make_codec, warm_up  # noqa: E402
from .block_keys import KeyExtras, block_keys  # noqa: E402
from hostagent.inference.block_layout import BlockLayout  # noqa: E402

DEFAULT_CONCURRENCY = 4


def cache_block_tensor(cache: DynamicCache, layout: BlockLayout, first: int = 0,
                       last: int | None = None) -> torch.Tensor:
    """Blocks ``first``..``last``-1 of a batch-1 cache (whole blocks only) as one contiguous
    tensor ``[n, L, 2, H, block_tokens, D]``."""
    if len(cache.layers) != layout.layers:
        raise ValueError(f"cache has {len(cache.layers)} layers, layout {layout.layers}")
    bt = layout.block_tokens
    full = cache.get_seq_length() // bt
    last = full if last is None else min(last, full)
    L, _, H, _, D = layout.shape
    if first >= last:
        return torch.empty((0, L, 2, H, bt, D), dtype=layout.dtype)
    lo, hi = first * bt, last * bt
    for layer in cache.layers:
        if layer.keys.shape[0] != 1 or layer.keys.dtype != layout.dtype:
            raise ValueError("only batch-1 caches of the layout's dtype can be cut into blocks")
    kv = torch.stack([torch.stack((layer.keys[0, :, lo:hi], layer.values[0, :, lo:hi]))
                      for layer in cache.layers])                 # [L, 2, H, T, D]
    return kv.unflatten(3, (last - first, bt)).permute(3, 0, 1, 2, 4, 5).contiguous()


def cache_to_blocks(cache: DynamicCache, layout: BlockLayout, first: int = 0,
                    last: int | None = None, codec: Codec | None = None) -> list[bytes]:
    """Blocks ``first``..``last``-1 of a batch-1 cache, serialised (whole blocks only), coded
    with ``codec`` (default: none, the layout's raw bytes)."""
    kv = cache_block_tensor(cache, layout, first, last)
    if codec is not None and codec.name != "none":
        bt = layout.block_tokens
        return [codec.encode(kv[i], (first + i) * bt) for i in range(kv.shape[0])]
    raw = kv.view(torch.uint8).numpy()                            # [n, L, 2, H, bt, D*itemsize]
    return [raw[i].tobytes() for i in range(kv.shape[0])]


def codec_for(layout: BlockLayout, kv_codec: str = "none") -> Codec:
    """The KV codec ``kv_codec`` (hostagent.inference.codec) bound to a layout."""
    return make_codec(kv_codec, layout.layers, layout.kv_heads, layout.block_tokens,
                      layout.head_dim, layout.dtype)


def _block_tensor(block, layout: BlockLayout) -> torch.Tensor:
    """A block (bytes-like, or the fetch engine's zero-copy Block) as a tensor of the layout's
    shape sharing its memory; only read."""
    buf = _bytes_of(block)
    if memoryview(buf).nbytes != layout.block_bytes:
        raise ValueError(f"a block has {memoryview(buf).nbytes} bytes, the layout "
                         f"{layout.block_bytes}")
    with warnings.catch_warnings():            # a read-only buffer: it is only read from
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(buf, dtype=layout.dtype).view(layout.shape)


def blocks_to_cache(blocks: Sequence, layout: BlockLayout, config=None,
                    codec: Codec | None = None) -> DynamicCache:
    """A DynamicCache holding the KV of ``blocks`` (consecutive, from the first), batch 1. A
    block is bytes-like or a fetch engine ``Block`` (read in place: one copy in all, from the
    blocks into the cache's tensors); with a ``codec`` other than none each block is decoded
    straight into the cache's tensor."""
    if not blocks:
        return DynamicCache(config=config)
    n, (L, _, H, bt, D) = len(blocks), layout.shape
    kv = torch.empty((L, 2, H, n * bt, D), dtype=layout.dtype)
    if codec is not None and codec.name != "none":
        for i, b in enumerate(blocks):
            codec.decode_into(_bytes_of(b), kv, i * bt)
    else:
        for i, b in enumerate(blocks):
            kv[:, :, :, i * bt:(i + 1) * bt].copy_(_block_tensor(b, layout))
    return DynamicCache([(kv[i, 0][None], kv[i, 1][None]) for i in range(L)], config=config)


@torch.inference_mode()
def prefill(model, tokens: Sequence[int], cache: DynamicCache, chunk: int) -> torch.Tensor:
    """Feed the tokens the cache does not hold yet, in chunks ending on multiples of ``chunk``
    (the block size); return the logits for the token after the last."""
    start = cache.get_seq_length()
    if not start < len(tokens):
        raise ValueError(f"nothing to prefill: the cache holds {start} of {len(tokens)} tokens")
    ids = torch.tensor([list(tokens)], dtype=torch.long)
    while start < len(tokens):
        end = min(len(tokens), (start // chunk + 1) * chunk)
        out = model(input_ids=ids[:, start:end], past_key_values=cache, use_cache=True,
                    logits_to_keep=1)
        start = end
    return out.logits[0, -1]


@torch.inference_mode()
def greedy(model, logits: torch.Tensor, cache: DynamicCache, new_tokens: int) -> list[int]:
    """Greedy decoding from the prefill's last logits: ``new_tokens`` token ids."""
    out = [int(logits.argmax())]
    while len(out) < new_tokens:
        step = model(input_ids=torch.tensor([[out[-1]]]), past_key_values=cache, use_cache=True)
        out.append(int(step.logits[0, -1].argmax()))
    return out


def _bytes_of(block):
    """A block's bytes: a ``Block``'s zero-copy array, or ``block`` itself (bytes-like)."""
    return block.numpy() if isinstance(block, Block) else block


def _release(block) -> None:
    """Give a client's ``Block`` back (bytes need nothing)."""
    if isinstance(block, Block):
        block.release()


@dataclass
class Loaded:
    """What ``KVConnector.load`` found: a cache of the first ``tokens`` prompt tokens."""
    cache: DynamicCache
    tokens: int
    blocks: int
    probed: int                   # full blocks the prompt has (before its last token)
    missing_at: int | None        # first block the pool lacked (None: every one was there)
    stats: TransferStats          # summed over blocks; seconds = wall time of the whole fetch
    rebuild_seconds: float = 0.0


class KVConnector:
    """Put and load a prompt's KV blocks through a ``KVClient`` or the fetch engine's
    ``AsyncFetchClient`` (already entered; ``hostagent.inference.fetch.open_client`` picks). With
    the engine, ``load`` builds the cache straight from its zero-copy blocks."""

    def __init__(self, client: KVClient, ns: int, layout: BlockLayout, model_id: str | bytes,
                 config=None, concurrency: int = DEFAULT_CONCURRENCY, kv_codec: str = "none"):
        if concurrency < 1:
            raise ValueError("concurrency must be at least 1")
        self.client, self.ns, self.layout, self.config = client, ns, layout, config
        self.concurrency = concurrency
        self.codec = codec_for(layout, kv_codec)
        warm_up(kv_codec)
        mid = model_id.encode() if isinstance(model_id, str) else model_id
        self.extra = mid + b"|" + layout.tag() + self.codec.tag()
        self.nchunks = math.ceil(self.codec.nbytes / client.chunk_size)

    def keys(self, tokens: Sequence[int], extras: KeyExtras | None = None) -> list[bytes]:
        return block_keys(tokens, self.layout.block_tokens, self.extra, extras)

    async def save(self, tokens: Sequence[int], cache: DynamicCache, first_block: int = 0,
                   extras: KeyExtras | None = None) -> TransferStats:
        """Put the full blocks of ``tokens`` from ``first_block`` on (the cache must hold them)."""
        keys = self.keys(tokens, extras)
        if cache.get_seq_length() < len(keys) * self.layout.block_tokens:
            raise ValueError("the cache holds fewer tokens than the prompt's full blocks")
        blocks = cache_to_blocks(cache, self.layout, first_block, len(keys), self.codec)
        total, sem, start = TransferStats(), asyncio.Semaphore(self.concurrency), time.monotonic()

        async def put(key: bytes, data: bytes) -> None:
            async with sem:
                total.add(await self.client.put_block(self.ns, key, data))

        await asyncio.gather(*(put(k, b) for k, b in zip(keys[first_block:], blocks)))
        total.seconds = time.monotonic() - start
        return total

    async def fetch_prefix(self, keys: Sequence[bytes], views: bool = False, sink=None
                           ) -> tuple[list, int | None, TransferStats]:
        """The blocks of the longest available prefix of ``keys``, the index of the first missing
        block (None if none was), and the transfer stats summed over every block moved (a block
        in flight past a gap still counts, though it is not kept). ``views``: ``Block``s (the
        caller releases them; the fetch engine's are zero-copy) instead of bytes.
        ``sink``: ``await sink(i, block)`` as each block arrives (outside the concurrency
        slot, so the next fetch runs meanwhile); it owns the block from then on."""
        getter = self.client.get_block_view if views else self.client.get_block
        got: list = [None] * len(keys)
        total, sem, start = TransferStats(), asyncio.Semaphore(self.concurrency), time.monotonic()
        missing = len(keys)
        tasks: list[asyncio.Task] = []

        async def one(i: int) -> None:
            nonlocal missing
            async with sem:                       # FIFO: blocks are asked for in chain order
                if i > missing:
                    return
                try:
                    got[i], stats = await getter(self.ns, keys[i], nchunks=self.nchunks)
                except BlockNotFound:
                    missing = min(missing, i)
                    for t in tasks[i + 1:]:
                        t.cancel()
                    return
                total.add(stats)
            if sink is not None and i < missing:
                block, got[i] = got[i], True
                await sink(i, block)

        tasks.extend(asyncio.create_task(one(i)) for i in range(len(keys)))
        results = await asyncio.gather(*tasks, return_exceptions=True)
        for b in got[missing:] if views else []:
            _release(b)                           # moved past the gap: not kept
        for result in results:
            if isinstance(result, BaseException) and not isinstance(result,
                                                                    asyncio.CancelledError):
                for b in got[:missing] if views else []:
                    _release(b)
                raise result
        total.seconds = time.monotonic() - start
        return list(got[:missing]), (missing if missing < len(keys) else None), total

    async def load(self, tokens: Sequence[int], extras: KeyExtras | None = None) -> Loaded:
        """The cache of the longest prefix of ``tokens`` whose blocks are available. It never
        covers the last token, whose logits the caller must compute (``prefill``)."""
        keys = self.keys(list(tokens)[:-1], extras)
        if self.codec.name != "none":
            return await self._load_decoding(keys)
        blocks, missing_at, stats = await self.fetch_prefix(keys, views=True)
        start = time.monotonic()
        try:
            cache = blocks_to_cache(blocks, self.layout, self.config, self.codec)
        finally:
            for b in blocks:
                _release(b)
        return Loaded(cache, len(blocks) * self.layout.block_tokens, len(blocks), len(keys),
                      missing_at, stats, time.monotonic() - start)

    async def _load_decoding(self, keys: list[bytes]) -> Loaded:
        """``load`` with a codec: each block is decoded into the cache's tensor as it arrives,
        in a worker thread (the decode loops release the GIL), while later blocks are fetched."""
        L, _, H, bt, D = self.layout.shape
        kv = torch.empty((L, 2, H, len(keys) * bt, D), dtype=self.layout.dtype)
        loop, busy = asyncio.get_running_loop(), [0.0]

        def decode(i: int, block) -> None:
            t0 = time.monotonic()
            try:
                self.codec.decode_into(block.numpy(), kv, i * bt)
            finally:
                _release(block)
            busy[0] += time.monotonic() - t0

        async def sink(i: int, block) -> None:
            await loop.run_in_executor(None, decode, i, block)

        got, missing_at, stats = await self.fetch_prefix(keys, views=True, sink=sink)
        n = len(got)
        if n < len(keys):                  # a shorter prefix: its own, contiguous tensor
            kv = kv[:, :, :, :n * bt].contiguous()
        cache = (DynamicCache([(kv[i, 0][None], kv[i, 1][None]) for i in range(L)],
                              config=self.config) if n else DynamicCache(config=self.config))
        return Loaded(cache, n * bt, n, len(keys), missing_at, stats, busy[0])
