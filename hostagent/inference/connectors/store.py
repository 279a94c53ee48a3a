"""The pool as the LMCache plugin and the SGLang HiCache backend see it (neither imported here):
their options checked (``StoreSettings``), their keys mapped to block keys (``store_key``) and
blocking calls for their threads (``StoreIO``, over the connectors' one ``PoolIO``).

Keys. LMCache and SGLang name a chunk or page by a string of their own (LMCache's
``CacheEngineKey.to_string()``: model, world size, worker, chained token hash, dtype; SGLang's
chained page hash). A block key is

    SHA-256(STORE_DOMAIN || len(model) || model || len(layout) || layout || len(name) || name)[:16]

(lengths u32 little-endian), where ``layout`` says how the bytes are laid out (shapes, dtypes,
memory format, parallel rank, ...), so engines share a block only under the same model id and
layout. ``STORE_DOMAIN`` differs from ``hostagent.common.hashing``'s prefix and passage domains,
so a store key never equals a key of the other connectors unless SHA-256 collides. A pure
function of its arguments: the same in every process (no ``hash()``).

I/O (``pool_io``). Existence is a GET of chunk 0 alone; whole blocks come through the block
getter (the XDP fetch engine where the node can run it) and go to the pool's holders, awaited.
A silent pool node is failed over and left out for a while (``hostagent.common.pools``); while
no node holding a block answers, it is a miss and writes of it are dropped, never an exception
into the engine. Every call is bounded: ``probe_deadline`` for existence, ``deadline`` for a
block.
"""
from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from hostagent.common import auth as auth_mod
from hostagent.common.transfer import BlockNotFound, unreachable
from kvproto import DEFAULT_CHUNK
from . import options as options_mod
from .pool_io import DROPPED, FAILED, SAVED, PoolIO

log = logging.getLogger("kvswitch.store")

STORE_DOMAIN = b"kvpool/store/v1"


def store_key(model: str, layout: str, name: str | bytes) -> bytes:
    """The 16-byte block key of an engine's chunk or page ``name`` (module docstring)."""
    parts = [model.encode(), layout.encode(), name.encode() if isinstance(name, str) else name]
    h = hashlib.sha256(STORE_DOMAIN)
    for p in parts:
        h.update(len(p).to_bytes(4, "little"))
        h.update(p)
    return h.digest()[:16]


# ---- options ---------------------------------------------------------------------------------
class StoreConfigError(ValueError):
    """A bad option: one line that names it (``key`` None: the options as a whole)."""

    def __init__(self, where: str, key: str | None, why: str):
        super().__init__(f"kvswitch {where}: " + (f"option {key!r}: " if key else "") + why)
        self.key = key


@dataclass(frozen=True)
class StoreSettings:
    """The options both stores take. Only ``pools`` is required."""
    pools: tuple[str, ...]
    namespace: int = options_mod.DEFAULT_NS   # 0..2^32-1, as every connector's (options)
    chunk_size: int = DEFAULT_CHUNK    # must be the switch's --chunk-size for hits
    window: int = 64                   # chunks in flight per block
    concurrency: int = 16              # blocks (or probes) in flight per batch
    deadline: float = 10.0             # seconds for one block (at least options.MIN_DEADLINE)
    probe_deadline: float = 2.0        # seconds for one existence probe (the same)
    retry_s: float = 5.0               # a silent pool node is asked again after this (doubling)
    silence_s: float = 1.0             # a transfer unanswered this long asks the next holder
    replicas: int = 1                  # pool nodes holding each block (1..len(pools))
    shared_store: bool = False         # pool nodes on one Mooncake Store: any node reads any
    model_id: str | None = None        # names the weights in every key; default: the engine's
    fetch_engine: str = "auto"         # auto: the XDP fetch engine where it can run; off
    auth_key_file: str | None = None   # keyed authentication (hostagent/common/auth.py)

    @classmethod
    def from_options(cls, options: Mapping[str, Any], where: str) -> StoreSettings:
        """Checked settings (``hostagent.inference.connectors.options``, the checks every connector
        shares); StoreConfigError names the first bad option (unknown, of the wrong type, out
        of range, an address that does not resolve or is no node's, a key file that cannot be
        used or has no key for the namespace)."""
        try:
            opts = options_mod.mapping(options, "the options")
            options_mod.known(opts, cls.__dataclass_fields__)
            pools = options_mod.common(
                opts, {"window": (1, 1 << 16), "concurrency": (1, 4096)},
                '"IP[:PORT],..."', {"fetch_engine": ("auto", "off")})
        except options_mod.BadOption as exc:
            raise StoreConfigError(where, exc.key, exc.why) from None
        return cls(**{**opts, "pools": pools})

    def keyring(self):
        """The client's ``auth``: the key file's keyring, else the process's (None: off)."""
        return auth_mod.keyring_for(self.namespace, self.auth_key_file)


