"""Which pool nodes hold a block and which of them answer now: placement and failover, one code
for every client (the asyncio ``KVClient``, the XDP fetch engine) and so for every connector.

Placement. A block's nodes are the pools in its rendezvous order (highest SHA-256 of (pool, ns,
key) first: adding or losing a node moves only its own blocks). The first ``replicas`` of them
hold it: a PUT goes to each, and a read asks them in that order. With ``shared`` (pool nodes on
one Mooncake Store: every node reads every block from the shared store, which replicates on
its own) a PUT goes to the first node alone and a read may be asked of any node. With
``spread`` a read asks its holders in a random order (the answering ones first): the readers of
one hot block share its holders' links instead of queueing at its owner's.

Failover. A node that left a transfer unanswered for ``silence_s`` (the clients judge it per
transfer: no reply to it, and none to any transfer on that node, for that long; ``heard`` holds
each node's last reply to either client sharing the placement, so a node whose PUTs wait for
its busy server while its kernel answers the engine's GETs is not taken for dead) is left out for
a back-off that doubles while it keeps failing (``retry_s`` .. ``RETRY_CAP``); meanwhile reads
ask only the block's other holders (one that lacks it is a miss) and PUTs skip it (a lost PUT
is a future miss). A read whose every holder is left out still asks them (one may be back).
Past its back-off a node is asked again by reads and PUTs, but it stays a suspect until it
answers: a transfer to a suspect is bounded by the silence limit even where it is the last
holder left, while another holder of the block is no suspect (``doubtful``; when every holder
went silent at once the reader's own path is the likelier cause, and the last is waited for);
a caller that must not wait (the vLLM scheduler's probe: ``wary``) never asks a suspect. One
log line when a node goes, one when it answers again.
"""
from __future__ import annotations

import hashlib
import logging
import random
import threading
import time
from collections.abc import Sequence

from .transfer import parse_addr

RETRY_CAP = 60.0                # seconds: the longest back-off of a silent pool node
SILENCE_S = 1.0                 # seconds without a reply before a transfer asks the next node

Addr = tuple[str, int]


def rendezvous(pools: Sequence[Addr], ns: int, key: bytes) -> list[Addr]:
    """``pools`` in a block's rendezvous order (its owner first)."""
    if not pools:
        raise ValueError("no pool nodes configured")
    tag = ns.to_bytes(4, "big") + key
    return sorted(pools, reverse=True,
                  key=lambda p: hashlib.sha256(f"{p[0]}:{p[1]}".encode() + tag).digest())


def pool_for(pools: Sequence[Addr], ns: int, key: bytes) -> Addr:
    """The pool node that owns a block (first in its rendezvous order)."""
    return rendezvous(pools, ns, key)[0]


def addresses(pools: Sequence[str | Addr]) -> list[Addr]:
    """Pool addresses as (IPv4, port), names resolved (``parse_addr``)."""
    return [parse_addr(p) if isinstance(p, str) else parse_addr(f"{p[0]}:{p[1]}")
            for p in pools]


