"""Checking many chunk CRCs at the speed of one big CRC.

Every reply carries its payload's CRC-32 (zlib's). Checking them with one call per chunk costs a
Python call per chunk (about a microsecond here, more than the CRC of 3 KB itself). CRC-32 is
linear over GF(2): for strings A, B with len(B) = n,

    crc32(A + B) = X_n(crc32(A)) ^ crc32(B)

where X_n is a fixed 32x32 bit matrix (zlib's crc32_combine). So the CRCs of m consecutive
chunks fold into the CRC their concatenation must have (``Folder.fold``: one precomputed operator
per position, four byte tables each, so a fold is four numpy gathers and one XOR reduction), and
one CRC call over the whole run checks them all. Chunks with holes between them (what a lossy
fetch has after a round) are runs: every run's fold in one numpy pass, one CRC call per run
(650 chunks with 35 holes: 0.1 ms, half what a Python CRC call per chunk of each short run took).
A run that does not match is checked chunk by chunk to find the bad ones.

``crc32`` is ISA-L's (PyPI ``isal``, a dependency: 6.8 GB/s on 3 KB slices here), else
zlib-ng's if installed, else zlib's (2.0 GB/s).
"""
from __future__ import annotations

import functools
import zlib

import numpy as np

POLY = 0xEDB88320
FOLD_FROM = 16                       # fewer chunks are checked one CRC call each (no numpy)


def _pick_crc32():
    try:
        from isal.isal_zlib import crc32
        return crc32, "isal"
    except ImportError:
        pass
    try:
        from zlib_ng.zlib_ng import crc32
        return crc32, "zlib-ng"
    except ImportError:
        return zlib.crc32, "zlib"


crc32, CRC_IMPL = _pick_crc32()


def _multmodp(a: int, b: int) -> int:
    """a * b modulo the CRC polynomial (reflected: bit 31 is x^0), as zlib's multmodp."""
    m, p = 1 << 31, 0
    while True:
        if a & m:
            p ^= b
            if a & (m - 1) == 0:
                break
        m >>= 1
        b = (b >> 1) ^ POLY if b & 1 else b >> 1
    return p


