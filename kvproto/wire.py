"""The KV block protocol v1 codec: one message per UDP datagram, a 48-byte header then payload.

The constants (port, magic, ops, flags, status codes) are read from ``xdp/kvproto.h``, the one
definition shared with the data plane; the header's field order (``LAYOUT``) is checked against that
header's ``struct kvhdr`` through BCC by the test suite. docs/protocol.md documents the format.
"""
from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass
from enum import IntEnum, IntFlag

import xdp

CONSTANTS = xdp.constants("kvproto.h")
PORT = CONSTANTS["KV_UDP_PORT"]
MAGIC = CONSTANTS["KV_MAGIC"]
VERSION = CONSTANTS["KV_VERSION"]
HEADER_LEN = CONSTANTS["KV_HDR_LEN"]
MAX_PAYLOAD = CONSTANTS["KV_MAX_PAYLOAD"]
KEY_LEN = 16
# the chunk (kvproto.h): the size every command and library uses unless told (a switch caches
# chunks of its own --chunk-size only, so hits need the same size on both sides), and the one
# rule for any other: a multiple of CHUNK_ALIGN from CHUNK_ALIGN to MAX_CHUNK
DEFAULT_CHUNK = CONSTANTS["KV_DEFAULT_CHUNK"]
CHUNK_ALIGN = CONSTANTS["KV_CHUNK_ALIGN"]
MAX_CHUNK = CONSTANTS["KV_MAX_CHUNK"]
VETH_MAX_MTU = CONSTANTS["KV_VETH_MAX_MTU"]     # this kernel refuses native XDP on veths above


def check_chunk_size(size: int) -> int:
    """``size`` if it is a chunk size a deployment may use, else ValueError saying the rule."""
    if isinstance(size, bool) or not isinstance(size, int) or not CHUNK_ALIGN <= size <= MAX_CHUNK \
            or size % CHUNK_ALIGN:
        raise ValueError(f"chunk size {size!r} is not a multiple of {CHUNK_ALIGN} from "
                         f"{CHUNK_ALIGN} to {MAX_CHUNK} (the switch and the fetch engine move "
                         f"chunks in {CHUNK_ALIGN}-byte words; a larger frame needs a larger "
                         f"MTU than native XDP takes on a veth)")
    return size


def _enum_from(prefix: str, base: type) -> type:
    members = {n[len(prefix):]: v for n, v in CONSTANTS.items() if n.startswith(prefix)}
    return base(prefix.strip("_").title().replace("_", ""), members)


Op: type[IntEnum] = _enum_from("KV_OP_", IntEnum)
Flag: type[IntFlag] = _enum_from("KV_F_", IntFlag)
Status: type[IntEnum] = _enum_from("KV_ST_", IntEnum)

# struct kvhdr (xdp/kvproto.h), the one Python declaration of the header: (field, struct code)
# in order. The codec's Struct, the field offsets and the scapy layer are derived from it.
LAYOUT = (("magic", "H"), ("version", "B"), ("op", "B"), ("flags", "H"), ("status", "H"),
          ("ns", "I"), ("req_id", "I"), ("key", f"{KEY_LEN}s"), ("chunk", "I"),
          ("nchunks", "I"), ("len", "H"), ("reserved", "H"), ("csum", "I"))
HEADER = struct.Struct("!" + "".join(code for _, code in LAYOUT))
FIELDS = tuple(name for name, _ in LAYOUT)
if HEADER.size != HEADER_LEN:
    raise ImportError("struct kvhdr and the codec disagree on the header size")


def _offsets() -> dict[str, int]:
    out, at = {}, 0
    for name, code in LAYOUT:
        out[name] = at
        at += struct.calcsize("!" + code)
    return out


OFFSET = _offsets()   # byte offset of each header field within the header


_OPS = frozenset(int(o) for o in Op)
_GET = int(Op.GET)
_unpack = HEADER.unpack_from


class ProtocolError(ValueError):
    """A datagram that is not a valid v1 message; ``status`` is the code to answer with."""

    def __init__(self, reason: str, status: int = Status.BAD_REQUEST):
        super().__init__(reason)
        self.status = status


