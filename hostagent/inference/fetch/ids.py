"""Request ids of the fetch engine's GETs: which transfer table entry a transfer gets and its
24-bit generation (request id = index << 24 | generation), both unpredictable.

An off-path host that can guess a request id can answer a GET before the pool does (issue 26:
with generations going up by one per transfer, 8 of 8 chunks of a fetch were forged). So the
index is drawn at random among the free entries and the generation at random from the 2^24 - 1
non-zero values (``secrets``), and an (index, generation) pair is not drawn again for
``hold`` seconds after its transfer ended: a late reply of a finished transfer (a held miss
released at the switch, a slow pool node) never matches a new one. The XDP program also checks
a reply's source addresses; keyed authentication (hostagent/common/auth.py) is what makes a guessed
id useless in the end.
"""
from __future__ import annotations

import collections
import secrets
import time


class RequestIds:
    """Free transfer table entries and recently used (index, generation) pairs."""

    def __init__(self, entries: int, gen_mask: int, hold: float = 300.0):
        self.gen_mask, self.hold = gen_mask, hold
        self.free = list(range(entries))
        self.recent: collections.OrderedDict[tuple[int, int], float] = collections.OrderedDict()

    def __bool__(self) -> bool:
        return bool(self.free)

    def take_index(self) -> int:
        """A free entry, at random (IndexError when none is free)."""
        if not self.free:
            raise IndexError("no free transfer entry")
        i = secrets.randbelow(len(self.free))
        self.free[i], self.free[-1] = self.free[-1], self.free[i]
        return self.free.pop()

    def give_index(self, idx: int) -> None:
        self.free.append(idx)

    def generation(self, idx: int, now: float | None = None) -> int:
        """A random non-zero generation for entry ``idx`` not used there within ``hold``."""
        self._expire(time.monotonic() if now is None else now)
        while True:
            gen = secrets.randbelow(self.gen_mask) + 1
            if (idx, gen) not in self.recent:
                return gen

    def retire(self, idx: int, gen: int, now: float | None = None) -> None:
        """Generation ``gen`` of entry ``idx`` is no longer active: do not reuse it for a while."""
        if gen > 0:
            self.recent[(idx, gen)] = time.monotonic() if now is None else now
            self.recent.move_to_end((idx, gen))

    def _expire(self, now: float) -> None:
        while self.recent:
            pair, when = next(iter(self.recent.items()))
            if now - when < self.hold:
                break
            del self.recent[pair]
