"""The state of the art as offline baselines: libCacheSim's cache algorithms (PyPI ``libcachesim``)
replayed on the evaluator's block-request stream at the same capacity.

    masks = run(keys, capacity)              # {name: numpy bool hit mask}, one per algorithm
    ratios = hit_ratios(keys, capacity)      # {name: hit ratio}, the library's own replay loop
    hits = belady_bypass(keys, capacity)     # libCacheSim's Belady in the evaluator's model

Model: every key is one object of size 1 and the cache holds ``capacity`` objects (libCacheSim
counts bytes; with size 1 and no metadata accounting, its default, bytes are objects). Each
algorithm admits every miss unless its own admission logic says otherwise (W-TinyLFU's filter,
S3-FIFO's small queue...). libCacheSim's Belady admits EVERY miss and evicts the cached object
needed furthest in the future; the evaluator's Belady (testbed.sim.hindsight) may also bypass the
miss, which is a different cache with a higher optimum. ``belady_bypass`` runs the library's
Belady in the bypass model, so the two can be compared request by request.

Determinism: the randomised algorithms (LHD, Cacheus, LeCaR, Hyperbolic, LRUProb, Random...) draw
from one process-wide generator in the library, so a result would depend on what ran before it in
the same process; every run reseeds it (``seed``) first. The sampling ones (LHD, Random*) also
depend on the hash table's size, which is set from the number of distinct keys (the library's
default of 2^24 buckets is slow to allocate and gives other samples).
"""
from __future__ import annotations

import ctypes
import os
import tempfile
import time

import numpy as np

from .hindsight import next_use

try:
    import libcachesim as _lcs
    from libcachesim import libcachesim_python as _core
except ImportError:            # reported by require() when an algorithm is actually asked for
    _lcs = _core = None

VERSION = "0.3.5"              # the version these results and MIN_CAPACITY were checked with
INSTALL_HINT = (f"libcachesim is not installed: run `pip install libcachesim=={VERSION}` "
                "(or `make setup`)")
INT64_MAX = (1 << 63) - 1
_M64 = (1 << 64) - 1


class LibCacheSimMissing(ImportError):
    """The libcachesim package is not importable."""


def require() -> None:
    if _lcs is None or _core is None:
        raise LibCacheSimMissing(INSTALL_HINT)


def version() -> str | None:
    return getattr(_lcs, "__version__", None)


def _wrapped(cls_name: str):
    """Constructor through the package's Python class."""
    def make(capacity: int, hashpower: int):
        return getattr(_lcs, cls_name)(int(capacity), hashpower=hashpower)._cache
    return make


def _raw(init_name: str):
    """Constructor of an algorithm compiled into the extension but without a Python class."""
    def make(capacity: int, hashpower: int):
        cc = _core.CommonCacheParams(cache_size=int(capacity), hashpower=hashpower)
        return getattr(_core, init_name)(cc, "")
    return make


# name -> constructor(capacity in objects, hashpower) -> a libCacheSim cache (``.get(Request)``)
ALGORITHMS = {
    **{n: _wrapped(n) for n in (
        "ARC", "LIRS", "S3FIFO", "Sieve", "WTinyLFU", "TwoQ", "Cacheus", "LeCaR", "LHD", "GDSF",
        "Belady", "LRU", "FIFO", "LFU", "LFUDA", "Clock", "ClockPro", "Clock2QPlus", "SLRU", "LRUK",
        "MQ", "Hyperbolic", "Random", "LRUProb", "FlashProb", "Size", "GLCache", "LRB",
        "ThreeLCache", "BeladySize")},
    **{n: _raw(f"{n}_init") for n in (
        "CAR", "QDLP", "S3FIFOd", "S3FIFOv0", "ARCv0", "LeCaRv0", "SLRUv0", "LFUCpp",
        "FIFO_Merge", "RandomLRU", "RandomTwo")},
}
REQUIRED = ("ARC", "LIRS", "S3FIFO", "Sieve", "WTinyLFU", "TwoQ", "Cacheus", "LeCaR", "LHD",
            "GDSF", "Belady")
HINDSIGHT = frozenset({"Belady", "BeladySize"})      # they read each request's next access
RANDOMISED = frozenset({"Cacheus", "LeCaR", "LeCaRv0", "LHD", "Hyperbolic", "Random", "LRUProb",
                        "FlashProb", "BeladySize", "FIFO_Merge", "RandomLRU", "RandomTwo"})
