"""A fetched block as the engine hands it over, and the arena's slot allocator.

A transfer owns a contiguous range of arena slots, so a finished block is contiguous bytes of
the mmapped arena: ``Block`` is a zero-copy view of them (numpy, memoryview, torch) valid until
``release()``, which gives the slots back for the next transfer. ``SlotAllocator`` hands out
first-fit ranges and merges freed neighbours.
"""
from __future__ import annotations

from collections.abc import Callable

import numpy as np

from hostagent.common.transfer import TransferStats


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


class SlotAllocator:
    """Free ranges of ``slots`` arena slots as (start, length), sorted and merged."""

    def __init__(self, slots: int):
        self.slots = slots
        self.free: list[tuple[int, int]] = [(0, slots)]

    def alloc(self, n: int) -> int | None:
        """First slot of a free range of ``n`` slots, or None."""
        for i, (start, length) in enumerate(self.free):
            if length >= n:
                if length == n:
                    del self.free[i]
                else:
                    self.free[i] = (start + n, length - n)
                return start
        return None

    def release(self, start: int, n: int) -> None:
        merged: list[tuple[int, int]] = []
        for s, ln in sorted(self.free + [(start, n)]):
            if merged and merged[-1][0] + merged[-1][1] == s:
                merged[-1] = (merged[-1][0], merged[-1][1] + ln)
            else:
                merged.append((s, ln))
        self.free = merged

    @property
    def idle(self) -> bool:
        """Every slot is free."""
        return self.free == [(0, self.slots)]
