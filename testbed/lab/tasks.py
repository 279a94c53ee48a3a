"""The one way experiments run Python inside a testbed node: ``run_task(topo, node, "module:func",
*args)`` calls ``func(*args)`` in a fresh interpreter inside the node's namespace (a coroutine
function is run with asyncio) and returns what it returned; arguments and the result travel as
JSON. ``start_task`` starts one and returns a handle, for several nodes at once; a
``StartLine`` gives tasks started together one start as soon as all are ready, and
``until_stopped`` runs a task until its caller says. Commands that
are not Python functions (the CLIs, ping, iperf3) run with ``Topology.run``/``popen``."""
from __future__ import annotations

import asyncio
import importlib
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

from .topology import TestbedError, Topology, python_argv


class Task:
    """A task running in a node; ``result()`` waits for it."""

    def __init__(self, proc: subprocess.Popen, node: str, target: str):
        self.proc, self.node, self.target = proc, node, target

    def result(self, timeout: float | None = 3600) -> Any:
        try:
            out, err = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.communicate()
            raise TestbedError(f"{self.node}: {self.target} still running after {timeout} s")
        if self.proc.returncode:
            raise TestbedError(f"{self.node}: {self.target} failed: {err.strip()[-800:]}")
        lines = out.strip().splitlines()
        if not lines:
            raise TestbedError(f"{self.node}: {self.target} printed no result: {err[-400:]}")
        return json.loads(lines[-1])


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
        """Wait until the ``tasks`` are all ready (or one has ended: its ``result`` says why)."""
        deadline = time.monotonic() + timeout
        while sum(n.startswith("ready-") for n in os.listdir(self.path)) < self.n and \
                all(t.proc.poll() is None for t in tasks):
            if time.monotonic() > deadline:
                raise TestbedError(f"tasks not ready after {timeout} s: {self.path}")
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
    proc = topo.popen(node, python_argv(__name__, target, json.dumps(args)),
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


if __name__ == "__main__":
    _main(*sys.argv[1:3])
