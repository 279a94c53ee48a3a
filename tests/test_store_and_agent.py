"""The pool node's store, and the client against a real server over loopback UDP: whole blocks
byte-exact, missing blocks, refused PUTs, and recovery from lost datagrams."""
import asyncio
import os

import pytest

from hostagent.common.pools import pool_for
from hostagent.common.transfer import BlockNotFound, parse_addr
from hostagent.inference.client import KVClient
from kvproto import Status, checksum
from conftest import local_pool
from hostagent.pool.server import PoolServer
from hostagent.pool.store import BlockStore, StoreError

KEY = bytes(range(16))


def test_store_put_get_and_incomplete():
    s = BlockStore(1 << 20)
    assert not s.put_chunk(1, KEY, 0, 2, b"ab", checksum(b"ab"))
    with pytest.raises(StoreError) as e:
        s.get_chunk(1, KEY, 0)
    assert e.value.status == Status.INCOMPLETE
    assert s.put_chunk(1, KEY, 1, 2, b"c", checksum(b"c"))
    assert s.get_chunk(1, KEY, 1) == (b"c", checksum(b"c"), 2)
    with pytest.raises(StoreError) as e:
        s.get_chunk(2, KEY, 0)  # another namespace never sees it
    assert e.value.status == Status.NOT_FOUND


def test_store_refuses_bad_checksums_and_rewrites():
    s = BlockStore(1 << 20)
    with pytest.raises(StoreError) as e:
        s.put_chunk(1, KEY, 0, 1, b"ab", checksum(b"ab") ^ 1)
    assert e.value.status == Status.CHECKSUM
    s.put_chunk(1, KEY, 0, 1, b"ab", checksum(b"ab"))
    assert s.put_chunk(1, KEY, 0, 1, b"ab", checksum(b"ab"))  # retransmission is fine
    with pytest.raises(StoreError):
        s.put_chunk(1, KEY, 0, 1, b"xy", checksum(b"xy"))     # immutable


def test_store_evicts_least_recently_used_complete_blocks():
    s = BlockStore(3 * 4096)                     # three pages: a small block takes one
    for i in range(4):
        s.put_chunk(1, bytes([i]) * 16, 0, 1, b"x" * 4, checksum(b"x" * 4))
        if i == 1:
            s.get_chunk(1, bytes([0]) * 16, 0)   # block 0 is used again: block 1 goes first
    assert s.used <= s.capacity and s.evicted_blocks == 1 and len(s) == 3
    with pytest.raises(StoreError):
        s.get_chunk(1, bytes([1]) * 16, 0)
    assert s.get_chunk(1, bytes([0]) * 16, 0)[0] == b"x" * 4
    big = b"y" * 5000
    with pytest.raises(StoreError) as e:         # larger than the whole store
        s.put_chunk(1, KEY, 0, 4, big, checksum(big))
    assert e.value.status == Status.NO_SPACE


def test_pool_for_is_stable_and_spreads():
    pools = [("198.18.0.101", 1), ("198.18.0.102", 1), ("198.18.0.103", 1)]
    owners = {pool_for(pools, 1, os.urandom(16)) for _ in range(200)}
    assert owners == set(pools)
    assert pool_for(pools, 1, KEY) == pool_for(list(reversed(pools)), 1, KEY)
    assert parse_addr("1.2.3.4") == ("1.2.3.4", 19286)
    with pytest.raises(ValueError):
        parse_addr("1.2.3.4:99999")


