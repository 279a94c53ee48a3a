"""What the kernel says about one of this node's own network interfaces, asked through the
socket ioctl (no sysfs: it answers for the network namespace the process runs in)."""
from __future__ import annotations

import fcntl
import socket
import struct

SIOCGIFFLAGS = 0x8913
IFF_UP, IFF_RUNNING = 0x1, 0x40


def has_carrier(ifname: str, sock: socket.socket | None = None) -> bool:
    """Whether ``ifname`` is up and operational: its cable is in (a veth whose peer is down,
    or a NIC without link, is not). Asked through ``sock`` if given (it answers for the
    namespace it was made in), else a socket of the process's namespace. OSError if there is
    no such interface."""
    req = struct.pack("16sH14x", ifname.encode()[:15], 0)
    if sock is not None:
        flags = struct.unpack_from("16sH", fcntl.ioctl(sock.fileno(), SIOCGIFFLAGS, req))[1]
    else:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            flags = struct.unpack_from("16sH", fcntl.ioctl(s.fileno(), SIOCGIFFLAGS, req))[1]
    return flags & (IFF_UP | IFF_RUNNING) == IFF_UP | IFF_RUNNING
