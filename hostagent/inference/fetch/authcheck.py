"""Keyed authentication in the fetch engine (hostagent/common/auth.py has the format): a transfer of
a namespace the engine's keyring covers gets a ``StreamCheck``; as its arrived prefix grows the
header is parsed and the data fed to GHASH straight from the arena (a memoryview: no copy), so
the tag check overlaps the fetch; when the last chunk is in the tag decides. The tag covers
every byte, so such a transfer skips the per-chunk CRC checks on the way (GHASH costs about what
ISA-L's CRC does: authentication then costs the engine next to nothing); the CRCs its replies
carried (kept in the slot words) are checked only when the tag fails, to tell damage from
forgery: damaged chunks are asked again and the check starts over; if every CRC holds, the
block was forged (or stored forged): the engine fetches it once more past the switch's cache,
then fails it with AuthError. No byte of a block that fails its tag is handed out."""
from __future__ import annotations

import logging

from hostagent.common.auth import AuthError, Keyring, StreamCheck, header_chunks, refused

from .verify import ask_again

log = logging.getLogger("hostagent.fetch")

FEED_BYTES = 256 << 10          # feed GHASH at least this much at a time (calls cost ~1 us)


def check_for(keyring: Keyring | None, ns: int, key: bytes, cs: int) -> StreamCheck | None:
    k = keyring.key_for(ns) if keyring is not None else None
    return None if k is None else StreamCheck(k, ns, key, cs)


def stored_hint(keyring: Keyring | None, ns: int, nchunks: int | None, cs: int) -> int | None:
    """A caller's chunk count (of the data) as the stored block's."""
    if nchunks is None or keyring is None or not keyring.covers(ns):
        return nchunks
    return nchunks + header_chunks(cs)


def advance(t, arena_mv, cs: int, tail_len: int) -> None:
    """Feed the check of ``t`` what became final (chunks below ``t.lo``); AuthError if the
    header is wrong. ``tail_len``: bytes of the block's last chunk once it arrived."""
    check = t.auth
    if check is None or not t.known:
        return
    h = check.data_off // cs
    if not check.started:
        if t.lo < h:
            return
        check.start(arena_mv[t.base * cs:t.base * cs + check.data_off], stored_chunks=t.nchunks)
    done = t.lo >= t.nchunks
    end = check.data_len if done else min(check.data_len, (t.lo - h) * cs)
    if done and (t.nchunks - 1) * cs + tail_len != check.data_off + check.data_len:
        raise AuthError("the block's last chunk is not the length its header says")
    if end - check.fed >= (1 if done else FEED_BYTES):
        start = (t.base + h) * cs
        check.feed(arena_mv[start + check.fed:start + end])


def finish(t) -> None:
    """The tag check of a complete transfer (AuthError)."""
    if t.auth is not None:
        t.auth.finish()


def repair(t, damaged, meta, keyring: Keyring, cs: int) -> bool:
    """After a failed check: if chunks fail their CRC (``damaged``, found by
    verify.crc_damaged), they are asked again and the check starts over once they are in;
    True. Else (every CRC holds: forged, not damaged) False."""
    t.stats.auth_failures += 1
    if not len(damaged):
        return False
    ask_again(t, damaged, meta)
    t.verified[damaged] = False
    t.nverified -= len(damaged)
    t.lo = min(t.lo, int(damaged.min()))
    t.auth = check_for(keyring, t.ns, t.key, cs)
    return True


def retry(t, exc: AuthError, keyring: Keyring, cs: int) -> AuthError | None:
    """After a failed check: ready ``t`` to be fetched again past the switch's cache (a forged
    or damaged copy there, or a forged reply that won a race) and return None (the engine
    activates it with a new generation), or, if that was done already, the error to fail it
    with."""
    if t.auth_retried or not t.known:
        return refused(t.ns, t.key, exc)
    log.warning("block %s in namespace %d failed authentication (%s): fetching it again past "
                "the switch's cache", t.key.hex(), t.ns, exc)
    t.auth_retried, t.no_cache = True, True
    t.auth = check_for(keyring, t.ns, t.key, cs)
    stats = t.stats
    t.reset(t.nchunks)
    t.stats = stats
    return None