@pytest.mark.parametrize("text, line", [
    ("0.0.0.0", "pool address '0.0.0.0' cannot be a pool node: the unspecified address"),
    ("255.255.255.255:7", "pool address '255.255.255.255' cannot be a pool node: the broadcast "
                          "address"),
    ("224.0.0.1", "pool address '224.0.0.1' cannot be a pool node: a multicast address"),
    ("239.255.255.250", "pool address '239.255.255.250' cannot be a pool node: a multicast "
                        "address"),
    ("5", "pool address '5' (0.0.0.5) cannot be a pool node: in 0.0.0.0/8 ('this network', "
          "never a destination)"),
    ("0.1.2.3", "pool address '0.1.2.3' cannot be a pool node: in 0.0.0.0/8 ('this network', "
                "never a destination)"),
])
def test_an_address_no_pool_node_can_have_is_refused_in_one_line(text, line):
    with pytest.raises(ValueError) as e:
        parse_addr(text)
    assert str(e.value) == line


def test_loopback_private_and_named_pool_addresses_stay_allowed():
    assert parse_addr("127.0.0.1") == ("127.0.0.1", 19286)
    assert parse_addr("127.8.9.10:7") == ("127.8.9.10", 7)
    assert parse_addr("10.0.0.1") == ("10.0.0.1", 19286)
    assert parse_addr("192.168.1.2") == ("192.168.1.2", 19286)
    assert parse_addr("198.18.0.255") == ("198.18.0.255", 19286)   # not known as broadcast
    assert parse_addr("localhost:9") == ("127.0.0.1", 9)


class LossyServer(PoolServer):
    """Drops every 7th datagram it receives and every 5th it would send."""

    def __init__(self, store):
        super().__init__(store)
        self.rx = self.tx = 0

    def datagram_received(self, data, addr):
        self.rx += 1
        if self.rx % 7 == 0:
            return
        super().datagram_received(data, addr)

    def send(self, parts, addr):
        self.tx += 1
        if self.tx % 5:
            super().send(parts, addr)


async def _with_server(factory, body):
    loop = asyncio.get_running_loop()
    transport, proto = await loop.create_datagram_endpoint(
        lambda: factory(BlockStore(64 << 20)), local_addr=("127.0.0.1", 0))
    try:
        return await body(transport.get_extra_info("sockname"), proto)
    finally:
        transport.close()


@pytest.mark.parametrize("factory", [PoolServer, LossyServer])
def test_blocks_round_trip_byte_exact(factory):
    data = os.urandom(300_000)

    async def body(addr, proto):
        async with KVClient([addr], chunk_size=1024, window=32, deadline=20) as c:
            put = await c.put_block(3, KEY, data)
            got, stats = await c.get_block(3, KEY)
            return put, got, stats

    put, got, stats = asyncio.run(_with_server(factory, body))
    assert got == data
    assert stats.chunks == put.chunks == 293 and stats.from_pool == 293
    if factory is LossyServer:
        assert put.retransmits > 0 and stats.retransmits > 0
    else:
        assert put.retransmits == 0 and stats.retransmits == 0


def test_missing_block_is_reported_not_retried():
    async def body(addr, proto):
        async with KVClient([addr], deadline=5) as c:
            with pytest.raises(BlockNotFound):
                await c.get_block(1, KEY)

    asyncio.run(_with_server(PoolServer, body))


def test_first_chunk_says_whether_a_block_is_there():
    """KVClient.first_chunk (the vLLM connector's probe): chunk 0 alone, the block's count."""
    from hostagent.common.transfer import TransferStats

    async def body(addr, proto):
        async with KVClient([addr], chunk_size=1024, deadline=5) as c:
            await c.put_block(2, KEY, os.urandom(5000))
            stats = TransferStats()
            n = await c.first_chunk(2, KEY, stats, deadline=2.0)
            with pytest.raises(BlockNotFound):
                await c.first_chunk(2, bytes(16))
            return n, stats, proto.counters["rx_get"]

    n, stats, gets = asyncio.run(_with_server(PoolServer, body))
    assert n == 5 and stats.from_pool == 1 and gets == 2