# Not run unless named: Size evicts the largest object (all are size 1: arbitrary); ClockPro keeps
# only half its capacity in use with unit sizes (~0.6% hits at 2%); the learned ones (GLCache,
# LRB, ThreeLCache) are slow and built for byte miss ratio on variable sizes; BeladySize is
# Belady again, sampled.
NOT_BY_DEFAULT = frozenset({"Size", "ClockPro", "LRB", "ThreeLCache", "GLCache", "BeladySize"})
DEFAULT_NAMES = tuple(n for n in ALGORITHMS if n not in NOT_BY_DEFAULT)
# Below these capacities (objects) the library kills the process or is degenerate (a scan of
# capacities 1-64 on two traces): the S3-FIFO family and FlashProb abort (a queue of 0 bytes),
# LFUDA segfaults at 1 and loops forever at 2-5 (bound kept with a margin), BeladySize loops
# forever at 1, WTinyLFU aborts below 5 and below 100 its 1% window holds no object (0 hits).
MIN_CAPACITY = {"S3FIFO": 10, "S3FIFOd": 10, "S3FIFOv0": 10, "QDLP": 10, "FlashProb": 20,
                "LFUDA": 16, "BeladySize": 2, "WTinyLFU": 100}


def runnable(capacity: int, names=None) -> list[str]:
    """The algorithms to run at ``capacity``: by default those of DEFAULT_NAMES that work there;
    named ones are checked (ValueError if unknown or if the library would abort)."""
    if names is None:
        return [n for n in DEFAULT_NAMES if capacity >= MIN_CAPACITY.get(n, 1)]
    names = list(names)
    unknown = [n for n in names if n not in ALGORITHMS]
    if unknown:
        raise ValueError(f"unknown libCacheSim algorithm {', '.join(unknown)} "
                         f"(choose from {', '.join(ALGORITHMS)})")
    small = [f"{n} (needs >= {MIN_CAPACITY[n]})" for n in names
             if capacity < MIN_CAPACITY.get(n, 1)]
    if small:
        raise ValueError(f"capacity {capacity} is too small for {', '.join(small)}: "
                         "libCacheSim would abort")
    return names


_set_rand_seed = None


def set_seed(seed: int) -> None:
    """Reseed libCacheSim's process-wide random generator (its exported ``set_rand_seed``)."""
    global _set_rand_seed
    if _set_rand_seed is None:
        try:
            fn = ctypes.CDLL(_core.__file__).set_rand_seed
            fn.argtypes, fn.restype = [ctypes.c_uint64], None
        except (OSError, AttributeError):
            fn = False
        _set_rand_seed = fn
    if _set_rand_seed:
        # a multiplicative (Lehmer) generator seeded with the value as is: 0 would make every
        # draw 0, so pass an odd mix of the seed (splitmix64)
        z = (int(seed) + 0x9E3779B97F4A7C15) & _M64
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
        _set_rand_seed((z ^ (z >> 31)) | 1)


def _prepare(keys, capacity, times):
    require()
    keys = np.asarray(keys)
    if keys.ndim != 1 or not np.issubdtype(keys.dtype, np.integer):
        raise TypeError("keys must be a 1-d integer array")
    capacity = int(capacity)
    if capacity < 1:
        raise ValueError(f"capacity must be >= 1 object, got {capacity}")
    uniq, inv = np.unique(keys, return_inverse=True)       # dense ids 1..D (obj_id is uint64)
    ids = inv.reshape(-1).astype(np.int64) + 1
    hashpower = int(min(24, max(12, len(uniq).bit_length() + 1)))   # >= 2x distinct keys
    clock = (np.arange(len(ids), dtype=np.int64) if times is None
             else np.floor(np.asarray(times, np.float64)).astype(np.int64))
    if len(clock) != len(ids):
        raise ValueError("times must have one entry per key")
    return ids, capacity, hashpower, clock


def next_access(keys) -> np.ndarray:
    """libCacheSim's next_access_vtime of each request: the position of the key's next request,
    INT64_MAX if none (the library aborts on -1 and silently mis-evicts on its default -2)."""
    nxt = next_use(keys)
    nxt[nxt == len(nxt)] = INT64_MAX
    return nxt


