"""UDP socket settings shared by the host agent's client and server."""
from __future__ import annotations

import socket

BUFFER_BYTES = 8 << 20


def grow_buffers(sock: socket.socket, size: int = BUFFER_BYTES) -> None:
    """Ask for large send/receive buffers so a window of chunks is not dropped at the socket
    (the kernel caps the request at net.core.[rw]mem_max)."""
    for opt in (socket.SO_RCVBUF, socket.SO_SNDBUF):
        try:
            sock.setsockopt(socket.SOL_SOCKET, opt, size)
        except OSError:
            pass
