"""The ``pca`` transform codec's loops (``hostagent.inference.codec_pca``), compiled by numba at
first use and cached on disk: quantising and packing the per-component code streams, unpacking
and dequantising them, and the pass that turns the inverse transform's output into KV in the
destination cache (mean added, RoPE put back on the keys, float32 written straight into the
cache's rows).

Code streams: component j of group g holds the codes of the block's coded tokens at ``bits[g, j]``
bits each, least significant bit first, eight codes in ``bits`` bytes (the coded tokens are a
multiple of 8, so every stream starts on a byte). A reader loads 8 bytes at once (the format ends
in 8 bytes of padding, so the last stream's load stays inside the block).
"""
from __future__ import annotations

import numpy as np
from numba import njit


@njit(cache=True, nogil=True, boundscheck=False, inline="always")
def _quantise_run(x, e, out, p, b):
    """One component's ``T`` values to codes of ``b`` bits (a constant where it is inlined:
    the search and the shifts unroll), packed from byte ``p``; the end offset."""
    for t0 in range(0, len(x), 8):
        w = np.uint64(0)
        for i in range(8):
            v = x[t0 + i]
            lo = 0
            step = 1 << (b - 1)
            while step:                     # branch-free binary search: the data decides
                lo += step * (e[lo + step - 1] < v)
                step >>= 1
            w |= np.uint64(lo) << np.uint64(b * i)
        for i in range(b):
            out[p + i] = np.uint8((w >> np.uint64(8 * i)) & np.uint64(255))
        p += b
    return p


@njit(cache=True, nogil=True, boundscheck=False)
def quantise(c, edges, bits, out, off):
    """Components ``c`` [G, P, T] (float32) to their nearest level's code (the number of the
    component's decision edges ``edges[g, j]`` below the value), packed into ``out`` from byte
    ``off``, group by group, component by component; components with 0 bits are skipped.
    Returns the end offset."""
    G, P, T = c.shape
    p = off
    for g in range(G):
        for j in range(P):
            b, x, e = bits[g, j], c[g, j], edges[g, j]
            if b == 1:                      # one loop a width: constant shifts and searches
                p = _quantise_run(x, e, out, p, 1)
            elif b == 2:
                p = _quantise_run(x, e, out, p, 2)
            elif b == 3:
                p = _quantise_run(x, e, out, p, 3)
            elif b == 4:
                p = _quantise_run(x, e, out, p, 4)
            elif b == 5:
                p = _quantise_run(x, e, out, p, 5)
            elif b == 6:
                p = _quantise_run(x, e, out, p, 6)
            elif b == 7:
                p = _quantise_run(x, e, out, p, 7)
            elif b == 8:
                p = _quantise_run(x, e, out, p, 8)
    return p


@njit(cache=True, nogil=True, boundscheck=False, inline="always")
def _unpack_run(src, p, lev, row, b):
    """One component's codes of ``b`` bits (a constant where it is inlined) from byte ``p``
    into ``row``, each looked up in ``lev``; the end offset."""
    mask = np.uint64((1 << b) - 1)
    for t0 in range(0, len(row), 8):
        w = np.uint64(0)
        for i in range(8):                  # LLVM merges these into one 64-bit load
            w |= np.uint64(src[p + i]) << np.uint64(8 * i)
        for i in range(8):
            row[t0 + i] = lev[(w >> np.uint64(b * i)) & mask]
        p += b
    return p


@njit(cache=True, nogil=True, boundscheck=False)
def unpack(src, goff, gids, bits, slot, levels, coef):
    """Dequantise the codes of groups ``gids`` (group g's streams start at byte ``goff[g]``)
    into ``coef`` [len(gids), K, T] (uint16: bf16 bits, or float32 when the tables are):
    component j of group g to row ``slot[g, j]``, value ``levels[g, j, code]``. Rows no
    component fills stay as they are."""
    for gi in range(len(gids)):
        g = gids[gi]
        p = goff[g]
        for j in range(bits.shape[1]):
            b, lev, row = bits[g, j], levels[g, j], coef[gi, slot[g, j]]
            if b == 1:                      # one loop a width: constant shifts, a third faster
                p = _unpack_run(src, p, lev, row, 1)
            elif b == 2:
                p = _unpack_run(src, p, lev, row, 2)
            elif b == 3:
                p = _unpack_run(src, p, lev, row, 3)
            elif b == 4:
                p = _unpack_run(src, p, lev, row, 4)
            elif b == 5:
                p = _unpack_run(src, p, lev, row, 5)
            elif b == 6:
                p = _unpack_run(src, p, lev, row, 6)
            elif b == 7:
                p = _unpack_run(src, p, lev, row, 7)
            elif b == 8:
                p = _unpack_run(src, p, lev, row, 8)


@njit(cache=True, fastmath=True, nogil=True, boundscheck=False)
def finish(y, gids, mean, cos, sin, rope_parts, parts, dim, out, out_stride, out_off):
    """Inverse-transform output ``y`` [n, T, parts * dim] of groups ``gids`` (uint16 bf16 bits)
    plus ``mean`` [G, parts * dim] into ``out`` (flat float32): part q of group g (a layer: its
    K heads, then its V heads) is cache row ``r = g * parts + q``, its token t at ``out[r *
    out_stride + out_off + t * dim:][:dim]`` (a block's rows inside a longer cache tensor). The
    first ``rope_parts`` (the keys) get RoPE back, with ``cos``/``sin`` [T, dim // 2] of the
    tokens' positions (HF's rotate-half pairs d, d + dim / 2)."""
    G, T, _ = y.shape
    half = dim // 2
    u = np.empty(dim, np.uint32)
    f = u.view(np.float32)
    for gi in range(G):
        g = gids[gi]
        for h in range(parts):
            rope = h < rope_parts
            m = mean[g, h * dim:(h + 1) * dim]
            base = (g * parts + h) * out_stride + out_off
            for t in range(T):
                yy = y[gi, t, h * dim:(h + 1) * dim]
                for d in range(dim):
                    u[d] = np.uint32(yy[d]) << np.uint32(16)
                o = out[base + t * dim:base + (t + 1) * dim]
                if rope:
                    c, s = cos[t], sin[t]
                    for d in range(half):
                        a = f[d] + m[d]
                        b = f[d + half] + m[d + half]
                        o[d] = a * c[d] - b * s[d]
                        o[d + half] = b * c[d] + a * s[d]
                else:
                    for d in range(dim):
                        o[d] = f[d] + m[d]


@njit(cache=True, fastmath=True, nogil=True, boundscheck=False)
def finish32(y, gids, mean, cos, sin, rope_parts, parts, dim, out, out_stride, out_off):
    """``finish`` for a float32 ``y`` (the inverse transform run in float32)."""
    G, T, _ = y.shape
    half = dim // 2
    for gi in range(G):
        g = gids[gi]
        for h in range(parts):
            rope = h < rope_parts
            m = mean[g, h * dim:(h + 1) * dim]
            base = (g * parts + h) * out_stride + out_off
            for t in range(T):
                f = y[gi, t, h * dim:(h + 1) * dim]
                o = out[base + t * dim:base + (t + 1) * dim]
                if rope:
                    c, s = cos[t], sin[t]
                    for d in range(half):
                        a = f[d] + m[d]
                        b = f[d + half] + m[d + half]
                        o[d] = a * c[d] - b * s[d]
                        o[d + half] = b * c[d] + a * s[d]
                else:
                    for d in range(dim):
                        o[d] = f[d] + m[d]