def _replay(cache, ids: list, clock: list, nav: list | None) -> np.ndarray:
    req = _core.Request()
    req.obj_size = 1
    get = cache.get
    hits = bytearray(len(ids))
    for i, (k, t, na) in enumerate(zip(ids, clock, nav or [INT64_MAX] * len(ids))):
        req.obj_id, req.clock_time, req.next_access_vtime = k, t, na
        if get(req):
            hits[i] = 1
    return np.frombuffer(bytes(hits), dtype=bool)


def run(keys, capacity: int, names=None, *, times=None, seed: int = 0,
        seconds: dict | None = None) -> dict[str, np.ndarray]:
    """Hit mask of each libCacheSim algorithm in ``names`` (default: ``runnable(capacity)``) on
    the request sequence ``keys`` with room for ``capacity`` objects. ``times`` (seconds) become
    the requests' clock time, else the request index. ``seconds`` receives wall times."""
    ids, capacity, hashpower, clock = _prepare(keys, capacity, times)
    names = runnable(capacity, names)
    ids_l, clock_l = ids.tolist(), clock.tolist()
    nav_l = next_access(ids).tolist() if HINDSIGHT & set(names) else None
    out = {}
    for name in names:
        t0 = time.perf_counter()
        set_seed(seed)
        cache = ALGORITHMS[name](capacity, hashpower)
        out[name] = _replay(cache, ids_l, clock_l, nav_l if name in HINDSIGHT else None)
        del cache
        if seconds is not None:
            seconds[name] = time.perf_counter() - t0
    return out


# ---- the library's own replay loop: an oracleGeneral trace file, no Python per request ---------
ORACLE_GENERAL = np.dtype([("clock_time", "<u4"), ("obj_id", "<u8"), ("obj_size", "<u4"),
                           ("next_access_vtime", "<i8")])          # 24 bytes, packed


def hit_ratios(keys, capacity: int, names=None, *, times=None, seed: int = 0) -> dict[str, float]:
    """Hit ratio of each algorithm through libCacheSim's trace reader and ``process_trace`` (~10x
    faster than ``run``, no hit masks; the same results, which checks ``run``'s replay)."""
    ids, capacity, hashpower, clock = _prepare(keys, capacity, times)
    names = runnable(capacity, names)
    rec = np.empty(len(ids), ORACLE_GENERAL)
    rec["clock_time"], rec["obj_id"], rec["obj_size"] = clock, ids, 1
    nav = next_access(ids)
    rec["next_access_vtime"] = np.where(nav == INT64_MAX, -1, nav)   # the format's "never"
    fd, path = tempfile.mkstemp(suffix=".oracleGeneral.bin")
    os.close(fd)
    try:
        rec.tofile(path)
        reader = _lcs.TraceReader(path, _lcs.TraceType.ORACLE_GENERAL_TRACE)
        out = {}
        for name in names:
            set_seed(seed)
            cache = ALGORITHMS[name](capacity, hashpower)
            reader.reset()
            out[name] = 1.0 - _core.c_process_trace(cache, reader._reader, 0, -1)[0]
            del cache
        return out
    finally:
        os.unlink(path)


def belady_bypass(keys, capacity: int) -> np.ndarray:
    """Hit mask of the optimum of a cache of ``capacity`` unit objects that MAY bypass a miss
    (the model of testbed.sim.hindsight.belady_hits), computed by libCacheSim's Belady, which
    may not: after every request insert a fresh key never requested again and give the cache one
    more slot. A real miss then always lands in the spare slot (the dummy there is needed never,
    so it goes first) and the dummy that follows forces one real key out, the one needed furthest
    in the future, which may be the one just requested: exactly 'keep the best ``capacity`` of
    the cached keys and the missed one'. The mask is over the real requests."""
    ids, capacity, hashpower, _ = _prepare(keys, capacity, None)
    n = len(ids)
    inter = np.empty(2 * n, np.int64)
    inter[0::2] = ids
    inter[1::2] = ids.max() + 1 + np.arange(n)
    cache = ALGORITHMS["Belady"](capacity + 1, min(24, hashpower + 1))
    mask = _replay(cache, inter.tolist(), list(range(2 * n)), next_access(inter).tolist())
    return mask[0::2].copy()
