"""The pool node's in-memory block store: whole KV blocks, stored chunk by chunk, with a byte
capacity. Blocks are immutable and content-addressed; when space runs out the least recently used
complete blocks go first. Every chunk keeps the checksum its writer sent, verified on arrival."""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from kvproto import Status, checksum


class StoreError(Exception):
    """A request the store refuses; ``status`` is the protocol status to answer with."""

    def __init__(self, status: int, reason: str):
        super().__init__(reason)
        self.status = status


@dataclass
class Block:
    nchunks: int
    chunks: dict[int, tuple[bytes, int]] = field(default_factory=dict)  # index -> (payload, crc)
    nbytes: int = 0

    @property
    def complete(self) -> bool:
        return len(self.chunks) == self.nchunks


class BlockStore:
    """Blocks by (namespace, key). Not thread-safe: the server drives it from one event loop."""

    def __init__(self, capacity_bytes: int):
        if capacity_bytes <= 0:
            raise ValueError("capacity must be positive")
        self.capacity = capacity_bytes
        self.used = 0
        self.evicted_blocks = 0
        self._blocks: OrderedDict[tuple[int, bytes], Block] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def put_chunk(self, ns: int, key: bytes, chunk: int, nchunks: int, payload: bytes,
                  crc: int) -> bool:
        """Store one chunk; returns True when its block is complete. Raises StoreError."""
        if nchunks < 1 or chunk >= nchunks:
            raise StoreError(Status.BAD_REQUEST, f"chunk {chunk} of a {nchunks}-chunk block")
        if checksum(payload) != crc:
            raise StoreError(Status.CHECKSUM, "payload does not match its checksum")
        block = self._blocks.get((ns, key))
        if block is None:
            block = self._blocks[(ns, key)] = Block(nchunks)
        elif block.nchunks != nchunks:
            raise StoreError(Status.BAD_REQUEST,
                             f"block has {block.nchunks} chunks, PUT says {nchunks}")
        old = block.chunks.get(chunk)
        if old is not None:
            if old[1] != crc:
                raise StoreError(Status.BAD_REQUEST, "blocks are immutable: chunk differs")
            return block.complete  # a retransmitted PUT
        self._make_room(len(payload), keep=(ns, key))
        block.chunks[chunk] = (payload, crc)
        block.nbytes += len(payload)
        self.used += len(payload)
        self._blocks.move_to_end((ns, key))
        return block.complete

    def get_chunk(self, ns: int, key: bytes, chunk: int) -> tuple[bytes, int, int]:
        """(payload, crc, nchunks) of one chunk of a complete block. Raises StoreError."""
        block = self._blocks.get((ns, key))
        if block is None:
            raise StoreError(Status.NOT_FOUND, "no such block")
        if not block.complete:
            raise StoreError(Status.INCOMPLETE, "block is still being written")
        if chunk >= block.nchunks:
            raise StoreError(Status.BAD_REQUEST, f"block has {block.nchunks} chunks")
        self._blocks.move_to_end((ns, key))
        payload, crc = block.chunks[chunk]
        return payload, crc, block.nchunks

    def remove(self, ns: int, key: bytes) -> bool:
        block = self._blocks.pop((ns, key), None)
        if block is not None:
            self.used -= block.nbytes
        return block is not None

    def _make_room(self, nbytes: int, keep: tuple[int, bytes]) -> None:
        if nbytes > self.capacity:
            raise StoreError(Status.NO_SPACE, "chunk larger than the store")
        for victim in list(self._blocks):
            if self.used + nbytes <= self.capacity:
                return
            if victim != keep and self._blocks[victim].complete:
                self.remove(*victim)
                self.evicted_blocks += 1
        if self.used + nbytes > self.capacity:
            raise StoreError(Status.NO_SPACE, "store is full of blocks being written")
