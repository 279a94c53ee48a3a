"""Test tiers: pure Python (no marker), `bpf` (XDP programs on crafted frames through
BPF_PROG_TEST_RUN) and `e2e` (a veth/namespace testbed with real traffic). The bpf and e2e tiers
never skip: when something they need is missing they fail and say what to install."""
from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _missing_for_kernel_tiers() -> str | None:
    if os.geteuid() != 0:
        return "the bpf and e2e tiers must run as root (sudo make test)"
    try:
        from xdp import NoXdp
        from xdp.loader import preflight
        preflight(None)
    except NoXdp as exc:
        return f"{exc}"
    if not shutil.which("ip"):
        return "iproute2 is missing: apt-get install iproute2 (or run 'make setup')"
    return None


_warm: set[int] = set()


@pytest.fixture(autouse=True)
def _kernel_tier_requirements(request):
    if request.node.get_closest_marker("bpf") or request.node.get_closest_marker("e2e"):
        problem = _missing_for_kernel_tiers()
        if problem:
            pytest.fail(f"cannot run this tier: {problem}", pytrace=False)
    if request.node.get_closest_marker("e2e") and not _warm:
        # the first compiles (seconds each, tens on a loaded box) of the fetch engine and of the
        # testbeds' switch happen here, once, not inside `hostagent get`s a test starts together
        # and times against each other, or a switchd start waited for with a timeout
        from hostagent.inference.fetch.program import bytecode
        for chunk_size in (1024, 3072):
            bytecode(chunk_size)
            _warm_switch(chunk_size)
        _warm.update((1024, 3072))


def _warm_switch(chunk_size: int) -> None:
    """The testbed switch's programs (65536 entries, pinned maps) in the bytecode cache."""
    import uuid
    from switchd.dataplane import DataPlane, Deployment
    pin_dir = f"/sys/fs/bpf/kvswitch-warm-{uuid.uuid4().hex[:8]}"
    try:
        DataPlane(Deployment(chunk_size=chunk_size, pin_dir=pin_dir)).bpf.cleanup()
    finally:
        shutil.rmtree(pin_dir, ignore_errors=True)


@contextlib.asynccontextmanager
async def local_pool(capacity: int = 64 << 20, store=None, ready_within: float = 30.0):
    """A pool node (hostagent.pool.server.serve) in this event loop on 127.0.0.1, at a port of
    its own: yields its protocol (``proto.sock.getsockname()`` is its address) and stops it on
    exit. A server that fails to start, or is not ready within ``ready_within`` seconds, raises
    here rather than leave the wait hanging."""
    from hostagent.pool.server import serve
    ready, stop, handle = asyncio.Event(), asyncio.Event(), {}
    task = asyncio.create_task(serve("127.0.0.1", 0, capacity, ready, stop, handle,
                                     **({"store": store} if store is not None else {})))
    waiting = asyncio.create_task(ready.wait())
    await asyncio.wait([task, waiting], timeout=ready_within,
                       return_when=asyncio.FIRST_COMPLETED)
    if not waiting.done():
        waiting.cancel()
        if not task.done():
            stop.set()
            task.cancel()
            raise TimeoutError(f"the pool node was not ready within {ready_within} s")
    if task.done():
        task.result()
        raise RuntimeError("the pool node stopped before it was ready")
    try:
        yield handle["protocol"]
    finally:
        stop.set()
        await task


@contextlib.contextmanager
def pool_in_thread(capacity: int = 64 << 20):
    """``local_pool`` run by an event loop thread of its own, for callers that block (the
    connectors' own I/O loop talks to it): yields its address, ``"127.0.0.1:PORT"``."""
    import threading
    loop, ready, done, out = asyncio.new_event_loop(), threading.Event(), None, {}

    async def main():
        nonlocal done
        done = asyncio.Event()
        async with local_pool(capacity, ready_within=10) as proto:
            out["addr"] = "%s:%d" % proto.sock.getsockname()[:2]
            ready.set()
            await done.wait()

    def run():
        try:
            loop.run_until_complete(main())
        finally:
            ready.set()
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    assert ready.wait(10) and "addr" in out, "the loopback pool node did not start"
    try:
        yield out["addr"]
    finally:
        loop.call_soon_threadsafe(done.set)
        thread.join(10)


@contextlib.contextmanager
def leaves_no_namespaces(prefix: str):
    """Around a testbed named ``prefix``: afterwards none of its namespaces may be left."""
    from testbed.lab.topology import namespaces_of
    try:
        yield prefix
    finally:
        assert not namespaces_of(prefix), "testbed left namespaces behind"


def need_mooncake() -> None:
    """Fail (never skip) with what to install where Mooncake Store or its master is missing."""
    from hostagent.pool.mooncake_store import MooncakeMissing, load_mooncake, master_binary
    try:
        load_mooncake()
        master_binary()
    except MooncakeMissing as exc:
        pytest.fail(f"cannot run the Mooncake tests: {exc}", pytrace=False)


def repo_files() -> list[Path]:
    """Every file of the checkout git would commit: tracked, or new and not ignored (a tracked
    file deleted in the work tree is listed too)."""
    names = subprocess.run(["git", "-C", str(ROOT), "ls-files", "-co", "--exclude-standard"],
                           capture_output=True, text=True, check=True).stdout.split()
    return [ROOT / n for n in names]


@pytest.fixture
def fresh_cache(tmp_path, monkeypatch):
    """An empty bytecode cache (xdp.cache) for this test alone: every program it loads is
    compiled by BCC."""
    from xdp import cache
    d = tmp_path / "bytecode"
    d.mkdir(mode=0o700)
    monkeypatch.setattr(cache, "CACHE_DIR", d)
    return d
