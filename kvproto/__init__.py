"""The KV block protocol, one package for every side (switch, endpoints, testbed): the message
codec and its constants (wire), whole frames, offsets and XDP verdicts (frames), and a scapy layer
(scapy_layer, imported on demand: scapy is slow to load)."""
from .wire import (CHUNK_ALIGN, CONSTANTS, DEFAULT_CHUNK, FIELDS, HEADER, HEADER_LEN, KEY_LEN,
                   LAYOUT, MAGIC, MAX_CHUNK, MAX_PAYLOAD, OFFSET, PORT, VERSION, VETH_MAX_MTU,
                   Flag, Message, Op, ProtocolError, Status, check_chunk_size, checksum,
                   unpack_header)

__all__ = ["CHUNK_ALIGN", "CONSTANTS", "DEFAULT_CHUNK", "FIELDS", "HEADER", "HEADER_LEN",
           "KEY_LEN", "LAYOUT", "MAGIC", "MAX_CHUNK", "MAX_PAYLOAD", "OFFSET", "PORT", "VERSION",
           "VETH_MAX_MTU", "Flag", "Message", "Op", "ProtocolError", "Status", "check_chunk_size",
           "checksum", "unpack_header"]
