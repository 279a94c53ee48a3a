"""The vLLM connector's worker-side transfers that run beside the engine's steps (``load_mode``
async, the default): no step waits for the pool.

Loads (``AsyncLoads``). The scheduler answers a remote prefix with ``load_kv_async``: vLLM
allocates the request's blocks and holds it in ``WAITING_FOR_REMOTE_KVS`` while every other
request keeps decoding. The load reaches the worker in the next step's metadata; ``start``
asks the I/O thread for its blocks and hands their copy into the paged cache
(``vllm_pool.drain``) to a thread of its own, so blocks land as they arrive, whatever
the engine's thread does. The engine's thread collects finished loads once a step
(``finished``, from ``get_finished``): their request ids go back as ``finished_recving``, and the
vLLM blocks of every pool block that did not land (the first that failed or did not come within
the load's time, and every one after it) as ``get_block_ids_with_load_errors`` in the same step,
so vLLM recomputes exactly those and keeps what landed. A load always finishes: each block has
the transfer ``deadline``, the whole load ``deadline`` per ``concurrency`` blocks plus 5 s; a
block arriving later is released unwritten, never copied into blocks vLLM may have reused.

Saves (``AsyncSaves``). ``wait_for_save`` hands each step's full prompt blocks to a copy thread,
which reads them out of the paged cache and gives the bytes to the I/O thread's PUTs without
waiting for room (too much unacknowledged: the blocks are shed, a future miss). A finished
request with a save planned keeps its blocks: the scheduler's ``request_finished`` says so and
names it in the next step's metadata (``hold``), and ``finished`` reports it in
``finished_sending`` once its copies are out. A preempted request's blocks may be reused in the
very step that preempts it: ``wait`` (from ``handle_preemptions``) finishes every copy first, so a
request that waits for a load after a preemption has none pending and is not held (vLLM holds
its blocks for the load and frees them when ``finished_recving`` says it ended).
"""
from __future__ import annotations

import concurrent.futures
import math
import threading
import time
from collections import defaultdict

from .paged_kv import PagedKV
from .vllm_blocks import LoadSpec, SaveSpec
from .vllm_pool import LoadOutcome, PoolBackend, discard, drain, log

LOAD_THREADS = 16          # loads copied at once (each mostly waits for the network)
LATE_S = 5.0               # seconds a load waits past its blocks' deadlines


class AsyncLoads:
    """Loads in flight beside the engine (module docstring)."""

    def __init__(self, backend: PoolBackend, paged: PagedKV, ns: int, nchunks: int):
        self.backend, self.paged, self.ns, self.nchunks = backend, paged, ns, nchunks
        self._pool = concurrent.futures.ThreadPoolExecutor(LOAD_THREADS, "kvswitch-load")
        self._lock = threading.Lock()
        self._done: list[tuple[LoadSpec, LoadOutcome, float]] = []
        self.in_flight = 0

    def start(self, ld: LoadSpec) -> None:
        s = self.backend.settings
        per_block = s.deadline + LATE_S
        overall = s.deadline * math.ceil(len(ld.keys) / s.concurrency) + LATE_S
        started = time.monotonic()
        q = self.backend.fetch(self.ns, ld.keys, self.nchunks)

        def run() -> None:
            try:
                out = drain(ld, q, self.paged, per_block, overall)
            except Exception as exc:          # reported, never a request left waiting
                log.exception("kvswitch: load of %s", ld.req_id)
                out = LoadOutcome(0, error=repr(exc), failures={"read_failed": len(ld.keys)})
            with self._lock:
                self._done.append((ld, out, time.monotonic() - started))
            if out.left:                      # late blocks: released, never written
                discard(q, out.left, overall)

        self.in_flight += 1
        self._pool.submit(run)

    def finished(self) -> list[tuple[LoadSpec, LoadOutcome, float]]:
        """Loads finished since the last call: (load, outcome, seconds)."""
        with self._lock:
            done, self._done = self._done, []
        self.in_flight -= len(done)
        return done

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class AsyncSaves:
    """Copies of saved blocks out of the paged cache, beside the engine (module docstring)."""

    def __init__(self, backend: PoolBackend, paged: PagedKV, ns: int, record):
        self.backend, self.paged, self.ns, self.record = backend, paged, ns, record
        self._pool = concurrent.futures.ThreadPoolExecutor(1, "kvswitch-save")
        self._lock = threading.Lock()
        self._copying: dict[str, int] = defaultdict(int)   # req -> copies not yet done
        self._futures: set[concurrent.futures.Future] = set()
        self._held: set[str] = set()           # finished: the scheduler keeps their blocks
        self._finished: set[str] = set()       # of those, named in finished_req_ids

    def submit(self, sv: SaveSpec) -> None:
        with self._lock:
            self._copying[sv.req_id] += 1
        fut = self._pool.submit(self._copy_out, sv)
        with self._lock:
            self._futures.add(fut)
        fut.add_done_callback(self._forget)

    def _forget(self, fut: concurrent.futures.Future) -> None:
        with self._lock:
            self._futures.discard(fut)

    def _copy_out(self, sv: SaveSpec) -> None:
        start = time.monotonic()
        try:
            bt = self.paged.layout.block_tokens          # each block with its first position
            blocks = [self.paged.read(ids, (sv.first + j) * bt) for j, ids in enumerate(sv.ids)]
            sent = self.backend.save(self.ns, sv.keys, blocks, wait=False)
            self.record(ev="save", req=sv.req_id, first=sv.first, blocks=len(blocks),
                        bytes=sum(map(len, blocks)), keys=[k.hex() for k in sv.keys],
                        copy_seconds=round(time.monotonic() - start, 6), shed=not sent)
        except Exception:                                  # a lost save is a future miss
            log.exception("kvswitch: save of %s", sv.req_id)
        finally:
            with self._lock:
                self._copying[sv.req_id] -= 1
                if not self._copying[sv.req_id]:
                    del self._copying[sv.req_id]

    def hold(self, req_ids) -> None:
        """Finished requests whose blocks the scheduler keeps until their copies are out."""
        self._held |= set(req_ids)

    def finished(self, finished_req_ids: set[str]) -> set[str]:
        """Of the held requests vLLM finished (now or before), those whose copies are all
        out: their blocks may be freed (each reported once)."""
        self._finished |= finished_req_ids & self._held
        with self._lock:
            done = {r for r in self._finished if r not in self._copying}
        self._held -= done
        self._finished -= done
        return done

    def wait(self, timeout: float | None = 60) -> None:
        """Every copy submitted so far done (the paged blocks may be reused after this)."""
        with self._lock:
            pending = list(self._futures)
        concurrent.futures.wait(pending, timeout)

    def shutdown(self) -> None:
        self.wait()
        self._pool.shutdown(wait=True)
