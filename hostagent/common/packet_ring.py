"""Frames sent in batches from userspace: an AF_PACKET socket's TX ring (TPACKET_V2), mmapped
and viewed as a numpy array of frames. A caller writes the bytes of the next frames in place
(``next_frames``) and ``send``s them with one system call; the kernel turns each into an skb and
transmits it out of the interface the ring is bound to, past its qdisc (PACKET_QDISC_BYPASS, as
XDP's own transmissions are). Slot memory starts zeroed and is only ever written by the caller, so
bytes a caller never writes (the room of a GET) stay zero.

This is how the fetch engine sends its GETs and the testbed's generator its requests: kernels may
refuse BPF_PROG_TEST_RUN in live-frames mode (`xdp.features`), and a packet socket is granted
wherever a root process may open one. Measured here: 1.3 M frames/s of 1,114 bytes through a veth
into a native XDP program, one core (the receiver's work included).
"""
from __future__ import annotations

import errno
import mmap
import socket
import struct

import numpy as np

SOL_PACKET = 263
PACKET_VERSION, PACKET_TX_RING, PACKET_QDISC_BYPASS, PACKET_LOSS = 10, 13, 20, 14
TPACKET_V2 = 1
TP_STATUS_AVAILABLE, TP_STATUS_SEND_REQUEST, TP_STATUS_SENDING = 0, 1, 2
HDR_LEN = 32                       # TPACKET_ALIGN(sizeof(struct tpacket2_hdr)): the frame's offset
_BLOCK = 1 << 16                   # ring block: a multiple of the page size and of every slot size


class PacketRing:
    """A TX ring of ``slots`` frames of ``frame_len`` bytes on interface ``ifname`` of the
    caller's current network namespace. ``frames`` views slot i's frame bytes as row i."""

    def __init__(self, ifname: str, frame_len: int, slots: int = 2048):
        if not 14 <= frame_len <= 9216:
            raise ValueError(f"frame length {frame_len} out of range")
        self.frame_len = frame_len
        self.slot_size = 1 << max(11, (HDR_LEN + frame_len - 1).bit_length())
        per_block = max(1, _BLOCK // self.slot_size)
        block = max(_BLOCK, self.slot_size)
        nblocks = -(-slots // per_block)
        self.slots = nblocks * per_block
        self.sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, 0)
        try:
            self.sock.setsockopt(SOL_PACKET, PACKET_VERSION, TPACKET_V2)
            self.sock.setsockopt(SOL_PACKET, PACKET_QDISC_BYPASS, 1)
            self.sock.setsockopt(SOL_PACKET, PACKET_LOSS, 1)   # skip a bad frame, never stall
            self.sock.setsockopt(SOL_PACKET, PACKET_TX_RING,
                                 struct.pack("IIII", block, nblocks, self.slot_size, self.slots))
            self.sock.bind((ifname, 0))
            self._mm = mmap.mmap(self.sock.fileno(), block * nblocks, mmap.MAP_SHARED,
                                 mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            self.sock.close()
            raise
        raw = np.frombuffer(self._mm, np.uint8).reshape(self.slots, self.slot_size)
        self._status = raw[:, 0:4].view(np.uint32)[:, 0]
        self._len = raw[:, 4:8].view(np.uint32)[:, 0]
        self._len[:] = frame_len
        self.frames = raw[:, HDR_LEN:HDR_LEN + frame_len]
        self.head = 0                   # the next slot the kernel sends from
        self.sent = 0                   # frames handed to the kernel, in all

    def next_frames(self, n: int) -> np.ndarray:
        """The slot indexes of the next ``n`` frames to send (n at most ``slots``)."""
        if not 0 <= n <= self.slots:
            raise ValueError(f"at most {self.slots} frames a call")
        return (self.head + np.arange(n)) % self.slots

    def send(self, n: int) -> int:
        """Send the next ``n`` frames (written in place beforehand); returns how many the kernel
        took (the rest are dropped: a sender that recovers from loss sends them again) once it
        has transmitted them (their slots are free again). OSError if the call failed."""
        if n == 0:
            return 0
        idx = self.next_frames(n)
        if self._status[idx].any():
            raise OSError(errno.EBUSY, "packet ring: slots still held by the kernel")
        self._status[idx] = TP_STATUS_SEND_REQUEST
        try:
            self.sock.send(b"")
        except OSError:
            self.head = (self.head + self._settle(idx)) % self.slots
            raise
        taken = n if not self._status[idx].any() else self._settle(idx)
        self.head = (self.head + taken) % self.slots
        self.sent += taken
        return taken

    def _settle(self, idx: np.ndarray) -> int:
        """After a call that stopped early (the kernel stops at a frame it could not send and
        leaves it and those after it requested): those frames are withdrawn, so the kernel's
        head is where the next call starts. Returns how many it took."""
        status = self._status[idx]
        left = np.flatnonzero(status == TP_STATUS_SEND_REQUEST)
        taken = int(left[0]) if left.size else idx.size
        self._status[idx[status != TP_STATUS_SENDING]] = TP_STATUS_AVAILABLE
        return taken

    def close(self) -> None:
        try:
            self._mm.close()
        except BufferError:             # numpy views still alive: the memory goes with them
            pass
        self.sock.close()