class Placement:
    """The pool nodes of a client (module docstring). Thread-safe: the fetch engine's stepping
    and a connector's I/O thread share one."""

    def __init__(self, pools: Sequence[str | Addr], replicas: int = 1, shared: bool = False,
                 retry_s: float = 5.0, silence_s: float = SILENCE_S,
                 log: logging.Logger | None = None, spread: bool = False):
        self.pools = addresses(pools)
        if not self.pools:
            raise ValueError("no pool nodes configured")
        if not 1 <= replicas <= len(self.pools):
            raise ValueError(f"replicas {replicas} is not in 1..{len(self.pools)} (the pool "
                             "nodes configured)")
        self.replicas, self.shared, self.spread = replicas, shared, spread
        self.retry_s, self.silence_s = retry_s, silence_s
        self.log = log or logging.getLogger("kvswitch.pools")
        self._down: dict[Addr, tuple[float, float]] = {}        # addr -> (until, back-off)
        self.heard: dict[Addr, float] = {}      # addr -> its last reply to any client (monotonic)
        self._lock = threading.Lock()
        self.skipped = 0                # reads or PUTs a silent node was spared

    @classmethod
    def of(cls, pools) -> Placement:
        """``pools`` itself if a Placement, else one over those addresses (one holder each)."""
        return pools if isinstance(pools, Placement) else cls(pools)

    def holders(self, ns: int, key: bytes) -> list[Addr]:
        """The nodes a PUT of the block goes to (its first ``replicas``, or its owner alone
        with a shared store), silent ones included: ``usable`` says which to skip."""
        order = rendezvous(self.pools, ns, key)
        return order[:1] if self.shared else order[:self.replicas]

    def _readers(self, ns: int, key: bytes) -> list[Addr]:
        """The nodes a read of the block may ask, in rendezvous order: its holders, or any node
        with a shared store."""
        order = rendezvous(self.pools, ns, key)
        return order if self.shared else order[:self.replicas]

    def read_order(self, ns: int, key: bytes, wary: bool = False) -> list[Addr]:
        """The nodes to ask for the block, in turn: its holders (any node, with a shared
        store) in rendezvous order (a random one with ``spread``) that are not left out now,
        or all of them if every one is. ``wary``: only those that answered last time (no
        suspect), maybe none."""
        order = self._readers(ns, key)
        if self.spread:
            random.shuffle(order)
        if wary:
            return [p for p in order if p not in self._down]
        return [p for p in order if self.usable(p)] or order

    def owner(self, ns: int, key: bytes) -> Addr:
        """The node asked first for the block now."""
        return self.read_order(ns, key)[0]

    # ---- reachability ------------------------------------------------------------------------
    def usable(self, addr: Addr) -> bool:
        """Not left out now (its back-off, if any, is over)."""
        state = self._down.get(addr)
        return state is None or time.monotonic() >= state[0]

    def suspect(self, addr: Addr) -> bool:
        """Left a transfer unanswered and has not answered since (back-off over or not)."""
        return addr in self._down

    def doubtful(self, addr: Addr, ns: int, key: bytes) -> bool:
        """``addr`` is a suspect while another node that may hold the block is not: a transfer
        to it is bounded by the silence limit, even as the last holder asked."""
        return self.suspect(addr) and any(not self.suspect(p)
                                          for p in self._readers(ns, key) if p != addr)

    def failed(self, addr: Addr, what: str, exc: BaseException | str) -> None:
        """``addr`` left a ``what`` (probe, load, save, read) unanswered: leave it out."""
        with self._lock:
            until, backoff = self._down.get(addr, (0.0, 0.0))
            backoff = min(RETRY_CAP, 2 * backoff) if backoff else self.retry_s
            self._down[addr] = (time.monotonic() + backoff, backoff)
        if not until:
            self.log.warning("kvswitch: pool node %s:%d does not answer (%s: %s): %s; asking "
                             "again in %g s", *addr, what, exc or type(exc).__name__,
                             self._meanwhile(), backoff)

    def _meanwhile(self) -> str:
        if self.shared or self.replicas > 1:
            return "its blocks are asked of the next node holding them"
        return "its blocks are misses and not saved"

    def due(self, ns: int, key: bytes) -> Addr | None:
        """A holder of the block that is a suspect past its back-off, claimed for one check (its
        back-off starts again, not doubled, so that no other caller asks it meanwhile); None if
        there is none. For a caller that never asks suspects itself (``wary``)."""
        now = time.monotonic()
        with self._lock:
            for addr in self.holders(ns, key):
                until, backoff = self._down.get(addr, (None, 0.0))
                if until is not None and now >= until:
                    self._down[addr] = (now + backoff, backoff)
                    return addr
        return None

    def answered(self, addr: Addr) -> None:
        """``addr`` answered a transfer: a suspect no more (cheap when it was none)."""
        if addr not in self._down:
            return
        with self._lock:
            back = self._down.pop(addr, None) is not None
        if back:
            self.log.warning("kvswitch: pool node %s:%d answers again", *addr)

    def readable(self, ns: int, key: bytes) -> bool:
        """Whether a holder of the block answered last time (a caller that must not wait,
        such as a scheduler's probe, takes the block for a miss otherwise)."""
        return bool(self.read_order(ns, key, wary=True))

    def writable(self, ns: int, key: bytes) -> bool:
        """Whether a node that would hold the block answers now."""
        return any(self.usable(a) for a in self.holders(ns, key))
