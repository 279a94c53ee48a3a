"""The fetch engine's driver: its lifecycle (load, attach, restore), the transfer table and
the arena's slots, and the step loop that ties the send ring (``sendring``: its send calls and
the thread that makes them), transfers, loss recovery and verification together. Python decides
per step, never per chunk.

Each ``step``: queue GETs from every active transfer into the send ring (``transfers.fill``),
send up to ``call_frames`` of them in one call from an AF_PACKET TX ring (the kernel transmits
them, runs the switch's program and receives the replies into the arena within the call when the
switch answers), then verify what arrived (``verify``) and finish or fail transfers. Threaded
(the default where the process may run on more than one CPU) a sender thread makes the send
calls (they release the GIL) while the stepping thread verifies; on a machine whose other core
is busy one thread can win (every wake-up waits for a time slice). A few GETs (at most
``batch_size``: a round of retransmissions) the stepping thread sends itself while the sender
thread is idle, sparing a hand-off that cost more than the call.

Which pool node a transfer asks is the engine's ``Placement`` (``hostagent.common.pools``). A
transfer silent for its silence limit (its node answering no other transfer either) moves on to
the block's next holder, as does one answered NOT_FOUND (a holder restarted empty) or
UNAVAILABLE; the silent node is left out, once this engine was answered at all (else its own
path may be what is silent: ``NoReply``); the last holder is waited for until the deadline
unless a suspect while another holder is not (``doubtful``). With no carrier on the engine's own
interface a transfer fails at once (``LinkDown``), blaming no node: the caller computes.

A block of unknown size is fetched in two steps: a one-slot probe transfer asks for chunk 0
(the program then accepts only chunk 0 and records the reply's chunk count), then a contiguous
range is reserved, chunk 0 copied there and the rest fetched. When the range does not fit and
the arena is otherwise empty, the engine loads a larger instance of its program (milliseconds:
``program`` caches the bytecode) and swaps it in on the interface.
"""
from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Sequence

from hostagent.common import auth as auth_mod
from hostagent.common.netif import has_carrier
from hostagent.common.packet_ring import PacketRing
from hostagent.common.pools import Placement
from hostagent.common.transfer import (BlockNotFound, LinkDown, NoAnswer, NoReply, Refused,
                                       Silent, TransferTimeout)
from kvproto import DEFAULT_CHUNK, PORT, Flag, Status
from kvproto.frames import PAYLOAD_OFF
from xdp import Netns, NoXdp

from . import authcheck, pacing, transfers
from hostagent.common.block import Block
from .block import SlotAllocator
from .crcfold import CRC_IMPL, Folder
from .ids import RequestIds
from .netpath import link, next_hop, route_header
from .program import GEN_MASK, XFERS, FetchAttachment, FetchProgram
from .sendring import EngineStats, Sender, SendRing
from .transfers import Route, Transfer
from .verify import crc_damaged, finish, status_error, verify

log = logging.getLogger("hostagent.fetch")
_NO_CACHE = int(Flag.NO_CACHE)


