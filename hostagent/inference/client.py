"""The inference-node client: puts and gets whole KV blocks over the KV block protocol.

A block is cut into chunks of ``chunk_size`` bytes; each chunk is one request. Requests are
pipelined (a window of them in flight per block, halved when a timeout fires and regrown by one per
window's worth of answers, as TCP does), lost ones are sent again after an adaptive retransmission
timeout (RFC 6298 estimator, Karn's rule, exponential backoff), and the whole operation fails with
TransferTimeout after ``deadline`` seconds. Every reply is checked against what was asked (sender,
namespace, key, chunk) and its payload against its CRC-32; a chunk whose bytes are wrong is counted
and fetched again with KV_F_NO_CACHE so the switch's copy is bypassed.

Which pool nodes hold a block is the client's ``Placement`` (``hostagent.common.pools``: the
first ``replicas`` of its rendezvous order). A PUT goes to each holder answering now; a GET asks
them in turn: a transfer left unanswered for the placement's silence limit (no accepted reply
to it, nor to any other transfer from that node, for that long) leaves its node out for a while
and asks the next holder for the chunks still missing (``Silent`` when none is left: the last
holder is waited for until the deadline, unless it is a suspect, silent before and not heard
since, while another holder is not).

Request ids are random (``secrets``) and never reused while a reply to them can arrive: one
in use or retired less than ``RID_HOLD`` seconds ago is not drawn again, so an off-path host
cannot predict the next one. Blocks of a namespace the client's keyring covers are
sealed on PUT and their tag checked on GET (hostagent/common/auth.py); a block failing its tag is
fetched once more with KV_F_NO_CACHE, then refused with AuthError.
"""
from __future__ import annotations

import asyncio
import collections
import secrets
import socket
import time
from collections.abc import Callable, Sequence

from kvproto import (DEFAULT_CHUNK, Flag, Message, Op, ProtocolError, Status,
                     check_chunk_size)
from hostagent.common import auth as auth_mod
from hostagent.common.block import Block
from hostagent.common.udp import grow_buffers
from hostagent.common.pools import Placement
from hostagent.common.transfer import (BlockNotFound, NoAnswer, Refused, Silent, TransferStats,
                                       TransferTimeout, unreachable)

DEFAULT_WINDOW = 64
RID_HOLD = 300.0          # seconds a retired request id is not drawn again


# what a reply means for the chunk it answers
DONE, IGNORE, RETRY_BYPASS = "done", "ignore", "retry-bypass"


class _RttEstimator:
    """RFC 6298 retransmission timeout."""

    def __init__(self, initial: float = 0.1, floor: float = 0.02, ceiling: float = 2.0):
        self.srtt: float | None = None
        self.rttvar = 0.0
        self.rto, self.floor, self.ceiling = initial, floor, ceiling

    def sample(self, rtt: float) -> None:
        if self.srtt is None:
            self.srtt, self.rttvar = rtt, rtt / 2
        else:
            self.rttvar = 0.75 * self.rttvar + 0.25 * abs(self.srtt - rtt)
            self.srtt = 0.875 * self.srtt + 0.125 * rtt
        self.rto = min(self.ceiling, max(self.floor, self.srtt + 4 * self.rttvar))


