"""The ``pca`` transform codec's loops (``hostagent.inference.codec_pca``), compiled by numba at
first use and cached on disk: quantising and packing the per-component code streams, unpacking
and dequantising them, and the pass that turns the inverse transform's output into KV in the
destination cache (mean added, RoPE put back on the keys, float32 written straight into the
cache's rows).

Where the cache's rows start 64-byte aligned (``STREAM_ALIGN``; a head dimension that is a
multiple of 16), ``finish(bf16, stream=True)`` writes them with non-temporal (streaming) stores:
a block's 11.8 MB of float32 would otherwise be read into the cache before it is overwritten and
push the transform's tables out on the way (the pass took 1.9 ms a block into a cold cache that
way against 0.9 ms streamed, here; a whole decode 5.9 ms against 4.6). The plain stores
(``stream=False``) serve caches that are not aligned so. A store fence ends the streamed pass,
so what it wrote is ordered before whatever the caller writes next (the hand-over to the thread
that reads the cache).

Code streams: component j of group g holds the codes of the block's coded tokens at ``bits[g, j]``
bits each, least significant bit first, eight codes in ``bits`` bytes (the coded tokens are a
multiple of 8, so every stream starts on a byte). A reader loads 8 bytes at once (the format ends
in 8 bytes of padding, so the last stream's load stays inside the block).
"""
from __future__ import annotations

import platform

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

STREAM_ALIGN = 64                          # bytes: where every row a streamed pass writes starts
_X86 = platform.machine().lower() in ("x86_64", "amd64")


@intrinsic
def _stream16(typingctx, dst, di, src, si):
    """``dst[di:di + 16] = src[si:si + 16]`` (float32) as one non-temporal vector store;
    ``dst[di]`` must be STREAM_ALIGN-aligned."""
    def codegen(context, builder, sig, args):
        d, i, s, j = args
        vec = ir.VectorType(ir.FloatType(), 16)
        src_ptr = context.make_array(sig.args[2])(context, builder, s).data
        dst_ptr = context.make_array(sig.args[0])(context, builder, d).data
        v = builder.load(builder.bitcast(builder.gep(src_ptr, [j], inbounds=True),
                                         vec.as_pointer()), align=4)
        st = builder.store(v, builder.bitcast(builder.gep(dst_ptr, [i], inbounds=True),
                                              vec.as_pointer()), align=STREAM_ALIGN)
        st.set_metadata("nontemporal",
                        builder.module.add_metadata([ir.Constant(ir.IntType(32), 1)]))
    return types.void(dst, di, src, si), codegen


@intrinsic
def _store_fence(typingctx):
    """Order the streaming stores before any store after them (x86: sfence)."""
    def codegen(context, builder, sig, args):
        if _X86:
            builder.call(ir.Function(builder.module, ir.FunctionType(ir.VoidType(), []),
                                     name="llvm.x86.sse.sfence"), [])
        else:
            builder.fence("seq_cst")
    return types.void(), codegen


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


def _finisher(bf16: bool, stream: bool):
    """The pass below, for ``y`` of bf16 bits or float32, its rows stored plainly or streamed
    (constants of each compiled variant: a flag read at run time, or a helper holding the
    row's arithmetic, made the streamed one several times slower under numba)."""
    @njit(cache=True, fastmath=True, nogil=True, boundscheck=False)
    def finish(y, gids, mean, cos, sin, rope_parts, parts, dim, out, out_stride, out_off):
        G, T, _ = y.shape
        half = dim // 2
        u = np.empty(dim, np.uint32)
        o = np.empty(dim, np.float32)            # a token's row, then stored into the cache
        for gi in range(G):
            g = gids[gi]
            for h in range(parts):
                rope = h < rope_parts
                m = mean[g, h * dim:(h + 1) * dim]
                base = (g * parts + h) * out_stride + out_off
                for t in range(T):
                    yy = y[gi, t, h * dim:(h + 1) * dim]
                    if bf16:
                        for d in range(dim):
                            u[d] = np.uint32(yy[d]) << np.uint32(16)
                        f = u.view(np.float32)
                    else:
                        f = yy
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
                    at = base + t * dim
                    if stream:
                        for k in range(0, dim, 16):
                            _stream16(out, at + k, o, k)
                    else:
                        for d in range(dim):
                            out[at + d] = o[d]
        if stream:
            _store_fence()
    return finish


# finish(bf16, stream) is the pass: inverse-transform output ``y`` [n, T, parts * dim] of groups
# ``gids`` (uint16 bf16 bits, or float32: the inverse transform run in float32) plus ``mean``
# [G, parts * dim] into ``out`` (flat float32): part q of group g (a layer: its K heads, then its
# V heads) is cache row ``r = g * parts + q``, its token t at ``out[r * out_stride + out_off + t *
# dim:][:dim]`` (a block's rows inside a longer cache tensor). The first ``rope_parts`` (the
# keys) get RoPE back, with ``cos``/``sin`` [T, dim // 2] of the tokens' positions (HF's
# rotate-half pairs d, d + dim / 2). Streamed: every row's start STREAM_ALIGN-aligned, ``dim`` a
# multiple of 16. (Each variant compiles at its first call.)
_FINISH = {(b, s): _finisher(b, s) for b in (True, False) for s in (True, False)}


def finish(bf16: bool, stream: bool):
    """The pass for ``y`` of bf16 bits (else float32), its rows streamed or stored plainly."""
    return _FINISH[(bf16, stream)]