class FetchEngine:
    """Fetch whole KV blocks with XDP doing the per-chunk work. ``with FetchEngine(pools, cs,
    netns=...) as e: blk = e.get_block(ns, key)``; ``submit`` + ``step``/``wait`` drive
    transfers from an event loop (``client.AsyncFetchClient``). ``open`` raises NoXdp (with the
    reason) where the engine cannot run; ``client.open_client`` then uses the asyncio client."""

    def __init__(self, pools: Sequence[str | tuple[str, int]] | Placement,
                 chunk_size: int = DEFAULT_CHUNK, *,
                 ifname: str = "eth0", netns: str | None = None,
                 arena_bytes: int = 256 << 20, max_arena_bytes: int = 2 << 30,
                 deadline: float = 30.0, burst: int = 1024, batch_size: int = 64,
                 start_window: int = 1024, max_window: int = 16384, rto_floor: float = 0.001,
                 reo_floor: float = 0.0001, tail_wait: float = 0.0002,
                 call_frames: int = 1024, poll_interval: float = 50e-6,
                 threaded: bool | None = None, first_reply_timeout: float = 2.0,
                 auth=auth_mod.DEFAULT):
        self.placement = Placement.of(pools)      # which nodes hold a block, which answer
        self.pools = self.placement.pools
        self.chunk_size, self.ifname, self.netns_name = chunk_size, ifname, netns
        self.slots = max(16, arena_bytes // chunk_size)
        self.max_slots = max(self.slots, max_arena_bytes // chunk_size)
        self.deadline, self.burst, self.batch_size = deadline, burst, batch_size
        self.start_window, self.max_window = start_window, max_window
        self.rto_floor, self.reo_floor, self.poll_interval = rto_floor, reo_floor, poll_interval
        self.tail_wait, self.call_frames = tail_wait, call_frames
        if threaded is None:
            threaded = len(os.sched_getaffinity(0)) > 1
        self.threaded, self.first_reply_timeout = threaded, first_reply_timeout
        self.keyring = auth_mod.resolve(auth)      # namespaces it covers: blocks checked
        self.answered = False            # any reply to any of this engine's GETs, ever
        self.stats = EngineStats()
        self.prog: FetchProgram | None = None
        self._opened = False

    # ---- lifecycle -------------------------------------------------------------------------
    def __enter__(self) -> FetchEngine:
        return self.open()

    def __exit__(self, *exc) -> None:
        self.close()

    def open(self) -> FetchEngine:
        if self._opened:
            return self
        if os.geteuid() != 0:
            raise NoXdp("not root: XDP needs CAP_BPF and CAP_NET_ADMIN")
        for host, port in self.pools:
            if port != PORT:
                raise NoXdp(f"pool {host}:{port} is not on the KV port {PORT}")
        self._ns = Netns(self.netns_name)
        self._att = FetchAttachment(self.ifname, self._ns)
        self._sock = self._packet = None
        try:
            self._att.inspect()
            self._routes = self._resolve()
            with self._ns:
                self._packet = PacketRing(self.ifname, PAYLOAD_OFF + self.chunk_size,
                                          max(2048, self.call_frames))
            self.prog = FetchProgram(self.chunk_size, self.slots)
            self._setup(self.prog)
            self._att.attach(self.prog.fd)
        except BaseException:
            self._close_partial()
            raise
        self.folder = Folder(self.chunk_size)
        self._ids = RequestIds(XFERS, GEN_MASK)        # random, not reused while replies may come
        self._slots = SlotAllocator(self.slots)
        self._active: list[Transfer] = []
        self._counter_base: dict[str, int] = {}
        self._ring = SendRing(self.prog, self._packet, self.chunk_size)
        for header in self._headers.values():
            self._ring.set_route(*header)
        self._sender = Sender(self._ring, self.call_frames, self.stats, self.threaded)
        self._opened = True
        log.info("XDP fetch engine on %s (%d-byte chunks, %d slots, CRC by %s)", self.ifname,
                 self.chunk_size, self.slots, CRC_IMPL)
        return self

    def _resolve(self) -> dict[tuple[str, int], Route]:
        """The engine's UDP port (a bound socket reserves it), our addresses and the next hop
        to every pool node."""
        with self._ns:
            self._sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            self._sock.bind(("0.0.0.0", 0))
            self.port = self._sock.getsockname()[1]
            self._mac, own_ip = link(self.ifname)
            routes, iface = {}, transfers.Interface()
            for i, p in enumerate(self.pools):
                r = routes[p] = Route(i, p, self.start_window, iface)
                r.mac, r.src = next_hop(p[0], self.ifname, self._sock, own_ip)
        return routes

    def _setup(self, prog: FetchProgram) -> None:
        """A freshly loaded program's control block and routes."""
        ctl = prog.ctl[0]
        ctl["port"] = socket.htons(self.port)
        ctl["loss_ppm"], ctl["owner"] = self._att.loss_ppm, os.getpid()
        self._headers = {p: (r.index, route_header(self._mac, r.mac, r.src, self.port, p[0],
                                                   p[1], self.chunk_size))
                         for p, r in self._routes.items()}
        for index, header in self._headers.values():
            prog.set_route(index, header)

    def _close_partial(self) -> None:
        if self.prog is not None:
            self.prog.close()
            self.prog = None
        if self._sock is not None:
            self._sock.close()
        if self._packet is not None:
            self._packet.close()
            self._packet = None
        self._att.close()
        self._ns.close()

    def close(self) -> None:
        """Put back the program that was on the interface; fail what is still in flight."""
        if not self._opened:
            return
        self._opened = False
        self._sender.stop()
        for t in list(self._active):
            self._fail(t, TransferTimeout("engine closed"))
        try:
            self._att.restore()
        except OSError as exc:
            log.warning("hostagent fetch: could not restore XDP on %s: %s", self.ifname, exc)
        self._close_partial()

    @property
    def loss_ppm(self) -> int:
        """The loss the engine emulates (that of the injector it stands in for); settable."""
        return int(self.prog.ctl[0]["loss_ppm"])

    @loss_ppm.setter
    def loss_ppm(self, value: int) -> None:
        self.prog.ctl[0]["loss_ppm"] = value

    def counters(self) -> dict[str, int]:
        now = self.prog.counters()
        return {k: v + self._counter_base.get(k, 0) for k, v in now.items()}

    def suspend(self) -> None:
        """Put the interface's previous program back for a while (no transfer may be active);
        ``resume()`` attaches the engine again (no reloading)."""
        if self._active:
            raise RuntimeError("transfers are active")
        self._att.suspend()

    def resume(self) -> None:
        self._att.resume()

    # ---- slots and the transfer table --------------------------------------------------------
    def _link_down(self) -> LinkDown | None:
        if has_carrier(self.ifname, self._sock):
            return None
        return LinkDown(f"{self.ifname} has no carrier: no pool node can be reached")

    def _move_on(self, t: Transfer, why: BaseException) -> None:
        """Ask the block's next holder (module docstring); a silent node is left out."""
        if isinstance(why, NoAnswer) and (down := self._link_down()) is not None:
            return self._fail(t, down)                # our cable, not the node
        if isinstance(why, NoAnswer) and self.answered:
            self.placement.failed(t.route.addr, "read", why)
        if not t.others:
            return self._fail(t, why)
        t.route.iface.settled += t.inflight          # never to come: not waited for
        t.move(self._routes[t.others.pop(0)])
        t.auth = authcheck.check_for(self.keyring, t.ns, t.key, self.chunk_size)
        t.auth_retried = False
        self.stats.moved += 1
        self._activate(t, t.nchunks, t.known)

    def _activate(self, t: Transfer, nslots: int, known: bool) -> None:
        self._ids.retire(t.idx, t.gen)
        t.gen = self._ids.generation(t.idx)
        t.seen_received = 0
        self.prog.set_transfer(t.idx, t.gen, t.ns, t.key, t.nchunks if known else 0, t.base,
                               nslots, t.route.index, _NO_CACHE if t.no_cache else 0)

    def _alloc(self, n: int, alone: Transfer | None = None) -> int | None:
        """A range of ``n`` slots; a larger arena if it does not fit and no other transfer
        (but ``alone``, whose slot is given up) is active. Blocks not released yet keep the
        old arena's memory until they are."""
        base = self._slots.alloc(n)
        if base is not None or n > self.max_slots:
            return base
        if [t for t in self._active if t is not alone] or not self._sender.drained():
            return None
        self._ring.prod = self._ring.cons             # only ``alone``'s retransmissions
        self._rebuild(min(self.max_slots, max(n, 2 * self.slots)))
        return self._slots.alloc(n)

    def _rebuild(self, slots: int) -> None:
        """Load the program with an arena of ``slots`` and swap it in (idle engine only)."""
        new = FetchProgram(self.chunk_size, slots)
        try:
            self._setup(new)
            new.ctl[0]["loss_ppm"] = self.loss_ppm
            self._att.swap(new.fd)
        except BaseException:
            new.close()
            raise
        for k, v in self.prog.counters().items():
            self._counter_base[k] = self._counter_base.get(k, 0) + v
        old, self.prog, self._ring.prog = self.prog, new, new
        old.close()
        self.slots, self._slots = slots, SlotAllocator(slots)
        self.stats.rebuilds += 1

    # ---- the public API ----------------------------------------------------------------------
    def submit(self, ns: int, key: bytes, nchunks: int | None = None,
               no_cache: bool = False, deadline: float | None = None) -> Transfer:
        """Start fetching a block; ``step()`` moves it on, ``t.done`` says when it is over."""
        if not self._opened:
            raise RuntimeError("engine not open")
        if self._att.suspended:
            raise RuntimeError("engine suspended: resume() first")
        nchunks = authcheck.stored_hint(self.keyring, ns, nchunks, self.chunk_size)
        order = self.placement.read_order(ns, key)
        t = Transfer(self._routes[order[0]], ns, key, nchunks, no_cache,
                     deadline or self.deadline)
        t.others = order[1:]
        if (down := self._link_down()) is not None:   # over at once: nothing is held
            t.error = down
            return t
        t.auth = authcheck.check_for(self.keyring, ns, key, self.chunk_size)
        t.auth_retried = False
        if not self._ids:
            raise RuntimeError(f"more than {XFERS} transfers at once")
        base = self._alloc(t.nchunks)
        if base is None:
            raise MemoryError(f"no room for {t.nchunks} chunks in the arena ({self.slots} "
                              "slots): release blocks or grow arena_bytes")
        t.idx, t.base = self._ids.take_index(), base
        self._activate(t, t.nchunks, t.known)
        self._active.append(t)
        return t

    def get_block(self, ns: int, key: bytes, nchunks: int | None = None,
                  no_cache: bool = False) -> Block:
        """Fetch one whole block, byte-exact (BlockNotFound, TransferTimeout, Refused)."""
        return self.get_blocks([(ns, key, nchunks)], no_cache=no_cache)[0]

    def get_blocks(self, requests: Sequence[tuple], no_cache: bool = False,
                   return_exceptions: bool = False) -> list:
        """Fetch several blocks in one loop; ``requests`` are (ns, key[, nchunks])."""
        ts = [self.submit(r[0], r[1], r[2] if len(r) > 2 else None, no_cache) for r in requests]
        self.wait(ts)
        if not return_exceptions:
            failed = next((t.error for t in ts if t.error is not None), None)
            if failed is not None:
                for t in ts:
                    if t.result is not None:
                        t.result.release()
                raise failed
        return [t.error if t.error is not None else t.result for t in ts]

    def cancel(self, t: Transfer) -> None:
        """Abandon a transfer: its slots come back, replies still on the way are stale."""
        if t.result is not None:
            t.result.release()
        elif not t.done:
            self._fail(t, TransferTimeout("cancelled"))

    def wait(self, transfers_: Sequence[Transfer]) -> None:
        while not all(t.done for t in transfers_):
            self.step()

    @property
    def busy(self) -> bool:
        return bool(self._active)

    # ---- one round -------------------------------------------------------------------------
    def step(self) -> bool:
        """Queue what is due, send, verify what arrived, wait a little; whether anything moved."""
        self.stats.steps += 1
        c0 = time.thread_time()
        self._sender.check()
        active = [t for t in self._active if not t.done]
        n = transfers.fill(active, self._ring, self.prog.meta, time.monotonic(), self.burst,
                           self.tail_wait, 2 * self.burst) if active else 0
        self.stats.frames += n
        if n and not self.threaded:                   # one thread: send a call's worth here
            self._sender.send()
        elif n and not self._sender.send_few(self.batch_size):
            self._sender.kick()
        got = self._collect()
        if not n and not got and self._active:
            t0 = time.monotonic()
            if self._ring.queued and not self.threaded:
                self._sender.send()
            elif self._ring.queued:                   # the sender is at work: its next call
                self._sender.wait()
            else:
                time.sleep(pacing.idle_wait(active, self.poll_interval))
            self.stats.idle_seconds += time.monotonic() - t0
        elif self.threaded or not self._ring.queued:      # a slow link trickles: let it gather
            self.stats.idle_seconds += pacing.trickle(active, got, self.poll_interval)
        self.stats.step_cpu += time.thread_time() - c0
        return bool(n or got)

    def _collect(self) -> int:
        """Verify every chunk that arrived since the last look; finish transfers."""
        t0, got, prog = time.monotonic(), 0, self.prog
        silence, heard = self.placement.silence_s, self.placement.heard   # node -> last reply
        for t in list(self._active):
            x = prog.xfers[t.idx]
            status = int(x["status"])
            if status:
                self.answered = True
                heard[t.route.addr] = t0
                self.placement.answered(t.route.addr)        # the node's own answer
                self._on_status(t, status, int(x["err"]), int(x["seen_nchunks"]))
                continue
            received = int(x["received"])
            if received:
                self.answered = True
            if received != t.seen_received:
                t.heard = heard[t.route.addr] = t0
                t.seen_received = received
                got += verify(t, x, prog.meta, prog.arena_mv, self.chunk_size, self.folder,
                              self._ring, self.rto_floor, self.reo_floor, self.max_window)
                try:
                    authcheck.advance(t, prog.arena_mv, self.chunk_size, int(x["tail_len"]))
                except auth_mod.AuthError as exc:
                    self._auth_failed(t, exc)
                    continue
            if t.done:
                continue
            if t.nverified == t.nchunks:
                if t.known:
                    self._finish(t, x)
                else:
                    self._grow(t, x)
            elif (time.monotonic() - max(t.heard, heard.get(t.route.addr, 0.0)) > silence
                  and (t.others or self._link_down() is not None
                       or self.placement.doubtful(t.route.addr, t.ns, t.key))):
                self._move_on(t, Silent(
                    f"{t.route.addr[0]}:{t.route.addr[1]} left a transfer unanswered for "
                    f"{silence:g} s"))
            elif (not self.answered and not received
                  and time.monotonic() - t.start > self.first_reply_timeout):
                self._fail(t, NoReply(
                    f"no reply to any GET the XDP engine sent to {t.route.addr[0]}:"
                    f"{t.route.addr[1]} in {self.first_reply_timeout:g} s"))
            elif time.monotonic() > t.deadline:
                self._fail(t, TransferTimeout(
                    f"{t.nchunks - t.nverified} chunk(s) still missing from "
                    f"{t.route.addr[0]}:{t.route.addr[1]} after {t.stats.retransmits} "
                    f"retransmissions"))
        self.stats.verify_seconds += time.monotonic() - t0
        return got

    def _grow(self, t: Transfer, x) -> None:
        """The probe's chunk 0 is in: the block has seen_nchunks chunks; move to a range."""
        n = int(x["seen_nchunks"])
        t.known = True
        if n <= 1:
            t.nchunks = 1
            self._finish(t, x)
            return
        cs, old = self.chunk_size, t.base
        self.prog.xfers[t.idx]["gen"] = 0
        word = int(self.prog.meta[old])
        chunk0 = self.prog.arena[old * cs:(old + 1) * cs].copy()
        self._slots.release(old, 1)
        base = self._alloc(n, alone=t)
        if base is None:
            t.base = self._slots.alloc(1)             # given back: hold one again to release
            return self._fail(t, MemoryError(f"no room for {n} chunks in the arena"))
        self.prog.arena[base * cs:(base + 1) * cs] = chunk0
        t.base, t.nchunks = base, n
        stats = t.stats
        t.reset(n)
        t.stats = stats
        self._activate(t, n, True)
        self.prog.meta[base] = (word & 0xFF000000FFFFFFFF) | (t.gen << 32)
        t.verified[0], t.nverified, t.lo = True, 1, 1
        t.sent_seq[0], t.tries[0], t.next_new = 0, 1, 1

    def _finish(self, t: Transfer, x) -> None:
        try:
            authcheck.finish(t)
        except auth_mod.AuthError as exc:
            return self._auth_failed(t, exc)
        self.prog.xfers[t.idx]["gen"] = 0
        base, n, slots, released = t.base, t.nchunks, self._slots, []

        def release():
            if not released:
                released.append(True)
                slots.release(base, n)        # an older arena's after a rebuild: unused

        data = (t.auth.data_off, t.auth.data_len) if t.auth is not None else None
        t.result = finish(t, x, self.prog.meta, self.prog.arena, self.chunk_size, release, data)
        if t.result.stats.from_pool:          # the node itself answered, not only the switch
            self.placement.answered(t.route.addr)
        self._retire(t)

    def _auth_failed(self, t: Transfer, exc: auth_mod.AuthError) -> None:
        """A tag check failed: chunks failing their CRC are asked again, else the block is
        fetched once more past the switch's cache, then refused (authcheck)."""
        p, cs = self.prog, self.chunk_size
        bad = crc_damaged(t, p.xfers[t.idx], p.meta, p.arena_mv, cs, self.folder)
        if authcheck.repair(t, bad, p.meta, self.keyring, cs):
            return
        final = authcheck.retry(t, exc, self.keyring, cs)
        if final is not None:
            return self._fail(t, final)
        self._activate(t, t.nchunks, True)

    def _on_status(self, t: Transfer, status: int, err: int, seen: int) -> None:
        exc = status_error(t, status, err, seen)
        if isinstance(exc, auth_mod.AuthError):      # another size than a sealed block's
            return self._auth_failed(t, exc)
        if t.others and (isinstance(exc, BlockNotFound) or (
                isinstance(exc, Refused) and exc.status == Status.UNAVAILABLE)):
            return self._move_on(t, exc)
        self._fail(t, exc)

    def _fail(self, t: Transfer, exc: BaseException) -> None:
        self.prog.xfers[t.idx]["gen"] = 0
        if t.base is not None and t.base >= 0:
            self._slots.release(t.base, len(t.verified))
        t.error = exc
        t.stats.seconds = time.monotonic() - t.start
        self._retire(t)

    def _retire(self, t: Transfer) -> None:
        t.route.iface.settled += t.inflight          # never to come: not waited for
        if t.rtt.srtt is not None:
            t.route.rtts[t.switched] = t.rtt
            t.route.last_switched = t.switched
        self._active.remove(t)
        self._ids.retire(t.idx, t.gen)
        self._ids.give_index(t.idx)
