"""Passages' KV through the pool for CacheBlend (hostagent/inference/blend.py does the compute).

A passage's KV, computed alone at positions 0.., is stored under position-independent keys
(``hostagent.common.hashing.passage_keys`` with the connector's ``extra``: model id, layout tag,
codec tag) in the connector's block layout: blocks of ``block_tokens`` tokens, the last one padded
with zeros (the key covers the passage's length, so the reader knows where it ends).
``PassageStore`` fetches a passage's blocks through a ``KVConnector`` (switch, pool nodes); a
passage missing from every tier (any block absent) is prefilled and put, never an error.
``fused_kv`` assembles the segments of a prompt, each moved to its offset.

Lead. A passage computed alone makes its first token an attention sink (the first token of any
sequence gathers attention and carries outsized activations), and its reused KV then holds one
sink per passage where the real prompt has one. With a ``lead`` (a fixed leading text, the RAG
system prompt here) every passage after the prompt's first segment is computed after the lead
and only its own KV is kept (CacheBlend and LMCache likewise compute chunks behind a shared
prefix); the lead's SHA-256 joins the keys' ``extra``, so passages computed behind another lead
(or none) never share a key. The prompt's first segment is computed alone: at offset 0 that is
exact. ``LocalClient`` is an in-process stand-in for the
pool, for quick runs and tests.
"""
from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from .blend import KV, move, passage_kv
from hostagent.common.transfer import BlockNotFound, TransferStats
from hostagent.common.hashing import passage_keys
from .connectors.hf import KVConnector


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
    def __init__(self, conn: KVConnector, model, lead: Sequence[int] = ()):
        self.conn, self.model, self.layout = conn, model, conn.layout
        if conn.codec.name != "none":
            raise ValueError("passages are stored raw (codec none)")
        self.lead = [int(t) for t in lead]
        tag = hashlib.sha256(np.asarray(self.lead, dtype="<u4").tobytes()).hexdigest()[:16]
        self.lead_extra = conn.extra + (f"|lead={tag}".encode() if self.lead else b"")

    def keys(self, tokens: Sequence[int], lead: bool = False) -> list[bytes]:
        """The keys of a passage computed alone (``lead`` False) or after the lead."""
        return passage_keys(tokens, self.layout.block_tokens,
                            self.lead_extra if lead else self.conn.extra)

    def compute(self, tokens: Sequence[int], lead: bool = False) -> KV:
        """A passage's KV as stored: at positions 0.. alone, or after the lead."""
        return passage_kv(self.model, tokens, 0, self.lead if lead else ())

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

    async def put(self, tokens: Sequence[int], kv: KV, lead: bool = False) -> TransferStats:
        total = TransferStats()
        for key, data in zip(self.keys(tokens, lead), self.to_blocks(kv)):
            total.add(await self.conn.client.put_block(self.conn.ns, key, data))
        return total

    async def get(self, tokens: Sequence[int], lead: bool = False
                  ) -> tuple[KV, TransferStats, bool]:
        """A passage's KV as stored (alone at 0.., or after the lead): (kv, fetch stats,
        found). Missing from every tier (any block): prefilled here and put."""
        blocks, missing, stats = await self.conn.fetch_prefix(self.keys(tokens, lead))
        if missing is None:
            return self.from_blocks(blocks, len(tokens)), stats, True
        kv = self.compute(tokens, lead)
        await self.put(tokens, kv, lead)
        return kv, stats, False

    async def fused_kv(self, passages: Sequence[Sequence[int]]) -> Fetched:
        """The segments' KV, fetched concurrently, each moved to its offset in their
        concatenation, as one KV of every layer. The first (at 0) is the one computed alone;
        with a lead every later one is the one computed after it."""
        start = time.perf_counter()
        got = await asyncio.gather(*(self.get(p, i > 0 and bool(self.lead))
                                     for i, p in enumerate(passages)))
        out, offset, parts = Fetched([]), 0, []
        for i, (p, (kv, stats, found)) in enumerate(zip(passages, got)):
            parts.append(move(self.model, kv, offset - (len(self.lead) if i > 0 else 0)))
            offset += len(p)
            out.stats.add(stats)
            out.hits, out.misses = out.hits + found, out.misses + (not found)
        out.kv = [(torch.cat([p[i][0] for p in parts], 2), torch.cat([p[i][1] for p in parts], 2))
                  for i in range(len(parts[0]))]
        out.seconds = time.perf_counter() - start
        return out
