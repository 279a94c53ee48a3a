"""The count-min sketch the data plane keeps (per CPU, in a BPF map) and the policies keep in
Python, with the same hashing, so switchd can load the data plane's counters into one."""
from __future__ import annotations

import hashlib
import math
from typing import Iterable

import numpy as np

M64 = (1 << 64) - 1
U32_MAX = (1 << 32) - 1


def key64(key) -> int:
    """The 64-bit value a key is hashed from. int: itself (two's complement, 64 bits); bytes: XOR
    of its little-endian 8-byte words (a 16-byte block key is already a hash, so this is cheap to
    mirror in BPF); str: its UTF-8 bytes; tuple: its parts combined; anything else: BLAKE2b."""
    if isinstance(key, int):
        return key & M64
    if isinstance(key, (bytes, bytearray, memoryview)):
        data = bytes(key)
        data += b"\0" * (-len(data) % 8)
        x = 0
        for i in range(0, len(data), 8):
            x ^= int.from_bytes(data[i:i + 8], "little")
        return x
    if isinstance(key, str):
        return key64(key.encode())
    if isinstance(key, tuple):
        x = 0x9E3779B97F4A7C15
        for part in key:
            x = ((x ^ key64(part)) * 0xBF58476D1CE4E5B9 + 1) & M64
        return x
    return int.from_bytes(hashlib.blake2b(repr(key).encode(), digest_size=8).digest(), "little")


class CountMinSketch:
    """``depth`` rows x ``width`` columns of saturating u32 counters, as the data plane keeps them.

    Row r maps a key to column ``((a_r * key64(key) + b_r) mod 2**64) >> (64 - log2(width))``
    (multiply-shift, a_r odd; width is rounded up to a power of two; ``a``/``b`` fix the
    coefficients, as the data plane's are, else they come from ``seed``). ``estimate`` never
    undercounts; with ``width >= 2e/eps`` and ``depth >= ln(1/delta)`` (see ``for_error``) it
    overcounts by more than eps*N with probability at most delta, N = ``total`` (increments so
    far). Aging: every ``aging_interval`` increments (0 = never) all counters and N are halved.
    """

    def __init__(self, width: int = 1024, depth: int = 4, *, aging_interval: int = 0,
                 seed: int = 0x5EED, a: list[int] | None = None, b: list[int] | None = None):
        if width < 2 or depth < 1:
            raise ValueError("count-min sketch needs width >= 2 and depth >= 1")
        bits = (int(width) - 1).bit_length()
        self.width, self.depth = 1 << bits, int(depth)
        self._shift = 64 - bits
        if a is None or b is None:
            rng = np.random.default_rng(seed)
            a = [int(v) | 1 for v in rng.integers(0, 1 << 63, self.depth, dtype=np.uint64) * 2]
            b = [int(v) for v in rng.integers(0, 1 << 63, self.depth, dtype=np.uint64)]
        if len(a) != self.depth or len(b) != self.depth:
            raise ValueError("one multiplier and one offset per row")
        self.a, self.b = [int(v) for v in a], [int(v) for v in b]
        self.table = np.zeros((self.depth, self.width), np.uint32)
        self.aging_interval = int(aging_interval)
        self.total = 0
        self._since_aging = 0

    @classmethod
    def for_error(cls, eps: float, delta: float, **kw) -> "CountMinSketch":
        """A sketch whose overestimate is <= eps*N with probability >= 1-delta."""
        return cls(math.ceil(2 * math.e / eps), max(1, math.ceil(math.log(1 / delta))), **kw)

    def _columns(self, key) -> list[int]:
        x = key64(key)
        return [((a * x + b) & M64) >> self._shift for a, b in zip(self.a, self.b)]

    def _columns_many(self, keys: np.ndarray) -> np.ndarray:
        x = np.asarray(keys).astype(np.uint64)
        a = np.array(self.a, np.uint64)[:, None]
        b = np.array(self.b, np.uint64)[:, None]
        with np.errstate(over="ignore"):
            return ((a * x[None, :] + b) >> np.uint64(self._shift)).astype(np.int64)

    def add(self, key, count: int = 1) -> None:
        """Count ``count`` occurrences of one key."""
        t = self.table
        for r, c in enumerate(self._columns(key)):
            t[r, c] = min(int(t[r, c]) + count, U32_MAX)
        self._counted(count)

    def add_many(self, keys: Iterable[int], counts=1) -> None:
        """Count integer keys in bulk (numpy); ``counts`` is a scalar or one count per key."""
        keys = np.asarray(keys)
        if keys.size == 0:
            return
        w = np.broadcast_to(np.asarray(counts, np.float64), keys.shape)
        cols = self._columns_many(keys)
        for r in range(self.depth):
            inc = np.bincount(cols[r], weights=w, minlength=self.width)
            self.table[r] = np.minimum(self.table[r] + inc, U32_MAX).astype(np.uint32)
        self._counted(int(w.sum()))

    def _counted(self, n: int) -> None:
        self.total += n
        self._since_aging += n
        if self.aging_interval and self._since_aging >= self.aging_interval:
            self.halve()

    def halve(self) -> None:
        """Age the sketch: every counter (and N) is halved."""
        self.table >>= 1
        self.total //= 2
        self._since_aging = 0

    def estimate(self, key) -> int:
        return int(min(self.table[r, c] for r, c in enumerate(self._columns(key))))

    def estimate_many(self, keys: Iterable[int]) -> np.ndarray:
        cols = self._columns_many(np.asarray(keys))
        return self.table[np.arange(self.depth)[:, None], cols].min(axis=0)

    def load(self, table: np.ndarray, total: int | None = None) -> None:
        """Adopt counters read from the data plane's sketch map (same shape, same hashing)."""
        table = np.asarray(table, np.uint32)
        if table.shape != self.table.shape:
            raise ValueError(f"sketch shape {table.shape} != {self.table.shape}")
        self.table = table.copy()
        self.total = int(table[0].sum()) if total is None else int(total)
