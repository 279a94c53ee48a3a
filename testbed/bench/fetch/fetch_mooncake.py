"""Mooncake Store's TCP get of the same bytes the fetch engine reads in `testbed bench fetch`:
a holder task keeps the blocks in p1's segment, a reader task on h1 gets them into a registered
buffer, with the switch's program attached and then detached. Also the block bytes both read."""
from __future__ import annotations

import os
import statistics
import time
from pathlib import Path

from ...lab import Lab
from ...lab.mooncake import HTTP_PORT, RPC_PORT, MooncakeMaster
from .generator import payload

MIB = 1 << 20


def _block(n: int, cs: int) -> bytes:
    return b"".join(payload(i, cs) for i in range(n))


def _gbps(nbytes: int, seconds: list[float]) -> float | None:
    return round(nbytes / statistics.median(seconds) / 1e9, 4) if seconds else None


def _mooncake_setup(store_mod, me: str, master: str, segment: int, buffer: int = 16 * MIB):
    store = store_mod.MooncakeDistributedStore()
    rc = store.setup(me, f"http://{master}:{HTTP_PORT}/metadata", segment, buffer, "tcp", "",
                     f"{master}:{RPC_PORT}")
    if rc:
        raise RuntimeError(f"mooncake setup failed: {rc}")
    return store


def mooncake_hold(me: str, master: str, blocks: list, ready: str, stop: str) -> dict:
    """Task in the holder: the blocks as Mooncake objects in this node's segment until
    ``stop`` exists. ``blocks``: (object key, chunk size, chunks)."""
    from hostagent.pool.mooncake_store import load_mooncake
    mc = load_mooncake()
    total, most = sum(cs * n for _, cs, n in blocks), max(cs * n for _, cs, n in blocks)
    store = _mooncake_setup(mc, me, master, total + 64 * MIB, most + 16 * MIB)   # put copies
    try:
        config = mc.ReplicateConfig()
        config.preferred_segment = store.get_hostname()
        for okey, cs, n in blocks:
            rc = store.put(okey, _block(n, cs), config)
            if rc:
                raise RuntimeError(f"mooncake put {okey} failed: {rc}")
        Path(ready).touch()
        deadline = time.monotonic() + 1800
        while not os.path.exists(stop) and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        store.close()
    return {"held": len(blocks)}


def mooncake_read(me: str, master: str, blocks: list, reps: int) -> dict:
    """Task in the reader: get_into a registered buffer, ``reps`` times per block."""
    import ctypes
    import numpy as np
    from hostagent.pool.mooncake_store import load_mooncake
    store = _mooncake_setup(load_mooncake(), me, master, 16 * MIB)
    out = {}
    try:
        size = max(cs * n for _, cs, n in blocks)
        buf = np.zeros(size, np.uint8)
        addr = buf.ctypes.data_as(ctypes.c_void_p).value
        if store.register_buffer(addr, size):
            raise RuntimeError("mooncake register_buffer failed")
        for okey, cs, n in blocks:
            seconds, exact = [], True
            expect = np.frombuffer(_block(n, cs), np.uint8)
            for _ in range(reps if n * cs <= 8 * MIB else max(2, reps // 3)):
                t0 = time.perf_counter()
                got = store.get_into(okey, addr, n * cs)
                seconds.append(time.perf_counter() - t0)
                exact &= got == n * cs and np.array_equal(buf[:n * cs], expect)
            out[okey] = {"seconds": seconds, "exact": bool(exact)}
        store.unregister_buffer(addr)
    finally:
        store.close()
    return out


def _mooncake(lab: Lab, blocks: dict, cs: int, reps: int, log) -> dict:
    """Mooncake TCP gets h1 <- p1, switch program attached, then detached (switchd stopped)."""
    master = MooncakeMaster(lab.topo, os.path.join(lab.tmp.name, "mooncake.log")).start()
    ready, stop = (os.path.join(lab.tmp.name, f) for f in ("mc-ready", "mc-stop"))
    spec = [[f"ffbench/{cs}/{m}", cs, n] for m, (_, n, _) in blocks.items()]
    holder = lab.start_task("p1", f"{__name__}:mooncake_hold", lab.topo.node("p1").ip,
                            master.node.ip, spec, ready, stop)
    out = {}
    try:
        deadline = time.monotonic() + 120
        while not os.path.exists(ready):
            if holder.proc.poll() is not None or time.monotonic() > deadline:
                holder.result(5)
                raise RuntimeError("the Mooncake holder did not get ready")
            time.sleep(0.1)
        for mode in ("attached", "detached"):
            if mode == "detached":
                lab.stop_switch()                       # SIGTERM: every port detached
            got = lab.task("h1", f"{__name__}:mooncake_read", lab.topo.node("h1").ip,
                           master.node.ip, spec, reps, timeout=600)
            for m, (okey, _, _) in zip(blocks, spec):
                out[(mode, m)] = got[okey]
            log(f"  {cs} B: mooncake TCP get, switch program {mode}: " + ", ".join(
                f"{m} MiB {_gbps(m * MIB, out[(mode, m)]['seconds']):.3f} GB/s"
                for m in blocks))
    finally:
        Path(stop).touch()
        try:
            holder.result(60)
        finally:
            master.stop()
    return out
