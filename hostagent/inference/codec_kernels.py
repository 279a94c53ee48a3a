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


@njit(cache=True, fastmath=True, nogil=True, boundscheck=False, inline="always")
def _h8(o):
    """The last butterfly stage (8) of the inverse rotation, in place on a token's 64 values."""
    for i0 in range(0, 64, 16):
        for j in range(8):
            a, b = o[i0 + j], o[i0 + j + 8]
            o[i0 + j], o[i0 + j + 8] = a + b, a - b


@njit(cache=True, fastmath=True, nogil=True, boundscheck=False)
def dec4h(packed, ks, km, vs, vm, out, heads, group, rows, tokens, out_stride, out_off):
    """int4h: 4-bit codes of the rotated head dimension (64), then the inverse rotation, the
    Hadamard stages 32, 16 and 8 (H8 ⊗ I8; its 1/sqrt(8) is folded into the scales; stages 32
    and 16 fused with the dequantisation). A token's 32 bytes hold rotated channel c (low
    nibble) and c + 32 (high). K rows (even ``r // heads``): per channel over ``group``
    tokens, ``ks``/``km`` [K rows, groups, 64]; V rows: per token, ``vs``/``vm`` [V rows,
    tokens]. Rows are ordered (layer, K/V, head) as in a block."""
    ng = tokens // group
    for r in range(rows):
        rr = (r // (2 * heads)) * heads + r % heads          # the row among K's (or V's)
        base = r * out_stride + out_off
        if (r // heads) % 2 == 0:
            for t in range(tokens):
                p = packed[(r * tokens + t) * 32:(r * tokens + t + 1) * 32]
                o = out[base + t * 64:base + t * 64 + 64]
                sb = (rr * ng + t // group) * 64
                s, m = ks[sb:sb + 64], km[sb:sb + 64]
                for j in range(16):
                    v, w = p[j], p[j + 16]
                    a0 = (v & 15) * s[j] + m[j]
                    a1 = (v >> 4) * s[j + 32] + m[j + 32]
                    a2 = (w & 15) * s[j + 16] + m[j + 16]
                    a3 = (w >> 4) * s[j + 48] + m[j + 48]
                    b0, b1, b2, b3 = a0 + a1, a0 - a1, a2 + a3, a2 - a3
                    o[j], o[j + 16], o[j + 32], o[j + 48] = b0 + b2, b0 - b2, b1 + b3, b1 - b3
                _h8(o)
        else:
            for t in range(tokens):
                p = packed[(r * tokens + t) * 32:(r * tokens + t + 1) * 32]
                o = out[base + t * 64:base + t * 64 + 64]
                sv, mv = vs[rr * tokens + t], vm[rr * tokens + t]
                for j in range(16):
                    v, w = p[j], p[j + 16]
                    a0 = (v & 15) * sv
                    a1 = (v >> 4) * sv
                    a2 = (w & 15) * sv
                    a3 = (w >> 4) * sv
                    b0, b1, b2, b3 = a0 + a1 + 2 * mv, a0 - a1, a2 + a3 + 2 * mv, a2 - a3
                    o[j], o[j + 16], o[j + 32], o[j + 48] = b0 + b2, b0 - b2, b1 + b3, b1 - b3
                _h8(o)