class StoreIO(PoolIO):
    """``PoolIO`` with the stores' counts and blocking batch calls. Thread-safe."""
    thread_name = "kvswitch-store-io"
    log = log

    def __init__(self, settings: StoreSettings):
        super().__init__(settings)
        self.counts = {"hits": 0, "misses": 0, "puts": 0, "put_failed": 0}

    @property
    def stats(self) -> dict:
        """The counts, and the calls a silent pool node was spared (``skipped``)."""
        return {**self.counts, "skipped": self.placement.skipped}

    async def get(self, ns: int, key: bytes, sink: Callable[[memoryview], Any] = bytes):
        """``sink(view of the block)`` (on the loop thread), or None for a miss or a failure."""
        if not self.readable(ns, key):
            self.placement.skipped += 1
            return None
        try:
            blk, _ = await self.view(ns, key)
            try:
                out = sink(memoryview(blk.view).cast("B"))
            finally:
                blk.release()
        except Exception as exc:
            if not isinstance(exc, BlockNotFound) and not unreachable(exc):
                self.log.warning("kvswitch: GET of %s failed: %s", key.hex(), exc)
            self.counts["misses"] += 1
            return None
        self.counts["hits"] += 1
        return out

    async def store(self, ns: int, key: bytes, data) -> bool:
        """PUT a block (``PoolIO.put``); whether it was saved."""
        outcome, _ = await self.put(ns, key, data)
        if outcome == SAVED:
            self.counts["puts"] += 1
        elif outcome == FAILED:
            self.counts["put_failed"] += 1
        elif outcome == DROPPED:
            self.placement.skipped += 1
        return outcome == SAVED

    async def _each(self, call, ns: int, items: Sequence[tuple]) -> list:
        sem = asyncio.Semaphore(self.settings.concurrency)

        async def one(args):
            async with sem:
                return await call(ns, *args)

        return list(await asyncio.gather(*(one(a) for a in items)))

    # ---- blocking calls for the engines' threads -----------------------------------------------
    def exists(self, ns: int, key: bytes) -> bool:
        return self.prefix_now(ns, [key]) == 1

    def prefix_now(self, ns: int, keys: Sequence[bytes]) -> int:
        """How many leading ``keys`` the pool has (bounded: none past the probe deadlines)."""
        if not keys:
            return 0
        return self.bounded(self.prefix(ns, list(keys), self.settings.concurrency),
                            self.settings.probe_deadline * (1 + len(keys)) + 5, 0)

    def get_many(self, ns: int, keys: Sequence[bytes], sinks: Sequence[Callable]) -> list:
        """Each block through its sink (None where missing); bounded by the deadline."""
        if not keys:
            return []
        waves = -(-len(keys) // self.settings.concurrency)
        return self.bounded(self._each(self.get, ns, list(zip(keys, sinks))),
                            self.settings.deadline * (1 + waves) + 5, [None] * len(keys))

    def put_many(self, ns: int, keys: Sequence[bytes], blocks: Sequence) -> list[bool]:
        if not keys:
            return []
        waves = -(-len(keys) // self.settings.concurrency)
        return self.bounded(self._each(self.store, ns, list(zip(keys, blocks))),
                            self.settings.deadline * (1 + waves) + 5, [False] * len(keys))


def io_for(settings: StoreSettings) -> StoreIO:
    """The process's StoreIO for these settings (made on first use, shared after)."""
    return StoreIO.shared(settings)
