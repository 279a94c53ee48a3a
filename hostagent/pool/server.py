"""The pool (storage) node: answers GETs and accepts PUTs of chunked blocks over UDP (asyncio),
in front of a store (``hostagent.pool.store``: in memory, or ``hostagent.pool.mooncake_store``).

Each datagram is one request and gets at most one answer; its header is checked by kvproto's
one check (``unpack_header``, which ``Message.decode`` uses too). One from UDP source port 0 gets
none (counted: ``refused_port0``), and one with a bad UDP checksum never gets here (the kernel
drops it; ``udp_in_csum_errors`` in the stats is its count). A datagram that is not a v1 message is
answered with ERROR when its header could be read far enough to address a reply, else dropped.
A GET for a staged block is answered from the staging arena: by XDP before it reaches this
process where it can (``hostagent.pool.xdpserve``), else here (the header packed, the chunk sent
from where it lies); a GET the store has to fetch, and the PUT that completes a block
the store has to write out, are answered when the store's future settles (requests for the same
block wait on the same future; at most ``max_waiting`` wait, the rest are dropped and retried by
their clients).
"""
from __future__ import annotations

import asyncio
import logging
import socket
from collections import Counter

from kvproto import (FIELDS, HEADER, HEADER_LEN, MAGIC, VERSION, Flag, Message, Op,
                     ProtocolError, Status, unpack_header)
from .store import BlockStore, PoolStore, StoreError
from hostagent.common.udp import grow_buffers

log = logging.getLogger("hostagent.server")
_RX_NAMES = {int(op): f"rx_{op.name.lower()}" for op in Op}
_GET, _GET_REPLY, _PUT, _PUT_ACK = int(Op.GET), int(Op.GET_REPLY), int(Op.PUT), int(Op.PUT_ACK)
_NACK, _ERROR, _DONE = int(Op.NACK), int(Op.ERROR), int(Flag.BLOCK_DONE)
_NACKED = (Status.NOT_FOUND, Status.INCOMPLETE)
_pack = HEADER.pack