class _Transfer:
    """One block's chunks in flight: window, retransmission, completion."""

    def __init__(self, client: KVClient, addr, items: Sequence[int],
                 build: Callable[[int, int, int], bytes],
                 accept: Callable[[int, Message], str], stats: TransferStats, deadline: float,
                 silence: float | None = None):
        self.client, self.addr, self.build, self.accept, self.stats = (
            client, addr, build, accept, stats)
        self.silence, self.heard = silence, time.monotonic()     # the last accepted reply
        self.from_node = False          # a reply from the node itself (not the switch's)
        self.todo = list(reversed(items))
        self.left = self.total = len(items)
        # item -> rid, sent, due, tries
        self.outstanding: dict[int, tuple[int, float, float, int]] = {}
        self.rid_item: dict[int, int] = {}
        self.loop = asyncio.get_running_loop()
        self.future = self.loop.create_future()
        self.deadline = time.monotonic() + deadline
        self.timer = None
        self.cwnd = float(client.window)

    async def run(self) -> None:
        if not self.left:
            return
        self._fill()
        self._arm()
        try:
            await self.future
        finally:
            if self.timer:
                self.timer.cancel()
            for rid in self.rid_item:
                self.client._retire_rid(rid)

    def _send(self, item: int, tries: int = 1, flags: int = 0) -> None:
        rid = self.client._next_rid()
        self.client._waiters[rid] = self
        self.rid_item[rid] = item
        now = time.monotonic()
        rto = min(self.client.rtt.ceiling, self.client.rtt.rto * (2 ** (tries - 1)))
        self.outstanding[item] = (rid, now, now + rto, tries)
        self.client._send_datagram(self.build(item, rid, flags), self.addr)

    def remaining(self) -> list[int]:
        """The items not done yet, in order (to ask another node for)."""
        return sorted([*self.todo, *self.outstanding])

    def _fill(self) -> None:
        while self.todo and len(self.outstanding) < int(self.cwnd):
            self._send(self.todo.pop())

    def _arm(self) -> None:
        self.timer = self.loop.call_later(max(0.002, self.client.rtt.rto / 4), self._tick)

    def _tick(self) -> None:
        if self.future.done():
            return
        now = time.monotonic()
        heard = max(self.heard, self.client._heard.get(self.addr, 0.0))   # or another transfer
        if self.silence is not None and now - heard > self.silence:
            self.future.set_exception(Silent(
                f"{self.addr[0]}:{self.addr[1]} left {self.left} chunk(s) unanswered for "
                f"{self.silence:g} s"))
            return
        if now > self.deadline:
            silent = self.left == self.total          # not one chunk answered
            self.future.set_exception((NoAnswer if silent else TransferTimeout)(
                f"{self.left} chunk(s) still missing from {self.addr[0]}:{self.addr[1]} "
                f"after {self.stats.retransmits} retransmissions"
                + (", none answered" if silent else "")))
            return
        expired = [(item, tries) for item, (_r, _s, due, tries) in self.outstanding.items()
                   if now >= due]
        if expired:
            self.cwnd = max(2.0, self.cwnd / 2)
        for item, tries in expired:  # earlier request ids stay valid: a late answer still counts
            self.stats.retransmits += 1
            self._send(item, tries + 1)
        self._arm()

    def on_message(self, msg: Message, sender) -> None:
        if sender != self.addr:
            return                 # only the pool node asked (or the switch in its name) answers
        item = self.rid_item.get(msg.req_id)
        if item is None or item not in self.outstanding or self.future.done():
            return
        _rid, sent, _due, tries = self.outstanding[item]
        try:
            verdict = self.accept(item, msg)
        except Exception as exc:  # a fatal answer (not found, refused, inconsistent)
            self.future.set_exception(exc)
            return
        if verdict == IGNORE:
            return
        self.heard = self.client._heard[self.addr] = time.monotonic()
        self.from_node |= not msg.flags & (Flag.FROM_SWITCH | Flag.REPLICA)
        if verdict == RETRY_BYPASS:
            self._send(item, tries, Flag.NO_CACHE)
            return
        if tries == 1:  # Karn: only unambiguous samples
            self.client.rtt.sample(time.monotonic() - sent)
        del self.outstanding[item]
        self.cwnd = min(float(self.client.window), self.cwnd + 1 / self.cwnd)
        self.left -= 1
        if not self.left:
            self.future.set_result(None)
        else:
            self._fill()


