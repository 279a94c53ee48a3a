"""Checking what arrived and handing over finished blocks.

A step looks at every transfer whose received count moved: its slot words (numpy, in the range
asked for but not verified) say which chunks arrived for this generation and with which CRC.
The block's last chunk (which may be short) is checked alone; the others with one CRC call per
run of consecutive chunks (``crcfold``). A bad chunk's slot word is cleared (one aligned 64-bit
store: the only write Python makes to a slot word, never a read-modify-write shared with XDP), so
the program takes it again, and it is asked for again at once with KV_F_NO_CACHE (counted in
``checksum_errors``). Verified chunks feed the round-trip estimator (first asks only) and the
route's window. A finished transfer becomes a ``Block`` over its slots, with where its chunks
came from read from the slot words' reply flags.
"""
from __future__ import annotations

import time

import numpy as np

from hostagent.common.auth import AuthError
from hostagent.common.transfer import BlockNotFound, Refused
from kvproto import Flag, ProtocolError, Status

from hostagent.common.block import Block
from .crcfold import Folder, crc32
from .program import C, GEN_MASK, SENDQ
from .transfers import Transfer

_FROM_SWITCH, _REPLICA = int(Flag.FROM_SWITCH), int(Flag.REPLICA)
_SHIFT_GEN, _SHIFT_FLAGS = np.uint64(32), np.uint64(56)


def _bad_chunks(t: Transfer, idx: np.ndarray, crcs: np.ndarray, x, arena_mv, cs: int,
                folder: Folder) -> list[int]:
    base = t.base
    n = t.nchunks if t.known else int(x["seen_nchunks"])
    bad = []
    if idx[-1] == n - 1:                         # the block's last chunk: alone
        tail, off = int(x["tail_len"]), (base + n - 1) * cs
        if not 1 <= tail <= cs or crc32(arena_mv[off:off + tail]) != crcs[-1]:
            bad.append(n - 1)
        idx, crcs = idx[:-1], crcs[:-1]
    return bad + folder.bad_chunks(arena_mv[base * cs:], crcs, idx)


def verify(t: Transfer, x, meta: np.ndarray, arena_mv, cs: int, folder: Folder, ring,
           rto_floor: float, reo_floor: float, max_window: int) -> int:
    """Verify the chunks of ``t`` that arrived since the last look; how many passed."""
    lo, hi, base, gen = t.lo, t.next_new, t.base, t.gen
    prev, t.looked = t.looked, time.monotonic()  # before the slot words are read
    if hi <= lo:
        return 0
    pend = lo + np.flatnonzero(~t.verified[lo:hi])   # asked for, not verified yet
    words = meta[base + pend]
    fresh = ((words >> _SHIFT_GEN) & np.uint64(GEN_MASK)) == gen
    idx, words = pend[fresh], words[fresh]
    if not idx.size:
        return 0
    crcs = (words & np.uint64(0xFFFFFFFF)).astype(np.uint32)
    # an authenticated block's tag covers every byte: its CRCs are read only to find damaged
    # chunks once the tag failed (authcheck.repair), not on the way
    bad = [] if getattr(t, "auth", None) is not None else _bad_chunks(
        t, idx, crcs, x, arena_mv, cs, folder)
    if bad:
        b = np.array(bad)
        ask_again(t, b, meta)
        keep = ~np.isin(idx, b)
        ok, words = idx[keep], words[keep]
    else:
        ok = idx
    if not ok.size:
        return 0
    now = time.monotonic()
    t.verified[ok] = True
    t.nverified += ok.size
    t.last_delivery = now
    # who answered: the switch from its cache (FROM_SWITCH: within the call) or the pool node
    # (directly, or a REPLICA of its reply to a held miss: at the pool's pace)
    src = (words >> _SHIFT_FLAGS).astype(np.uint8)
    hits = ((src & _FROM_SWITCH) != 0) & ((src & _REPLICA) == 0)
    if hits.any():                               # the switch's cache: within the call
        t.max_hit_seq = max(t.max_hit_seq, int(t.sent_seq[ok[hits]].max()))
    t.pool_path |= not hits.all()
    if prev is not None:                         # came after its call and our last look
        ended = ring.done_time[t.sent_seq[ok] % SENDQ]
        t.rtt.arrived(np.count_nonzero(ended < prev) / ok.size)
    first = t.tries[ok] == 1                     # Karn: unambiguous samples only
    clean = ok[first]
    if clean.size:
        seqs = t.sent_seq[clean]
        # the pool's path only: a cache hit overtakes a miss held for the pool's reply
        pool_path = ((src[first] & _FROM_SWITCH) == 0) | ((src[first] & _REPLICA) != 0)
        if pool_path.any():
            t.max_recv_seq = max(t.max_recv_seq, int(seqs[pool_path].max()))
        sent = ring.sent_time(seqs, t.sent_t[clean])
        t.rtt.sample(now - float(sent.mean()), rto_floor, reo_floor)
        # the route's: the pool node's own replies to our GETs where there are any
        own = (src[first] & (_FROM_SWITCH | _REPLICA)) == 0
        on = own if own.any() else slice(None)
        t.route.rtt_sample(now - float(sent[on].mean()), now - float(sent[on].max()),
                           bool(own.any()))
    t.copied = np.count_nonzero(src & (_FROM_SWITCH | _REPLICA)) * 2 > ok.size
    t.switched = not t.no_cache and bool(
        np.count_nonzero(src & _FROM_SWITCH) * 10 >= 9 * ok.size)
    t.route.acked(ok.size, max_window)
    v = t.verified[t.lo:t.next_new]              # the lowest chunk still missing
    k = int(v.argmin()) if v.size else 0
    t.lo += k if v.size and not v[k] else v.size
    return ok.size


