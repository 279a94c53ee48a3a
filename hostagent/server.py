"""The pool (storage) node: answers GETs and accepts PUTs of chunked blocks over UDP (asyncio).

Each datagram is one request and gets at most one answer. A datagram that is not a v1 message is
answered with ERROR when its header could be read far enough to address a reply, else dropped.
"""
from __future__ import annotations

import asyncio
import logging
from collections import Counter

from kvproto import FIELDS, HEADER, HEADER_LEN, MAGIC, Flag, Message, Op, ProtocolError, Status
from .udp import grow_buffers
from .store import BlockStore, StoreError

log = logging.getLogger("hostagent.server")
_RX_NAMES = {int(op): f"rx_{op.name.lower()}" for op in Op}


class PoolServer(asyncio.DatagramProtocol):
    def __init__(self, store: BlockStore):
        self.store = store
        self.counters: Counter[str] = Counter()
        self.transport: asyncio.DatagramTransport | None = None

    def connection_made(self, transport):
        self.transport = transport

    def datagram_received(self, data: bytes, addr):
        try:
            msg = Message.decode(data)
        except ProtocolError as exc:
            self.counters["malformed"] += 1
            if len(data) >= HEADER_LEN:
                self._refuse(data, addr, exc.status)
            return
        reply = self.handle(msg)
        if reply is not None:
            self.transport.sendto(reply.encode(), addr)

    def handle(self, msg: Message) -> Message | None:
        self.counters[_RX_NAMES[msg.op]] += 1
        try:
            if msg.op == Op.GET:
                payload, crc, nchunks = self.store.get_chunk(msg.ns, msg.key, msg.chunk)
                self.counters["tx_bytes"] += len(payload)
                return msg.answer(Op.GET_REPLY, payload=payload, csum=crc, nchunks=nchunks)
            if msg.op == Op.PUT:
                done = self.store.put_chunk(msg.ns, msg.key, msg.chunk, msg.nchunks,
                                            msg.payload, msg.csum)
                return msg.answer(Op.PUT_ACK, flags=Flag.BLOCK_DONE if done else 0)
        except StoreError as exc:
            self.counters[f"err_{Status(exc.status).name.lower()}"] += 1
            op = Op.NACK if exc.status in (Status.NOT_FOUND, Status.INCOMPLETE) else Op.ERROR
            return msg.answer(op, status=exc.status)
        return None  # replies and acks addressed to a server are ignored

    def _refuse(self, data: bytes, addr, status: int) -> None:
        """ERROR for a bad datagram of our protocol, addressed with its header's fields."""
        fields = dict(zip(FIELDS, HEADER.unpack_from(data)))
        if fields["magic"] != MAGIC:
            return  # not ours: say nothing
        error = Message(Op.ERROR, fields["ns"], fields["key"], fields["chunk"],
                        req_id=fields["req_id"], status=status)
        self.transport.sendto(error.encode(), addr)


async def serve(host: str, port: int, capacity_bytes: int,
                ready: asyncio.Event | None = None, stop: asyncio.Event | None = None,
                handle: dict | None = None) -> None:
    """Serve until ``stop`` is set (or forever). ``handle['protocol']`` gets the PoolServer."""
    loop = asyncio.get_running_loop()
    store = BlockStore(capacity_bytes)
    transport, proto = await loop.create_datagram_endpoint(
        lambda: PoolServer(store), local_addr=(host, port))
    grow_buffers(transport.get_extra_info("socket"))
    if handle is not None:
        handle["protocol"] = proto
    log.info("pool node serving on %s:%d, capacity %d bytes", host, port, capacity_bytes)
    if ready is not None:
        ready.set()
    try:
        await (stop.wait() if stop is not None else asyncio.Future())
    finally:
        transport.close()
