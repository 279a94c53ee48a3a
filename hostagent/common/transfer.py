"""What both of the inference node's clients (the asyncio fallback client,
``hostagent.inference.client``, and the fetch engine, ``hostagent.inference.fetch``) share
with their callers: the transfer errors, ``TransferStats`` (counted per reply, summed with
``add``) and pool addresses (``parse_addr``). Which pool nodes hold a block, and which answer
now, is ``hostagent.common.pools``.
"""
from __future__ import annotations

import ipaddress
import socket
from dataclasses import asdict, dataclass, fields

from kvproto import PORT, Flag, Message, Status


# plain ints: IntFlag operations are slow on the receive path
_REPLICA, _FROM_SWITCH = int(Flag.REPLICA), int(Flag.FROM_SWITCH)


class BlockNotFound(KeyError):
    """The pool node does not have (all of) the block."""


class TransferTimeout(TimeoutError):
    """Chunks were still missing when the deadline passed."""


class NoAnswer(TransferTimeout):
    """The deadline passed without a single answer from the peer (not a slow transfer: the
    peer, or the path to it, is gone)."""


class Silent(NoAnswer):
    """A pool node left a transfer unanswered for its silence limit (``pools.Placement``): the
    transfer moves on to the block's next holder, or fails with this when there is none."""


class NoReply(NoAnswer):
    """Nothing ever came back to the fetch engine's GETs: its frames do not leave the interface
    (a veth whose peer carries no XDP program drops what XDP transmits) or the pool is gone.
    The asyncio client tells the two apart (``AsyncFetchClient`` retries with it)."""


class LinkDown(NoAnswer):
    """The fetch engine's own interface has no carrier: no pool node can be reached."""


def unreachable(exc: BaseException) -> bool:
    """An error that says a pool node did not answer at all (not that it lacks a block,
    refused one, or was slow: a transfer that timed out with answers is congestion, and a
    node left out for it would turn a busy link into recomputation): no answer within the
    deadline or the silence limit (``NoAnswer``: the fetch engine's ``NoReply`` is one), or the
    network refusing the address."""
    if isinstance(exc, NoAnswer):
        return True
    return isinstance(exc, OSError) and not isinstance(exc, TimeoutError)  # a slow transfer


class Refused(RuntimeError):
    """The peer answered ERROR; ``status`` says why."""

    def __init__(self, status: int, what: str):
        super().__init__(f"{what}: refused with {Status(status).name}")
        self.status = status


@dataclass
class TransferStats:
    chunks: int = 0
    bytes: int = 0
    from_switch: int = 0      # replies written by the switch (cache hits)
    replicas: int = 0         # replies the switch copied from another reader's fetch
    from_pool: int = 0        # replies sent by the pool node itself
    retransmits: int = 0
    checksum_errors: int = 0
    auth_failures: int = 0    # tag checks failed (the block was fetched again past the switch)
    seconds: float = 0.0

    def as_dict(self) -> dict:
        return asdict(self)

    def add(self, part: TransferStats, seconds: bool = False) -> None:
        """Add ``part``'s counts to these, and its seconds if ``seconds`` (a running total of
        time in transfers; a caller timing one concurrent operation sets seconds itself)."""
        for f in fields(self):
            if seconds or f.name != "seconds":
                setattr(self, f.name, getattr(self, f.name) + getattr(part, f.name))

    def count_reply(self, msg: Message) -> None:
        """One accepted GET_REPLY: its bytes, and who sent it (by its flags)."""
        self.chunks += 1
        self.bytes += len(msg.payload)
        if msg.flags & _REPLICA:
            self.replicas += 1
        elif msg.flags & _FROM_SWITCH:
            self.from_switch += 1
        else:
            self.from_pool += 1


def parse_addr(text: str, default_port: int = PORT) -> tuple[str, int]:
    """'10.0.0.1', 'pool-3' or '10.0.0.1:19286' -> (IPv4 address, port); a name is resolved
    now, so replies can be matched to the address asked. ValueError (one line naming the
    address) for a port out of range, a name that does not resolve, or an address no pool
    node can have (``not_a_node``)."""
    host, sep, port = text.rpartition(":")
    if not sep:
        host, port = text, str(default_port)
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"bad port in address {text!r}")
    try:
        addr = socket.getaddrinfo(host, None, socket.AF_INET, socket.SOCK_DGRAM)[0][4][0]
    except (socket.gaierror, UnicodeError):
        raise ValueError(f"pool address {host!r} is not an IPv4 address or a name that "
                         "resolves to one") from None
    why = not_a_node(addr)
    if why:
        shown = repr(host) if host == addr else f"{host!r} ({addr})"
        raise ValueError(f"pool address {shown} cannot be a pool node: {why}")
    return addr, int(port)


_THIS_NETWORK = ipaddress.IPv4Network("0.0.0.0/8")


def not_a_node(addr: str) -> str | None:
    """Why the IPv4 address ``addr`` cannot be one node's (a datagram to it never reaches one
    pool node that answers from it), or None. Unspecified (0.0.0.0), "this network" (0.0.0.0/8:
    '5' resolves to 0.0.0.5), limited broadcast and multicast are refused; loopback and private
    addresses are addresses like any other."""
    ip = ipaddress.IPv4Address(addr)
    if ip.is_unspecified:
        return "the unspecified address"
    if ip in _THIS_NETWORK:
        return "in 0.0.0.0/8 ('this network', never a destination)"
    if ip == ipaddress.IPv4Address("255.255.255.255"):
        return "the broadcast address"
    if ip.is_multicast:
        return "a multicast address"
    return None
