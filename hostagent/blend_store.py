"""Passages' KV through the pool for CacheBlend (hostagent/blend.py does the compute).

A passage's KV, computed alone at positions 0.., is stored under position-independent keys
(``hostagent.hashing.passage_keys`` with the connector's ``extra``: model id, layout tag, codec
tag) in the connector's block layout: blocks of ``block_tokens`` tokens, the last one padded with
zeros (the key covers the passage's length, so the reader knows where it ends). ``PassageStore``
fetches a passage's blocks through a ``KVConnector`` (switch, pool nodes); a passage missing from
every tier (any block absent) is prefilled and put, never an error. ``fused_kv`` assembles the
passages of a prompt, each moved to its offset. ``LocalClient`` is an in-process stand-in for the
pool, for quick runs and tests.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from .blend import KV, move, passage_kv
from .client import BlockNotFound, TransferStats
from .hashing import passage_keys
from .kvconnector import KVConnector, _add


class LocalClient:
    """A dict standing in for the pool (``put_block``/``get_block`` as KVClient's)."""

    def __init__(self, chunk_size: int = 3072):
        self.chunk_size, self.blocks = chunk_size, {}

    async def put_block(self, ns: int, key: bytes, data: bytes) -> TransferStats:
        self.blocks[(ns, key)] = bytes(data)
        return TransferStats(bytes=len(data))

    async def get_block(self, ns: int, key: bytes, nchunks: int | None = None,
                        no_cache: bool = False) -> tuple[bytes, TransferStats]:
        try:
            data = self.blocks[(ns, key)]
        except KeyError:
            raise BlockNotFound(1, "not in the local store") from None
        return data, TransferStats(bytes=len(data))


@dataclass
class Fetched:
    kv: KV
    stats: TransferStats = field(default_factory=TransferStats)
    hits: int = 0                  # passages found in the pool
    misses: int = 0                # passages prefilled (and put) here
    seconds: float = 0.0


class PassageStore:
    def __init__(self, conn: KVConnector, model):
        self.conn, self.model, self.layout = conn, model, conn.layout
        if conn.codec.name != "none":
            raise ValueError("passages are stored raw (codec none)")

    def keys(self, tokens: Sequence[int]) -> list[bytes]:
        return passage_keys(tokens, self.layout.block_tokens, self.conn.extra)

    def to_blocks(self, kv: KV) -> list[bytes]:
        L, _, H, bt, D = self.layout.shape
        n = kv[0][0].shape[2]
        nb = -(-n // bt)
        t = torch.zeros((L, 2, H, nb * bt, D), dtype=self.layout.dtype)
        for i, (k, v) in enumerate(kv):
            t[i, 0, :, :n], t[i, 1, :, :n] = k[0], v[0]
        t = t.unflatten(3, (nb, bt)).permute(3, 0, 1, 2, 4, 5).contiguous()
        raw = t.view(torch.uint8).numpy()
        return [raw[i].tobytes() for i in range(nb)]

    def from_blocks(self, blocks: Sequence[bytes], n: int) -> KV:
        L, _, H, bt, D = self.layout.shape
        t = torch.empty((L, 2, H, len(blocks) * bt, D), dtype=self.layout.dtype)
        for i, b in enumerate(blocks):
            if len(b) != self.layout.block_bytes:
                raise ValueError(f"a passage block has {len(b)} bytes, the layout "
                                 f"{self.layout.block_bytes}")
            t[:, :, :, i * bt:(i + 1) * bt] = torch.frombuffer(
                bytearray(b), dtype=self.layout.dtype).view(self.layout.shape)
        return [(t[i, 0, :, :n][None], t[i, 1, :, :n][None]) for i in range(L)]

    async def put(self, tokens: Sequence[int], kv: KV) -> TransferStats:
        total = TransferStats()
        for key, data in zip(self.keys(tokens), self.to_blocks(kv)):
            _add(total, await self.conn.client.put_block(self.conn.ns, key, data))
        return total

    async def get(self, tokens: Sequence[int]) -> tuple[KV, TransferStats, bool]:
        """A passage's KV at positions 0..: (kv, fetch stats, found). Missing from every tier
        (any block): prefilled here and put."""
        keys = self.keys(tokens)
        blocks, missing, stats = await self.conn.fetch_prefix(keys)
        if missing is None:
            return self.from_blocks(blocks, len(tokens)), stats, True
        kv = passage_kv(self.model, tokens)
        await self.put(tokens, kv)
        return kv, stats, False

    async def fused_kv(self, passages: Sequence[Sequence[int]]) -> Fetched:
        """The passages' KV, fetched concurrently, each moved to its offset in their
        concatenation (the first at 0), as one KV of every layer."""
        start = time.perf_counter()
        got = await asyncio.gather(*(self.get(p) for p in passages))
        out, offset, parts = Fetched([]), 0, []
        for p, (kv, stats, found) in zip(passages, got):
            parts.append(move(self.model, kv, offset))
            offset += len(p)
            _add(out.stats, stats)
            out.hits, out.misses = out.hits + found, out.misses + (not found)
        out.kv = [(torch.cat([p[i][0] for p in parts], 2), torch.cat([p[i][1] for p in parts], 2))
                  for i in range(len(parts[0]))]
        out.seconds = time.perf_counter() - start
        return out