class KVClient:
    """Put and get whole blocks. Use as ``async with KVClient(pools) as c: ...``."""

    def __init__(self, pools: Sequence[str | tuple[str, int]] | Placement,
                 chunk_size: int = DEFAULT_CHUNK, window: int = DEFAULT_WINDOW,
                 deadline: float = 30.0, bind: str = "0.0.0.0", auth=auth_mod.DEFAULT):
        check_chunk_size(chunk_size)
        if window < 1:
            raise ValueError("window must be at least 1")
        self.placement = Placement.of(pools)         # which nodes hold a block, which answer
        self.pools = self.placement.pools
        self.chunk_size, self.window, self.deadline, self.bind = chunk_size, window, deadline, bind
        self.rtt = _RttEstimator()
        self.malformed = 0
        self._waiters: dict[int, _Transfer] = {}
        self._heard = self.placement.heard     # pool node -> its last answer (any client's)
        self._retired: collections.OrderedDict[int, float] = collections.OrderedDict()
        self.keyring = auth_mod.resolve(auth)
        self._sock: socket.socket | None = None

    # A plain non-blocking socket rather than an asyncio datagram transport: that reads one
    # datagram per event-loop turn, which at thousands of chunks a second is most of the cost.
    async def __aenter__(self) -> KVClient:
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        try:
            sock.setblocking(False)
            sock.bind((self.bind, 0))
            # checksum 0 (none), as the XDP fetch engine sends: a GET whose checksum is left
            # for offload on veth is forwarded by the switch and passed by the pool's XDP
            # (xdp/reply.h), never answered there
            sock.setsockopt(socket.SOL_SOCKET, getattr(socket, "SO_NO_CHECK", 11), 1)
            grow_buffers(sock)
            asyncio.get_running_loop().add_reader(sock.fileno(), self._drain)
        except BaseException:
            sock.close()
            raise
        self._sock = sock
        return self

    async def __aexit__(self, *exc) -> None:
        asyncio.get_running_loop().remove_reader(self._sock.fileno())
        self._sock.close()

    def _send_datagram(self, data: bytes, addr) -> None:
        try:
            self._sock.sendto(data, addr)
        except (BlockingIOError, InterruptedError, ConnectionRefusedError):
            pass  # as good as lost on the wire: the retransmission timer sends it again

    def _drain(self, budget: int = 512) -> None:
        """Handle every datagram waiting on the socket (up to ``budget``, then yield)."""
        for _ in range(budget):
            try:
                data, sender = self._sock.recvfrom(65536)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:  # an ICMP error queued on the socket (port unreachable ...)
                continue
            try:
                msg = Message.decode(data)
            except ProtocolError:
                self.malformed += 1
                continue
            waiter = self._waiters.get(msg.req_id)
            if waiter is not None:
                waiter.on_message(msg, sender)

    def _next_rid(self) -> int:
        """A random request id neither in use nor retired within RID_HOLD seconds."""
        now = time.monotonic()
        while self._retired:
            rid, when = next(iter(self._retired.items()))
            if now - when < RID_HOLD:
                break
            del self._retired[rid]
        while True:
            rid = secrets.randbits(32)
            if rid not in self._waiters and rid not in self._retired:
                return rid

    def _retire_rid(self, rid: int) -> None:
        if self._waiters.pop(rid, None) is not None:
            self._retired[rid] = time.monotonic()
            self._retired.move_to_end(rid)

    def pool_for(self, ns: int, key: bytes) -> tuple[str, int]:
        """The pool node asked first for a block now."""
        return self.placement.owner(ns, key)

    async def put_block(self, ns: int, key: bytes, data: bytes) -> TransferStats:
        """Store a whole block on each of its holders that answers now (the placement's); returns
        when every chunk is acknowledged by one of them at least (the stats sum every holder's),
        else raises the first holder's error (``Silent`` at once when none answers now)."""
        if not data:
            raise ValueError("a block must not be empty")
        k = self.keyring.key_for(ns) if self.keyring is not None else None
        if k is not None:
            data = auth_mod.seal(k, ns, key, data, self.chunk_size)
        place = self.placement
        holders = place.holders(ns, key)
        up = [a for a in holders if place.usable(a)]
        if not up:
            place.skipped += 1
            raise Silent(f"no node holding block {key.hex()} answers now: "
                         + ", ".join(f"{h}:{p}" for h, p in holders))
        # with more than one holder a silent one is not waited for: the others hold the block
        silence = place.silence_s if len(holders) > 1 else None
        got = await asyncio.gather(*(self._put_to(a, ns, key, data, silence) for a in up),
                                   return_exceptions=True)
        stats, first_error = TransferStats(), None
        for addr, r in zip(up, got):
            if isinstance(r, TransferStats):
                stats.add(r, seconds=not stats.chunks)
                place.answered(addr)
                continue
            if unreachable(r):
                place.failed(addr, "save", r)
            first_error = first_error or r
        if not stats.chunks:
            raise first_error
        return stats

    async def _put_to(self, addr, ns: int, key: bytes, data: bytes,
                      silence: float | None) -> TransferStats:
        cs = self.chunk_size
        chunks = [data[i:i + cs] for i in range(0, len(data), cs)]
        stats = TransferStats(chunks=len(chunks), bytes=len(data))

        def build(i: int, rid: int, flags: int) -> bytes:
            return Message(Op.PUT, ns, key, i, len(chunks), rid, flags,
                           payload=chunks[i]).encode()

        def accept(i: int, msg: Message) -> str:
            if msg.op == Op.ERROR:
                raise Refused(msg.status, f"PUT of chunk {i}")
            return DONE if msg.op == Op.PUT_ACK and msg.chunk == i else IGNORE

        start = time.monotonic()
        await _Transfer(self, addr, list(range(len(chunks))), build, accept, stats,
                        self.deadline, silence).run()
        stats.seconds = time.monotonic() - start
        return stats

    async def get_block(self, ns: int, key: bytes, nchunks: int | None = None,
                        no_cache: bool = False) -> tuple[bytes, TransferStats]:
        """Fetch a whole block, byte-exact. ``nchunks`` (if known) saves a first round trip.
        A block of a namespace the keyring covers: its data once its tag checked (AuthError)."""
        k = self.keyring.key_for(ns) if self.keyring is not None else None
        if k is None:
            return await self._get_raw(ns, key, nchunks, no_cache)
        if nchunks is not None:
            nchunks = auth_mod.sealed_chunks(nchunks, self.chunk_size)
        data, stats = await self._get_raw(ns, key, nchunks, no_cache)
        try:
            return bytes(auth_mod.open_sealed(k, ns, key, data, self.chunk_size)), stats
        except auth_mod.AuthError:
            pass
        data, again = await self._get_raw(ns, key, nchunks, True)     # past the switch's cache
        again.auth_failures = stats.auth_failures = 1
        try:
            return bytes(auth_mod.open_sealed(k, ns, key, data, self.chunk_size)), again
        except auth_mod.AuthError as exc:
            raise auth_mod.refused(ns, key, exc) from None

    async def get_block_view(self, ns: int, key: bytes, nchunks: int | None = None,
                             no_cache: bool = False) -> tuple[Block, TransferStats]:
        """As ``get_block``, the block as a ``Block`` (the interface every client offers: the
        fetch engine's is a zero-copy view of its arena; this one owns its bytes)."""
        data, stats = await self.get_block(ns, key, nchunks, no_cache)
        return Block.of_bytes(ns, key, data, self.chunk_size, stats), stats

    async def first_chunk(self, ns: int, key: bytes, stats: TransferStats | None = None,
                          deadline: float | None = None, wary: bool = False) -> int:
        """GET chunk 0 of a block alone, as every GET is made (window, retransmission, CRC
        check and bypass), within ``deadline`` seconds (the client's by default): the block's
        chunk count, or BlockNotFound if its pool node lacks it. For a caller that asks whether
        a block is there without fetching it (the vLLM connector's probe); ``wary``: of the
        holders that answered last time only (``Placement.read_order``), ``Silent`` if none."""
        stats = TransferStats() if stats is None else stats
        known: dict = {"n": None}
        build, accept = self._get_chunk(ns, key, {}, known, stats, 0)
        await self._read(ns, key, [0], build, accept, stats,
                         self.deadline if deadline is None else deadline, wary)
        return known["n"]

    async def recheck(self, addr, ns: int, key: bytes) -> None:
        """Ask ``addr`` (a suspect, ``Placement.due``) for chunk 0 of a block, past the switch's
        cache, within the silence limit: the placement learns whether it answers (a NACK is an
        answer too)."""
        place, known = self.placement, {"n": None}
        build, accept = self._get_chunk(ns, key, {}, known, TransferStats(), Flag.NO_CACHE)
        t = _Transfer(self, addr, [0], build, accept, TransferStats(), place.silence_s,
                      place.silence_s)
        try:
            await t.run()
        except NoAnswer as exc:
            place.failed(addr, "read", exc)
            return
        except (BlockNotFound, Refused):
            pass
        place.answered(addr)

    async def _get_raw(self, ns: int, key: bytes, nchunks: int | None,
                       no_cache: bool) -> tuple[bytes, TransferStats]:
        stats = TransferStats()
        parts: dict[int, bytes] = {}
        known = {"n": nchunks}
        build, accept = self._get_chunk(ns, key, parts, known, stats,
                                        Flag.NO_CACHE if no_cache else 0)
        start = time.monotonic()
        if known["n"] is None:
            await self._read(ns, key, [0], build, accept, stats, self.deadline)
        await self._read(ns, key, [i for i in range(known["n"]) if i not in parts],
                         build, accept, stats, self.deadline - (time.monotonic() - start))
        stats.seconds = time.monotonic() - start
        data = b"".join(parts[i] for i in range(known["n"]))
        stats.chunks, stats.bytes = known["n"], len(data)
        return data, stats

    def _get_chunk(self, ns: int, key: bytes, parts: dict[int, bytes], known: dict,
                   stats: TransferStats, base_flags: int):
        """(build, accept) of a transfer's GETs for chunks of a block: payloads go to
        ``parts``, the block's chunk count to ``known["n"]`` (checked once known)."""
        room = self.chunk_size

        def build(i: int, rid: int, flags: int) -> bytes:
            return Message(Op.GET, ns, key, i, 0, rid, base_flags | flags, room=room).encode()

        def accept(i: int, msg: Message) -> str:
            if msg.op == Op.NACK:
                raise BlockNotFound(f"block {key.hex()} in namespace {ns}: "
                                    f"{Status(msg.status).name}")
            if msg.op == Op.ERROR:
                raise Refused(msg.status, f"GET of chunk {i}")
            if msg.op != Op.GET_REPLY or msg.ns != ns or msg.key != key or msg.chunk != i:
                return IGNORE
            if not msg.checksum_ok():
                stats.checksum_errors += 1
                return RETRY_BYPASS
            if known["n"] is None:
                known["n"] = msg.nchunks
            elif msg.nchunks != known["n"]:
                raise ProtocolError(f"chunk {i} says the block has {msg.nchunks} chunks, "
                                    f"not {known['n']}")
            parts[i] = msg.payload
            stats.count_reply(msg)
            return DONE

        return build, accept

    async def _read(self, ns, key, items, build, accept, stats, deadline: float,
                    wary: bool = False) -> None:
        """Ask the block's holders for ``items`` in turn (module docstring): the next one when
        a node stays silent, lacks the block (restarted empty) or refuses it as UNAVAILABLE
        (its store cannot reach it now), within ``deadline`` seconds in all."""
        place = self.placement
        order, end = place.read_order(ns, key, wary), time.monotonic() + deadline
        if not order:
            raise Silent(f"no node holding block {key.hex()} answered last time")
        for n, addr in enumerate(order, 1):
            last = n == len(order)
            patient = last and not place.doubtful(addr, ns, key)   # waited for to the deadline
            t = _Transfer(self, addr, list(items), build, accept, stats,
                          max(0.0, end - time.monotonic()), None if patient else place.silence_s)
            try:
                await t.run()
            except BlockNotFound:          # a holder that lost it (restarted empty): the next
                place.answered(addr)
                if last:
                    raise
                items = t.remaining()
                continue
            except Refused as exc:
                if last or exc.status != Status.UNAVAILABLE:
                    raise
                items = t.remaining()
                continue
            except NoAnswer as exc:
                place.failed(addr, "read", exc)
                if last:
                    raise
                items = t.remaining()
                continue
            if t.from_node:                # a suspect no more (the switch's hits say nothing)
                place.answered(addr)
            return