class PoolServer(asyncio.DatagramProtocol):
    def __init__(self, store: PoolStore, max_waiting: int = 65536):
        self.store = store
        self.counters: Counter[str] = Counter()
        self.transport: asyncio.DatagramTransport | None = None
        self.sock: socket.socket | None = None     # set by serve(): replies go out with sendmsg
        self.max_waiting, self.waiting = max_waiting, 0

    def connection_made(self, transport):
        self.transport = transport

    def stats(self) -> dict:
        """Counters of the node: GETs answered by XDP count in rx_get and tx_bytes too (their
        own counts are the xdp_ ones)."""
        out = {**self.counters, **self.store.stats(), **_udp_csum_errors()}
        if "xdp_hit" in out:
            out["rx_get"] = out.get("rx_get", 0) + out["xdp_hit"]
            out["tx_bytes"] = out.get("tx_bytes", 0) + out["xdp_hit_bytes"]
        return out

    # ---- sending -------------------------------------------------------------------------
    def send(self, parts: list, addr) -> None:
        """Send one datagram made of ``parts`` (bytes-like); a full socket drops it."""
        if self.sock is None:
            self.transport.sendto(b"".join(parts), addr)
            return
        try:
            self.sock.sendmsg(parts, (), 0, addr)
        except (BlockingIOError, InterruptedError):
            self.counters["tx_dropped"] += 1
        except OSError as exc:
            self.counters["tx_errors"] += 1
            log.debug("send to %s: %s", addr, exc)

    def _answer(self, msg: Message, op: int, addr, flags: int = 0, status: int = 0) -> None:
        self.send([_pack(MAGIC, VERSION, op, flags, status, msg.ns, msg.req_id, msg.key,
                         msg.chunk, msg.nchunks, 0, 0, 0)], addr)

    def _send_chunk(self, block, ns: int, req_id: int, key: bytes, chunk: int, addr) -> None:
        payload, crc = block.chunk(chunk)
        self.counters["tx_bytes"] += len(payload)
        self.send([_pack(MAGIC, VERSION, _GET_REPLY, 0, 0, ns, req_id, key, chunk,
                         block.nchunks, len(payload), 0, crc), payload], addr)

    def _refuse(self, msg: Message, addr, exc: StoreError) -> None:
        self.counters[f"err_{Status(exc.status).name.lower()}"] += 1
        self._answer(msg, _NACK if exc.status in _NACKED else _ERROR, addr, status=exc.status)

    # ---- receiving -----------------------------------------------------------------------
    def datagram_received(self, data: bytes, addr):
        if not addr[1]:                       # source port 0: no reply could be sent to it
            self.counters["refused_port0"] += 1
            return
        try:
            fields = unpack_header(data)
        except ProtocolError as exc:
            self.counters["malformed"] += 1
            if len(data) >= HEADER_LEN:
                self._refuse_bad(data, addr, exc.status)
            return
        (_magic, _version, op, _flags, _status, ns, req_id, key, chunk, _n, _len, _reserved,
         _csum) = fields
        if op == _GET:                        # the common case first: a GET for a staged block
            first = chunk == 0
            if first and self.store.on_get is not None:
                self.store.on_get(ns, key)    # a fetch seen by the process (tier policy)
            block = self.store.staging.get(ns, key, touch=first)
            if block is not None and chunk < block.nchunks:
                self.counters["rx_get"] += 1
                self._send_chunk(block, ns, req_id, key, chunk, addr)
                return
        self.handle(Message.from_header(fields, data), addr)

    def handle(self, msg: Message, addr) -> None:
        self.counters[_RX_NAMES[msg.op]] += 1
        try:
            if msg.op == _GET:
                got = self.store.get(msg.ns, msg.key)
                if isinstance(got, asyncio.Future):
                    self._wait(got, msg, addr, self._answer_get)
                else:
                    self._answer_get(msg, addr, got)
            elif msg.op == _PUT:
                done = self.store.put_chunk(msg.ns, msg.key, msg.chunk, msg.nchunks,
                                            msg.payload, msg.csum, addr[0])
                if isinstance(done, asyncio.Future):
                    self._wait(done, msg, addr, self._answer_put)
                else:
                    self._answer_put(msg, addr, done)
            # replies and acks addressed to a server are ignored
        except StoreError as exc:
            self._refuse(msg, addr, exc)

    def _answer_get(self, msg: Message, addr, block) -> None:
        if msg.chunk >= block.nchunks:
            self._refuse(msg, addr, StoreError(Status.BAD_REQUEST,
                                               f"block has {block.nchunks} chunks"))
            return
        self._send_chunk(block, msg.ns, msg.req_id, msg.key, msg.chunk, addr)

    def _answer_put(self, msg: Message, addr, done: bool) -> None:
        self._answer(msg, _PUT_ACK, addr, flags=_DONE if done else 0)

    def _wait(self, future: asyncio.Future, msg: Message, addr, answer) -> None:
        """Answer ``msg`` with ``answer(msg, addr, result)`` once ``future`` settles."""
        if self.waiting >= self.max_waiting:
            self.counters["dropped_waiting"] += 1
            return
        self.waiting += 1

        def settled(f: asyncio.Future) -> None:
            self.waiting -= 1
            if f.cancelled():
                return
            exc = f.exception()
            if exc is None:
                answer(msg, addr, f.result())
            elif isinstance(exc, StoreError):
                self._refuse(msg, addr, exc)
            else:
                self._refuse(msg, addr, StoreError(Status.NO_SPACE, repr(exc)))

        future.add_done_callback(settled)

    def _refuse_bad(self, data: bytes, addr, status: int) -> None:
        """ERROR for a bad datagram of our protocol, addressed with its header's fields."""
        fields = dict(zip(FIELDS, HEADER.unpack_from(data)))
        if fields["magic"] != MAGIC:
            return  # not ours: say nothing
        error = Message(Op.ERROR, fields["ns"], fields["key"], fields["chunk"],
                        req_id=fields["req_id"], status=status)
        self.send([error.encode()], addr)


