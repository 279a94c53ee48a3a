"""The KV block protocol, one package for every side (switch, endpoints, testbed): the message
codec and its constants (wire), whole frames, offsets and XDP verdicts (frames), and a scapy layer
(scapy_layer, imported on demand: scapy is slow to load)."""
from .wire import (CONSTANTS, DEFAULT_CHUNK, FIELDS, HEADER, HEADER_LEN, KEY_LEN, LAYOUT, MAGIC,
                   MAX_PAYLOAD, OFFSET, PORT, VERSION, Flag, Message, Op, ProtocolError, Status,
                   checksum, unpack_header)

__all__ = ["CONSTANTS", "DEFAULT_CHUNK", "FIELDS", "HEADER", "HEADER_LEN", "KEY_LEN", "LAYOUT",
           "MAGIC", "MAX_PAYLOAD", "OFFSET", "PORT", "VERSION", "Flag", "Message", "Op",
           "ProtocolError", "Status", "checksum", "unpack_header"]
