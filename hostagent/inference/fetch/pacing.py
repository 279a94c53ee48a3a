"""How long the engine's step sleeps while replies come through a link's queue: a shaped link
delivers a chunk every 0.25-1 ms, and a step per chunk (polling every 50 us) spent a core per
reader, which 16 readers on two cores took from the links' forwarding. Where every active
transfer is link-paced (``link_paced``) a step that moved nothing, or verified fewer than
``IDLE_CHUNKS`` replies and finished no transfer, sleeps about the time ``IDLE_CHUNKS`` replies
take at the slowest active route's delivery rate, at most ``IDLE_MAX``; elsewhere the engine's
``poll_interval``.
"""
from __future__ import annotations

import time

from .transfers import Transfer, queue_free

IDLE_CHUNKS, IDLE_MAX = 8, 0.002        # a step on a queued link sleeps ~8 deliveries, <= 2 ms


def link_paced(t: Transfer) -> bool:
    """Whether ``t``'s replies come through a link's queue (its smoothed round trip is
    ``QUEUE_SIGNAL`` above the route's base one): they keep coming at the link's rate, and the
    engine may let a few gather between steps. Not on unshaped paths, nor in loss recovery
    there (the round trip stays near the base one)."""
    return t.rtt.srtt is not None and not queue_free(t) and not t.rtt.sync


def idle_wait(active: list[Transfer], poll_interval: float) -> float:
    """How long an engine step sleeps that moved nothing, or (``trickle``) verified fewer than
    ``IDLE_CHUNKS`` replies and finished no transfer, where every active transfer is
    link-paced: about the time ``IDLE_CHUNKS`` replies take at the slowest active route's
    delivery rate, at most ``IDLE_MAX``; elsewhere ``poll_interval``."""
    rates = [t.route.bw for t in active]
    if not rates or min(rates) <= 0 or not all(link_paced(t) for t in active):
        return poll_interval
    return min(IDLE_MAX, max(poll_interval, IDLE_CHUNKS / min(rates)))


def trickle(active: list[Transfer], got: int, poll_interval: float) -> float:
    """After a step that verified ``got`` replies: sleep while a slow link's replies gather
    (see ``idle_wait``); the seconds slept."""
    if got >= IDLE_CHUNKS or any(t.done for t in active):
        return 0.0
    wait = idle_wait(active, poll_interval)
    if wait <= poll_interval:
        return 0.0
    time.sleep(wait)
    return wait