class _SocketTransport(asyncio.DatagramTransport):
    """The transport serve() hands its PoolServer: a plain non-blocking socket drained in
    batches (asyncio's own datagram transport reads one datagram per event-loop turn)."""

    def __init__(self, sock: socket.socket, proto: PoolServer):
        super().__init__()
        self.sock, self.proto = sock, proto
        asyncio.get_running_loop().add_reader(sock.fileno(), self._drain)

    def _drain(self, budget: int = 256) -> None:
        receive, handle = self.sock.recvfrom, self.proto.datagram_received
        for _ in range(budget):
            try:
                data, addr = receive(65536)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                continue                  # an ICMP error queued on the socket
            handle(data, addr)

    def sendto(self, data, addr=None) -> None:
        self.proto.send([data], addr)

    def get_extra_info(self, name, default=None):
        return {"socket": self.sock, "sockname": self.sock.getsockname()}.get(name, default)

    def close(self) -> None:
        if self.sock.fileno() >= 0:
            asyncio.get_running_loop().remove_reader(self.sock.fileno())
            self.sock.close()


async def serve(host: str, port: int, capacity_bytes: int,
                ready: asyncio.Event | None = None, stop: asyncio.Event | None = None,
                handle: dict | None = None, store: PoolStore | None = None) -> None:
    """Serve until ``stop`` is set (or forever), from ``store`` (default: in memory, of
    ``capacity_bytes``). ``handle['protocol']`` gets the PoolServer. ``ready`` is set once the
    socket is bound and the store can serve (a Mooncake store is connected)."""
    store = store if store is not None else BlockStore(capacity_bytes)
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        sock.setblocking(False)
        sock.bind((host, port))
    except BaseException:
        sock.close()
        raise
    grow_buffers(sock)
    from . import xdpserve
    try:
        xdp_server = xdpserve.start(host, port, store)   # None: GETs stay with asyncio
    except BaseException:
        sock.close()
        raise
    proto = PoolServer(store)
    proto.sock = sock
    transport = _SocketTransport(sock, proto)
    proto.connection_made(transport)
    if handle is not None:
        handle["protocol"] = proto
    stopping = asyncio.ensure_future(stop.wait() if stop is not None else asyncio.Future())
    ticker = asyncio.create_task(_tick(store))
    try:
        starting = asyncio.create_task(store.start())
        await asyncio.wait([starting, stopping], return_when=asyncio.FIRST_COMPLETED)
        if starting.done():
            starting.result()             # start-up failed: raise why
            log.info("pool node serving on %s:%d, %s store, %d bytes staged at most", host,
                     port, store.kind, store.capacity)
            if ready is not None:
                ready.set()
            await stopping
        else:
            starting.cancel()
    finally:
        ticker.cancel()
        stopping.cancel()
        transport.close()
        try:
            await store.close()
        finally:
            if xdp_server is not None:
                xdp_server.close()


def _udp_csum_errors() -> dict:
    """UDP datagrams this network namespace's kernel dropped for a bad checksum (they never
    reach the server: /proc/net/snmp's Udp InCsumErrors, for every socket of the namespace)."""
    try:
        with open("/proc/net/snmp") as f:
            rows = [line.split() for line in f if line.startswith("Udp:")]
        return {"udp_in_csum_errors": int(dict(zip(rows[0], rows[1]))["InCsumErrors"])}
    except (OSError, IndexError, KeyError, ValueError):
        return {}


async def _tick(store: PoolStore) -> None:
    while True:
        await asyncio.sleep(1.0)
        store.tick()