def test_a_silent_peer_is_no_answer_and_a_slow_one_a_timeout():
    """A transfer that got no answer at all fails with NoAnswer (the peer is gone: the vLLM
    connector stops asking it for a while); one that got answers but not all of them in time
    fails with a plain TransferTimeout (congestion, not a dead node)."""
    import socket
    from hostagent.common.transfer import NoAnswer, TransferTimeout

    class HalfDeaf(PoolServer):          # answers the first chunk of a PUT, then nothing more
        def datagram_received(self, data, addr):
            self.seen = getattr(self, "seen", 0) + 1
            if self.seen <= 1:
                super().datagram_received(data, addr)

    quiet = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    quiet.bind(("127.0.0.1", 0))

    async def silent():
        async with KVClient(["%s:%d" % quiet.getsockname()], chunk_size=1024, deadline=0.5) as c:
            await c.first_chunk(1, KEY)

    async def body(addr, proto):
        async with KVClient([addr], chunk_size=1024, window=1, deadline=0.5) as c:
            await c.put_block(1, KEY, os.urandom(4096))

    with pytest.raises(NoAnswer, match="none answered"):
        asyncio.run(silent())
    with pytest.raises(TransferTimeout) as e:
        asyncio.run(_with_server(HalfDeaf, body))
    assert not isinstance(e.value, NoAnswer)
    quiet.close()


def test_server_answers_garbage_with_error_or_silence():
    async def body(addr, proto):
        from kvproto import Message, Op
        loop = asyncio.get_running_loop()
        got = asyncio.Queue()

        class Peer(asyncio.DatagramProtocol):
            def datagram_received(self, data, a):
                got.put_nowait(data)

        t, _ = await loop.create_datagram_endpoint(Peer, remote_addr=addr)
        t.sendto(b"not a kv message at all, though long enough for a header......")
        good = Message(Op.GET, 1, KEY, req_id=9, room=16).encode()
        t.sendto(good[:2] + b"\x09" + good[3:])                   # version 9
        reply = Message.decode(await asyncio.wait_for(got.get(), 2))
        t.close()
        return reply, proto.counters["malformed"]

    reply, malformed = asyncio.run(_with_server(PoolServer, body))
    assert reply.status == Status.BAD_VERSION and reply.req_id == 9
    assert malformed == 2


def _snmp_udp_csum_errors() -> int:
    rows = [line.split() for line in open("/proc/net/snmp") if line.startswith("Udp:")]
    return int(dict(zip(rows[0], rows[1]))["InCsumErrors"])


def test_gets_the_server_cannot_answer_are_refused_and_counted():
    """A GET from UDP source port 0 (no reply can go there: its sendmsg failed, #26) is dropped
    and counted; one with a bad UDP checksum never reaches the server (the kernel drops it; the
    server's stats report the count); the block is then fetched as ever. Crafted with a raw
    socket over loopback (root)."""
    import socket
    import struct
    from kvproto import Message, Op

    async def body():
        async with local_pool(1 << 20) as proto:
            addr = proto.sock.getsockname()
            data = os.urandom(5000)
            async with KVClient([addr], chunk_size=1024) as c:
                await c.put_block(1, KEY, data)
            raw = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_UDP)
            get = Message(Op.GET, 1, KEY, 0, req_id=5, room=1024).encode()
            csum_errors = _snmp_udp_csum_errors()
            for sport, csum in ((0, 0), (0, 0), (40000, 0x1234)):   # (0: no checksum, valid)
                raw.sendto(struct.pack("!HHHH", sport, addr[1], 8 + len(get), csum) + get,
                           ("127.0.0.1", 0))
            raw.close()
            await asyncio.sleep(0.3)
            stats = proto.stats()
            async with KVClient([addr], chunk_size=1024) as c:
                got, _ = await c.get_block(1, KEY)
            return stats, got == data, csum_errors

    stats, exact, csum_errors = asyncio.run(body())
    assert stats["refused_port0"] == 2 and not stats.get("tx_errors"), stats
    assert stats.get("rx_get", 0) == 0, stats                      # neither reached a GET
    assert stats["udp_in_csum_errors"] >= csum_errors + 1, stats
    assert exact
