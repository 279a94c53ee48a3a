"""What the data plane tells switchd about demand: the per-CPU count-min sketch of block misses,
the recently missed blocks (the candidates), per-entry hit counters grouped by block, and
per-namespace counters. Reading the sketch resets it: it counts one interval's misses, and the
policy keeps the long-term, decayed view."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .dataplane import CONSTANTS, DataPlane
from .slots import Slots
from .sketch import CountMinSketch

DEPTH, WIDTH = CONSTANTS["KV_SKETCH_DEPTH"], CONSTANTS["KV_SKETCH_WIDTH"]
HI_MUL, NS_MUL = CONSTANTS["KV_SKETCH_HI_MUL"], CONSTANTS["KV_SKETCH_NS_MUL"]
M64 = (1 << 64) - 1
BlockId = tuple[int, bytes]  # (namespace, 16-byte key)


def sketch_x(ns: int, key: bytes) -> int:
    """The 64-bit value the data plane hashes a block by (see kvproto.h)."""
    lo, hi = int.from_bytes(key[:8], "little"), int.from_bytes(key[8:], "little")
    return lo ^ ((hi * HI_MUL) & M64) ^ ((ns * NS_MUL) & M64)


def new_sketch() -> CountMinSketch:
    return CountMinSketch(WIDTH, DEPTH, a=[CONSTANTS[f"KV_SKETCH_A{r}"] for r in range(DEPTH)],
                          b=[CONSTANTS[f"KV_SKETCH_B{r}"] for r in range(DEPTH)])


@dataclass
class CachedBlock:
    nchunks: int
    chunks: int = 0     # entries present
    hits: int = 0       # fetches served: hits of chunk 0, which every fetch asks for
    speculative: bool = False  # some chunk was filled before the block was admitted


@dataclass
class Snapshot:
    candidates: dict[BlockId, tuple[int, int]]  # missed block -> (misses this interval, nchunks)
    cached: dict[BlockId, CachedBlock]
    ns_counters: dict[int, dict[str, int]] = field(default_factory=dict)
    cache_entries: int = 0


class Popularity:
    def __init__(self, dp: DataPlane):
        self.dp = dp
        self.sketch = new_sketch()

    def read_sketch(self, reset: bool = True) -> CountMinSketch:
        """Sum the per-CPU rows into ``self.sketch`` (and zero the data plane's)."""
        table = np.zeros((DEPTH, WIDTH), np.uint64)
        t = self.dp.sketch
        for r in range(DEPTH):
            per_cpu = t[t.Key(r)]
            for cpu_row in per_cpu:
                table[r] += np.frombuffer(bytes(cpu_row), np.uint32)
            if reset:  # a per-CPU update takes one value per possible CPU
                t[t.Key(r)] = (t.Leaf * len(per_cpu))()
        self.sketch.load(np.minimum(table, 0xFFFFFFFF))
        return self.sketch

    def snapshot(self) -> Snapshot:
        sketch = self.read_sketch()
        recent = {(k.ns, bytes(k.key)): v.nchunks for k, v in self.dp.recent.items()}
        candidates = {}
        for block, nchunks in recent.items():
            misses = sketch.estimate(sketch_x(*block))
            if misses:
                candidates[block] = (misses, nchunks)
        blocks, entries = Slots.of(self.dp).summary()
        cached = {b: CachedBlock(s.nchunks, s.chunks, s.hits, s.speculative)
                  for b, s in blocks.items()}
        return Snapshot(candidates, cached, self.ns_counters(), entries)

    def ns_counters(self) -> dict[int, dict[str, int]]:
        out: dict[int, dict[str, int]] = {}
        for table in (self.dp.ns_low, self.dp.ns_stats):
            for k, per_cpu in table.items():
                row = {"hits": sum(v.hits for v in per_cpu),
                       "misses": sum(v.misses for v in per_cpu),
                       "hit_bytes": sum(v.hit_bytes for v in per_cpu)}
                if any(row.values()):
                    out[k.value] = row
        return out
