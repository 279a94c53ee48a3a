"""The arena's slot allocator: a transfer owns a contiguous range of arena slots, so a finished
block is contiguous bytes of the mmapped arena (``hostagent.common.block.Block``, a zero-copy
view of them until ``release()`` gives the slots back). ``SlotAllocator`` hands out first-fit
ranges and merges freed neighbours.
"""
from __future__ import annotations


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
