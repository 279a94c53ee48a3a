"""The one way experiments run Python inside a testbed node: ``run_task(topo, node, "module:func",
*args)`` calls ``func(*args)`` in a fresh interpreter inside the node's namespace (a coroutine
function is run with asyncio) and returns what it returned; arguments and the result travel as
JSON. ``start_task`` starts one and returns a handle, for several nodes at once, and
``gather`` waits for several; a ``StartLine`` gives tasks started together one start as soon
as all are ready, and ``until_stopped`` runs a task until its caller says. Commands that
are not Python functions (the CLIs, ping, iperf3) run with ``Topology.run``/``popen``.

A task's standard error reaches the caller's as it is written, each line under the node's
name; a task that fails ends whoever waits for it (``StartLine``, ``gather``) at once, with
that task's own last lines, its fellow tasks stopped; one that does not get ready in time is
named, with what it said last."""
from __future__ import annotations

import asyncio
import collections
import importlib
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

from .topology import TestbedError, Topology, python_argv


class Task:
    """A task running in a node; ``result()`` waits for it. Its standard error is echoed to
    ours as it comes (``echo``) and its last lines kept for errors."""

    def __init__(self, proc: subprocess.Popen, node: str, target: str, echo: bool = True):
        self.proc, self.node, self.target = proc, node, target
        self._out: list[str] = []
        self._err: collections.deque[str] = collections.deque(maxlen=40)
        self._readers = [threading.Thread(target=self._read, args=(proc.stdout, False, echo),
                                          daemon=True),
                         threading.Thread(target=self._read, args=(proc.stderr, True, echo),
                                          daemon=True)]
        for r in self._readers:
            r.start()

    def _read(self, stream, is_err: bool, echo: bool) -> None:
        for line in stream:
            if not is_err:
                self._out.append(line)
                continue
            self._err.append(line.rstrip("\n"))
            if echo:
                sys.stderr.write(f"[{self.node}] {line}")
                sys.stderr.flush()

    def said(self, chars: int = 800) -> str:
        """The end of what it wrote to standard error."""
        return "\n".join(self._err).strip()[-chars:]

    def failure(self) -> str | None:
        """Why it failed (the last line it wrote: its exception), once it has ended with an
        error; else None."""
        if self.proc.poll() is None or self.proc.returncode == 0:
            return None
        for r in self._readers:
            r.join(5)
        last = next((ln.strip() for ln in reversed(self._err) if ln.strip()), "")
        return f"{self.node}: {self.target} failed: {last or f'exit {self.proc.returncode}'}"

    def result(self, timeout: float | None = 3600) -> Any:
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise TestbedError(f"{self.node}: {self.target} still running after {timeout} s: "
                               f"{self.said(400) or 'it printed nothing'}") from None
        for r in self._readers:
            r.join(30)
        if self.proc.returncode:
            raise TestbedError(self.failure())
        lines = "".join(self._out).strip().splitlines()
        if not lines:
            raise TestbedError(f"{self.node}: {self.target} printed no result: "
                               f"{self.said(400)}")
        return json.loads(lines[-1])

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()


def _fail_together(tasks: list[Task], failed: Task) -> None:
    """``failed`` ended with an error: stop the others, raise its error."""
    for t in tasks:
        t.stop()
    raise TestbedError(failed.failure())