def ask_again(t: Transfer, b: np.ndarray, meta: np.ndarray) -> None:
    """Chunks ``b`` of ``t`` failed their CRC: cleared, asked again at once past the switch."""
    meta[t.base + b] = 0                         # the program takes it again
    t.bypass[b] = True
    t.sent_t[b] = -1e9                           # due at once
    t.stats.checksum_errors += b.size


def crc_damaged(t: Transfer, x, meta: np.ndarray, arena_mv, cs: int,
                folder: Folder) -> np.ndarray:
    """The verified chunks of ``t`` whose bytes fail the CRC their reply carried."""
    idx = np.flatnonzero(t.verified)
    if not idx.size:
        return idx
    crcs = (meta[t.base + idx] & np.uint64(0xFFFFFFFF)).astype(np.uint32)
    return np.array(_bad_chunks(t, idx, crcs, x, arena_mv, cs, folder), np.int64)


def finish(t: Transfer, x, meta: np.ndarray, arena: np.ndarray, cs: int, release,
           data: tuple[int, int] | None = None) -> Block:
    """The finished transfer as a Block over its slots (``data``: the (offset, length) of the
    bytes handed out, those of an authenticated block's data), its stats filled in."""
    n, base = t.nchunks, t.base
    tail = int(x["tail_len"])
    flags = (meta[base:base + n] >> _SHIFT_FLAGS).astype(np.uint8)
    replica = (flags & _REPLICA) != 0
    switch = ((flags & _FROM_SWITCH) != 0) & ~replica
    s = t.stats
    s.chunks, s.bytes = n, (n - 1) * cs + tail
    s.replicas, s.from_switch = int(replica.sum()), int(switch.sum())
    s.from_pool = n - s.replicas - s.from_switch
    s.seconds = time.monotonic() - t.start
    off, s.bytes = data if data is not None else (0, s.bytes)
    return Block(t.ns, t.key, n - off // cs, arena[base * cs + off:base * cs + off + s.bytes], s,
                 release)


def status_error(t: Transfer, status: int, err: int, seen: int) -> Exception:
    """What a NACK, an ERROR or another chunk count (the transfer's status bits) means. For an
    authenticated block, another chunk count or a chunk refused as past the block (BAD_REQUEST)
    means it is not the size its sealed form has: AuthError (the engine fetches it once more)."""
    if status & C["KV_FETCH_XS_NACK"]:
        try:
            why = Status(err).name
        except ValueError:
            why = str(err)
        return BlockNotFound(f"block {t.key.hex()} in namespace {t.ns}: {why}")
    if getattr(t, "auth", None) is not None and (
            status & C["KV_FETCH_XS_NCHUNKS"] or err == Status.BAD_REQUEST):
        what = f"has {seen} chunks" if status & C["KV_FETCH_XS_NCHUNKS"] else "is shorter"
        return AuthError(f"the block {what}, not the {t.nchunks} of a sealed block of that "
                         "data: not sealed with this namespace's key")
    if status & C["KV_FETCH_XS_ERROR"]:
        return Refused(err, f"GET of block {t.key.hex()}")
    return ProtocolError(f"the block has {seen} chunks, not {t.nchunks}")