def _multmodp_vec(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """_multmodp elementwise over uint64 arrays."""
    p = np.zeros(np.broadcast(a, b).shape, np.uint64)
    b = np.broadcast_to(b, p.shape).copy()
    for k in range(32):
        p ^= np.where(a & np.uint64(1 << (31 - k)), b, np.uint64(0))
        b = np.where(b & np.uint64(1), (b >> np.uint64(1)) ^ np.uint64(POLY), b >> np.uint64(1))
    return p


_X2N = [1 << 30]                     # x^(2^k) mod p, k = 0..31
for _ in range(31):
    _X2N.append(_multmodp(_X2N[-1], _X2N[-1]))


def _x8n(n: int) -> int:
    """x^(8n) mod p: the shift by n bytes."""
    p, k = 1 << 31, 3
    while n:
        if n & 1:
            p = _multmodp(_X2N[k & 31], p)
        n >>= 1
        k += 1
    return p


def combine(crc1: int, crc2: int, len2: int) -> int:
    """crc32(A + B) from crc32(A), crc32(B) and len(B) (zlib's crc32_combine)."""
    return _multmodp(_x8n(len2), crc1) ^ crc2


@functools.lru_cache(maxsize=8)
def _tables(chunk: int, span: int) -> np.ndarray:
    """Flat uint32 [position][byte][value]: the operator X^position (a shift by position
    chunks), split by the byte of the CRC it applies to."""
    shifts, step = [1 << 31], _x8n(chunk)             # x^0: the identity
    for _ in range(span - 1):
        shifts.append(_multmodp(step, shifts[-1]))
    bits = np.uint64(1) << np.arange(32, dtype=np.uint64)
    cols = _multmodp_vec(np.array(shifts, np.uint64)[:, None], bits[None, :])   # [span, 32]
    v = np.arange(256, dtype=np.uint64)
    out = np.zeros((span, 4, 256), np.uint64)
    for byte in range(4):
        for bit in range(8):
            on = ((v >> np.uint64(bit)) & np.uint64(1)).astype(bool)
            out[:, byte, :] ^= np.where(on[None, :], cols[:, 8 * byte + bit][:, None],
                                        np.uint64(0))
    return out.astype(np.uint32).reshape(-1)


class Folder:
    """Folds the CRCs of up to ``span`` consecutive ``chunk``-byte chunks into the CRC of their
    concatenation: the XOR over k of X^(m-1-k)(crc_k). ``bad_chunks`` checks any set of chunks
    (runs of consecutive ones with holes between them, as a lossy fetch leaves) with one CRC call
    per run, every run's expected CRC folded in one numpy pass."""

    def __init__(self, chunk: int, span: int = 1024):
        self.chunk, self.span = chunk, span
        self.tables = _tables(chunk, span)

    def _fold_runs(self, crcs: np.ndarray, shift: np.ndarray, starts: np.ndarray) -> np.ndarray:
        """Per run (``starts``: where each begins in ``crcs``) the folded CRC, chunk k of a run
        shifted by ``shift[k]`` chunks (its distance from the run's end)."""
        v = np.asarray(crcs, np.uint32).astype(np.int64)
        base, t = shift.astype(np.int64) << 10, self.tables
        acc = (t[base + (v & 0xFF)] ^ t[base + 256 + ((v >> 8) & 0xFF)] ^
               t[base + 512 + ((v >> 16) & 0xFF)] ^ t[base + 768 + (v >> 24)])
        return np.bitwise_xor.reduceat(acc, starts)

    def fold(self, crcs: np.ndarray) -> int:
        """CRC-32 of the concatenation of len(crcs) <= span full chunks with these CRCs."""
        m = len(crcs)
        if m == 0:
            return 0
        if m > self.span:
            raise ValueError(f"at most {self.span} chunks per fold")
        return int(self._fold_runs(crcs, np.arange(m - 1, -1, -1), np.zeros(1, np.int64))[0])

    def bad_chunks(self, buf, crcs: np.ndarray, idx: np.ndarray | None = None) -> list[int]:
        """Which of the full chunks ``idx`` of ``buf`` (ascending; all len(crcs) of them by
        default) differ from their CRCs ``crcs``. A run of consecutive chunks (at most ``span``)
        is checked with one CRC call over its bytes; one that does not match, chunk by chunk."""
        n, cs = len(crcs), self.chunk
        if n == 0:
            return []
        idx = np.arange(n) if idx is None else np.asarray(idx, np.int64)
        if n <= FOLD_FROM:                           # a few chunks: cheaper one by one
            return self._one_by_one(buf, crcs, idx)
        if idx[-1] - idx[0] == n - 1 and n <= self.span:      # one run: no holes
            first = int(idx[0])
            if crc32(buf[first * cs:(first + n) * cs]) == self.fold(crcs):
                return []
            return self._one_by_one(buf, crcs, idx)
        pos = np.arange(n)
        new = np.ones(n, bool)
        new[1:] = np.diff(idx) != 1                  # a hole: a run starts
        run_start = np.maximum.accumulate(np.where(new, pos, 0))
        new |= (pos - run_start) % self.span == 0    # and every span chunks within a run
        starts = np.flatnonzero(new)
        ends = np.append(starts[1:], n)
        run = np.cumsum(new) - 1
        folded = self._fold_runs(crcs, ends[run] - 1 - pos, starts)
        bad: list[int] = []
        at, want = (idx[starts] * cs).tolist(), folded.tolist()
        for r, size in enumerate(((ends - starts) * cs).tolist()):
            if crc32(buf[at[r]:at[r] + size]) != want[r]:
                a, b = int(starts[r]), int(ends[r])
                bad += self._one_by_one(buf, crcs[a:b], idx[a:b])
        return bad

    def _one_by_one(self, buf, crcs: np.ndarray, idx: np.ndarray) -> list[int]:
        cs = self.chunk
        return [i for i, c in zip(idx.tolist(), np.asarray(crcs).tolist())
                if crc32(buf[i * cs:(i + 1) * cs]) != c]