def gather(tasks: list[Task], timeout: float | None = 3600) -> list[Any]:
    """Every task's result, in order; the first that fails ends the wait at once with its own
    error (the others stopped), and one still running after ``timeout`` seconds is named."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while any(t.proc.poll() is None for t in tasks):
        failed = next((t for t in tasks if t.failure()), None)
        if failed is not None:
            _fail_together(tasks, failed)
        if deadline is not None and time.monotonic() > deadline:
            late = [t for t in tasks if t.proc.poll() is None]
            for t in tasks:
                t.stop()
            raise TestbedError(f"still running after {timeout} s: " + "; ".join(
                f"{t.node}: {t.target} ({t.said(200) or 'no output'})" for t in late))
        time.sleep(0.05)
    failed = next((t for t in tasks if t.failure()), None)
    if failed is not None:
        _fail_together(tasks, failed)
    return [t.result(timeout=60) for t in tasks]


class StartLine:
    """One start for tasks started together, as soon as every one is ready, instead of a time
    far enough ahead for the slowest to be (seconds of waiting, and still late on a loaded
    box). The tasks get ``path`` and call ``StartLine.wait(path)`` when ready: it returns the
    common start (epoch seconds) that ``go`` writes once all ``n`` have said so."""

    def __init__(self, directory: str, n: int):
        self.path, self.n = tempfile.mkdtemp(prefix="start-", dir=directory), n

    def go(self, tasks: list[Task], margin: float = 0.5, timeout: float = 600) -> float:
        """Wait for the ``tasks`` to be ready (or one to end: its ``result`` says why), then
        start them ``margin`` seconds from now; returns that time."""
        self.ready(tasks, timeout)
        at = time.time() + margin
        tmp = os.path.join(self.path, "go.tmp")
        with open(tmp, "w") as f:
            f.write(f"{at:.6f}")
        os.replace(tmp, os.path.join(self.path, "go"))
        return at

    def ready(self, tasks: list[Task], timeout: float = 600) -> None:
        """Wait until the ``tasks`` are all ready. One that fails meanwhile ends the wait at once
        with its own error, the others stopped; after ``timeout`` seconds, those not ready are
        named with what they said last."""
        deadline = time.monotonic() + timeout
        while True:
            said_ready = {n.removeprefix("ready-") for n in os.listdir(self.path)
                          if n.startswith("ready-")}
            if len(said_ready) >= self.n:
                return
            failed = next((t for t in tasks if t.failure()), None)
            if failed is not None:
                _fail_together(tasks, failed)
            if time.monotonic() > deadline:
                late = [t for t in tasks if str(t.proc.pid) not in said_ready]
                for t in tasks:
                    t.stop()
                raise TestbedError(f"not ready after {timeout:g} s: " + "; ".join(
                    f"{t.node}: {t.target} ({t.said(200) or 'no output'})" for t in late))
            time.sleep(0.02)

    @staticmethod
    def wait(path: str) -> float:
        """In a task: say it is ready, and the common start once there is one."""
        open(os.path.join(path, f"ready-{os.getpid()}"), "w").close()
        go = os.path.join(path, "go")
        while not os.path.exists(go):
            time.sleep(0.01)
        with open(go) as f:
            return float(f.read())


def until_stopped(stop: str, target: str, *args: Any) -> dict:
    """Task: ``target(*args)`` (a task that works for the time its arguments say, returning a
    dict of counts) called again and again until the file ``stop`` exists and the summed counts
    have reached the least ones it holds (JSON), then the sums: a load that lasts as long as
    its caller needs it, not a time guessed long enough."""
    module, _, name = target.partition(":")
    fn, total = getattr(importlib.import_module(module), name), {}
    while True:
        for k, v in fn(*args).items():
            total[k] = total.get(k, 0) + v
        if os.path.exists(stop):
            with open(stop) as f:
                least = json.loads(f.read() or "{}")
            if all(total.get(k, 0) >= v for k, v in least.items()):
                return total


def stop_task(stop: str, **least: int) -> None:
    """End an ``until_stopped`` task once its counts reach ``least``."""
    with open(stop + ".tmp", "w") as f:
        json.dump(least, f)
    os.replace(stop + ".tmp", stop)


def start_task(topo: Topology, node: str, target: str, *args: Any) -> Task:
    proc = topo.popen(node, python_argv("testbed.lab", target, json.dumps(args)),
                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return Task(proc, node, target)


def run_task(topo: Topology, node: str, target: str, *args: Any,
             timeout: float | None = 3600) -> Any:
    return start_task(topo, node, target, *args).result(timeout)


def _main(target: str, args: str) -> None:
    module, _, name = target.partition(":")
    result = getattr(importlib.import_module(module), name)(*json.loads(args))
    if asyncio.iscoroutine(result):
        result = asyncio.run(result)
    print(json.dumps(result), flush=True)
