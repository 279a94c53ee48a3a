"""Codec round trips against fixed byte vectors written out field by field from docs/protocol.md."""
import pytest

import xdp
from kvproto import (FIELDS, HEADER_LEN, MAGIC, MAX_PAYLOAD, PORT, Flag, Message, Op,
                     ProtocolError, Status, checksum, unpack_header)

KEY = bytes(range(16))

# GET ns=7 req=0x01020304 chunk=5 with 8 bytes of room
GET_VECTOR = bytes.fromhex(
    "4b56" "01" "01" "0000" "0000"          # magic version op flags status
    "00000007" "01020304"                    # ns req_id
    "000102030405060708090a0b0c0d0e0f"      # key
    "00000005" "00000000"                    # chunk nchunks
    "0008" "0000" "00000000"                 # len reserved csum
    "0000000000000000")                      # room

# GET_REPLY of b"hello" from the switch, chunk 5 of 9
REPLY_VECTOR = bytes.fromhex(
    "4b56" "01" "02" "0001" "0000"
    "00000007" "01020304"
    "000102030405060708090a0b0c0d0e0f"
    "00000005" "00000009"
    "0005" "0000" "3610a686"                 # crc32(b"hello") = 0x3610a686
    ) + b"hello"


def test_constants_come_from_the_c_header():
    c = xdp.constants("kvproto.h")
    assert (PORT, MAGIC, HEADER_LEN) == (19286, 0x4B56, 48)
    assert Op.GET == c["KV_OP_GET"] == 1 and Op.ERROR == 6
    assert Flag.FROM_SWITCH == 1 and Flag.NO_CACHE == 2
    assert Status.NOT_FOUND == c["KV_ST_NOT_FOUND"]


def test_get_encodes_to_the_vector_and_back():
    msg = Message(Op.GET, 7, KEY, chunk=5, req_id=0x01020304, room=8)
    assert msg.encode() == GET_VECTOR
    back = Message.decode(GET_VECTOR)
    assert back == Message(Op.GET, 7, KEY, 5, 0, 0x01020304, 0, 0, b"", 8, 0)


def test_reply_encodes_to_the_vector_and_back():
    msg = Message(Op.GET_REPLY, 7, KEY, chunk=5, nchunks=9, req_id=0x01020304,
                  flags=Flag.FROM_SWITCH, payload=b"hello")
    assert checksum(b"hello") == 0x3610A686
    assert msg.encode() == REPLY_VECTOR
    back = Message.decode(REPLY_VECTOR)
    assert back.payload == b"hello" and back.csum == 0x3610A686 and back.checksum_ok()
    assert back.flags == Flag.FROM_SWITCH and back.nchunks == 9


def test_answer_keeps_the_request_identity():
    req = Message.decode(GET_VECTOR)
    nack = req.answer(Op.NACK, status=Status.NOT_FOUND)
    assert (nack.ns, nack.key, nack.chunk, nack.req_id) == (7, KEY, 5, 0x01020304)
    assert Message.decode(nack.encode()).status == Status.NOT_FOUND


@pytest.mark.parametrize("bad, reason", [
    (REPLY_VECTOR[:47], "shorter than the header"),
    (b"\x00\x00" + REPLY_VECTOR[2:], "bad magic"),
    (REPLY_VECTOR[:2] + b"\x02" + REPLY_VECTOR[3:], "version 2"),
    (REPLY_VECTOR[:3] + b"\x63" + REPLY_VECTOR[4:], "unknown op"),
    (REPLY_VECTOR + b"x", "datagram has 6"),
    (REPLY_VECTOR[:-1], "datagram has 4"),
    (REPLY_VECTOR[:42] + b"\x00\x01" + REPLY_VECTOR[44:], "reserved"),
])
@pytest.mark.parametrize("check", [Message.decode, unpack_header])
def test_malformed_datagrams_are_refused(bad, reason, check):
    with pytest.raises(ProtocolError, match=reason):
        check(bad)


def test_one_header_check_for_every_receiver():
    """unpack_header (the pool server's fast path) and decode accept and refuse alike."""
    fields = dict(zip(FIELDS, unpack_header(REPLY_VECTOR)))
    assert (fields["op"], fields["ns"], fields["chunk"], fields["len"]) == (Op.GET_REPLY, 7, 5, 5)
    assert Message.from_header(unpack_header(GET_VECTOR), GET_VECTOR) == Message.decode(GET_VECTOR)
    n = MAX_PAYLOAD + 1
    big = REPLY_VECTOR[:40] + n.to_bytes(2, "big") + REPLY_VECTOR[42:48] + bytes(n)
    for check in (Message.decode, unpack_header):
        with pytest.raises(ProtocolError, match="too large") as exc:
            check(big)
        assert exc.value.status == Status.TOO_LARGE


def test_version_errors_carry_their_status():
    with pytest.raises(ProtocolError) as exc:
        Message.decode(REPLY_VECTOR[:2] + b"\x02" + REPLY_VECTOR[3:])
    assert exc.value.status == Status.BAD_VERSION


def test_corrupted_payload_fails_its_checksum():
    bad = REPLY_VECTOR[:-1] + b"O"
    assert not Message.decode(bad).checksum_ok()


@pytest.mark.parametrize("kwargs", [dict(key=b"short"), dict(payload=bytes(3445))])
def test_encode_rejects_what_cannot_go_on_the_wire(kwargs):
    base = dict(op=Op.PUT, ns=1, key=KEY)
    base.update(kwargs)
    with pytest.raises(ValueError):
        Message(**base).encode()
