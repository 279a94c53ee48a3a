"""A fetched block as every client hands it over (``get_block_view`` of the XDP fetch engine's
client and of the asyncio ``KVClient``): its bytes as zero-copy views (numpy, memoryview,
torch) valid until ``release()``, and where its chunks came from (``stats``). The engine's
block is a view of its arena (``release`` gives the slots back for the next transfer); the
asyncio client's owns its bytes (``release`` drops them).
"""
from __future__ import annotations

from collections.abc import Callable

import numpy as np

from .transfer import TransferStats


class Block:
    """A fetched block. Its bytes are a view of the engine's arena until ``release()`` (then
    the slots are reused: copy what must outlive that, e.g. with ``tobytes()``)."""

    def __init__(self, ns: int, key: bytes, nchunks: int, data: np.ndarray,
                 stats: TransferStats, release: Callable[[], None] | None = None):
        self.ns, self.key, self.nchunks, self.stats = ns, key, nchunks, stats
        self._data, self._release = data, release

    @property
    def nbytes(self) -> int:
        return self._array().nbytes

    def _array(self) -> np.ndarray:
        if self._data is None:
            raise ValueError("block released")
        return self._data

    def numpy(self) -> np.ndarray:
        """The block as a read-only uint8 array (no copy)."""
        v = self._array().view()
        v.flags.writeable = False
        return v

    @property
    def view(self) -> memoryview:
        return memoryview(self.numpy())

    def torch(self, dtype=None):
        """The block as a torch tensor sharing the arena's memory (no copy); ``dtype``
        reinterprets the bytes (e.g. torch.bfloat16)."""
        import torch
        t = torch.frombuffer(self._array(), dtype=torch.uint8)
        return t if dtype is None else t.view(dtype)

    def tobytes(self) -> bytes:
        return self._array().tobytes()

    def release(self) -> None:
        """Give the slots back (idempotent); the views taken before must not be used after."""
        if self._release is not None:
            self._release()
            self._release = None
        self._data = None

    def __enter__(self) -> Block:
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    @classmethod
    def of_bytes(cls, ns: int, key: bytes, data: bytes, chunk_size: int,
                 stats: TransferStats) -> Block:
        """A block over ``data`` (bytes the caller no longer needs)."""
        return cls(ns, key, -(-len(data) // chunk_size), np.frombuffer(data, np.uint8), stats)