def unpack_header(data: bytes) -> tuple:
    """The header fields (in ``FIELDS`` order) of ``data`` if it is a valid v1 message, the one
    check every receiver in Python makes (``Message.decode``, the pool server's GET fast path);
    else ProtocolError saying why. One combined test on the common path, the reason after."""
    n = len(data) - HEADER_LEN
    if n >= 0:
        fields = _unpack(data)
        if fields[0] == MAGIC and fields[1] == VERSION and not fields[11] and \
                fields[2] in _OPS and fields[10] == n and n <= MAX_PAYLOAD:
            return fields
    raise _invalid(data)


def _invalid(data: bytes) -> ProtocolError:
    """Why ``data`` is not a valid v1 message (the first problem, in header order)."""
    if len(data) < HEADER_LEN:
        return ProtocolError(f"datagram of {len(data)} bytes is shorter than the header")
    (magic, version, op, _flags, _status, _ns, _req_id, _key, _chunk, _nchunks, length, reserved,
     _csum) = _unpack(data)
    if magic != MAGIC:
        return ProtocolError(f"bad magic 0x{magic:04x}")
    if version != VERSION:
        return ProtocolError(f"version {version} is not spoken here", Status.BAD_VERSION)
    if reserved:
        return ProtocolError("reserved field is not zero")
    if op not in _OPS:
        return ProtocolError(f"unknown op {op}")
    if length != len(data) - HEADER_LEN:
        return ProtocolError(f"header says {length} payload bytes, datagram has "
                             f"{len(data) - HEADER_LEN}")
    return ProtocolError(f"payload of {length} bytes is too large", Status.TOO_LARGE)


def checksum(payload: bytes) -> int:
    """The payload checksum carried in every message: CRC-32 (IEEE 802.3, as zlib.crc32)."""
    return zlib.crc32(payload) & 0xFFFFFFFF


@dataclass(frozen=True)
class Message:
    """One protocol message. A GET carries ``room`` zeroed bytes instead of a payload."""

    op: int
    ns: int
    key: bytes
    chunk: int = 0
    nchunks: int = 0
    req_id: int = 0
    flags: int = 0
    status: int = 0
    payload: bytes = b""
    room: int = 0
    csum: int | None = None  # None: computed from the payload when encoded

    def encode(self) -> bytes:
        if len(self.key) != KEY_LEN:
            raise ValueError(f"block key must be {KEY_LEN} bytes, got {len(self.key)}")
        if self.op == Op.GET:
            if self.payload:
                raise ValueError("a GET carries room, not payload")
            length, body, csum = self.room, bytes(self.room), 0
        else:
            length, body = len(self.payload), self.payload
            csum = checksum(body) if self.csum is None else self.csum
        if length > MAX_PAYLOAD:
            raise ValueError(f"payload of {length} bytes exceeds the {MAX_PAYLOAD}-byte maximum")
        head = HEADER.pack(MAGIC, VERSION, self.op, self.flags, self.status, self.ns,
                           self.req_id, self.key, self.chunk, self.nchunks, length, 0, csum)
        return head + body

    @classmethod
    def decode(cls, data: bytes) -> Message:
        return cls.from_header(unpack_header(data), data)

    @classmethod
    def from_header(cls, fields: tuple, data: bytes) -> Message:
        """The message of datagram ``data`` whose header ``unpack_header`` returned as
        ``fields`` (so a caller that looked at the header first does not read it again)."""
        (_magic, _version, op, flags, status, ns, req_id, key, chunk, nchunks, length, _reserved,
         csum) = fields
        if op == _GET:
            return cls(op, ns, key, chunk, nchunks, req_id, flags, status, b"", length, 0)
        return cls(op, ns, key, chunk, nchunks, req_id, flags, status,
                   bytes(data[HEADER_LEN:]), 0, csum)

    def checksum_ok(self) -> bool:
        return self.csum == checksum(self.payload)

    def answer(self, op: int, *, payload: bytes = b"", nchunks: int | None = None,
               flags: int = 0, status: int = 0, csum: int | None = None) -> Message:
        """A reply to this request: same namespace, key, chunk and request id."""
        return Message(op, self.ns, self.key, self.chunk,
                       self.nchunks if nchunks is None else nchunks, self.req_id, flags, status,
                       payload, 0, csum)
