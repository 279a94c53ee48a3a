"""The KV codecs' decode loops (``hostagent.inference.codec``), compiled by numba at first use and
cached on disk. Each decodes ``rows`` rows of ``row_len`` values from coded bytes into ``out``, a
flat float32 array, row r at ``out[r * out_stride + out_off:][:row_len]`` (a block's tokens inside a
longer cache tensor). One pass, the inner loop over contiguous values (LLVM vectorises it).
"""
from __future__ import annotations

from numba import njit


@njit(cache=True, fastmath=True, nogil=True, boundscheck=False)
def dec8(codes, scales, out, gsize, rows, row_len, out_stride, out_off):
    """int8: value = code * scale of its group of ``gsize`` consecutive values."""
    ng = row_len // gsize
    for r in range(rows):
        base_in, base_out = r * row_len, r * out_stride + out_off
        for g in range(ng):
            s = scales[r * ng + g]
            i0, o0 = base_in + g * gsize, base_out + g * gsize
            c, o = codes[i0:i0 + gsize], out[o0:o0 + gsize]
            for i in range(gsize):
                o[i] = c[i] * s


@njit(cache=True, fastmath=True, nogil=True, boundscheck=False)
def decf8(codes, table, scales, out, gsize, rows, row_len, out_stride, out_off):
    """fp8 e4m3: value = table[code] * scale of its group."""
    ng = row_len // gsize
    for r in range(rows):
        base_in, base_out = r * row_len, r * out_stride + out_off
        for g in range(ng):
            s = scales[r * ng + g]
            i0, o0 = base_in + g * gsize, base_out + g * gsize
            c, o = codes[i0:i0 + gsize], out[o0:o0 + gsize]
            for i in range(gsize):
                o[i] = table[c[i]] * s


@njit(cache=True, fastmath=True, nogil=True, boundscheck=False)
def dec4(packed, scales, mins, out, group, dim, rows, row_len, out_stride, out_off):
    """int4, per channel over ``group`` tokens: byte (j, d) of a group holds tokens 2j (low
    nibble) and 2j+1 (high) of channel d; value = code * scale[d] + min[d]."""
    ng = row_len // (group * dim)
    half = group // 2
    for r in range(rows):
        for g in range(ng):
            sb = (r * ng + g) * dim
            pin = (r * row_len + g * group * dim) // 2
            o0 = r * out_stride + out_off + g * group * dim
            s, m = scales[sb:sb + dim], mins[sb:sb + dim]
            for j in range(half):
                p = packed[pin + j * dim:pin + (j + 1) * dim]
                a = out[o0 + 2 * j * dim:o0 + (2 * j + 1) * dim]
                b = out[o0 + (2 * j + 1) * dim:o0 + (2 * j + 2) * dim]
                for d in range(dim):
                    v = p[d]
                    a[d] = (v & 15) * s[d] + m[d]
                    b[d] = (v >> 4) * s[d] + m[d]
