"""The stored form of a whole KV block, shared by every pool-node store: one object per block
(a Mooncake object, a run of staging pages) laid out as

    header (64 bytes) | CRC-32 of each chunk (u32 each) | zero padding | payload

The header names the block (namespace, 16-byte key), its chunking (chunk count and size: chunk i
is payload[i*chunk_size:][:chunk_size], the last may be shorter) and where the payload starts;
``payload_off`` is rounded up to a multiple of the chunk size, so a block read into pages of
that size has every chunk in a page of its own (what an XDP program serving from a page-array
map needs). The CRCs are the ones the writer sent with each PUT: a reader checks the header's
own CRC (which also covers the CRC array) before trusting the layout, and every chunk against
its CRC before serving it. Multi-byte fields are little-endian. Also owns the object key a
block has in a shared store (``object_key``).
"""
from __future__ import annotations

import struct
import sys
import zlib
from array import array
from dataclasses import dataclass

MAGIC = b"KVB1"
VERSION = 1
# magic version flags ns key nchunks chunk_size payload_off payload_len head_crc, padded to 64
HEAD = struct.Struct("<4sHHI16sIIIQI12x")
HEAD_LEN = HEAD.size
_CRC_AT = HEAD_LEN - 16          # head_crc's offset: the CRC covers the bytes before it
KEY_PREFIX = "kvswitch"
assert HEAD_LEN == 64


class BlockFormatError(ValueError):
    """Bytes that are not a well-formed block of the expected name."""


def object_key(ns: int, key: bytes) -> str:
    """The key a block has in a shared store: ``kvswitch/<ns>/<key hex>``."""
    if not 0 <= ns <= 0xFFFFFFFF or len(key) != 16:
        raise ValueError("a block is named by a u32 namespace and a 16-byte key")
    return f"{KEY_PREFIX}/{ns}/{key.hex()}"


def parse_object_key(text: str) -> tuple[int, bytes]:
    prefix, ns, key = text.split("/")
    if prefix != KEY_PREFIX:
        raise ValueError(f"{text!r} is not a kvswitch block key")
    return int(ns), bytes.fromhex(key)


def payload_offset(nchunks: int, chunk_size: int) -> int:
    head = HEAD_LEN + 4 * nchunks
    return -(-head // chunk_size) * chunk_size


@dataclass(frozen=True)
class ObjectLayout:
    """Where a stored block's parts are, relative to the start of its object."""
    ns: int
    key: bytes
    nchunks: int
    chunk_size: int
    payload_off: int
    payload_len: int

    @property
    def size(self) -> int:
        """Bytes of the whole object."""
        return self.payload_off + self.payload_len

    def chunk_span(self, i: int) -> tuple[int, int]:
        """(offset in the object, length) of chunk i."""
        start = i * self.chunk_size
        return self.payload_off + start, min(self.chunk_size, self.payload_len - start)

    @classmethod
    def for_payload(cls, ns: int, key: bytes, payload_len: int, chunk_size: int) -> ObjectLayout:
        if payload_len < 1 or chunk_size < 1:
            raise ValueError("a block has at least one byte and a positive chunk size")
        n = -(-payload_len // chunk_size)
        return cls(ns, key, n, chunk_size, payload_offset(n, chunk_size), payload_len)


def object_size(payload_len: int, nchunks: int, chunk_size: int) -> int:
    return payload_offset(nchunks, chunk_size) + payload_len


def _crc_bytes(crcs) -> bytes:
    a = array("I", crcs)
    if sys.byteorder != "little":
        a.byteswap()
    return a.tobytes()


def write_block(buf: memoryview, layout: ObjectLayout, chunks: list[bytes],
                crcs: list[int]) -> None:
    """Lay a block out in ``buf`` (at least ``layout.size`` bytes, writable)."""
    if len(chunks) != layout.nchunks or len(crcs) != layout.nchunks:
        raise ValueError("one payload and one CRC per chunk")
    off = layout.payload_off
    crc_end = HEAD_LEN + 4 * layout.nchunks
    buf[HEAD_LEN:crc_end] = _crc_bytes(crcs)
    buf[crc_end:off] = bytes(off - crc_end)
    for c in chunks:
        buf[off:off + len(c)] = c
        off += len(c)
    if off != layout.size:
        raise ValueError("the chunks do not add up to the payload length")
    head = bytearray(HEAD.pack(MAGIC, VERSION, 0, layout.ns, layout.key, layout.nchunks,
                               layout.chunk_size, layout.payload_off, layout.payload_len, 0))
    crc = zlib.crc32(buf[HEAD_LEN:crc_end], zlib.crc32(head[:_CRC_AT]))
    struct.pack_into("<I", head, _CRC_AT, crc)
    buf[:HEAD_LEN] = head


def encode_block(ns: int, key: bytes, chunks: list[bytes], crcs: list[int] | None = None
                 ) -> bytes:
    """A block as one object (bytes), from its chunks (all but the last of one size)."""
    if crcs is None:
        crcs = [zlib.crc32(c) for c in chunks]
    layout = ObjectLayout.for_payload(ns, key, sum(map(len, chunks)), len(chunks[0]))
    buf = bytearray(layout.size)
    write_block(memoryview(buf), layout, chunks, crcs)
    return bytes(buf)


def read_layout(buf, size: int, ns: int | None = None, key: bytes | None = None) -> ObjectLayout:
    """The layout of the ``size``-byte object at the start of ``buf``, its header checked
    (against the expected name when given). Raises BlockFormatError."""
    if size < HEAD_LEN:
        raise BlockFormatError(f"{size} bytes is shorter than a block header")
    (magic, version, _flags, bns, bkey, n, cs, off, length,
     crc) = HEAD.unpack_from(buf, 0)
    if magic != MAGIC or version != VERSION:
        raise BlockFormatError("not a kvswitch block (bad magic or version)")
    if n < 1 or cs < 1 or off != payload_offset(n, cs) or off + length != size or \
            not (n - 1) * cs < length <= n * cs:
        raise BlockFormatError(f"inconsistent header: {n} chunks of {cs} B, payload "
                               f"{length} B at {off}, object {size} B")
    mv = memoryview(buf)
    if zlib.crc32(mv[HEAD_LEN:HEAD_LEN + 4 * n], zlib.crc32(mv[:_CRC_AT])) != crc:
        raise BlockFormatError("header or chunk CRC array is corrupt")
    if (ns is not None and bns != ns) or (key is not None and bkey != key):
        raise BlockFormatError(f"object holds block {bns}/{bkey.hex()}, not the one asked for")
    return ObjectLayout(bns, bkey, n, cs, off, length)


def read_crcs(buf, layout: ObjectLayout) -> array:
    a = array("I")
    a.frombytes(bytes(memoryview(buf)[HEAD_LEN:HEAD_LEN + 4 * layout.nchunks]))
    if sys.byteorder != "little":
        a.byteswap()
    return a


def bad_chunks(buf, layout: ObjectLayout, crcs: array) -> list[int]:
    """Indices of the chunks whose bytes do not match their CRC (empty: all good)."""
    mv, bad = memoryview(buf), []
    for i in range(layout.nchunks):
        off, ln = layout.chunk_span(i)
        if zlib.crc32(mv[off:off + ln]) != crcs[i]:
            bad.append(i)
    return bad
